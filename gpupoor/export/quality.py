"""What a quantization cost: perplexity on held-out text of the full-precision model and of each written GGUF,
the GGUF read back by an independent reader (transformers' GGUF loader, which dequantizes with the gguf package)
and run in torch, in float32. The same token ids and targets for every model: the merged model's tokenizer
encodes them once.

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


def perplexity_of_gguf(path: Path, text: EvalText, model_dir: Path, dtype=torch.float32) -> float:
    """The GGUF loaded by transformers (dequantized to `dtype`) and scored on the same ids."""
    nll, _ = mean_nll(load_gguf_back(path, model_dir, dtype), text.examples)
    return math.exp(nll)


def load_gguf_back(path: Path, model_dir: Path, dtype=torch.float32):
    """The model in a written GGUF file, in `dtype`: through transformers' GGUF loader, or for the one
    architecture it cannot load (Gemma 1), through the gguf package's reader and dequantizer into the model
    class built from the original config (`read_with_gguf`)."""
    import functools
    from unittest import mock

    import transformers.modeling_gguf_pytorch_utils as gguf_loading
    from transformers import AutoModelForCausalLM

    from gpupoor.export.architectures import rope_scaling

    # The loader's own tqdm bar ignores transformers' progress-bar switch: one bar per file is noise here.
    with mock.patch.object(gguf_loading, "tqdm", functools.partial(gguf_loading.tqdm, disable=True)):
        config = json.loads((model_dir / "config.json").read_text())
        if config.get("model_type") == "gemma":
            return read_with_gguf(path, model_dir).to(dtype)
        if rope_scaling(config)["rope_type"] != "default":
            # transformers' GGUF loader reads no rope-scaling keys (llama.cpp does): its config would rotate
            # differently from the file's, so the tensors are read from the file into the original config.
            from transformers import AutoConfig

            return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype,
                                                        config=AutoConfig.from_pretrained(model_dir))
        return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype)


def read_with_gguf(path: Path, model_dir: Path):
    """Every tensor of the file dequantized by the gguf package, put back in transformers' layout and loaded
    into the model built from `model_dir`'s config."""
    import gguf
    from transformers import AutoConfig, AutoModelForCausalLM

    from gpupoor.export.architectures import family_of, from_llama_cpp_layout

    config = json.loads((model_dir / "config.json").read_text())
    family = family_of(config, str(model_dir))
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir), dtype=torch.float32)
    arch = next(key for key, value in gguf.MODEL_ARCH_NAMES.items() if value == family.gguf_arch)
    names = gguf.get_tensor_name_map(arch, config["num_hidden_layers"])
    hf_names = {names.get_name(name, try_suffixes=(".weight", ".bias")): name for name in model.state_dict()}
    state = {}
    for tensor in gguf.GGUFReader(str(path)).tensors:
        name = hf_names[tensor.name]
        values = gguf.dequantize(tensor.data, tensor.tensor_type).astype("float32")
        state[name] = torch.from_numpy(from_llama_cpp_layout(name, values, config, family).copy())
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or any(name != "lm_head.weight" for name in missing):
        raise ValueError(f"{path}: tensors do not match the model: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    return model
