"""setup_logging (utils/logging.py): a second run in one process replaces the first run's handlers."""

from __future__ import annotations

import logging

from lmforge.utils.logging import get_logger, setup_logging


def test_a_second_setup_closes_the_first_runs_log_file_and_writes_only_to_its_own(tmp_path):
    root = logging.getLogger("lmforge")
    saved = (list(root.handlers), root.level, root.propagate)
    try:
        setup_logging(log_file=str(tmp_path / "first.log"))
        first = next(h for h in root.handlers if isinstance(h, logging.FileHandler))
        setup_logging(log_file=str(tmp_path / "second.log"))
        assert first.stream is None  # closed: no file descriptor left open per finished run
        get_logger("lmforge.test").info("second run")
        files = [h for h in root.handlers if isinstance(h, logging.FileHandler)]
        assert [h.baseFilename for h in files] == [str(tmp_path / "second.log")]
        for h in files:
            h.flush()
        assert "second run" in (tmp_path / "second.log").read_text()
        assert "second run" not in (tmp_path / "first.log").read_text()
    finally:
        for h in list(root.handlers):
            root.removeHandler(h)
            h.close()
        for h in saved[0]:
            root.addHandler(h)
        root.setLevel(saved[1])
        root.propagate = saved[2]
