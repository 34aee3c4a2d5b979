"""A checkpoint into what build_session built: checked first (the same data, trajectory settings, processes and
model files, or --force), then its weights, optimizer (and GradScaler) state and progress; the schedule is built
at the restored step. A resume feeds the builders' outputs, never the loop."""

from __future__ import annotations

import json
from pathlib import Path

from gpupoor.errors import RunFailed, UserError
from gpupoor.recipe.schema import Recipe
from gpupoor.run.session import Session


def check_checkpoint_matches(session: Session, checkpoint) -> None:
    """Refuse (unless --force) a checkpoint written for other data or other trajectory settings."""
    from gpupoor.recipe.diff import trajectory_hash

    if checkpoint.manifest.get("data_fingerprint") not in (None, session.data.fingerprint):
        raise UserError("the training data (or tokenizer, format or max_length) is not what this run was "
                        f"trained on: its fingerprint changed since checkpoint {checkpoint.path.name}",
                        hint="restore the original data, or pass --force to continue on the new data")
    recorded = checkpoint.manifest.get("recipe_hash")
    if recorded not in (None, trajectory_hash(session.recipe)) and session.recipe.model.fused_layers:
        unfused = session.recipe.model_copy(update={"model": session.recipe.model.model_copy(
            update={"fused_layers": False})})
        if recorded == trajectory_hash(unfused):
            raise UserError(f"checkpoint {checkpoint.path.name} was written with the plain decoder modules (by a "
                            "gpupoor before model.fused_layers, or with it off); the fused layers round differently",
                            hint="resume with --set model.fused_layers=false to continue it exactly, or pass --force "
                            "to continue with the fused layers")
    if recorded not in (None, trajectory_hash(session.recipe)):
        raise UserError(f"run_dir/recipe.yaml no longer describes the run that wrote {checkpoint.path.name} "
                        "(its trajectory settings were edited)",
                        hint="restore them, or pass --force to continue with the edited recipe")
    saved, now = checkpoint.manifest.get("processes", 1), session.accelerator.num_processes
    if saved != now:
        # Each process draws its own micro-batches and the gradients meet by all-reduce: another count takes
        # other micro-batches per optimizer step (and another step count per epoch).
        raise UserError(f"these changes alter the training trajectory, so the result would no longer be the run "
                        f"that was started:\n  processes: {saved} -> {now} (checkpoint {checkpoint.path.name} "
                        "was written by a run on " f"{saved} process{'es' if saved != 1 else ''})",
                        hint=f"launch {saved} process{'es' if saved != 1 else ''} again (e.g. torchrun --nproc-per-node "
                        f"{saved}), or pass --force to continue on {now} (the data position carries over; the "
                        "optimizer state is resharded)")


def check_models(session: Session, checkpoint, *, force: bool, say) -> tuple[dict, dict[str, str]]:
    """The identity of each model the run loads (gpupoor.model.identity), taken by the first process (it writes the
    checkpoints) and sent to the others, and what changed since the checkpoint recorded them: refused unless
    --force, which accepts them. Every process gets the same verdict, so a refusal ends them all with exit 2
    (the others would otherwise go on into the next collective alone). Returns (identities, changes by key)."""
    if session.smoke:
        return {}, {}
    verdict: object = None
    if session.main:
        try:
            verdict = _model_verdict(session, checkpoint)
        except Exception as exc:  # a file that cannot be read: said by every process, not only the first
            verdict = exc
    if session.accelerator.num_processes > 1:
        import torch.distributed as dist

        sent = [verdict if not isinstance(verdict, Exception) else RunFailed(str(verdict))]
        dist.broadcast_object_list(sent, src=0)  # a sync point: the others wait while the first hashes
        verdict = verdict if session.main else sent[0]
    if isinstance(verdict, Exception):
        raise verdict
    models, changes = verdict
    listed = "\n".join(f"  {key}: {change}" for key, change in changes.items())
    if changes and not force:
        raise UserError(f"the model{'s' if len(changes) > 1 else ''} this run trained with changed at the same path "
                        f"since checkpoint {checkpoint.path.name}; resuming would continue on other weights:\n{listed}",
                        hint="restore the original files, or pass --force to accept the new ones (the next "
                        "checkpoint records them)")
    if changes:
        say(f"warning: --force: resuming with changed models (recorded from now on):\n{listed}")
    return models, changes


def _model_verdict(session: Session, checkpoint) -> tuple[dict, dict[str, str]]:
    """(identities, changes since the checkpoint's record) of the models the recipe names."""
    from gpupoor.model.identity import model_changes, model_identities

    recorded = checkpoint.manifest.get("models") if checkpoint is not None else None
    models = model_identities(session.recipe, recorded)
    session.startup.mark("model")  # identifying the model's files counts as loading them
    return models, model_changes(recorded, models)


def restore(session: Session, checkpoint, *, force: bool) -> None:
    """Load a checkpoint's adapter, optimizer (and GradScaler) state and progress; then build the schedule at
    the restored step. `checkpoint` None: a new run at step 0. (latest_valid verified every listed file.)"""
    from gpupoor.train.optim import build_scheduler
    from gpupoor.train.state import TrainState

    session.state = TrainState()
    if checkpoint is not None:
        from gpupoor.storage.checkpoint import STATE, load_torch
        from gpupoor.train.distributed import load_optimizer

        load_trained_weights(session, checkpoint.path)
        # Into the bare optimizer: accelerate's wrapper adds nothing to its state.
        load_optimizer(session.unwrapped, session.raw_optimizer, checkpoint.path)
        scaler = session.accelerator.scaler
        if scaler is not None and (checkpoint.path / "scaler.pt").is_file():
            scaler.load_state_dict(load_torch(checkpoint.path / "scaler.pt"))
        if force:
            _apply_hyperparameters(session.recipe, session.optimizer)
        session.state = TrainState.from_dict(json.loads((checkpoint.path / STATE).read_text()))
        session.warmup = _resumed_warmup(session, checkpoint, force)
    # Built after the optimizer state is restored: it starts at the current step of the schedule for `steps`.
    session.scheduler = build_scheduler(session.recipe.training, session.raw_optimizer, session.steps,
                                        session.warmup, session.state.step)


def _resumed_warmup(session: Session, checkpoint, force: bool) -> int:
    """The run's own warmup, which never restarts when a resume extends the run: as its manifest records it, or
    (older checkpoints; --force with new warmup settings) computed from the total the checkpoint was written for."""
    from gpupoor.train.optim import warmup_steps

    if "warmup_steps" in checkpoint.manifest and not force:
        return checkpoint.manifest["warmup_steps"]
    return warmup_steps(session.recipe.training, checkpoint.manifest.get("total_steps", session.steps))


def load_trained_weights(session: Session, directory: Path) -> None:
    """A checkpoint's adapter (or, `full`, its whole model) into the built model."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    from gpupoor.storage.checkpoint import ADAPTER

    device = session.accelerator.device
    device = "cpu" if device.type == "cpu" else str(device)  # safetensors refuses "cpu:0" (torchrun on CPUs)
    if session.full:
        load_model_weights(session.unwrapped, directory, device=device, sharded=session.sharded)
        return
    weights = load_file(directory / ADAPTER, device=device)
    if session.sharded:
        from gpupoor.train.distributed import load_weights

        unexpected = load_weights(session.model, weights, adapter=True)
    else:
        unexpected = getattr(set_peft_model_state_dict(session.unwrapped, weights), "unexpected_keys", None)
    if unexpected:
        raise UserError(f"checkpoint {directory.name} does not fit this model: unexpected {unexpected[:3]}")


def load_model_weights(model, directory: Path, *, device: str, sharded: bool = False) -> None:
    """A full fine-tune's checkpoint into the built model, shard by shard. Only weights tied to another one (the
    output head tied to the embeddings, which save_pretrained writes once) may be absent."""
    from safetensors.torch import load_file

    from gpupoor.storage.shards import weight_files
    from gpupoor.train.distributed import load_weights

    missing: set[str] = set(model.state_dict())
    for shard in weight_files(directory):
        weights = load_file(shard, device=device)
        if sharded:
            unexpected = load_weights(model, weights, adapter=False)
        else:
            unexpected = model.load_state_dict(weights, strict=False).unexpected_keys
        if unexpected:
            raise UserError(f"checkpoint {directory.name} does not fit this model: unexpected {unexpected[:3]}")
        missing -= set(weights)
    tied = {name for name in missing if name.endswith("lm_head.weight")
            and getattr(model.config, "tie_word_embeddings", False)}
    if missing - tied:
        raise UserError(f"checkpoint {directory.name} lacks weights of this model, e.g. {sorted(missing - tied)[:3]}")


def _apply_hyperparameters(recipe: Recipe, optimizer) -> None:
    """After a forced resume: the recipe's optimizer settings replace those restored from the checkpoint (the
    saved state carries the old peak learning rate, betas, weight decay). The scheduler, built afterwards,
    takes its peak from `initial_lr`."""
    from gpupoor.optimizers import OPTIMIZERS

    training = recipe.training
    for group in optimizer.param_groups:
        group["initial_lr"] = training.learning_rate
        group["weight_decay"] = training.weight_decay
        if "betas" in group:
            group["betas"] = tuple(training.adam_betas)
        if "eps" in group and "adam_eps" in OPTIMIZERS[training.optimizer].settings:
            group["eps"] = training.adam_eps
