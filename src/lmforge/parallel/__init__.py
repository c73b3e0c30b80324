"""Parallelism applied from outside the model: ParallelDims and the mesh, FSDP2/HSDP, TP+SP, EP, CP, PP.

Entry points: :class:`ParallelDims` (degrees from the ``parallelism`` section and the world size),
:meth:`ParallelDims.build_mesh`, :func:`parallelize` (apply everything to a model built on meta),
:func:`accumulation_steps`, and :func:`estimate_memory` for ``lmforge check --world-size N``.
"""

from lmforge.parallel.api import ParallelInfo, parallelize, validate_options
from lmforge.parallel.dims import ParallelDims, ParallelMesh, accumulation_steps, parallelism_options
from lmforge.parallel.memory import MemoryEstimate, describe_ranks, estimate_memory

__all__ = [
    "MemoryEstimate",
    "ParallelDims",
    "ParallelInfo",
    "ParallelMesh",
    "accumulation_steps",
    "describe_ranks",
    "estimate_memory",
    "parallelism_options",
    "parallelize",
    "validate_options",
]
