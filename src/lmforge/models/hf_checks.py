"""Checks of a Hugging Face directory's weights against its config.json, before any weight is read.

A directory is untrusted input: its index, its safetensors headers, the dtypes and shapes of its tensors
and its config.json can each be wrong or disagree. Every such case is a ``CheckpointError`` naming the
file and the tensor, found from the headers alone (``safe_open`` reads no weight bytes until asked):

* an index that is not a ``weight_map`` of tensor names to file names in the directory;
* a file whose header safetensors cannot parse;
* a tensor that is not floating point (an int32 table, a bool mask, fp8 weights that need their
  scales): copying it into a parameter would cast it silently;
* a tensor whose shape differs from the one the config.json's model has (the shapes come from the
  family adapter's ``to_hf`` run on a meta-device model: no memory, the adapter's own names);
* tensors the config.json's model does not use (more layers, experts or MTP depths than it says).
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from lmforge.errors import CheckpointError
from lmforge.models.common.transformer_config import TransformerConfig

# safetensors dtype names of the floating formats a weight may be stored in (F64 is read in full).
FLOAT_DTYPES = frozenset({"F64", "F32", "F16", "BF16"})
# Tensors a Hugging Face directory may hold that no model parameter maps to (derived buffers).
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def open_safetensors(file: Path, stack: contextlib.ExitStack) -> Any:
    """A ``safe_open`` handle; a file safetensors cannot parse is a ``CheckpointError``."""
    try:
        return stack.enter_context(safe_open(str(file), framework="pt"))
    except Exception as exc:  # noqa: BLE001 (safetensors raises its own error types)
        raise CheckpointError(
            f"{file} is not a readable safetensors file ({exc}); re-download or re-export it."
        ) from None


def tensor_headers(files: dict[str, Path]) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Tensor name → (safetensors dtype, shape), from the headers of ``files`` (name → file)."""
    headers: dict[str, tuple[str, tuple[int, ...]]] = {}
    with contextlib.ExitStack() as stack:
        by_file: dict[Path, list[str]] = {}
        for name, file in files.items():
            by_file.setdefault(file, []).append(name)
        for file, names in sorted(by_file.items()):
            handle = open_safetensors(file, stack)
            present = set(handle.keys())
            for name in names:
                if name not in present:
                    raise CheckpointError(
                        f"{file} does not hold the tensor '{name}' that model.safetensors.index.json places "
                        "there; the index and the weight files disagree (re-download or re-export them)."
                    )
                view = handle.get_slice(name)
                headers[name] = (str(view.get_dtype()), tuple(view.get_shape()))
    return headers


def expected_hf_shapes(
    model: torch.nn.Module, cfg: TransformerConfig, to_hf: Any
) -> dict[str, tuple[int, ...]]:
    """Hugging Face tensor name → shape, for the model of ``cfg`` (built on any device, meta included)."""
    sd = {name: t for name, t in model.state_dict().items()}
    return {name: tuple(t.shape) for name, t in to_hf(sd, cfg).items()}


def check_hf_tensors(path: Path, files: dict[str, Path], expected: dict[str, tuple[int, ...]]) -> None:
    """Refuse non-floating tensors and shapes other than ``expected`` in the directory ``path``."""
    headers = tensor_headers(files)
    wrong_dtype = [
        f"'{name}' ({dtype}, in {files[name].name})"
        for name, (dtype, _) in sorted(headers.items())
        if dtype not in FLOAT_DTYPES and not name.endswith(IGNORED_SUFFIXES)
    ]
    if wrong_dtype:
        raise CheckpointError(
            f"{path}: {len(wrong_dtype)} tensor(s) are not floating point: {', '.join(wrong_dtype[:4])}. Model "
            "weights must be stored as F32, BF16, F16 or F64; lmforge does not cast other types into weights "
            "(quantized checkpoints need to be dequantized first)."
        )
    wrong_shape = [
        f"'{name}' is {list(headers[name][1])} in {files[name].name}, config.json's model needs {list(shape)}"
        for name, shape in expected.items()
        if name in headers and headers[name][1] != shape
    ]
    if wrong_shape:
        raise CheckpointError(
            f"{path}: the weights do not match config.json: {'; '.join(wrong_shape[:3])}"
            f"{f' (and {len(wrong_shape) - 3} more)' if len(wrong_shape) > 3 else ''}. config.json and the "
            "safetensors files must describe the same model (hidden_size, intermediate_size, vocab_size, heads)."
        )


def check_unused(path: Path, unused: Any) -> None:
    """Refuse tensors of ``path`` that the adapter's ``from_hf`` left over (``unused``)."""
    leftover = sorted(n for n in unused if not n.endswith(IGNORED_SUFFIXES))
    if leftover:
        raise CheckpointError(
            f"{path}: {len(leftover)} tensor(s) are not part of the model config.json describes, e.g. "
            f"{', '.join(leftover[:4])}. config.json and the weights disagree (num_hidden_layers, the experts "
            "or the MTP layers?); fix config.json so that every tensor belongs to the model."
        )
