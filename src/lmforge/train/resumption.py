"""How a run begins: from its own checkpoint (auto-resume), from ``checkpoint.load_path``, or fresh; and
what follows any restore (resume, or recovery's rollback) into the trainer's live objects."""

from __future__ import annotations

from typing import Any

from lmforge.train.checkpoint import load_checkpoint
from lmforge.train.checkpoint.resume import checkpoint_to_load
from lmforge.utils.logging import get_logger

logger = get_logger("lmforge.train")


class Resumption:
    """The trainer's start: which checkpoint, the data position, the counters and the loss scale.

    Holds the trainer it starts (a back-reference, as OLMo-core's callbacks hold theirs): it fills the
    trainer's dataloader, state and checkpoint manager, nothing else.
    """

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        self.resumed_from: str | None = None  # the checkpoint the run started from (the summary names it)

    def resume_or_start(self) -> None:
        trainer = self.trainer
        checkpoint_cfg = trainer.checkpoint_cfg
        header, own = checkpoint_to_load(checkpoint_cfg)
        # This job's own checkpoint (auto-resume) continues completely, optimizer included.
        no_load_optim = False if own else checkpoint_cfg.no_load_optim
        consumed = 0
        if header is not None and header.kind == "dcp" and not no_load_optim:
            consumed = int(header.common.get("consumed_samples", 0))
        trainer.dataloader = trainer.dataloader_factory(consumed)
        if header is not None:
            load_checkpoint(
                header,
                trainer.checkpointable(),
                no_load_optim=no_load_optim,
                hf_loader=trainer.hf_loader,
                partial_load=checkpoint_cfg.partial_load,
                reset_optimizer=checkpoint_cfg.reset_optimizer,
            )
            self.resumed_from = str(header.path)
            if header.kind == "dcp" and not no_load_optim:
                self._rescale_step(int(header.common.get("global_batch_size") or 0))
        self._record_lora_base(header)
        self.after_restore()
        if trainer._recovery is not None:
            trainer._recovery.start(trainer.state)
        scaler = trainer.step_fn.loss_scaler
        if scaler is not None:
            logger.info(
                "model.compute_dtype float16: dynamic loss scaling from %g (x%g after %d clean updates, x%g "
                "on overflow)",
                scaler.scale,
                scaler.growth_factor,
                scaler.growth_interval,
                scaler.backoff_factor,
            )

    def _rescale_step(self, saved_gbs: int) -> None:
        """A checkpoint trained with another global batch size: the sample position is kept, re-expressed
        in steps of the new batch (as the original)."""
        state, batches = self.trainer.state, self.trainer.batches
        current = batches.global_batch_at(state.consumed_samples)
        if batches.rampup is None and saved_gbs and saved_gbs != current:
            state.global_step = int(state.global_step * saved_gbs / current)
            logger.warning(
                "The checkpoint was trained with global_batch_size %d, this run uses %d: resuming at step %d.",
                saved_gbs,
                current,
                state.global_step,
            )

    def after_restore(self) -> None:
        """After a checkpoint was loaded into the live objects (resume, or recovery's rollback)."""
        trainer = self.trainer
        trainer.state.max_steps = int(trainer.config.training.steps)
        scaler = trainer.step_fn.loss_scaler
        if scaler is not None:
            if trainer.state.loss_scaler:
                scaler.load_state_dict(trainer.state.loss_scaler)  # the scale of the checkpoint
            trainer.state.loss_scaler = scaler.state_dict()
        trainer._restart_data_iteration()

    def _record_lora_base(self, header: Any) -> None:
        """A LoRA run saves small checkpoints: the adapters plus where the frozen base came from."""
        from lmforge.train.checkpoint.lora import base_record, has_adapters

        trainer = self.trainer
        manager = getattr(trainer, "_checkpoint_manager", None)
        if manager is None or not has_adapters(trainer.model):
            return
        seed = int(trainer.config.training.seed)
        if trainer.ctx.rank == 0:  # only rank 0 writes common.json
            manager.lora_base = base_record(header, seed)
        else:
            manager.lora_base = {}  # every rank must leave the frozen base out of the state dict
