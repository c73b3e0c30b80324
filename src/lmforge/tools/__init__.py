"""Offline analyses of a configuration, no process group needed: the per-rank memory estimate
(``memory.py``), what ``lmforge check --world-size N`` prints about parallelism (``report.py``) and the
layout planner of ``lmforge plan`` (``planner.py``).

Layer: above ``parallel`` (they read the run plan's degrees, batch schedule and a meta-device model)
and below ``train`` (the training doctor's memory remedies ask the same estimate) and ``cli``.
"""
