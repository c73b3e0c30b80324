"""Parallelism applied from outside the model: ParallelDims and the mesh, FSDP2/HSDP, TP+SP, EP, CP, PP.

Entry points: :class:`ParallelDims` (degrees from the ``parallelism`` section and the world size),
:meth:`ParallelDims.build_mesh`, :func:`parallelize` (apply everything to a model built on meta),
:class:`RunPlan` (every pre-build check and the batch schedule, :mod:`lmforge.parallel.plan`),
:func:`accumulation_steps`. The memory estimate, ``check``'s parallel report and the layout planner are
tools (:mod:`lmforge.tools`).
"""

from lmforge.parallel.api import ParallelInfo, parallelize
from lmforge.parallel.dims import ParallelDims, ParallelMesh
from lmforge.parallel.plan import BatchSchedule, RunPlan, accumulation_steps

__all__ = [
    "BatchSchedule",
    "ParallelDims",
    "ParallelInfo",
    "ParallelMesh",
    "RunPlan",
    "accumulation_steps",
    "parallelize",
]
