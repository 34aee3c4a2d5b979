"""The loop's hooks for a run (gpupoor.train.loop.Hooks): each step boundary reported (Reporter), each eval judged
(EvalJudge), a checkpoint saved when due (CheckpointSaver), and the reason to stop, every one agreed by all
processes before anyone acts on it.

Where new things go: a tracker is a writer beside MetricsWriter, called from Reporter.write; a decision from
evaluation goes in EvalJudge."""

from __future__ import annotations

from gpupoor.run.judging import EvalJudge
from gpupoor.run.reporting import Reporter
from gpupoor.run.saving import CheckpointPolicy, CheckpointSaver
from gpupoor.run.session import Session


class RunHooks:
    """What happens at each step boundary of the loop, by the part whose job it is."""

    def __init__(self, session: Session, *, policy: CheckpointPolicy, stop, manifest_base: dict,
                 resumed: bool = False):
        self.session, self.stop = session, stop
        self.report = Reporter(session, resumed=resumed)
        self.saver = CheckpointSaver(session, policy, report=self.report, stop=stop, manifest_base=manifest_base)
        self.judge = EvalJudge(session, report=self.report, saver=self.saver)

    def loop_hooks(self):
        from gpupoor.train.loop import Hooks

        return Hooks(on_step=self.on_step, on_eval=self.judge.on_eval, should_stop=self.should_stop)

    def on_step(self, record: dict, state) -> None:
        from gpupoor import faults
        from gpupoor.train.distributed import any_process

        self.report.step(record, state)
        if any_process(self.saver.policy.due(state.step, self.session.steps)):  # each process has its own clock
            self.saver.save()
        faults.after_step(state.step)

    def should_stop(self, state, last_step_s: float) -> str | None:
        from gpupoor import faults
        from gpupoor.train.distributed import summed

        signal = self.stop.requested
        out_of_time = self.saver.policy.out_of_time(last_step_s) or state.step in faults.steps_for("timeout")
        # Every process must stop at the same step: a signal may reach one process only, and each measures its own
        # time. One all-reduce per step boundary (a sync point) makes the decision common.
        signal, out_of_time = (count > 0 for count in summed(float(signal), float(out_of_time)))
        if self.judge.patience_spent(state):
            return "early_stop"
        if signal:
            return self.stop.name or "stop requested on another process"
        return "time_limit" if out_of_time else None

    def close(self) -> None:
        self.report.close()
