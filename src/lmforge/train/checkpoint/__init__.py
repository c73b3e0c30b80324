"""Checkpoints on torch.distributed.checkpoint (DCP): atomic, rotated, resumable, reshardable.

Layout (the directory names and ``common.json`` follow the original's Checkpoint 2.0 format; the
tensor files are DCP's, so a checkpoint saved on one parallel layout loads into another)::

    {save_path}/
      latest_checkpointed_iteration.txt      # the newest complete iteration, written last
      iteration_{step:08d}/
        .metadata                            # DCP: every key, its shape, dtype and shards
        {prefix}-{rank:07d}-{world:07d}_0.distcp
        common.json                          # step, consumed samples, batch size, format, ...
        config.yaml                          # the run's resolved configuration (for generate)

One DCP state dict holds ``model``, ``optimizer`` (unless no_save_optim), ``scheduler``,
``trainer`` (step counters), and per rank ``rng.rank_{r}`` and ``dataloader.rank_{r}``.

Atomicity: a save is written into the hidden sibling ``.iteration_{step:08d}.partial``, its files
fsynced, then renamed into place; the tracker is replaced last through a temporary file and
``os.replace``. A crash at any point leaves the previous checkpoint and tracker intact; a re-save of
an existing iteration moves the old copy to ``.iteration_X.old`` first, and :func:`resolve_checkpoint`
puts it back if a crash hit between the two renames. A failed save (disk full, ...) is a
``CheckpointError`` that names the intact previous checkpoint.

Reading never runs code from the files (``train/checkpoint/safe_load.py``): ``.metadata`` and non-tensor items go
through allowlisting unpicklers, and the state skeletons are JSON.
"""

from lmforge.train.checkpoint.files import (
    COMMON_FILE,
    CONFIG_FILE,
    FORMAT,
    HF_WEIGHT_FILES,
    TRACKER_FILE,
    _distributed,
    _quiet_single_process,
    iteration_dir_name,
    read_tracker,
    write_tracker,
)
from lmforge.train.checkpoint.load import (
    HF_RESUME_MESSAGE,
    NO_OPTIMIZER_MESSAGE,
    load_checkpoint,
    load_model_weights,
)
from lmforge.train.checkpoint.manager import CheckpointManager, recover_save_path
from lmforge.train.checkpoint.resolve import (
    CheckpointHeader,
    _read_common,
    _read_metadata,
    is_hf_model_dir,
    resolve_checkpoint,
)
from lmforge.train.checkpoint.safe_load import TensorRef as _TensorRef
from lmforge.train.checkpoint.state_codec import _allocate_encoded, decode_state, encode_state
from lmforge.train.checkpoint.state_dicts import Checkpointable, _canonical_name, _model_state_dict
from lmforge.utils.logging import get_logger

# The one logger of the package (every module of it logs under this name).
logger = get_logger("lmforge.train.checkpoint")

__all__ = [
    "COMMON_FILE",
    "CONFIG_FILE",
    "FORMAT",
    "HF_RESUME_MESSAGE",
    "HF_WEIGHT_FILES",
    "NO_OPTIMIZER_MESSAGE",
    "TRACKER_FILE",
    "CheckpointHeader",
    "CheckpointManager",
    "Checkpointable",
    "_TensorRef",
    "_allocate_encoded",
    "_canonical_name",
    "_distributed",
    "_model_state_dict",
    "_quiet_single_process",
    "_read_common",
    "_read_metadata",
    "decode_state",
    "encode_state",
    "is_hf_model_dir",
    "iteration_dir_name",
    "load_checkpoint",
    "load_model_weights",
    "logger",
    "read_tracker",
    "recover_save_path",
    "resolve_checkpoint",
    "write_tracker",
]
