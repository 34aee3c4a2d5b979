"""Where a run's trained weights are, and that they are what gpupoor wrote. A run directory means its final/ or,
by name, checkpoints/step-N; any other directory is the weights themselves (an adapter, or a whole model for
peft.method `full`). Before anything reads them they are checked against their manifest. merge-lora, generate
and peft.init_adapter resolve through here."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from gpupoor.errors import UserError
from gpupoor.storage.checkpoint import ADAPTER_CONFIG, MODEL_CONFIG, verify_weights_dir
from gpupoor.storage.rundir import is_run_dir


@dataclass
class RunWeights:
    path: Path  # the weights directory: final/, checkpoints/step-N, or a directory named directly
    run_dir: Path | None  # set when given a run directory: its recipe and metrics describe the weights

    @property
    def is_adapter(self) -> bool:
        return (self.path / ADAPTER_CONFIG).is_file()

    def verify(self, skip: bool = False) -> None:
        """Raise a UserError naming the file that differs from the manifest (a run's weights always have one; a
        directory from elsewhere is checked when it has one). `skip`: the user changed the files on purpose."""
        verify_weights_dir(self.path, skip=skip, in_run=self.run_dir is not None)


def named_weights(path: Path) -> RunWeights:
    """What `path` names, unchecked: a run directory's final/, else the directory itself."""
    return RunWeights(path / "final", path) if is_run_dir(path) else RunWeights(path, None)


def locate_weights(path: Path, checkpoint: str = "final") -> RunWeights:
    """PATH [--checkpoint final | step-N] as merge-lora and generate take them: a run's weights (checked to be
    there), or `path` itself when it is not a run (then --checkpoint must be left at final). Not yet verified."""
    if is_run_dir(path):
        return RunWeights(_run_weights_dir(path, checkpoint), path)
    _refuse_checkpoint_outside_run(path, checkpoint)
    return RunWeights(path, None)


def resolve_model(path: Path, checkpoint: str) -> RunWeights:
    """A run dir (with --checkpoint final | step-N), an adapter or a model directory, verified against its manifest:
    what export and serve turn into a model."""
    if not path.is_dir():
        raise UserError(f"{path} is not a directory", hint="pass a run directory, an adapter or a model directory")
    weights = locate_weights(path, checkpoint)
    if not weights.is_adapter and not (weights.path / "config.json").is_file():
        raise UserError(f"{path} is neither a gpupoor run directory, an adapter nor a model directory (no "
                        "recipe.yaml, adapter_config.json or config.json)")
    weights.verify()
    return weights


def resolve_adapter(path: Path, checkpoint: str, check_files: bool = True) -> RunWeights:
    """A run dir (with --checkpoint final | step-N) or an adapter directory, verified against its manifest
    (unless `check_files` is off) before anything reads it."""
    if not is_run_dir(path) and not (path / ADAPTER_CONFIG).is_file():
        raise UserError(f"{path} is neither a gpupoor run directory nor a PEFT adapter directory "
                        "(no recipe.yaml, no adapter_config.json)")
    weights = locate_weights(path, checkpoint)
    if not weights.is_adapter:
        raise UserError(f"{weights.path} holds a whole fine-tuned model (peft.method: full), not an adapter: there "
                        "is nothing to merge", hint=f"load it as it is (AutoModelForCausalLM.from_pretrained) or "
                        f"try it with: gpupoor generate {path}")
    weights.verify(skip=not check_files)
    return weights


def _run_weights_dir(run_dir: Path, checkpoint: str) -> Path:
    """final/ or checkpoints/step-N of a run: an adapter, or (peft.method: full) a whole model."""
    if checkpoint != "final" and not re.fullmatch(r"step-\d+", checkpoint):
        # A name, not a path: "--checkpoint ../../other-run/final" must not reach weights outside this run.
        raise UserError(f"--checkpoint {checkpoint!r}: use final or the name step-N of one of {run_dir}'s "
                        "checkpoints (gpupoor status lists them), not a path",
                        hint="to use an adapter directory elsewhere, pass that directory instead of the run")
    weights = run_dir / "final" if checkpoint == "final" else run_dir / "checkpoints" / checkpoint
    if not ((weights / ADAPTER_CONFIG).is_file() or (weights / MODEL_CONFIG).is_file()):
        available = sorted(p.name for p in (run_dir / "checkpoints").glob("step-*")) \
            if (run_dir / "checkpoints").is_dir() else []
        raise UserError(f"{run_dir} has no trained weights at {weights.relative_to(run_dir)}"
                        + (" (the run has not finished)" if checkpoint == "final" else ""),
                        hint="pick one with --checkpoint: " + ", ".join(available) if available
                        else "train the run to the end first (gpupoor resume)")
    return weights


def _refuse_checkpoint_outside_run(path: Path, checkpoint: str) -> None:
    """--checkpoint picks among a run's checkpoints: given with an adapter or model directory it would be ignored."""
    if checkpoint != "final":
        raise UserError(f"--checkpoint {checkpoint}: {path} is not a run directory, so it has no checkpoints "
                        "to choose from", hint="pass the run directory, or leave --checkpoint out")
