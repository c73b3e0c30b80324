"""Files a run leaves behind, damaged or hand-edited: read with a report, never a crash."""

from __future__ import annotations

import json

import pytest

from tools.doctor.test_rules_synthetic import _healthy, _write_run

HOSTILE_FACTS = {
    "a list": "[]",
    "a string": '"x"',
    "cut": '{"frozen": ["a"',
    "wrong types": json.dumps(
        {
            "world_size": "abc",
            "frozen": 5,
            "not_updated": [1, 2],
            "decayed_1d": [None],
            "moe_num_experts": "x",
            "moe_top_k": [],
            "device_memory_bytes": "big",
            "not_updated_checked_at_step": 1.5,
            "compute_dtype": 3,
        }
    ),
}


@pytest.mark.parametrize("name", list(HOSTILE_FACTS))
def test_the_offline_doctor_reads_a_malformed_facts_file_with_a_report(tmp_path, cli, name):
    run = _write_run(tmp_path, _healthy())
    (run / "doctor_facts.json").write_text(HOSTILE_FACTS[name])
    code, out, err = cli("doctor", run)
    assert code == 0, err
    assert "doctor_facts.json" in err and ("ignored" in err or "is not the JSON object" in err)


HOSTILE_METRICS = {
    "step a string": '{"step": "four", "loss": 1.0}',
    "step null": '{"step": null, "loss": 1.0}',
    "step overflowing": '{"step": 1e400, "loss": 1.0}',
    "rollback to a string": '{"event": "rollback", "to_step": "x"}',
    "not an object": "[1, 2]",
    "not JSON": "garbage",
}


@pytest.mark.parametrize("name", list(HOSTILE_METRICS))
def test_the_offline_doctor_reads_a_damaged_metrics_line_with_a_report(tmp_path, cli, name):
    # Before: a step that is not a whole number was a traceback from a rule's int() (ValueError,
    # TypeError, OverflowError); a damaged line in the middle of the file was dropped without a word.
    run = _write_run(tmp_path, _healthy())
    lines = (run / "metrics.jsonl").read_text().splitlines()
    lines.insert(2, HOSTILE_METRICS[name])
    (run / "metrics.jsonl").write_text("\n".join(lines) + '\n{"step": 99, "lo')  # and a crash-cut last line
    code, out, err = cli("doctor", run)
    assert code == 0 and "Traceback" not in err, err
    assert "metrics.jsonl: ignored line(s) 3:" in err, err
    assert "line(s) 3, " not in err  # the cut last line is expected after a crash: not reported
