"""`gpupoor export`: a run (or a model directory) as GGUF files for llama.cpp, Ollama and LM Studio, one per
`--quant`, from one merge, and a table of what each quantization cost in perplexity.

Everything that can be refused is refused before any work: the format, the quant names, the eval text (read and
tokenized with the model's tokenizer: a file, or the run's eval set), the architecture, the output paths and
--work-dir, and a disk without room for what the export writes (gpupoor/export/space.py).
An adapter is merged once into a temporary fp32 model directory in the work directory (`--work-dir`, default the
output folder; the streaming merge of merge-lora, QLoRA through the dequantized base) and removed afterwards; a
full fine-tune or a model directory is read as it is. Ctrl-C, SIGTERM and SIGHUP remove what was half written and
say which files are complete; what a killed export left is removed by the next one into the same folder."""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from gpupoor.errors import UserError

if TYPE_CHECKING:
    from gpupoor.export.quality import EvalText
    from gpupoor.export.space import SpacePlan
    from gpupoor.export.writer import ExportWriter, Written


@dataclass
class QualityRow:
    type: str  # the --quant name, or "full precision"
    file: str | None
    size_bytes: int
    bits_per_weight: float
    perplexity: float | None
    change_pct: float | None  # perplexity change vs full precision, in percent
    tensor_types: dict | None = None


@dataclass
class ExportSource:
    weights_dir: Path  # an adapter, or a whole model
    run_dir: Path | None
    is_adapter: bool
    config: dict  # the model's config.json (the base's, for an adapter)
    name: str
    base: str | None = None  # an adapter's base model (adapter_config.json's base_model_name_or_path)


def resolve_source(path: Path, checkpoint: str) -> ExportSource:
    """The weights behind PATH (a run's final/ or step-N, an adapter, a model directory), verified, and the
    config of the model they make."""
    from gpupoor.model.merge import base_config
    from gpupoor.storage.run_weights import resolve_model

    weights = resolve_model(path, checkpoint)
    if weights.is_adapter:
        adapter = json.loads((weights.path / "adapter_config.json").read_text())
        base = adapter.get("base_model_name_or_path")
        config = base_config(base, adapter.get("revision")) if base else None
        if config is None:
            raise UserError(f"cannot read the config of the adapter's base model {base!r}",
                            hint="make the base model available locally (or online) and export again")
    else:
        config = json.loads((weights.path / "config.json").read_text())
    name = (weights.run_dir or weights.path).resolve().name
    return ExportSource(weights.path, weights.run_dir, weights.is_adapter, config, name,
                        base if weights.is_adapter else None)


def output_paths(source: ExportSource, quants: list[str], output: Path | None,
                 writer: ExportWriter) -> tuple[dict[str, Path], Path]:
    """Where each quant's file goes: --output (with -QUANT before the suffix when there are several), else
    RUN_DIR/FORMAT/ or beside a model directory, none existing yet; and the quality table's JSON
    (NAME.quality.json)."""
    suffix = writer.suffix
    if output is not None:
        output = output.expanduser().absolute()
        if output.is_dir():
            raise UserError(f"--output {output} is a directory", hint=f"give a file name ending in {suffix}")
        if output.suffix != suffix:
            raise UserError(f"--output {output}: a {writer.name.upper()} file's name ends in {suffix}",
                            hint=f"e.g. {output}{suffix}")
        paths = {q: output if len(quants) == 1 else output.with_name(f"{output.stem}-{q}{suffix}") for q in quants}
        table = output.with_name(f"{output.stem}.quality.json")
    else:
        folder = source.run_dir.absolute() / writer.name if source.run_dir else source.weights_dir.resolve().parent
        paths = {q: folder / f"{source.name}-{q}{suffix}" for q in quants}
        table = folder / f"{source.name}.quality.json"
    for path in paths.values():
        if path.exists() or path.is_symlink():
            raise UserError(f"{path} already exists", hint="choose another --output, or delete it")
    if table.exists() and not table.is_file():  # found only when it is written, after all the work
        raise UserError(f"{table} (the quality table's file) is not a file", hint="move it, or choose another "
                        "--output, and export again")
    return paths, table


# How an export's user merges a QLoRA adapter into the original full-precision base: export has no --qlora-base.
QLORA_ORIGINAL = ("gpupoor merge-lora RUN --qlora-base original --output DIR, then gpupoor export DIR --eval FILE "
                  "(or --no-quality)")


@contextlib.contextmanager
def model_directory(source: ExportSource, scratch_parent: Path, say: Callable[[str], None]):
    """A transformers model directory of the trained model: the weights themselves, or the adapter merged into its
    base in fp32 in a temporary directory (removed afterwards; its name carries this process's id, so that the
    next export can tell a killed export's scratch from a running one's)."""
    if not source.is_adapter:
        yield source.weights_dir
        return
    from gpupoor.export.space import VERB
    from gpupoor.model.merge import merge_lora, merge_scratch
    from gpupoor.storage.run_weights import RunWeights

    with merge_scratch(VERB, scratch_parent) as scratch:
        say(f"merging the adapter into its base (fp32, in {scratch_parent})")
        merged = merge_lora(RunWeights(source.weights_dir, source.run_dir), scratch / "merged", dtype="fp32",
                            say=say, qlora_original=QLORA_ORIGINAL,
                            check_base=False)  # export checked it before any work
        yield merged


def export(path: Path, *, quants: list[str], fmt: str = "gguf", output: Path | None = None,
           checkpoint: str = "final", eval_file: Path | None = None, eval_tokens: int = 16384,
           quality: bool = True, say: Callable[[str], None] = print, force: bool = False,
           work_dir: Path | None = None) -> list[QualityRow]:
    """Every file of `quants` in format `fmt` from the model at `path`, and (`quality`) the table of what each
    cost in perplexity."""
    from gpupoor.errors import termination_raised
    from gpupoor.export.format_table import export_format
    from gpupoor.export.quality import read_eval_file
    from gpupoor.storage.rundir import check_work_dir, check_writable

    writer = export_format(fmt)
    quants = writer.check_quants(quants)
    writer.check_installed()
    # Read now, not after the files are written: a bad --eval found then would leave files a corrected rerun
    # is refused for.
    eval_text = read_eval_file(eval_file) if quality and eval_file is not None else None
    source = resolve_source(path, checkpoint)
    if source.is_adapter:  # before any work: the merge would use whatever base sits at the recorded path now
        from gpupoor.model.identity import check_base_unchanged

        check_base_unchanged(source.weights_dir, None, force, lambda text: say(f"warning: {text}"),
                             "the exported model")
    writer.check_model(source.config, str(path))
    for note in writer.notes(source.base, quants, source.config):
        say(f"note: {note}")
    paths, table = output_paths(source, quants, output, writer)
    if quality and eval_file is None and source.run_dir is None:
        raise UserError(f"{path} is not a run, so there is no eval set to measure the quantization cost on",
                        hint="pass --eval FILE (plain text, or JSONL rows with a \"text\" field), or --no-quality")
    folder = next(iter(paths.values())).parent
    check_writable(folder, f"--output {folder}", hint="give --output a file in a writable directory")
    work = work_dir.expanduser().absolute() if work_dir is not None else folder
    if work_dir is not None:
        check_work_dir(work)
    # Tokenized now, not after the files are written: a text of under two tokens, or a run whose eval set is not
    # text, found then would leave files a corrected rerun is refused for. The tokenizer is the one the merge copies.
    # (After the cheap checks of the paths: loading a tokenizer may take a while.)
    text = eval_text_for(source, eval_file, eval_text, eval_tokens) if quality else None
    space = _space_plan(source, quants, work, folder, writer, say)
    progress = Progress(space, writing=work if source.is_adapter else None)  # the merge comes first
    with termination_raised(), _said_if_stopped(progress, say), _disk_full_said(progress), \
            _folder_removed_if_empty(folder), _folder_removed_if_empty(work), \
            model_directory(source, work, say) as model_dir:
        rows = _write_and_measure(model_dir, source, writer, paths, table, progress, say, text)
    return rows


def eval_text_for(source: ExportSource, eval_file: Path | None, raw: str | None, eval_tokens: int) -> EvalText:
    """The text the quality table is measured on, tokenized: `--eval FILE` (`raw`: its text, read already), else
    the run's eval set; with the tokenizer the exported model carries (merge-lora copies an adapter's own, else its
    base's)."""
    from gpupoor.export.quality import file_eval_text, run_eval_text
    from gpupoor.model.load import load_tokenizer
    from gpupoor.recipe.schema import ModelSection

    own = not source.is_adapter or (source.weights_dir / "tokenizer_config.json").is_file()
    location = str(source.weights_dir) if own else source.base
    tokenizer = load_tokenizer(location, ModelSection(name_or_path=location),
                               key="the exported model's tokenizer" if own else "the adapter's base model")
    if eval_file is not None:
        return file_eval_text(eval_file, tokenizer, eval_tokens, raw=raw)
    return run_eval_text(source.run_dir, tokenizer, eval_tokens)


@dataclass
class Progress:
    """What the export has written so far, for the message when it stops or the disk fills."""

    space: SpacePlan | None  # None when the model's size is not one gpupoor can count
    finished: list[Path] = field(default_factory=list)  # files completely written
    writing: Path | None = None  # the file (or the merge's folder) being written


def _space_plan(source: ExportSource, quants: list[str], work: Path, folder: Path, writer: ExportWriter,
                say: Callable[[str], None]):
    """Remove what killed exports left in the folders, then refuse when a disk lacks room for this export."""
    from gpupoor.export.space import plan_space, sweep_export_leftovers
    from gpupoor.hardware import DTYPES
    from gpupoor.model.gguf import is_gguf
    from gpupoor.storage.checkpoint import read_manifest

    sweep_export_leftovers([folder, work], say)
    base_copy = 0  # a GGUF base is dequantized into the work directory before the merge, in the run's precision
    if source.is_adapter and source.base and is_gguf(source.base):
        base_copy = DTYPES[read_manifest(source.weights_dir).get("precision") or "fp32"].itemsize
    space = plan_space(source.config, quants, writer.file_bytes, source.is_adapter, base_copy, work, folder)
    if space is not None:
        space.check()
    return space


def _write_and_measure(model_dir: Path, source: ExportSource, writer: ExportWriter, paths: dict[str, Path],
                       table: Path, progress: Progress, say: Callable[[str], None],
                       text: EvalText | None) -> list[QualityRow]:
    """Each file, its companions beside it (GGUF: a Modelfile), and (`text`: what to measure on) the table."""
    written = []
    for quant, target in paths.items():
        progress.writing = target
        file = writer.write(model_dir, target, quant, name=source.name)
        progress.finished.append(file.path)
        say(f"wrote {file.path} ({file.size_bytes / 2**20:.1f} MiB, {file.bits_per_weight:.2f} bits/weight)")
        written.append(file)
    progress.writing = table.parent
    write_companions(model_dir, written, writer, source, say)
    if text is None:
        return [QualityRow(f.quant, f.path.name, f.size_bytes, round(f.bits_per_weight, 3), None, None,
                           dict(f.types)) for f in written]
    return measure(model_dir, writer, written, text, table, say)


@contextlib.contextmanager
def _folder_removed_if_empty(folder: Path):
    """Create the folder; remove it again at the end if this export created it and left nothing in it (it failed
    before writing anything, or it is the --work-dir the merge's scratch was removed from)."""
    created = not folder.exists()
    folder.mkdir(parents=True, exist_ok=True)
    try:
        yield
    finally:
        if created and folder.is_dir() and not any(folder.iterdir()):
            folder.rmdir()


@contextlib.contextmanager
def _said_if_stopped(progress: Progress, say: Callable[[str], None]):
    """Ctrl-C, SIGTERM or SIGHUP (gpupoor.errors.Terminated): once the half-written file and the merge's
    scratch are removed, say which files are complete."""
    try:
        yield
    except KeyboardInterrupt as exc:
        how = f"stopped by {exc.name}" if hasattr(exc, "signum") else "interrupted"
        complete = f"complete and kept: {', '.join(map(str, progress.finished))}" if progress.finished else \
            "no file was complete"
        say(f"{how}: {complete}; what was half written was removed")
        raise


@contextlib.contextmanager
def _disk_full_said(progress: Progress):
    """A full disk, however the library writing said it (safetensors' SafetensorError, numpy's short write), as
    bad input with the space the export needs; raised once what was half written is removed."""
    from gpupoor.storage.files import ran_out_of_space

    try:
        yield
    except Exception as exc:
        if not ran_out_of_space(exc):
            raise
        if progress.space is not None:
            raise progress.space.disk_full(progress.writing, progress.finished) from None
        kept = f"; complete and kept: {', '.join(map(str, progress.finished))}" if progress.finished else ""
        raise UserError(f"the disk filled while writing {progress.writing}: what was half written was removed{kept}",
                        hint="free space there (the fp32 merge takes 4 bytes a parameter), or write elsewhere "
                        "(--work-dir, --output), and export again") from None


def measure(model_dir: Path, writer: ExportWriter, written: list[Written], text: EvalText, table: Path,
            say: Callable[[str], None]) -> list[QualityRow]:
    """Perplexity of the full-precision model and of each file read back (on `text`, tokenized before any work:
    eval_text_for), printed as a table and written as JSON beside the files."""
    from gpupoor.export.quality import perplexity_of_model_dir
    from gpupoor.hardware import dtype_of, resolve_inference_precision
    from gpupoor.units import ProgressLine

    tokens = sum(int((labels != -100).sum()) for _, labels in text.examples)
    # Scored where export runs, the CPU: in bf16 where its matrix units multiply faster, as generate computes.
    compute = resolve_inference_precision("cpu", None)
    dtype = dtype_of(compute.value)
    say(f"measuring perplexity on {tokens} target tokens of {text.source}: the full-precision model, then each file "
        f"read back by transformers, computing in {compute.value} ({compute.reason})")
    progress = ProgressLine(len(written) + 1, say, "perplexity", "models measured", every_s=0)
    reference, _ = perplexity_of_model_dir(model_dir, text, dtype)
    progress.tick()
    parameters = written[0].parameters
    rows = [QualityRow("full precision", None, 4 * parameters, 32.0, round(reference, 4), 0.0)]
    for file in written:
        value = writer.perplexity(file.path, text, model_dir, dtype)
        progress.tick()
        rows.append(QualityRow(file.quant, file.path.name, file.size_bytes, round(file.bits_per_weight, 3),
                               round(value, 4), round(100 * (value / reference - 1), 3), dict(file.types)))
    say(render_table(rows))
    measured_on = {"source": text.source, "target_tokens": tokens, "full_precision_perplexity": round(reference, 4),
                   "computed_in": compute.value}
    report, kept = with_earlier_rows(table, {"eval": measured_on,
                                             "rows": [{**asdict(row), "eval": measured_on} for row in rows]})
    _write_text(table, json.dumps(report, indent=2) + "\n")
    say(f"wrote {table}" + (f", keeping the earlier measurements of {', '.join(kept)} (each row names the text "
                            "it was measured on)" if kept else ""))
    return rows


def with_earlier_rows(table: Path, report: dict) -> tuple[dict, list[str]]:
    """`report` with the rows an earlier export wrote to the same table for types this one did not measure, and
    their names: a second export of a run adds to its table instead of replacing it (a type measured again: the
    newest measurement). Each row keeps the text it was measured on ("eval"), whose full-precision perplexity its
    change is relative to."""
    try:
        earlier = json.loads(table.read_text(encoding="utf-8")) if table.is_file() else {}
    except (OSError, ValueError):  # unreadable: nothing to keep (it is replaced, as before)
        earlier = {}
    rows = earlier.get("rows") if isinstance(earlier, dict) else None
    measured = {row["type"] for row in report["rows"]}
    kept = [{**row, "eval": row.get("eval") or earlier.get("eval")} for row in rows or []
            if isinstance(row, dict) and row.get("type") not in measured]
    return {**report, "rows": report["rows"][:1] + kept + report["rows"][1:]}, [row["type"] for row in kept]


def render_table(rows: list[QualityRow]) -> str:
    """The quality table as plain aligned columns (what a terminal shows as it is; NAME.quality.json holds the
    numbers)."""
    lines = [("type", "size MiB", "bits/weight", "perplexity", "change")]
    for row in rows:
        change = "" if row.change_pct is None or row.type == "full precision" else f"{row.change_pct:+.2f}%"
        lines.append((row.type, f"{row.size_bytes / 2**20:.1f}", f"{row.bits_per_weight:.2f}",
                      "" if row.perplexity is None else f"{row.perplexity:.3f}", change))
    widths = [max(len(line[i]) for line in lines) for i in range(5)]
    return "\n".join("  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in
                               enumerate(zip(line, widths))).rstrip() for line in lines)


def write_companions(model_dir: Path, written: list[Written], writer: ExportWriter, source: ExportSource,
                     say: Callable[[str], None]) -> None:
    """What a runtime needs beside each file (GGUF: an Ollama Modelfile, `ollama create NAME -f FILE`), in the
    prompt format the run trained on."""
    from gpupoor.storage.rundir import stored_recipe

    sources = stored_recipe(source.run_dir).data.sources() if source.run_dir else []
    trained_format = sources[0].format if len(sources) == 1 else None
    names = []
    for file in written:
        for target, text in writer.companions(model_dir, file, source.config, trained_format).items():
            _write_text(target, text)
            names.append(target.name)
    if names:
        say(f"wrote beside the files: {', '.join(names)}")


def _write_text(target: Path, text: str) -> None:
    """Written whole or not at all: under a temporary name (with this process's id, see gpupoor/export/space.py)
    that is removed if the write fails."""
    from gpupoor.storage.files import writer_tag

    temporary = target.with_name(f".{target.name}.tmp-{writer_tag()}")
    try:
        temporary.write_text(text, encoding="utf-8")
        os.replace(temporary, target)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
