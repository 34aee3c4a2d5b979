"""`gpupoor report` (figures and a self-contained HTML page from a run's metrics) and the loss sparkline of
`gpupoor status`, on real short runs of the tiny model: one stopped by SIGTERM and resumed, with evals."""

from __future__ import annotations

import base64
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from support.cli import invoke
from support.rows import alpaca_rows, write_jsonl
from support.report import BAD_LINES, insert_bad_line

pytest.importorskip("matplotlib")

def _train(base: Path, model: Path, name: str, fault: str | None = None, **training) -> Path:
    data = base / "train.jsonl"
    if not data.exists():
        write_jsonl(data, alpaca_rows(48))
    recipe = {"model": {"name_or_path": str(model)},
              "data": {"path": str(data), "format": "alpaca", "max_length": 128, "sampler": "random", "eval_rows": 8},
              "peft": {"rank": 4},
              "training": {"micro_batch_size": 4, "max_steps": 6, "learning_rate": 1e-2, "cpu_threads": 1,
                           "warmup_steps": 0, "eval_every_steps": 2, **training},
              "checkpoint": {"every_steps": 2}, "logging": {"progress": "none"}, "seed": 0}
    path = base / f"{name}.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    run = base / name
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("GPUPOOR_CACHE", str(base / "cache"))
        result = invoke("train", path, "--output-dir", run, fault=fault, monkeypatch=patch)
        if fault:
            assert result.exit_code == 75, result.output
            result = invoke("resume", run, monkeypatch=patch)
        assert result.exit_code == 0, result.output
    return run


def _append(run: Path, *records: dict) -> None:
    with open(run / "metrics.jsonl", "a") as handle:
        handle.writelines(json.dumps(record) + "\n" for record in records)


def _records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_model) -> Path:
    """A folder holding `resumed` (6 steps, SIGTERM after step 3, resumed; evals at 2, 4, 6) and `faster` (a
    higher learning rate, straight through)."""
    base = tmp_path_factory.mktemp("report-runs")
    resumed = _train(base, tiny_model, "resumed", fault="sigterm@3")
    # The session events, as the run writes them (added by hand when this version of the loop does not yet).
    if not any(r.get("event") == "stop" for r in _records(resumed)):
        _append(resumed, {"step": 3, "event": "stop", "reason": "SIGTERM"},
                {"step": 3, "event": "start", "session": "resume", "time": 0})
    _train(base, tiny_model, "faster", learning_rate=3e-2)
    return base


@pytest.fixture()
def marked(runs, tmp_path) -> Path:
    """A copy of the resumed run with what only some runs log: a skipped step with a null loss and one with a
    finite loss, a best checkpoint, an early stop, and an event kind this version does not know."""
    run = tmp_path / "marked"
    shutil.copytree(runs / "resumed", run)
    records = _records(run)
    for record in records:
        if record.get("step") in (4, 5) and "loss" in record:
            record["skipped"] = True
            record["loss"] = None if record["step"] == 4 else record["loss"]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    _append(run, {"step": 2, "event": "best", "checkpoint": "step-000002", "best_eval_loss": 6.5},
            {"step": 4, "event": "best", "checkpoint": "step-000004", "best_eval_loss": 5.9},
            {"step": 6, "event": "early_stop", "best_step": 4, "best_eval_loss": 5.9},
            {"step": 6, "event": "something-new", "detail": 1})
    return run


# ---- the PNG -----------------------------------------------------------------------------------------------------

def test_png_has_every_panel_drawn(runs, tmp_path):
    from matplotlib.image import imread

    output = tmp_path / "out" / "report.png"
    result = invoke("report", runs / "resumed", "--output", output, "--log-scale")
    assert result.exit_code == 0, result.output
    assert f"wrote {output}" in result.output and "KiB" in result.output
    image = imread(output)
    assert image.shape[:2] == (1300, 1000)
    assert not [p for p in output.parent.iterdir() if p.name != "report.png"]  # no temporary file left
    # The loss panel fills the top ~40%, the other three share the rest. Axes, grid and labels are black and
    # grey: coloured pixels are the curves (a panel with its data missing has none; these have >1000).
    height, width = image.shape[:2]
    loss_area = image[int(0.03 * height):int(0.38 * height), int(0.08 * width):int(0.8 * width), :3]
    assert loss_area.std() > 0.02  # an empty loss panel (grid lines only) measures ~0.013
    for top, bottom in ((0.03, 0.38), (0.40, 0.57), (0.58, 0.75), (0.76, 0.97)):  # loss, lr, tokens/s, memory
        panel = image[int(top * height):int(bottom * height), int(0.08 * width):int(0.8 * width), :3]
        coloured = (panel.max(axis=-1) - panel.min(axis=-1) > 0.25).sum()
        assert coloured > 300, (top, bottom, coloured)


# ---- the HTML page -----------------------------------------------------------------------------------------------

def test_html_is_self_contained_and_summarizes_the_run(runs, tmp_path):
    run = tmp_path / "resumed"
    shutil.copytree(runs / "resumed", run)
    result = invoke("report", run)  # one run, no --output: RUN_DIR/report.html
    assert result.exit_code == 0, result.output
    page = (run / "report.html").read_text(encoding="utf-8")
    images = re.findall(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page)
    assert len(images) == 3  # the loss figure in linear and log scale, the other three panels
    assert all(base64.b64decode(image).startswith(b"\x89PNG\r\n\x1a\n") for image in images)
    # Nothing to fetch: no URL anywhere, and every src= is one of the embedded images.
    assert "http://" not in page and "https://" not in page and "//" not in re.sub(r"base64,[^\"]+", "", page)
    assert page.count("src=") == 3 and "href=" not in page and "<script" not in page and "url(" not in page
    assert "<h2>resumed</h2>" in page and f"<td>{run}</td>" in page
    final = json.loads((run / "final" / "manifest.json").read_text())
    assert f"{final['loss']:.4f} (final/, step 6)" in page
    assert f"the adapter is in {run / 'final'}" in page
    best_eval = min(r["eval_loss"] for r in _records(run) if "eval_loss" in r)
    assert f"{best_eval:.4f} at step" in page
    assert "6 of 6" in page and "lora rank 4" in page and "lr 0.01 cosine" in page
    assert f"transformers {final['versions']['transformers']}" in page
    assert "resume from step 3" in page and "stopped early: SIGTERM at step 3" in page


def test_html_of_an_unfinished_run_says_how_to_continue(runs, tmp_path):
    run = tmp_path / "unfinished"
    shutil.copytree(runs / "resumed", run)
    shutil.rmtree(run / "final")
    result = invoke("report", run, "--output", tmp_path / "r.html")
    assert result.exit_code == 0, result.output
    page = (tmp_path / "r.html").read_text()
    assert f"unfinished: newest checkpoint {run / 'checkpoints' / 'step-000006'} (step 6)" in page
    assert f"gpupoor resume {run}" in page and "(last logged)" in page


# ---- what the loss panel marks, and overlays ---------------------------------------------------------------------

def test_loss_panel_marks_checkpoints_sessions_skips_and_the_best(marked):
    from gpupoor.commands.report import load_runs, loss_panel

    ax = loss_panel(load_runs([marked]), log_scale=True).axes[0]
    assert ax.get_yscale() == "log"
    texts = [text.get_text() for text in ax.texts]
    assert "SIGTERM → resume" in texts, texts  # a stop and the resume from its checkpoint: one label
    assert any("early stop (best step 4)" in t for t in texts), texts
    labels = ax.get_legend_handles_labels()[1]
    for label in ("marked loss", "marked eval loss", "checkpoint", "skipped step", "best checkpoint"):
        assert label in labels, labels
    star = next(line for line in ax.lines if line.get_label() == "best checkpoint")
    assert list(star.get_xdata()) == [4] and list(star.get_ydata()) == [5.9]
    skipped_x = sorted(x for line in ax.lines if line.get_marker() == "x" for x in line.get_xdata())
    assert skipped_x == [4, 5]  # the null loss on the bottom edge, the finite one on the curve
    assert invoke("report", marked, "--output", marked / "r.html").exit_code == 0
    page = (marked / "r.html").read_text()
    assert "best checkpoint kept: step-000004 (5.9000)" in page and "2 skipped" in page


def test_the_html_figures_share_one_step_axis_and_show_the_sessions_on_every_panel(runs):
    """The loss figure and the figure under it are separate images: a step sits at the same pixel column in both
    (same width, same plot margins, same step range), and each panel draws the resume's line."""
    from gpupoor.commands.report import all_panels, load_runs, loss_panel, other_panels

    loaded = load_runs([runs / "resumed", runs / "faster"])
    axes = loss_panel(loaded, log_scale=False).axes + other_panels(loaded).axes + all_panels(loaded, False).axes
    for ax in axes:
        assert ax.figure.get_size_inches()[0] == 10
        pixels = ax.transData.transform([(1, 0), (6, 0)])[:, 0]  # where steps 1 and 6 are drawn
        assert pixels == pytest.approx(axes[0].transData.transform([(1, 0), (6, 0)])[:, 0], abs=0.01)
        assert ax.get_xlim() == axes[0].get_xlim()
        assert ax.get_xlim()[0] < 1 and ax.get_xlim()[1] > 6  # every logged step inside the frame
        resume = [line for line in ax.lines if line.get_linestyle() == ":" and list(line.get_xdata()) == [3, 3]]
        assert resume, [line.get_xdata() for line in ax.lines]
    label = next(text for text in axes[0].texts if "→ resume" in text.get_text())
    assert label.get_fontsize() >= 8 and label.get_bbox_patch().get_facecolor()[:3] == (1.0, 1.0, 1.0)


def test_session_labels_close_together_do_not_overlap_and_stay_in_the_panel(runs, tmp_path):
    """A 200-step run resumed at steps 100, 103, 106 and 109 (a flaky machine): four labels a few pixels apart."""
    from gpupoor.commands.report import load_runs, loss_panel

    run = tmp_path / "crowded"
    shutil.copytree(runs / "resumed", run)
    _append(run, *({"step": step, "loss": 1.0 + 1 / step, "lr": 1e-3} for step in range(7, 201)))
    for step in (100, 103, 106, 109):
        _append(run, {"step": step, "event": "stop", "reason": "time_limit"},
                {"step": step, "event": "start", "session": "resume", "time": 0})
    figure = loss_panel(load_runs([run]), log_scale=False)
    figure.canvas.draw()
    ax = figure.axes[0]
    frame = ax.get_window_extent()
    boxes = [text.get_bbox_patch().get_window_extent() for text in ax.texts if "time limit → resume" in text.get_text()]
    assert len(boxes) == 4
    assert not [(a, b) for a in range(4) for b in range(a + 1, 4) if boxes[a].overlaps(boxes[b])]
    assert all(frame.y0 - 1 <= box.y0 and box.y1 <= frame.y1 + 1 for box in boxes)


def test_legends_fit_in_the_figure_with_long_names_and_many_runs(runs, tmp_path):
    from gpupoor.commands.report import load_runs, loss_panel, other_panels

    copies = []
    for index in range(12):  # the demo's default run names, a dozen of them overlaid
        copies.append(tmp_path / f"demo-20261126-1644{index:02d}")
        shutil.copytree(runs / "resumed", copies[-1])
    for paths in (copies[:2], copies):
        loaded = load_runs(paths)
        for figure in (loss_panel(loaded, log_scale=False), other_panels(loaded)):
            figure.canvas.draw()
            width, height = figure.bbox.width, figure.bbox.height
            for ax in figure.axes:
                if ax.get_legend() is not None:
                    box = ax.get_legend().get_window_extent()
                    assert box.x1 <= width and box.y0 >= 0, (len(paths), box, width)


def test_two_runs_are_overlaid_and_both_named(runs, tmp_path):
    from gpupoor.commands.report import load_runs, loss_panel, other_panels

    loaded = load_runs([runs / "resumed", runs / "faster"])
    loss_labels = loss_panel(loaded, log_scale=False).axes[0].get_legend_handles_labels()[1]
    assert {"resumed loss", "faster loss", "resumed eval loss", "faster eval loss"} <= set(loss_labels)
    for ax in other_panels(loaded).axes:
        labels = " ".join(ax.get_legend_handles_labels()[1])
        assert "resumed" in labels and "faster" in labels
    output = tmp_path / "compare.html"
    result = invoke("report", runs / "resumed", runs / "faster", "--output", output)
    assert result.exit_code == 0, result.output
    page = output.read_text()
    assert "<h2>resumed</h2>" in page and "<h2>faster</h2>" in page and "lr 0.03 cosine" in page
    assert invoke("report", runs / "resumed", runs / "faster", "--output", tmp_path / "c.png").exit_code == 0


# ---- errors ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("metrics", ["", '{"step": 0, "event": "start", "session": "train", "time": 1}\n{"st'])
def test_a_run_with_no_step_logged_has_nothing_to_plot(runs, tmp_path, metrics):
    run = tmp_path / "new"
    run.mkdir()
    shutil.copy(runs / "resumed" / "recipe.yaml", run / "recipe.yaml")
    (run / "metrics.jsonl").write_text(metrics)
    result = invoke("report", run)
    assert result.exit_code == 2 and "nothing to plot yet" in result.output, result.output
    assert not (run / "report.html").exists()


@pytest.mark.parametrize("kind", BAD_LINES)
def test_a_bad_line_in_metrics_is_skipped_with_one_warning_by_status_and_report(runs, tmp_path, kind):
    run = tmp_path / "bad"
    shutil.copytree(runs / "resumed", run)
    insert_bad_line(run, BAD_LINES[kind])
    warning = f"warning: {run / 'metrics.jsonl'}: skipped 1 line that is not a metrics record (line 3: "
    status = invoke("status", run)
    assert status.exit_code == 0, status.output
    assert status.output.count(warning) == 1 and "(steps 1-6)" in status.output  # every good record still read
    report = invoke("report", run, "--output", tmp_path / "r.html")
    assert report.exit_code == 0, report.output
    assert report.output.count(warning) == 1 and (tmp_path / "r.html").stat().st_size > 0


def test_a_last_line_cut_short_by_a_kill_is_no_warning_whatever_it_reads_as(runs, tmp_path):
    # A SIGKILL can cut the last record inside a multi-byte character: that is a kill, not a damaged file.
    run = tmp_path / "cut"
    shutil.copytree(runs / "resumed", run)
    with open(run / "metrics.jsonl", "ab") as metrics:
        metrics.write('{"step": 7, "note": "é'.encode()[:-1])
    status = invoke("status", run)
    assert status.exit_code == 0 and "warning" not in status.output, status.output


def test_an_output_that_is_neither_png_nor_html_is_exit_2(runs, tmp_path):
    result = invoke("report", runs / "resumed", "--output", tmp_path / "report.pdf")
    assert result.exit_code == 2 and ".png" in result.output and ".html" in result.output


def test_without_matplotlib_says_what_to_install(runs, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib...` raise ImportError
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    result = invoke("report", runs / "resumed", "--output", tmp_path / "r.png")
    hint = "pip install matplotlib (from gpupoor's clone: pip install -e '.[report]')"
    assert result.exit_code == 2 and hint in result.output, result.output
    assert not (tmp_path / "r.png").exists()


# ---- the sparkline in `gpupoor status` ---------------------------------------------------------------------------

def test_status_shows_the_loss_sparkline(runs):
    status = invoke("status", runs / "resumed")
    assert status.exit_code == 0, status.output
    out = status.output
    line = next(line for line in out.splitlines() if line.startswith("  loss "))
    assert re.fullmatch(r"  loss [▁▂▃▄▅▆▇█]{6} \S+ -> \S+ \(steps 1-6\)", line), line
    assert out.index("progress:") < out.index("  loss ") < out.index("checkpoints:")


def test_status_of_a_live_epoch_run_shows_its_total_and_eta_and_no_resume_advice(make_recipe, tmp_path):
    """An epoch-based run's step count is known from its start record (before any checkpoint); while its lock is
    held (a process trains in it), status gives the ETA and does not tell the user to resume it."""
    import json

    from support.cli import invoke
    from gpupoor.commands.status import status_report
    from gpupoor.storage.rundir import RunLock

    run = tmp_path / "run"
    assert invoke("train", make_recipe(training={"max_steps": None, "epochs": 1}), "--output-dir", run).exit_code == 0
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    total = next(r["total_steps"] for r in records if r.get("event") == "start")
    shutil.rmtree(run / "final")
    shutil.rmtree(run / "checkpoints")  # as before the first checkpoint: only metrics.jsonl knows the count
    kept = [r for r in records if r.get("event") == "start" or r.get("step", 0) <= 2 and "loss" in r]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in kept))
    lock = RunLock(run).acquire()
    try:
        report, _ = status_report(run)
    finally:
        lock.release()
    assert f"step 2/{total} logged" in report and "ETA" in report
    assert "continue with" not in report
    report, _ = status_report(run)  # no process: the advice is back, the ETA is not
    assert "continue with: gpupoor resume" in report and "ETA" not in report


@pytest.mark.report_at_the_end
def test_a_finished_run_draws_its_report_by_itself_unless_told_not_to(make_recipe, tmp_path):
    from support.cli import invoke

    run = tmp_path / "run"
    result = invoke("train", make_recipe(logging={"report": True}), "--output-dir", run)
    assert result.exit_code == 0, result.output
    assert f"report: {run.resolve() / 'report.html'}" in result.output or f"report: {run / 'report.html'}" in \
        result.output
    assert (run / "report.html").stat().st_size > 10_000
    quiet = tmp_path / "quiet"
    assert invoke("train", make_recipe(logging={"report": False}), "--output-dir", quiet).exit_code == 0
    assert not (quiet / "report.html").exists()
