"""Evaluations during a run: each eval record reported, and judged once: the best eval_loss so far (its checkpoint
kept when checkpoint.keep_best says so) and the count of evaluations without improvement that early stopping reads.
What it decides lives in the TrainState (best_eval_loss, best_step, evals_without_improvement, evaluated_step),
so a resume goes on judging where the run left off."""

from __future__ import annotations

from gpupoor.run.session import Session


class EvalJudge:
    """Reports evals and keeps the best. `report`: the run's Reporter; `saver`: its CheckpointSaver (the best
    step is saved when it is not already)."""

    def __init__(self, session: Session, *, report, saver):
        self.session, self.report, self.saver = session, report, saver

    def on_eval(self, record: dict, state) -> None:
        self.report.write(record)
        self.report.message(f"step {record['step']}: eval_loss {record['eval_loss']:.4f}, "
                            f"accuracy {record['eval_accuracy']:.1%}")
        if record["step"] > state.evaluated_step:  # judge each eval once
            self._judge(record["eval_loss"], state)

    def _judge(self, loss: float, state) -> None:
        """Early stopping and the best checkpoint. Any fall of eval_loss makes a new best; only a fall of at least
        early_stopping_min_delta resets the count of evaluations without improvement."""
        training, keep_best = self.session.recipe.training, self.session.recipe.checkpoint.keep_best
        state.evaluated_step = state.step
        best = state.best_eval_loss
        if best is None or loss < best - training.early_stopping_min_delta:
            state.evals_without_improvement = 0
        else:
            state.evals_without_improvement += 1
        if best is None or loss < best:
            state.best_eval_loss, state.best_step = loss, state.step
            if keep_best:
                # Every process knows whether this step is saved (the policy's record is common): the save is
                # collective under FSDP.
                name = f"step-{state.step:06d}" if self.saver.policy.last_step == state.step else self.saver.save()
                self.report.write({"step": state.step, "event": "best", "checkpoint": name, "best_eval_loss": loss})

    def patience_spent(self, state) -> bool:
        """training.early_stopping_patience evaluations in a row without improvement. The same on every process:
        evals are reduced."""
        patience = self.session.recipe.training.early_stopping_patience
        return bool(patience) and state.evals_without_improvement >= patience
