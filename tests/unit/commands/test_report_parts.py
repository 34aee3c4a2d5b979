"""The unit tier of test_report.py (the tiers are described in tests/conftest.py)."""

from __future__ import annotations

from support.cli import invoke


def test_labels_tell_same_named_runs_apart(tmp_path):
    from gpupoor.commands.report import run_labels

    assert run_labels([tmp_path / "a" / "out", tmp_path / "b" / "out"]) == ["a/out", "b/out"]
    assert run_labels([tmp_path / "x", tmp_path / "y"]) == ["x", "y"]


def test_not_a_run_dir_is_exit_2(tmp_path):
    result = invoke("report", tmp_path)
    assert result.exit_code == 2 and "not a gpupoor run directory" in result.output
    assert not (tmp_path / "report.html").exists()


def test_sparkline_averages_into_at_most_40_marks_and_skips_non_finite():
    from gpupoor.commands.status import loss_sparkline

    line = loss_sparkline([{"step": s, "loss": 10.0 / s} for s in range(1, 1201)])
    marks = line.split()[1]
    assert len(marks) == 40 and marks[0] == "█" and marks[-1] == "▁" and set(marks) <= set("▁▂▃▄▅▆▇█")
    assert line.endswith("(steps 1-1200, 30 per mark)") and " mean " in line and " -> " in line
    first_mark = sum(10.0 / s for s in range(1, 31)) / 30  # the ends are the marks' means, not a step's loss
    assert f" mean {first_mark:.4g} -> " in line
    records = [{"step": 1, "loss": 3.0}, {"step": 2, "loss": None}, {"step": 3, "loss": float("nan")},
               {"step": 4, "loss": 1.0}]
    assert loss_sparkline(records) == "loss █▁ 3 -> 1 (steps 1-4)"
    assert loss_sparkline([{"step": 1, "loss": None}]) is None and loss_sparkline([]) is None
    assert loss_sparkline([{"step": s, "loss": 2.0} for s in range(1, 4)]) == "loss ▄▄▄ 2 -> 2 (steps 1-3)"


def test_log_scale_of_losses_at_or_below_zero_draws_them_without_a_warning(tmp_path):
    """A GRPO run's loss is often 0 or negative: on the log-scale loss panel (drawn for every report.html)
    matplotlib warned 'Data has no positive values' into a finished run's last lines and drew nothing."""
    import warnings

    from gpupoor.commands.report import RunMetrics, figure_png, loss_panel

    steps = [{"step": s, "loss": loss} for s, loss in enumerate([0.5, 0.0, -0.25, -0.1, 0.2], start=1)]
    negative = RunMetrics(tmp_path, "grpo", steps, [{"step": 5, "eval_loss": -0.3}], [], [])
    positive = RunMetrics(tmp_path, "sft", [{"step": 1, "loss": 2.0}, {"step": 2, "loss": 1.0}], [], [], [])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        figure = loss_panel([negative], log_scale=True)
        assert figure.axes[0].get_yscale() == "symlog" and "symmetric log" in figure.axes[0].get_ylabel()
        assert figure_png(figure).startswith(b"\x89PNG")
        assert loss_panel([positive], log_scale=True).axes[0].get_yscale() == "log"
