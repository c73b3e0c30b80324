"""Loop features on the tiny model: non-finite handling, batch ramp-up, accumulation rules, callbacks."""

import json

import pytest
import torch

from lmforge.errors import EXIT_TRAINING_FAILED, ConfigError
from lmforge.train.callbacks import TrainerCallback, read_metrics, register_callback
from lmforge.train.step import TrainingStopped

from .conftest import tiny_trainer


class PoisonSteps(TrainerCallback):
    """Makes the model produce NaN during the given (1-based) steps."""

    def __init__(self, steps):
        self.steps = set(steps)

    def on_step_begin(self, args, state, **kw):
        kw["model"].poison = (state.global_step + 1) in self.steps


def test_non_finite_steps_are_skipped_reported_and_never_saved(make_config):
    cfg = make_config(training={"steps": 6}, checkpoint={"save_interleaved_steps": 3})
    trainer = tiny_trainer(cfg, callbacks=[PoisonSteps({3})])
    summary = trainer.fit()
    records = read_metrics(trainer.output_dir / "metrics.jsonl")
    assert [r.get("skipped", False) for r in records] == [False, False, True, False, False, False]
    assert records[2]["loss"] == "nan" and "loss is nan" in records[2]["skip_reason"]
    assert summary["skipped steps"] == 1
    # The skipped step did not move the lr schedule: step 4 got the lr step 3 would have had.
    assert records[3]["lr"] == records[2]["lr"]
    log = (trainer.output_dir / "train.log").read_text()
    assert "Step 3: update skipped (loss is nan)" in log
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())


def test_consecutive_non_finite_steps_stop_training_with_a_clear_message(make_config):
    cfg = make_config(training={"steps": 10}, monitor={"health_checkpoint": {"global_norm_skip_time": 3}})
    trainer = tiny_trainer(cfg, callbacks=[PoisonSteps({2, 3, 4, 5})])
    with pytest.raises(TrainingStopped, match="3 consecutive steps were skipped"):
        trainer.fit()
    assert [r["step"] for r in read_metrics(trainer.output_dir / "metrics.jsonl")] == [1, 2, 3, 4]


ALL_STEPS = set(range(1, 100))


@pytest.mark.parametrize(
    "sections,why",
    [
        ({"monitor": {"health_checkpoint": {"global_norm_skip_time": 0}}}, "global_norm_skip_time is 0"),
        (
            {},
            "fewer steps than the 10 skipped steps in a row that stop a run "
            "(monitor.health_checkpoint.global_norm_skip_time = 10, its default without a monitor.health_checkpoint "
            "section)",
        ),
        ({"recovery": {"enable": True}}, "fewer steps than the 10 skipped steps in a row"),
    ],
    ids=["no-skip-limit", "shorter-than-the-limit", "with-recovery"],
)
def test_a_run_whose_every_step_is_skipped_fails_with_what_happened_and_what_to_change(
    make_config, sections, why
):
    cfg = make_config(training={"steps": 4}, checkpoint={"save_interleaved_steps": 2}, **sections)
    trainer = tiny_trainer(cfg, callbacks=[PoisonSteps(ALL_STEPS)])
    with pytest.raises(TrainingStopped) as info:
        trainer.fit()
    message = str(info.value)
    assert info.value.exit_status == EXIT_TRAINING_FAILED
    assert message.startswith(
        "Training applied no update: all 4 step(s) this run took (steps 1..4) were skipped (4 non-finite loss; "
        "the last: loss is nan), so the model's weights are the ones it started from; the checkpoints it saved "
        "(iteration_00000002, iteration_00000004) hold those same weights"
    )
    assert why in message and "Lower lr_scheduler.learning_rate" in message
    summary = json.loads((trainer.output_dir / "summary.json").read_text())
    assert summary["status"] == "failed: no update applied: all 4 step(s) skipped"
    assert (
        summary["skipped steps"] == 4 and summary["skipped steps (this run)"] == "4 of 4 (4 non-finite loss)"
    )
    assert "Training applied no update" in (trainer.output_dir / "train.log").read_text()


def test_a_run_that_ends_on_skipped_steps_completes_and_says_so_in_its_summary(make_config):
    cfg = make_config(training={"steps": 6}, monitor={"health_checkpoint": {"global_norm_skip_time": 0}})
    summary = tiny_trainer(cfg, callbacks=[PoisonSteps({2, 5, 6})]).fit()
    assert summary["status"] == "completed"
    assert summary["skipped steps (this run)"] == "3 of 6 (3 non-finite loss)"
    assert summary["last steps skipped"] == (
        "2 (steps 5..6; last: loss is nan): the final weights are those after the update of step 4"
    )


def test_a_stopped_run_with_no_update_is_no_failure_and_a_resumed_run_counts_its_own_steps(
    make_config, tmp_path
):
    class StopAt2(TrainerCallback):
        def on_step_end(self, args, state, **kw):
            if state.global_step == 2:
                kw["trainer"].request_stop("test stop")

    cfg = make_config(training={"steps": 6})
    summary = tiny_trainer(cfg, callbacks=[PoisonSteps({1, 2}), StopAt2()]).fit()
    assert summary["status"] == "stopped early (test stop); no update applied: all 2 step(s) skipped"
    # Resumed at step 2: this run's steps 3..6 are all skipped, so it trained nothing, whatever came before.
    resumed = make_config(training={"steps": 6}, checkpoint={"auto_resume": True})
    with pytest.raises(TrainingStopped, match=r"all 4 step\(s\) this run took \(steps 3..6\) were skipped"):
        tiny_trainer(resumed, callbacks=[PoisonSteps(ALL_STEPS)]).fit()
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert (
        summary["skipped steps"] == 6 and summary["skipped steps (this run)"] == "4 of 4 (4 non-finite loss)"
    )


def test_batch_rampup_grows_global_batch_and_accumulation(make_config):
    # start 2, +2 per increment, over 12 samples: 2 increments, one every 6 samples.
    cfg = make_config(
        training={"steps": 7, "global_batch_size": 6, "local_batch_size": 2, "rampup_batch_size": [2, 2, 12]}
    )
    trainer = tiny_trainer(cfg)
    trainer.fit()
    records = read_metrics(trainer.output_dir / "metrics.jsonl")
    # consumed before each step: 0,2,4 -> gbs 2; 6,10 -> 4; 14.. -> 6 (ramp-up over at 12).
    assert [r["global_batch_size"] for r in records] == [2, 2, 2, 4, 4, 6, 6]
    assert [r["consumed_samples"] for r in records] == [2, 4, 6, 10, 14, 20, 26]


def test_batch_too_small_for_one_micro_step_is_the_documented_error(make_config):
    cfg = make_config(training={"global_batch_size": 2, "local_batch_size": 4})
    with pytest.raises(
        ConfigError, match="The product of data_parallel and local_batch_size exceeds global_batch_size"
    ):
        tiny_trainer(cfg)


def test_non_multiple_global_batch_warns_and_counts_the_effective_batch(make_config, capsys):
    cfg = make_config(training={"steps": 2, "global_batch_size": 5, "local_batch_size": 2})
    trainer = tiny_trainer(cfg)
    trainer.fit()
    assert (
        "effective global batch is 4 samples"
        in capsys.readouterr().err + (trainer.output_dir / "train.log").read_text()
    )
    assert [r["consumed_samples"] for r in read_metrics(trainer.output_dir / "metrics.jsonl")] == [4, 8]


@register_callback("CountingCallback")
class CountingCallback(TrainerCallback):
    instances = []

    def __init__(self, tag="x"):
        self.tag, self.events = tag, []
        CountingCallback.instances.append(self)

    def on_train_begin(self, args, state, **kw):
        self.events.append("train_begin")

    def on_step_end(self, args, state, **kw):
        self.events.append(
            ("step", state.global_step, round(kw["loss"], 3) == round(kw["metrics"]["loss"], 3))
        )

    def on_train_end(self, args, state, **kw):
        self.events.append("train_end")


@pytest.mark.slow
def test_config_callbacks_are_built_from_the_registry(make_config):
    cfg = make_config(training={"steps": 2}, callbacks=[{"type": "CountingCallback", "tag": "y"}])
    tiny_trainer(cfg).fit()
    cb = CountingCallback.instances[-1]
    assert cb.tag == "y" and cb.events == ["train_begin", ("step", 1, True), ("step", 2, True), "train_end"]
    with pytest.raises(ConfigError, match=r"callbacks\[0\].type: unknown callback 'Nope'"):
        tiny_trainer(make_config(callbacks=[{"type": "Nope"}]))


class EpochRecorder(TrainerCallback):
    def __init__(self):
        self.events = []

    def on_epoch_begin(self, args, state, **kw):
        self.events.append(("begin", state.epoch, state.global_step))

    def on_epoch_end(self, args, state, **kw):
        self.events.append(("end", state.epoch, state.global_step))


def test_epoch_hooks_follow_the_loaders_epoch_length(make_config):
    from .tiny import TinyLoader

    class ThreePerEpoch(TinyLoader):
        def __len__(self):
            return 3  # micro-batches per epoch

    cfg = make_config(training={"steps": 4}, checkpoint={"enable_save": False})
    rec = EpochRecorder()
    trainer = tiny_trainer(cfg, callbacks=[rec])
    trainer.dataloader_factory = lambda consumed: ThreePerEpoch(consumed, 2, seed=7)
    trainer.fit()
    # 4 steps x 2 micro-batches = 8: epochs end with micro-batches 3 and 6 (steps 2 and 3); the next
    # epoch begins with the next micro-batch fetched (4: step 2; 7: step 4).
    assert rec.events == [("begin", 0, 0), ("end", 0, 1), ("begin", 1, 1), ("end", 1, 2), ("begin", 2, 3)]
    assert trainer.state.epoch == 2


def test_spike_skipping_is_opt_in_and_non_finite_steps_are_always_skipped(make_config):
    from lmforge.train.step import SkipPolicy

    # The spec: an omitted section turns its feature off; the step then clips and applies.
    off = SkipPolicy.from_monitor(make_config().monitor)
    assert off.grad_norm_threshold == off.embedding_norm_threshold == float("inf")
    assert not off.spike_skipping and off.max_consecutive == 10
    other_monitor = SkipPolicy.from_monitor(make_config(monitor={"tensorboard": {"log_interval": 2}}).monitor)
    assert other_monitor == off
    on = SkipPolicy.from_monitor(make_config(monitor={"health_checkpoint": {}}).monitor)
    assert (on.grad_norm_threshold, on.embedding_norm_threshold, on.max_consecutive) == (100.0, 100.0, 10)

    tiny = {"health_checkpoint": {"global_norm_skip_threshold": 1e-6, "global_norm_skip_time": 0}}
    spiky = tiny_trainer(make_config(training={"steps": 3}, monitor=tiny))
    # Every step skipped: the run applied no update, an error (train/run_outcome.py) that names the threshold.
    with pytest.raises(
        TrainingStopped, match=r"Raise monitor.health_checkpoint.global_norm_skip_threshold \(1e-06\)"
    ):
        spiky.fit()
    records = read_metrics(spiky.output_dir / "metrics.jsonl")
    assert all(r.get("skipped") and "global_norm_skip_threshold" in r["skip_reason"] for r in records)
    plain = tiny_trainer(make_config(training={"steps": 3}), callbacks=[PoisonSteps({2})])
    plain.fit()
    records = read_metrics(plain.output_dir / "metrics.jsonl")
    assert [r.get("skipped", False) for r in records] == [False, True, False]


def test_a_save_after_the_loop_is_reported_in_the_summary_and_log(make_config, tmp_path):
    # Step 5 is no multiple of 2: its checkpoint is written after the loop, where no metrics line is.
    cfg = make_config(training={"steps": 5}, checkpoint={"save_interleaved_steps": 2})
    trainer = tiny_trainer(cfg)
    summary = trainer.fit()
    records = read_metrics(trainer.output_dir / "metrics.jsonl")
    assert [r["step"] for r in records if "checkpoint_save_s" in r] == [2, 4]
    assert summary["final checkpoint save"].startswith("step 5, ")
    seconds = float(summary["final checkpoint save"].split(", ")[1].removesuffix(" s"))
    assert seconds > 0
    assert (
        "Checkpoint of step 5 saved at the end of the run" in (trainer.output_dir / "train.log").read_text()
    )
    # A last step that was already saved in the loop is not saved again, and nothing is reported.
    cfg = make_config(
        output_dir=str(tmp_path / "run2"),
        training={"steps": 4},
        checkpoint={"save_interleaved_steps": 2, "save_path": str(tmp_path / "ckpt2")},
    )
    second = tiny_trainer(cfg).fit()
    assert second["steps"] == "4/4" and second["resumed from"] == "-"
    assert "final checkpoint save" not in second
