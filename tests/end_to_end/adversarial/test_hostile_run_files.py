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
