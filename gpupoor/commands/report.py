"""`gpupoor report`: one or more runs drawn as figures (loss with its events, learning rate, tokens/s, peak
memory), written as one PNG or as one self-contained HTML page that adds each run's summary.

Reads only what a run directory holds (metrics.jsonl, recipe.yaml, manifests) and imports no torch. matplotlib is
an optional extra (`report`), imported inside the drawing functions so that `gpupoor --help` and every
other verb never pay for it. Figures are `matplotlib.figure.Figure` objects rendered by the Agg canvas, never
pyplot: no GUI backend is chosen, no window opens, and no global figure state is left behind.
"""

from __future__ import annotations

import base64
import html
import io
import math
import time
from dataclasses import dataclass
from pathlib import Path

from gpupoor import __version__, faults
from gpupoor.method_table import METHODS
from gpupoor.storage.checkpoint import read_manifest, scan
from gpupoor.errors import UserError
from gpupoor.storage.files import atomic_file
from gpupoor.recipe.schema import Recipe
from gpupoor.storage.rundir import LIBRARIES, METRICS, RECIPE, require_run_dir, stored_recipe
from gpupoor.train.metrics import read_metrics
from gpupoor.units import format_duration

INSTALL_HINT = "pip install matplotlib (from gpupoor's clone: pip install -e '.[report]')"
SUFFIXES = {".png": "png", ".html": "html", ".htm": "html"}
STOP_REASONS = {"time_limit": "time limit"}  # signals read as they are: SIGTERM, SIGUSR1, ...


@dataclass
class RunMetrics:
    """One run's records, split by kind. `steps` holds one record per step (the last one written for it: a
    crashed process may have logged steps that the resume trains, and logs, again)."""

    path: Path
    label: str
    steps: list[dict]
    evals: list[dict]
    checkpoints: list[dict]
    events: list[dict]

    def events_of(self, kind: str) -> list[dict]:
        return [e for e in self.events if e.get("event") == kind]

    def best(self) -> dict | None:
        """The last "best" event: each one supersedes the one before, so it names the checkpoint kept."""
        best = [e for e in self.events_of("best") if isinstance(e.get("step"), int) and _finite(_best_loss(e))]
        return best[-1] if best else None


def _best_loss(event: dict):
    return event.get("best_eval_loss", event.get("eval_loss"))


def run_labels(paths: list[Path]) -> list[str]:
    """Each run's directory name, with as many parent folders as it takes to tell them apart
    (runs/a/out and runs/b/out read a/out and b/out)."""
    parts = [path.resolve().parts for path in paths]
    for depth in range(1, max(len(p) for p in parts) + 1):
        labels = ["/".join(p[-depth:]) for p in parts]
        if len(set(labels)) == len(labels):
            return labels
    return [str(path) for path in paths]  # the same directory given twice: say so plainly


def load_run(path: Path, label: str) -> RunMetrics:
    require_run_dir(path)
    steps: dict[int, dict] = {}
    evals, checkpoints, events = [], [], []
    for record in read_metrics(path / METRICS):
        if "event" in record:
            events.append(record)
        elif "eval_loss" in record:
            evals.append(record)
        elif "checkpoint" in record:
            checkpoints.append(record)
        elif "loss" in record and isinstance(record.get("step"), int):
            steps[record["step"]] = record
    if not steps:
        raise UserError(f"{path / METRICS}: nothing to plot yet (no training step logged)",
                        hint=f"the first record is written after the first optimizer step; `gpupoor status {path}` "
                             "shows whether the run is training")
    return RunMetrics(path.resolve(), label, [steps[s] for s in sorted(steps)], evals, checkpoints, events)


def load_runs(paths: list[Path]) -> list[RunMetrics]:
    return [load_run(path, label) for path, label in zip(paths, run_labels(paths))]


def default_output(paths: list[Path]) -> Path:
    """One run: its report lives with it (RUN_DIR/report.html). Several: a comparison belongs to none of them,
    so it goes to the current directory."""
    return paths[0] / "report.html" if len(paths) == 1 else Path("report.html")


def output_kind(output: Path) -> str:
    kind = SUFFIXES.get(output.suffix.lower())
    if kind is None:
        raise UserError(f"--output {output}: the name must end in .png (the figures) or .html (figures and each "
                        "run's summary in one file)")
    if output.is_dir():
        raise UserError(f"--output {output} is a directory", hint=f"name a file, e.g. {output / 'report.html'}")
    return kind


def require_matplotlib() -> None:
    try:
        import matplotlib.figure  # noqa: F401
    except ImportError:
        raise UserError("gpupoor report draws with matplotlib, which is not installed",
                        hint=INSTALL_HINT) from None


def write_report(paths: list[Path], output: Path | None = None, log_scale: bool = False) -> Path:
    """Draw the runs into `output` (.png or .html; default `default_output`), written atomically: a reader
    never sees half a report. Returns the path written."""
    output = output if output is not None else default_output(paths)
    kind = output_kind(output)
    require_matplotlib()
    runs = load_runs(paths)
    content = render_png(runs, log_scale) if kind == "png" else render_html(runs, log_scale).encode("utf-8")
    try:
        with atomic_file(output) as tmp:
            tmp.write_bytes(content)
            faults.at_stage("working")  # tests: a signal with the report half written
    except OSError as exc:
        raise UserError(f"cannot write {output}: {exc.strerror or exc}",
                        hint="pass --output to a writable location") from None
    return output


# ---- figures ---------------------------------------------------------------------------------------------------

def _finite(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def _series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    """Steps and values; a missing or non-finite value is NaN, which matplotlib draws as a gap in the line."""
    return [r["step"] for r in records], [r[key] if _finite(r.get(key)) else math.nan for r in records]


# Every figure has the same width and the same left and right margins (legends go in the right one), and every
# panel the same step range: in the HTML page the loss figure and the figure below it are separate images, and a
# step must fall at the same pixel column in both. A "constrained" layout would size each figure's margins to its
# own legend and labels, so the step axes would not line up.
FIGURE_WIDTH_IN, PLOT_LEFT, PLOT_RIGHT = 10.0, 0.08, 0.76


def step_range(runs: list[RunMetrics]) -> tuple[float, float]:
    """The steps every panel shows: all that any run logged (steps, evals, checkpoints, session events), with a
    margin so the first and last points are not on the frame."""
    steps = [r["step"] for run in runs for records in (run.steps, run.evals, run.checkpoints, run.events)
             for r in records if isinstance(r.get("step"), (int, float))]
    low, high = (min(steps), max(steps)) if steps else (0, 1)
    margin = max(0.5, 0.02 * (high - low))
    return low - margin, high + margin


def new_figure(height_ratios: list[float], height: float, runs: list[RunMetrics]):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(FIGURE_WIDTH_IN, height), dpi=100)
    FigureCanvasAgg(figure)  # a renderer to measure the session labels with, before the figure is saved
    axes = figure.subplots(len(height_ratios), 1, sharex=True, squeeze=False, gridspec_kw={
        "height_ratios": height_ratios, "left": PLOT_LEFT, "right": PLOT_RIGHT, "top": 1 - 0.4 / height,
        "bottom": 0.6 / height, "hspace": 0.28})[:, 0]
    for ax in axes:
        ax.grid(True, alpha=0.3)
        ax.xaxis.get_major_locator().set_params(integer=True)
    axes[0].set_xlim(*step_range(runs))  # shared by the figure's panels
    axes[-1].set_xlabel("optimizer step")
    return figure, list(axes)


def legend_outside(ax) -> None:
    """On the right, outside the plot (inside, it would cover the lines' last steps), in the margin every figure
    keeps for it: labels wrapped to its width, and smaller when there are many (a dozen runs overlaid)."""
    import textwrap

    handles, labels = ax.get_legend_handles_labels()
    if labels:
        size = 8 if len(labels) <= 10 else 7 if len(labels) <= 16 else 6
        ax.legend(handles, [textwrap.fill(label, 30 if size == 8 else 34) for label in labels], fontsize=size,
                  loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)


class _Legend:
    """Marker kinds (checkpoint, skipped step, ...) get one legend entry across all runs, not one per run."""

    def __init__(self):
        self.seen: set[str] = set()

    def __call__(self, name: str) -> str | None:
        if name in self.seen:
            return None
        self.seen.add(name)
        return name


def draw_loss(ax, runs: list[RunMetrics], log_scale: bool) -> None:
    legend = _Legend()
    for index, run in enumerate(runs):
        color = f"C{index % 10}"
        steps, losses = _series(run.steps, "loss")
        ax.plot(steps, losses, color=color, linewidth=1.4, label=f"{run.label} loss")
        if run.evals:
            eval_steps, eval_losses = _series(run.evals, "eval_loss")
            ax.plot(eval_steps, eval_losses, "o--", color=color, markersize=4, linewidth=1,
                    label=f"{run.label} eval loss")
        _draw_markers(ax, run, color, legend)
    plotted = [value for run in runs for records, key in ((run.steps, "loss"), (run.evals, "eval_loss"))
               for value in _series(records, key)[1] if _finite(value)]
    if log_scale and any(value <= 0 for value in plotted):
        # GRPO's loss (and a distillation's KL term) can be 0 or negative, which a log axis cannot show: matplotlib
        # said so in a UserWarning on a finished run's last lines and drew an empty panel. A symmetric log axis,
        # linear within the smallest loss's magnitude of 0, shows them all.
        smallest = min((abs(value) for value in plotted if value != 0), default=1.0)
        ax.set_yscale("symlog", linthresh=smallest)
        scale_name = " (symmetric log scale: some losses are 0 or below)"
    else:
        ax.set_yscale("log" if log_scale else "linear")
        scale_name = " (log scale)" if log_scale else ""
    ax.set_ylabel("loss" + scale_name)
    ax.set_title("loss per step (line), eval loss (circles)", loc="left", fontsize=10)
    legend_outside(ax)


def _draw_markers(ax, run: RunMetrics, color: str, legend: _Legend) -> None:
    """Checkpoints (ticks on the bottom edge), skipped steps (x), the best checkpoint (a star on its eval loss),
    and the sessions' starts and stops (annotated vertical lines)."""
    bottom = ax.get_xaxis_transform()  # x in steps, y in axes fractions: the bottom edge whatever the scale
    saved = [r["step"] for r in run.checkpoints]
    if saved:
        ax.plot(saved, [0.0] * len(saved), linestyle="none", marker="|", markersize=10, color=color,
                transform=bottom, clip_on=False, label=legend("checkpoint"))
    skipped = [r for r in run.steps if r.get("skipped")]
    finite = [r for r in skipped if _finite(r.get("loss"))]
    if finite:
        ax.plot([r["step"] for r in finite], [r["loss"] for r in finite], "x", color="red", markersize=7,
                label=legend("skipped step"))
    if len(finite) < len(skipped):  # no loss to put them on: along the bottom edge
        steps = [r["step"] for r in skipped if not _finite(r.get("loss"))]
        ax.plot(steps, [0.06] * len(steps), "x", color="red", markersize=7, transform=bottom,
                label=legend("skipped step"))
    best = run.best()
    if best is not None:
        ax.plot([best["step"]], [_best_loss(best)], "*", color=color, markersize=15, markeredgecolor="black",
                label=legend("best checkpoint"))
    _draw_event_lines(ax, run, color)


def session_events(run: RunMetrics) -> list[tuple[int, str, str, str]]:
    """(step, line style, kind, what) per session start (dotted; what: the session's name), stop with a
    checkpoint (dashed; the reason) and early stop (dash-dot). A session that starts at step 0 is the run's own
    start: the left edge says that."""
    marks = []
    for event in run.events:
        kind, step = event.get("event"), event.get("step")
        if not isinstance(step, int):
            continue
        if kind == "start" and step > 0:
            marks.append((step, ":", "start", str(event.get("session", "session"))))
        elif kind == "stop":
            reason = str(event.get("reason", "?"))
            marks.append((step, "--", "stop", STOP_REASONS.get(reason, reason)))
        elif kind == "early_stop":
            marks.append((step, "-.", "early_stop", f"early stop (best step {event.get('best_step', '?')})"))
    return marks


def session_label(events: list[tuple[str, str]]) -> str:
    """One step's (kind, what) events as one short label: a stop and the session resumed from its checkpoint read
    "time limit → resume" (a label is a column of text beside its line: short ones stack when sessions are close)."""
    stops = [what for kind, what in events if kind == "stop"]
    starts = [what for kind, what in events if kind == "start"]
    others = [what for kind, what in events if kind not in ("stop", "start")]
    if stops and starts:
        return ", ".join([f"{', '.join(stops)} → {', '.join(starts)}", *others])
    return ", ".join([*(f"stopped: {what}" for what in stops), *(f"{what} starts" for what in starts), *others])


def draw_session_lines(ax, run: RunMetrics, color: str) -> None:
    """The sessions' lines alone, for the panels under the loss: a resume explains a dip in tokens/s or a step
    in memory there."""
    for step, style, _, _ in session_events(run):
        ax.axvline(step, color=color, linestyle=style, linewidth=1, alpha=0.6)


def _draw_event_lines(ax, run: RunMetrics, color: str) -> None:
    """The sessions' lines with their labels (the run's colour says whose). Events of one step share one label (a
    stop and the resume from its checkpoint fall on the same step: "time limit → resume"); each label sits on a
    white box beside its line, not across it. A label that would overlap one already drawn (sessions a few steps
    apart) goes below it, measured; with no room left below, back at the top."""
    notes: dict[int, list[tuple[str, str]]] = {}
    for step, style, kind, what in session_events(run):
        ax.axvline(step, color=color, linestyle=style, linewidth=1, alpha=0.8)
        notes.setdefault(step, []).append((kind, what))
    from matplotlib.transforms import Bbox

    renderer = ax.figure.canvas.get_renderer()
    frame = ax.get_window_extent(renderer)
    placed: list = []  # the boxes drawn so far, in display coordinates

    def extent(label) -> Bbox:  # the text and its white box (0.2 em of padding, ~2.2 px), and 1 px to spare
        x0, y0, x1, y1 = label.get_window_extent(renderer).extents
        return Bbox.from_extents(x0 - 3.5, y0 - 3.5, x1 + 3.5, y1 + 3.5)

    for step in sorted(notes):
        label = ax.text(step, 0.98, session_label(notes[step]), transform=ax.get_xaxis_transform(),
                        rotation=90, va="top", ha="right", fontsize=8, color=color,
                        bbox={"boxstyle": "round,pad=0.2", "facecolor": "white", "edgecolor": "none", "alpha": 0.85})
        for _ in range(len(placed)):
            box = extent(label)
            blocking = [other for other in placed if other.overlaps(box)]
            if not blocking:
                break
            top = min(other.y0 for other in blocking) - 1  # under the lowest box in the way
            if top - box.height < frame.y0:
                label.set_y(0.98)  # no room below: the top, over the others (many sessions within a few steps)
                break
            label.set_y((top - 3.5 - frame.y0) / frame.height)  # the text's top, inside its box
        placed.append(extent(label))


def _draw_series(ax, runs: list[RunMetrics], key: str, title: str, ylabel: str) -> None:
    for index, run in enumerate(runs):
        steps, values = _series(run.steps, key)
        ax.plot(steps, values, color=f"C{index % 10}", linewidth=1.2, label=run.label)
        draw_session_lines(ax, run, f"C{index % 10}")
    ax.set_title(title, loc="left", fontsize=10)
    ax.set_ylabel(ylabel)
    if len(runs) > 1:
        legend_outside(ax)


def draw_memory(ax, runs: list[RunMetrics]) -> None:
    """Measured (solid) and planned (dashed) peaks. With several runs the legend names each run's colour once and
    the dashed style once, not two entries a run."""
    from matplotlib.lines import Line2D

    planned = False
    for index, run in enumerate(runs):
        color = f"C{index % 10}"
        steps, peaks = _series(run.steps, "peak_mem_mb")
        ax.plot(steps, peaks, color=color, linewidth=1.2, label=run.label if len(runs) > 1 else "measured")
        steps, predicted = _series(run.steps, "predicted_peak_mb")
        if any(not math.isnan(v) for v in predicted):
            ax.plot(steps, predicted, "--", color=color, linewidth=1.2)
            planned = True
        draw_session_lines(ax, run, color)
    if planned:
        ax.add_line(Line2D([], [], color="black" if len(runs) > 1 else "C0", linestyle="--", linewidth=1.2,
                           label="predicted (plan)"))
    ax.set_title("peak memory: measured (solid), the memory plan's prediction (dashed)", loc="left", fontsize=10)
    ax.set_ylabel("MiB")
    legend_outside(ax)


def draw_others(axes: list, runs: list[RunMetrics]) -> None:
    lr_ax, speed_ax, memory_ax = axes
    _draw_series(lr_ax, runs, "lr", "learning rate", "lr")
    if any("reward" in record for run in runs for record in run.steps):  # GRPO: what it learns is its reward
        _draw_series(speed_ax, runs, "reward", "mean reward of the sampled answers (GRPO)", "reward")
    else:
        _draw_series(speed_ax, runs, "tokens_per_s", "throughput", "tokens/s")
    draw_memory(memory_ax, runs)


def all_panels(runs: list[RunMetrics], log_scale: bool):
    """The four panels in one figure (the PNG): loss taller than the others, one shared step axis."""
    figure, axes = new_figure([2.2, 1, 1, 1], height=13, runs=runs)
    draw_loss(axes[0], runs, log_scale)
    draw_others(axes[1:], runs)
    return figure


def loss_panel(runs: list[RunMetrics], log_scale: bool):
    figure, axes = new_figure([1], height=5, runs=runs)
    draw_loss(axes[0], runs, log_scale)
    return figure


def other_panels(runs: list[RunMetrics]):
    figure, axes = new_figure([1, 1, 1], height=8, runs=runs)
    draw_others(axes, runs)
    return figure


def figure_png(figure) -> bytes:
    buffer = io.BytesIO()
    # No "Software" text chunk: it carries matplotlib's URL, and the report names nothing outside itself.
    figure.savefig(buffer, format="png", metadata={"Software": None})
    return buffer.getvalue()


def render_png(runs: list[RunMetrics], log_scale: bool) -> bytes:
    return figure_png(all_panels(runs, log_scale))


# ---- the HTML page -----------------------------------------------------------------------------------------------

STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1040px; color: #222; }
img { max-width: 100%; }
.scale { display: none; }
input[name=scale] { margin-left: 1em; }
#scale-linear:checked ~ .linear, #scale-log:checked ~ .log { display: block; }
table { border-collapse: collapse; margin-bottom: 2em; }
th, td { text-align: left; vertical-align: top; padding: 0.25em 0.8em; border-bottom: 1px solid #ddd; }
th { white-space: nowrap; color: #555; font-weight: normal; }
.note { color: #666; font-size: 0.9em; }
"""


def _img(png: bytes, alt: str) -> str:
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{base64.b64encode(png).decode("ascii")}">'


def _loss_toggle(runs: list[RunMetrics], log_scale: bool) -> str:
    """Both scales embedded; radio buttons and a CSS sibling rule pick the one shown (no script at all)."""
    linear, log = (figure_png(loss_panel(runs, scale)) for scale in (False, True))
    checked = {True: " checked", False: ""}
    return (f'<input type="radio" name="scale" id="scale-linear"{checked[not log_scale]}>'
            f'<label for="scale-linear">linear</label>'
            f'<input type="radio" name="scale" id="scale-log"{checked[log_scale]}>'
            f'<label for="scale-log">log scale</label>'
            f'<div class="scale linear">{_img(linear, "loss per step, linear scale")}</div>'
            f'<div class="scale log">{_img(log, "loss per step, log scale")}</div>')


def _table(rows: list[tuple[str, str]]) -> str:
    body = "".join(f"<tr><th>{html.escape(key)}</th><td>{html.escape(value)}</td></tr>" for key, value in rows)
    return f"<table>{body}</table>"


def render_html(runs: list[RunMetrics], log_scale: bool) -> str:
    names = ", ".join(run.label for run in runs)
    summaries = "".join(f"<h2>{html.escape(run.label)}</h2>{_table(run_summary(run))}" for run in runs)
    made = time.strftime("%Y-%m-%d %H:%M", time.localtime())
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>gpupoor report: {html.escape(names)}</title><style>{STYLE}</style></head><body>"
            f"<h1>gpupoor report: {html.escape(names)}</h1>"
            f"<p class=\"note\">written {made} by gpupoor {__version__}; ticks on the loss plot's bottom edge are "
            "checkpoints; vertical lines mark where a session resumed (dotted), stopped with a checkpoint "
            "(dashed: time limit or signal) or stopped early on the eval loss (dash-dot); x is a skipped step, "
            "a star the best checkpoint</p>"
            f"<section>{_loss_toggle(runs, log_scale)}</section>"
            f"<section>{_img(figure_png(other_panels(runs)), 'learning rate, tokens/s and peak memory')}</section>"
            f"{summaries}</body></html>\n")


# ---- each run's summary ------------------------------------------------------------------------------------------

def _method(recipe: Recipe) -> str:
    peft = recipe.peft
    text = "full fine-tuning" if not METHODS[peft.method].adapter else f"{peft.method} rank {peft.rank}"
    if peft.method == "lora" and peft.alpha is not None:
        text += f" alpha {peft.alpha:g}"
    if peft.last_layers:
        text += f", last {peft.last_layers} layers"
    if peft.modules_to_save:
        text += f", also trains {', '.join(peft.modules_to_save)}"
    if recipe.quantization.bits:
        text += f" on a {recipe.quantization.bits}-bit base"
        text += f" ({recipe.quantization.quant_type})" if recipe.quantization.bits == 4 else ""
    if recipe.distill is not None:
        text += (f"; distilled from {recipe.distill.teacher} (temperature {recipe.distill.temperature:g}, "
                 f"weight {recipe.distill.weight:g})")
    return text


def _dataset(recipe: Recipe) -> str:
    data = recipe.data
    if data.eval_path:
        held_out = f"eval on {data.eval_path}"
    else:
        held_out = f"eval on {data.eval_rows} rows held out" if data.eval_rows else "no eval"
    return f"{data.describe()} ({data.format}, max_length {data.max_length}, sampler {data.sampler}; {held_out})"


def _highlights(recipe: Recipe) -> str:
    training = recipe.training
    batch = f"batch {training.micro_batch_size} x {training.gradient_accumulation_steps} accumulated"
    warmup = (f"warmup {training.warmup_steps} steps" if training.warmup_steps is not None
              else f"warmup {training.warmup_ratio:g} of the steps")
    return (f"lr {training.learning_rate:g} {training.lr_scheduler}, {warmup}; {batch}; optimizer "
            f"{training.optimizer}; precision {recipe.precision}; seed {recipe.seed}")


def _versions(run_dir: Path, final: dict, newest: dict) -> str:
    """The libraries that wrote the newest weights (final/, else the newest checkpoint), else those named in
    the stored recipe's header, which were there when the run started."""
    versions = final.get("versions") or newest.get("versions")
    if not versions:
        versions = {}
        for line in (run_dir / RECIPE).read_text(encoding="utf-8").splitlines():
            if line.startswith("# "):  # "# torch 2.5.1": one library a line, above the YAML
                name, _, version = line[2:].partition(" ")
                if name in LIBRARIES and version:
                    versions[name] = version
    return ", ".join(f"{name} {version}" for name, version in versions.items()) or "not recorded"


def _sessions(run: RunMetrics) -> str | None:
    starts = run.events_of("start")
    stops = [f"{STOP_REASONS.get(str(e.get('reason')), e.get('reason'))} at step {e['step']}"
             for e in run.events_of("stop")]
    if not starts and not stops:
        return None
    text = f"{len(starts)}: " + ", ".join(f"{e.get('session', '?')} from step {e['step']}" for e in starts)
    return text + (f"; stopped early: {', '.join(stops)}" if stops else "")


def _evaluation(run: RunMetrics) -> str:
    evals = [e for e in run.evals if _finite(e.get("eval_loss"))]
    if not evals:
        return "no eval logged"
    best = min(evals, key=lambda e: e["eval_loss"])
    last = evals[-1]
    text = f"{best['eval_loss']:.4f} at step {best['step']} (last {last['eval_loss']:.4f} at step {last['step']})"
    accuracy = [e for e in run.evals if _finite(e.get("eval_accuracy"))]
    if accuracy:
        text += f"; last eval accuracy {accuracy[-1]['eval_accuracy']:.4f}"
    best_kept = run.best()
    if best_kept is not None:
        text += f"; best checkpoint kept: {best_kept.get('checkpoint', '?')} ({_best_loss(best_kept):.4f})"
    for event in run.events_of("early_stop"):
        text += f"; stopped early at step {event['step']} (best step {event.get('best_step', '?')})"
    return text


def _outcome(run: RunMetrics, final: dict, newest: tuple[Path, int] | None) -> tuple[str, str]:
    """The final loss and where the weights are (or that the run is unfinished and how to continue)."""
    if final:
        loss = final.get("loss")
        what = "model" if final.get("weights") == "model" else "adapter"
        loss_text = f"{loss:.4f} (final/, step {final.get('step')})" if _finite(loss) else "not recorded"
        return loss_text, f"the {what} is in {run.path / 'final'}"
    logged = [r for r in run.steps if _finite(r.get("loss"))]
    loss_text = f"{logged[-1]['loss']:.4f} at step {logged[-1]['step']} (last logged)" if logged else "-"
    where = f"newest checkpoint {newest[0]} (step {newest[1]})" if newest else "no checkpoint yet"
    return loss_text, f"unfinished: {where}; continue with: gpupoor resume {run.path}"


def run_summary(run: RunMetrics) -> list[tuple[str, str]]:
    """(what, value) rows: model, method, data, recipe highlights, versions, progress, time, losses, outputs."""
    recipe = stored_recipe(run.path)
    checkpoints = [(path, step) for path, step, problem in scan(run.path / "checkpoints", check_files=False)
                   if problem is None]
    newest = read_manifest(checkpoints[0][0]) if checkpoints else {}
    final = read_manifest(run.path / "final") if (run.path / "final").is_dir() else {}
    # An epoch-based run's step count is known once it has started: its manifests record it.
    planned = recipe.training.max_steps or final.get("total_steps") or newest.get("total_steps")
    last = run.steps[-1]
    skipped = sum(1 for r in run.steps if r.get("skipped"))
    final_loss, where = _outcome(run, final, checkpoints[0] if checkpoints else None)
    rows = [("run directory", str(run.path)),
            ("model", recipe.model.name_or_path + (f" @ {recipe.model.revision}" if recipe.model.revision else "")),
            ("method", _method(recipe)),
            ("data", _dataset(recipe)),
            ("recipe", _highlights(recipe)),
            ("versions", _versions(run.path, final, newest)),
            ("steps", f"{last['step']}" + (f" of {planned}" if planned else "") +
             (f"; {skipped} skipped (non-finite loss or gradient)" if skipped else "")),
            ("training time", format_duration(last.get("elapsed_s") or 0.0, style="age"))]
    sessions = _sessions(run)
    if sessions:
        rows.append(("sessions", sessions))
    rows += [("final loss", final_loss), ("best eval loss", _evaluation(run)), ("weights", where)]
    return rows
