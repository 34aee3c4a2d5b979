"""`--profile N`: a trace that names the matmul operators, the top operators, and a summary whose parts add up
to the profiled steps' own time."""

from __future__ import annotations

import json

import pytest

from support.cli import invoke
from support.runs import read_metrics


def test_profile_writes_a_trace_and_a_summary_that_adds_up(make_recipe, tmp_path):
    run = tmp_path / "run"
    result = invoke("train", make_recipe(training={"max_steps": 7, "gradient_accumulation_steps": 2}),
                    "--output-dir", run, "--profile", "3")
    assert result.exit_code == 0, result.output
    assert "profile of 3 steps" in result.output and "forward" in result.output
    trace = json.loads((run / "profile" / "trace.json").read_text())
    names = {event.get("name") for event in trace["traceEvents"]}
    assert names & {"aten::mm", "aten::addmm", "aten::bmm"}, sorted(n for n in names if n and "aten" in n)[:20]
    assert {"gpupoor/forward", "gpupoor/backward", "gpupoor/optimizer"} <= names
    assert "aten::" in (run / "profile" / "top_ops.txt").read_text()
    summary = json.loads((run / "profile" / "summary.json").read_text())
    # The profiled steps are steps 4-6 (2 warm-up steps, then one the profiler warms up on).
    step_s = [r["step_s"] for r in read_metrics(run) if "loss" in r and 4 <= r["step"] <= 6]
    assert summary["steps"] == 3 and summary["step_s"] == pytest.approx(sum(step_s))
    parts = summary["parts_s"]
    assert all(parts[part] > 0 for part in ("data", "forward", "loss", "backward", "optimizer"))
    assert sum(parts.values()) == pytest.approx(summary["step_s"], rel=0.10)


def test_a_run_too_short_for_the_profile_says_so(make_recipe, tmp_path):
    result = invoke("train", make_recipe(training={"max_steps": 3}), "--output-dir", tmp_path / "run", "--profile", "5")
    assert result.exit_code == 0 and "nothing was profiled" in result.output
    assert not (tmp_path / "run" / "profile").exists()


def test_the_profile_counts_the_dtype_casts_of_a_step(make_recipe, tmp_path):
    """fp32 casts next to nothing; bf16 on the CPU casts (norms to fp32 and back, the fp32 LoRA factors to bf16,
    the loss's chunks), and the summary says how many per step."""
    casts = {}
    for precision in ("fp32", "bf16"):
        run = tmp_path / precision
        result = invoke("train", make_recipe(precision=precision, training={"max_steps": 4}), "--output-dir", run,
                        "--profile", "1")
        assert result.exit_code == 0, result.output
        assert "casts (aten::_to_copy):" in result.output
        casts[precision] = json.loads((run / "profile" / "summary.json").read_text())["casts"]["per_step"]
    assert casts["bf16"] > casts["fp32"] + 10, casts
