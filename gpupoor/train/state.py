"""The one resumable progress object. Everything needed to continue a run exactly, besides the tensors of
the model, optimizer and scheduler, lives here and is saved as human-readable JSON."""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, field

import numpy as np
import torch


@dataclass
class TrainState:
    step: int = 0  # optimizer steps taken (including skipped ones)
    epoch: int = 0  # epoch the next micro-batch comes from
    batch_in_epoch: int = 0  # micro-batches of `epoch` already consumed: the data position
    samples_seen: int = 0  # examples consumed over the whole run
    tokens_seen: int = 0  # real (non-padding) tokens consumed
    target_tokens_seen: int = 0  # tokens the loss was computed on
    skipped_steps: int = 0  # steps dropped for a non-finite loss or gradient norm (fp16: the GradScaler's too)
    nonfinite_steps: int = 0  # of those, the ones that went wrong (not an fp16 GradScaler calibrating its scale)
    elapsed_s: float = 0.0  # training time so far, across resumes
    examples_by_source: dict = field(default_factory=dict)  # a mixture: examples drawn from each source so far
    # Evaluation that decides (early stopping, the best checkpoint): the best eval loss and its step, the evals
    # since it improved, and the last step whose eval was recorded and judged when this state was saved (a
    # checkpoint saved before its step's eval has an older one: a resumed run evaluates that step again).
    best_eval_loss: float | None = None
    best_step: int | None = None
    evals_without_improvement: int = 0
    evaluated_step: int = 0
    rng: dict = field(default_factory=dict)  # filled by capture_rng() at save time (the first process's)
    rng_by_rank: list = field(default_factory=list)  # several processes: each one's own, by rank
    # GRPO with grpo.iterations > 1: the answers the current iterations update on (gpupoor.objectives
    # .grpo_objective.Rollout, one per micro-batch), and with several processes each one's own, by rank.
    rollout: list = field(default_factory=list)
    window_start: list = field(default_factory=lambda: [0, 0])  # (epoch, batch_in_epoch) the last window began at
    rollout_by_rank: list = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "TrainState":
        return cls(**data)


def capture_rng() -> dict:
    """Python, numpy, torch CPU and each CUDA device's RNG state (tensors as lists, so JSON-safe)."""
    state = {
        "python": _to_json(random.getstate()),
        "numpy": _to_json(np.random.get_state()),
        "torch": torch.get_rng_state().tolist(),
    }
    if torch.cuda.is_available():
        state["cuda"] = [s.tolist() for s in torch.cuda.get_rng_state_all()]
    return state


def restore_rng(state: dict) -> None:
    random.setstate(_from_json(state["python"]))
    np.random.set_state(_from_json(state["numpy"]))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.tensor(s, dtype=torch.uint8) for s in state["cuda"]])


def _to_json(value):
    if isinstance(value, tuple):
        return {"tuple": [_to_json(v) for v in value]}
    if isinstance(value, np.ndarray):
        return {"ndarray": value.tolist(), "dtype": str(value.dtype)}
    return value


def _from_json(value):
    if isinstance(value, dict) and "tuple" in value:
        return tuple(_from_json(v) for v in value["tuple"])
    if isinstance(value, dict) and "ndarray" in value:
        return np.array(value["ndarray"], dtype=value["dtype"])
    return value
