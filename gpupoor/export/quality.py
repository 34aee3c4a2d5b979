"""What a quantization cost: perplexity on held-out text of the full-precision model and of each written file, read
back by its format (GGUF: gpupoor/export/gguf/read_back.py) and run in torch, in float32. The same token ids and
targets for every model: the merged model's tokenizer encodes them once. Knows no format.

The text is the run's eval set (its examples and targets, as eval_loss counts them), or `--eval FILE` (plain text
or JSONL rows with a "text" field, cut into windows), or, for a run that held nothing out, its training examples
(said in the table: a perplexity on trained text is lower, the change between types still reads the same)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from gpupoor.errors import UserError
from gpupoor.objectives.cross_entropy import mean_nll

IGNORE_INDEX = -100


@dataclass
class EvalText:
    examples: list[tuple[torch.Tensor, torch.Tensor]]  # (input ids, labels: -100 where not a target)
    source: str  # what the text is, for the table


def _capped(examples, max_tokens: int) -> list:
    kept, total = [], 0
    for ids, labels in examples:
        if total >= max_tokens:
            break
        kept.append((ids, labels))
        total += int((labels != IGNORE_INDEX).sum())
    return kept


def run_eval_text(run_dir: Path, tokenizer, max_tokens: int) -> EvalText:
    """The run's eval examples (or its training examples when it held none out), tokenized as it trained."""
    from gpupoor.data.build import build_data
    from gpupoor.storage.rundir import stored_recipe

    recipe = stored_recipe(run_dir)
    if recipe.data.format == "preference":
        raise UserError(f"{run_dir} trained on preference pairs: its eval set is pairs, not text to score",
                        hint="pass --eval FILE with plain text (or JSONL rows with a \"text\" field)")
    bundle = build_data(recipe.data, tokenizer, micro_batch_size=1, seed=recipe.seed, base_dir=run_dir)
    dataset, source = (bundle.eval, "the run's eval set") if bundle.eval is not None and len(bundle.eval) else \
        (bundle.train, "the run's training examples (it held out no eval set; pass --eval FILE for unseen text)")
    return EvalText(_capped((dataset[i] for i in range(len(dataset))), max_tokens), source)


# What `--eval FILE` may be, by extension: anything else (a .csv, a .json array) would be scored as if it were
# prose, its markup and all, and the table would measure the wrong thing.
EVAL_FORMATS = {".txt": "plain text", ".md": "plain text", ".jsonl": 'JSONL rows with a "text" field'}
EVAL_HINT = 'give a .txt (or .md) file of plain text, or a .jsonl file with a "text" string in each row'


def read_eval_file(path: Path) -> str:
    """The text of `--eval FILE` (a JSONL file's "text" fields joined by blank lines), checked before the export
    does any work: it exists, has an extension gpupoor reads, is UTF-8, holds text, and every JSONL row has a
    "text" string (named by line)."""
    if not path.is_file():
        what = "is a directory" if path.is_dir() else "no such file"
        raise UserError(f"--eval {path}: {what}", hint=EVAL_HINT)
    if path.suffix.lower() not in EVAL_FORMATS:
        accepted = ", ".join(f"{suffix} ({what})" for suffix, what in EVAL_FORMATS.items())
        raise UserError(f"--eval {path}: {path.suffix or 'a name without an extension'} is not a format gpupoor "
                        f"reads as eval text; it reads {accepted}", hint=EVAL_HINT)
    try:
        raw = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise UserError(f"--eval {path}: not UTF-8 text (byte {exc.start}: {exc.reason})",
                        hint="save the file as UTF-8") from None
    if path.suffix.lower() == ".jsonl":
        raw = "\n\n".join(_jsonl_texts(path, raw))
    if not raw.strip():
        raise UserError(f"--eval {path}: there is no text in it to score", hint=EVAL_HINT)
    return raw


def _jsonl_texts(path: Path, raw: str) -> list[str]:
    texts = []
    for number, line in enumerate(raw.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise UserError(f"--eval {path}:{number}: not JSON ({exc.msg})") from None
        if not isinstance(row, dict) or not isinstance(row.get("text"), str):
            raise UserError(f"--eval {path}:{number}: a row needs a \"text\" string",
                            hint="or give the text as a .txt file")
        texts.append(row["text"])
    return texts


def file_eval_text(path: Path, tokenizer, max_tokens: int, window: int = 512, raw: str | None = None) -> EvalText:
    """Plain text or JSONL rows with a "text" field (`raw`: the text read_eval_file read from `path` already),
    tokenized and cut into windows of `window` tokens."""
    raw = read_eval_file(path) if raw is None else raw
    ids = torch.tensor(tokenizer(raw, add_special_tokens=False)["input_ids"], dtype=torch.long)
    if len(ids) < 2:
        raise UserError(f"--eval {path}: fewer than two tokens of text to score")
    examples = [(ids[start:start + window], ids[start:start + window].clone())
                for start in range(0, len(ids) - 1, window) if len(ids[start:start + window]) > 1]
    return EvalText(_capped(examples, max_tokens), f"{path.name}")


def perplexity_of_model_dir(model_dir: Path, text: EvalText, dtype=torch.float32) -> tuple[float, int]:
    """`dtype`: what the model computes in (gpupoor.decisions.choose_inference_precision: bf16 on a CPU whose
    matrix units multiply it faster, float32 elsewhere); the losses are summed in float64 either way."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    nll, tokens = mean_nll(model, text.examples)
    return math.exp(nll), tokens


def perplexity_of(model, text: EvalText) -> float:
    """A loaded model (a written file read back by its format) scored on the same ids."""
    nll, _ = mean_nll(model, text.examples)
    return math.exp(nll)
