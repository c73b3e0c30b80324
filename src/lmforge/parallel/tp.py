"""Tensor parallel with sequence parallel (always on together, as in the spec) for lmforge's models.

Layout over the ``tp`` mesh dimension (size t):

* The residual stream between blocks is split along the sequence (``[B, S/t, H]`` per rank); the
  norms on it run locally with replicated weights.
* Attention and MLP blocks gather the sequence at their input, compute on ``1/t`` of the heads / of
  the FFN width, and reduce-scatter back to sequence shards at their output projection.
* The embedding (torch's ``RowwiseParallel``) and the output layer are split by vocabulary rows; the
  output gathers full logits.

The input projections (``linear_qkv``, SwiGLU ``linear_fc1``, MLA's up projections) are split by
output rows (``Shard(0)``, Megatron's column parallel): their stored layout puts whole units (key-value
groups, gate/up pairs, heads) in every equal chunk of rows (``models/common/fused_layout.py``), so rank r
computes exactly its heads / FFN width from the gathered block input, and the blocks find their local
head counts from the width they get. One all-gather in, one reduce-scatter out per block.

Every block is declared as DTensor styles in the family's plan (``models/<family>/parallelize.py``,
styles in ``models/common/tp_plan.py``), applied with ``parallelize_module`` or as forward hooks; no
module's forward is replaced:

* GQA attention and SwiGLU MLPs (shared experts included): torch's ``ColwiseParallel`` /
  ``RowwiseParallel`` (LoRA-aware subclasses: the adapters' factors are replicated DTensors and the
  adapter's own forward runs on DTensors) and a first-input ``PrepareModuleInput`` (sequence shard →
  replicated DTensor); DTensor's autograd does the collectives.
* MLA attention: the same, plus replicated DTensor down projections and latent norms computing on the
  replicated block input, and the shared rope key turned into a local tensor for this rank's heads with
  a ``Partial`` gradient at the model's ``shared_k_rope`` seam.
* A MoE router's balancing loss: its ``balance_inputs`` seam gathered over the sequence with torch's
  ``PrepareModuleOutput``.

The norms on the residual stream (and Qwen3's per-head QK norms) are torch's ``SequenceParallel``.
The parameters keep their DTensor placements (FSDP, checkpoints, gradient clipping and optimizers see
them). A weight that the plan does not name (routers, routed experts) becomes a replicated DTensor that
sees only this rank's tokens: the module's own forward reads its local view, whose gradient DTensor sums
over the tp group (``models/common/local_weight.py``).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from lmforge.errors import ConfigError
from lmforge.models.common.layers import layer_modules
from lmforge.models.common.tp_plan import (
    ColwiseShard,
    LocalHeads,
    Replicated,
    ReplicatedOnShard,
    ReplicateInput,
    RowwiseShard,
    SequenceAuxLoss,
    SharedToLocal,
)


def _distribute(module: nn.Module, name: str, mesh: Any, placement: Any) -> None:
    from torch.distributed.tensor import DTensor, distribute_tensor

    param = getattr(module, name)
    if param is None or isinstance(param, DTensor):
        return
    dt = distribute_tensor(param.data, mesh, [placement])
    module.register_parameter(name, nn.Parameter(dt, requires_grad=param.requires_grad))


# ------------------------------------------------------------------ DTensor styles


def _shard_linear(linear: nn.Module, mesh: Any, weight: Any, bias: Any) -> None:
    """Weight and bias as DTensors with the given placements; LoRA factors (``lora_A``/``lora_B``)
    replicated, so the adapter's own forward runs on DTensors too."""
    from torch.distributed.tensor import Replicate

    _distribute(linear, "weight", mesh, weight)
    if linear.bias is not None:
        _distribute(linear, "bias", mesh, bias)
    for name in ("lora_A", "lora_B"):
        factor = getattr(linear, name, None)
        if factor is not None:
            _distribute(factor, "weight", mesh, Replicate())


def _styles() -> tuple[type, type, type]:
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

    class LinearColwise(ColwiseParallel):
        """``ColwiseParallel`` that also takes a ``LoRALinear`` (torch's would register its adapters' dotted
        parameter names on the linear itself)."""

        def _partition_linear_fn(self, name, module, device_mesh):
            if (
                name == ""
            ):  # distribute_module calls this for every submodule: the adapters come with the root
                _shard_linear(module, device_mesh, Shard(0), Shard(0))

    class LinearRowwise(RowwiseParallel):
        def _partition_linear_fn(self, name, module, device_mesh):
            if name == "":
                _shard_linear(module, device_mesh, Shard(1), Replicate())

    class FirstInputReplicated(ParallelStyle):
        """``PrepareModuleInput`` for the first positional input only (blocks differ in their other
        arguments: cos/sin/mask for attention, none for an MLP): sequence shard → replicated DTensor."""

        def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
            def pre_hook(mod: nn.Module, args: tuple) -> tuple:
                x = args[0]
                if not isinstance(x, DTensor):
                    x = DTensor.from_local(x, device_mesh, (Shard(1),), run_check=False)
                return (x.redistribute(device_mesh, (Replicate(),)), *args[1:])

            module.register_forward_pre_hook(pre_hook)
            return module

    return LinearColwise, LinearRowwise, FirstInputReplicated


def _check_units(style: ColwiseShard, t: int) -> None:
    if style.units % t:
        raise ConfigError(
            f"parallelism.tensor_parallel={t} must divide the {style.what} ({style.units}): each rank computes "
            "whole ones."
        )


def _apply_dtensor_style(module: nn.Module, style: Any, mesh: Any) -> None:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import parallelize_module

    colwise, rowwise, first_input = _styles()
    if isinstance(style, ReplicateInput):
        parallelize_module(module, mesh, first_input())
    elif isinstance(style, ColwiseShard):
        _check_units(style, mesh.size())
        parallelize_module(module, mesh, colwise(input_layouts=Replicate()))
    elif isinstance(style, RowwiseShard):
        if module.in_features % mesh.size():
            raise ConfigError(
                f"parallelism.tensor_parallel={mesh.size()} must divide the input width {module.in_features} "
                "of an output projection."
            )
        parallelize_module(module, mesh, rowwise(output_layouts=Shard(1)))


def _replicated(module: nn.Module, mesh: Any) -> None:
    """Every parameter of ``module`` (LoRA adapters included) a replicated DTensor; the module computes on
    the block's replicated DTensor input, and DTensor sums the gradients its sharded consumers leave."""
    from torch.distributed.tensor import Replicate

    for sub in module.modules():
        for name, _ in list(sub.named_parameters(recurse=False)):
            _distribute(sub, name, mesh, Replicate())


def _shared_to_local(module: nn.Module) -> None:
    """The module's replicated DTensor output becomes this rank's plain tensor for its local heads; each
    rank's gradient covers only its heads, so it is declared ``Partial`` (summed by DTensor upstream)."""
    from torch.distributed.tensor import DTensor, Partial

    def hook(mod: nn.Module, args: tuple, output: Any) -> Any:
        if isinstance(output, DTensor):
            return output.to_local(grad_placements=(Partial(),))
        return output

    module.register_forward_hook(hook)


def _vocab_parallel_embedding(emb: nn.Embedding, mesh: Any) -> None:
    """Rows split by vocabulary (torch's ``RowwiseParallel`` on an embedding): each rank looks up the ids
    in its rows, and the partial sums are reduce-scattered to this rank's sequence shard."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import RowwiseParallel, parallelize_module

    t, vocab = mesh.size(), emb.num_embeddings
    if vocab % t:
        raise ConfigError(f"parallelism.tensor_parallel={t} must divide the vocabulary size ({vocab}).")
    parallelize_module(emb, mesh, RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)))


def _vocab_split_output(linear: nn.Linear, mesh: Any) -> None:
    """Store the output layer split by vocabulary rows (a ``Shard(0)`` DTensor): the model's loss reads this
    rank's rows (chunked, vocabulary-parallel) or gathers them (``GPTModel._output_weight``); ``parallel.api``
    gathers the final norm's output over the sequence."""
    from torch.distributed.tensor import Shard

    t = mesh.size()
    if linear.out_features % t:
        raise ConfigError(
            f"parallelism.tensor_parallel={t} must divide the vocabulary size ({linear.out_features})."
        )
    if linear.bias is not None:
        raise ConfigError("tensor parallel does not support a bias on output_layer.")
    _distribute(linear, "weight", mesh, Shard(0))


# ------------------------------------------------------------------ blocks


def _tp_core_attention(core: nn.Module, mesh: Any) -> None:
    """Local heads: ``CoreAttention`` tracks their max logits at their global positions from its
    ``head_offset`` (QK-Clip reduces them with MAX over the ranks)."""
    t = mesh.size()
    if core.num_heads % t:
        raise ConfigError(
            f"parallelism.tensor_parallel={t} must divide the attention heads ({core.num_heads})."
        )
    core.head_offset = mesh.get_local_rank() * (core.num_heads // t)


def _sequence_balance_inputs(module: nn.Module, mesh: Any) -> None:
    """The router's ``balance_inputs`` (scores and choices ``[b, s/t, ...]`` of this rank's sequence shard)
    gathered over the sequence with torch's ``PrepareModuleOutput``, so the balancing loss sees whole
    sequences; every rank computes the same loss, so each keeps its own tokens' gradient (the backward of
    Shard → Replicate is the local slice)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import PrepareModuleOutput, parallelize_module

    style = PrepareModuleOutput(
        output_layouts=(Shard(1), Shard(1)), desired_output_layouts=(Replicate(), Replicate())
    )
    parallelize_module(module, mesh, style)


def _apply_style(module: nn.Module, style: Any, mesh: Any) -> None:
    if isinstance(style, (ReplicateInput, ColwiseShard, RowwiseShard)):
        _apply_dtensor_style(module, style, mesh)
    elif isinstance(style, ReplicatedOnShard):
        _replicated_on_shard(module, mesh, style.dim)
    elif isinstance(style, Replicated):
        _replicated(module, mesh)
    elif isinstance(style, SharedToLocal):
        _shared_to_local(module)
    elif isinstance(style, LocalHeads):
        _tp_core_attention(module, mesh)
    elif isinstance(style, SequenceAuxLoss):
        _sequence_balance_inputs(module, mesh)
    else:
        raise ConfigError(f"unknown tensor-parallel style {style!r} in a family's TP plan.")


def _apply_layer_plan(layer: nn.Module, plan: dict[str, tuple[Any, ...]], mesh: Any) -> None:
    for path, styles in plan.items():
        module = layer.get_submodule(path)
        for style in styles:
            _apply_style(module, style, mesh)


def _replicated_on_shard(module: nn.Module, mesh: Any, dim: int) -> None:
    """torch's ``SequenceParallel`` along ``dim`` (replicated DTensor weights, input this rank's shard,
    local output), keeping a frozen (LoRA base) weight frozen: torch's re-creates them as trainable."""
    from torch.distributed.tensor import DTensor, Replicate
    from torch.distributed.tensor.parallel import SequenceParallel, parallelize_module

    class FrozenAwareSequenceParallel(SequenceParallel):
        def _replicate_module_fn(self, name: str, module: nn.Module, device_mesh: Any) -> None:
            for p_name, param in module.named_parameters(recurse=False):
                replicated = DTensor.from_local(param, device_mesh, [Replicate()], run_check=False)
                module.register_parameter(p_name, nn.Parameter(replicated, requires_grad=param.requires_grad))

    parallelize_module(module, mesh, FrozenAwareSequenceParallel(sequence_dim=dim, use_local_output=True))


def _sequence_parallel_norms(model: nn.Module, tp_mesh: Any) -> None:
    """The token-wise modules on the residual stream (the layers' norms, the final norm, an MTP depth's
    norms and ``eh_proj``) as torch's ``SequenceParallel``: replicated DTensor weights on this rank's
    sequence shard, their gradients summed over tp by DTensor."""
    modules = [getattr(getattr(model, "decoder", None), "final_layernorm", None)]
    for layer in layer_modules(model):
        inner = getattr(layer, "transformer_layer", layer)  # an MTP depth wraps a transformer layer
        modules += [getattr(inner, "input_layernorm", None), getattr(inner, "pre_mlp_layernorm", None)]
        if inner is not layer:
            modules += [
                getattr(layer, name, None) for name in ("enorm", "hnorm", "eh_proj", "final_layernorm")
            ]
    for module in modules:
        if module is not None:
            _replicated_on_shard(module, tp_mesh, 1)


def apply_tp(model: nn.Module, tp_mesh: Any) -> None:
    """Apply tensor + sequence parallel in place over ``tp_mesh`` (1-D): the embedding and output layer
    by vocabulary rows, each decoder layer by its family's ``tp_plan`` (``models/<family>/parallelize.py``)."""
    from torch.distributed.tensor import DTensor

    from lmforge.models.registry import family_for

    cfg = model.config
    family = family_for(cfg.model_type)
    if family.tp_plan is None:
        raise ConfigError(
            f"model_type {family.model_type!r} declares no tensor-parallel plan; set parallelism.tensor_parallel: 1."
        )
    emb = getattr(getattr(model, "embedding", None), "word_embeddings", None)
    out = getattr(model, "output_layer", None)
    tied = emb is not None and out is not None and out.weight is emb.weight
    if emb is not None:
        _vocab_parallel_embedding(emb, tp_mesh)
    for layer in layer_modules(model):
        layer = getattr(layer, "transformer_layer", layer)  # an MTP depth wraps a transformer layer
        _apply_layer_plan(layer, family.tp_plan(cfg, layer.layer_id), tp_mesh)
    if out is not None and not tied:
        _vocab_split_output(out, tp_mesh)
    _sequence_parallel_norms(model, tp_mesh)
    # Everything else (routers, routed experts) becomes a replicated DTensor and sees only this rank's tokens:
    # the module's own forward reads it through ``models/common/local_weight.py``, whose gradient is summed
    # over tp. No hook swaps tensors in; a module that reads such a weight directly fails loudly (DTensor
    # refuses to mix with the plain activations).
    from torch.distributed.tensor import Replicate

    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if not isinstance(param, DTensor):
                _distribute(module, name, tp_mesh, Replicate())
