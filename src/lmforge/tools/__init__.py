"""Offline analyses of a configuration or a run, no process group needed: the per-rank memory estimate
(``memory.py``), what ``lmforge check --world-size N`` prints about parallelism (``report.py``) and the
layout planner of ``lmforge plan`` (``planner.py``); and the offline training doctor (``doctor/``), which
reads a run directory and applies its rules (``lmforge doctor RUN_DIR``).

Layer: above ``parallel`` (they read the run plan's degrees, batch schedule and a meta-device model)
and below ``train`` (the live doctor callback runs the doctor's rules; its memory remedies ask the same
estimate) and ``cli``.
"""
