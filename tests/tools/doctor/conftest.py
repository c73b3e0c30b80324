"""Induced-pathology runs, trained once per test session and shared by the tests that need them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from .runs import MOE_MODEL, train_run


def _freeze_embedding(trainer) -> None:
    trainer.model.embedding.word_embeddings.weight.requires_grad_(False)


def _no_loss_scaler(trainer) -> None:
    """Custom code (or another framework) running fp16 without the trainer's dynamic loss scaler."""
    trainer.step_fn.loss_scaler = None


def _collapse_router(trainer) -> None:
    """Every router weight 0 and frozen: all scores tie and top-1 picks expert 0 for every token."""
    for module in trainer.model.modules():
        if type(module).__name__ == "TopKRouter":
            with torch.no_grad():
                module.weight.zero_()
            module.weight.requires_grad_(False)


# name -> (dotted YAML changes, a function altering the built trainer or None)
PATHOLOGIES = {
    "healthy": ({}, None),
    "healthy_moe": ({"model": MOE_MODEL}, None),
    "lr_zero": ({"lr_scheduler.learning_rate": 0.0, "lr_scheduler.lr_end": 0.0}, None),
    "warmup_gt_steps": ({"lr_scheduler.warmup_steps": 200}, None),
    "warmup_gt_decay": ({"lr_scheduler.warmup_steps": 100, "lr_scheduler.decay_steps": 20}, None),
    "lr_x100": ({"lr_scheduler.learning_rate": 1.0, "lr_scheduler.lr_end": 0.1}, None),
    "fp16_no_scaling": ({"model.compute_dtype": "float16"}, _no_loss_scaler),
    "fp16_scaled": ({"model.compute_dtype": "float16"}, None),
    "eps_1e16_bf16": ({"model.compute_dtype": "bfloat16", "optimizer.eps": 1e-16}, None),
    "weight_decay_10": ({"optimizer.weight_decay": 10.0}, None),
    "decay_norms": ({"optimizer.weight_decay_include": ["*norm*"]}, None),
    "schedule_ends_early": ({"lr_scheduler.decay_steps": 8}, None),
    "frozen_embedding": ({}, _freeze_embedding),
    "router_collapse": ({"model": MOE_MODEL}, _collapse_router),
    "doctor_off": ({"monitor": {"doctor": {"enable": False}}}, None),
}


@pytest.fixture(scope="session")
def pathology_run(tmp_path_factory):
    base = tmp_path_factory.mktemp("doctor_runs")
    done: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in done:
            changes, prepare = PATHOLOGIES[name]
            done[name] = train_run(base, name, changes, prepare=prepare)
        return done[name]

    return get
