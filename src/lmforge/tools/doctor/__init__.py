"""The training doctor: diagnose a run from what it wrote (``lmforge doctor RUN_DIR``). The same rules
run live during training through :mod:`lmforge.train.callbacks.doctor_live`, which imports them from here.

``read_run_dir(path) -> RunEvidence``; ``diagnose(evidence) -> Diagnosis`` with ``findings`` (symptom,
evidence, cause, keys) and ``checked`` (the healthy signs looked at). The rules are one table,
:data:`lmforge.tools.doctor.rules.RULES`, mirrored in docs/guide.md.
"""

from lmforge.tools.doctor.evidence import FACTS_FILE, RunEvidence, read_run_dir
from lmforge.tools.doctor.rules import RULES, Diagnosis, Finding, diagnose

__all__ = ["FACTS_FILE", "RULES", "Diagnosis", "Finding", "RunEvidence", "diagnose", "read_run_dir"]
