"""Recovery at world size 1 (fp32 tiny model): a damage injected once, a rollback, and the run ends bitwise
where an undamaged run (replay) or a run that never saw the skipped batches (skip) ends."""

from __future__ import annotations

import pytest
import torch

from lmforge.train.callbacks import TrainerCallback, read_metrics
from lmforge.train.step import TrainingStopped

from ..conftest import tiny_config, tiny_trainer
from ..tiny import TinyLoader

STEPS = 8
DAMAGE_AT = 4  # the weights after update 4 are damaged (and saved so: the checkpoint of step 4 is bad)

pytestmark = pytest.mark.slow  # each trains the tiny model several times (docs/architecture.md, Testing)


class DamageWeights(TrainerCallback):
    """Test-only fault: multiplies the output layer's weights by 100 after update ``step``, ``times`` times."""

    order = 70  # before the checkpoint callback (80): the damaged weights get saved, as a real fault would

    def __init__(self, step: int, times: int = 1) -> None:
        self.step, self.left = step, times

    def on_step_end(self, args, state, **kwargs):
        if state.global_step == self.step and self.left > 0:
            self.left -= 1
            with torch.no_grad():
                kwargs["model"].output_layer.weight.mul_(100.0)


def run(tmp, *, recovery=None, callbacks=(), loader=None, save_max=10, extra=None):
    sections = {
        "training": {"steps": STEPS},
        "checkpoint": {"save_interleaved_steps": 2, "save_max": save_max},
        **(extra or {}),
    }
    if recovery is not None:
        sections["recovery"] = {"enable": True, **recovery}
    cfg = tiny_config(tmp, **sections)
    trainer = tiny_trainer(cfg, callbacks=list(callbacks))
    if loader is not None:
        trainer.dataloader_factory = loader
    trainer.fit()
    return trainer


def timeline(tmp):
    """The (step, loss, grad_norm) records of the run as it finally went: a rollback's undone steps dropped."""
    kept: dict[int, tuple] = {}
    for r in read_metrics(tmp / "run" / "metrics.jsonl"):
        if r.get("event") == "rollback":
            kept = {s: v for s, v in kept.items() if s <= r["to_step"]}
        else:
            kept[r["step"]] = (r["loss"], r["grad_norm"])
    return sorted(kept.items())


def weights(trainer):
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def assert_bitwise(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.fixture(scope="module")
def undamaged(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("undamaged")
    return weights(run(tmp)), timeline(tmp)


def test_replay_after_damage_ends_bitwise_where_the_undamaged_run_ends(tmp_path, undamaged):
    trainer = run(
        tmp_path, recovery={"data": "replay", "lr_scale": 1.0}, callbacks=[DamageWeights(DAMAGE_AT)]
    )
    events = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if r.get("event") == "rollback"]
    # The loss of step 5 is the first computed with the damaged weights; the checkpoint of step 4 holds
    # them, so the safe one is step 2's.
    assert len(events) == 1
    e = events[0]
    assert (e["step"], e["to_step"], e["onset"]) == (DAMAGE_AT + 1, 2, DAMAGE_AT + 1)
    assert e["reason"].startswith("loss spike")
    assert e["skipped_samples"] is None and e["replayed_samples"] == [8, 19]  # steps 3..5, 4 samples each
    assert trainer.state.global_step == STEPS
    assert_bitwise(weights(trainer), undamaged[0])
    assert timeline(tmp_path) == undamaged[1]


class SkippingLoader(TinyLoader):
    """The reference for ``data: skip``: a loader that never yields samples [first, last]."""

    def __init__(self, consumed, lbs, seed, first, last):
        super().__init__(consumed, lbs, seed=seed)
        self.first, self.gap = first, last - first + 1

    def sample(self, i):
        return super().sample(i + self.gap if i >= self.first else i)


def test_skip_after_damage_ends_bitwise_where_a_run_without_those_batches_ends(tmp_path):
    damaged = tmp_path / "damaged"
    trainer = run(damaged, recovery={"data": "skip"}, callbacks=[DamageWeights(DAMAGE_AT)])
    (event,) = [r for r in read_metrics(damaged / "run" / "metrics.jsonl") if r.get("event") == "rollback"]
    first, last = event["skipped_samples"]
    assert (event["to_step"], first, last) == (2, 8, 19)
    assert trainer.state.global_step == STEPS
    assert trainer.state.consumed_samples == STEPS * 4 + (last - first + 1)

    reference = tmp_path / "reference"
    ref = run(reference, loader=lambda consumed: SkippingLoader(consumed, 2, 7, first, last))
    assert_bitwise(weights(trainer), weights(ref))
    assert timeline(damaged) == timeline(reference)


def test_damage_that_recurs_stops_after_max_rollbacks_with_an_error_and_a_checkpoint(tmp_path):
    with pytest.raises(TrainingStopped, match=r"recovery.max_rollbacks \(2\) is reached") as info:
        run(
            tmp_path,
            recovery={"data": "replay", "max_rollbacks": 2},
            callbacks=[DamageWeights(DAMAGE_AT, times=5)],
        )
    assert "iteration_00000002" in str(info.value)  # names the newest safe checkpoint
    events = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if r.get("event") == "rollback"]
    assert [e["rollback"] for e in events] == [1, 2]
    assert (tmp_path / "ckpt" / "iteration_00000002" / ".metadata").is_file()


def test_rotation_keeps_the_safe_checkpoint_beyond_save_max(tmp_path, undamaged):
    trainer = run(tmp_path, recovery={"data": "replay"}, callbacks=[DamageWeights(DAMAGE_AT)], save_max=1)
    assert_bitwise(weights(trainer), undamaged[0])


def test_without_recovery_the_damage_stays(tmp_path, undamaged):
    trainer = run(tmp_path, callbacks=[DamageWeights(DAMAGE_AT)])
    assert not torch.equal(weights(trainer)["output_layer.weight"], undamaged[0]["output_layer.weight"])
