"""Generation from a trained model, for every verb that answers prompts (generate, chat, eval, serve's model, the
demo): `load_generator` loads a run directory, an adapter on its base or a plain model directory, in the precision
it trained in, with the encoder that renders prompts exactly as training did; `complete` answers tokenized prompts
(greedy unless a temperature is given), and `cap_new_tokens` keeps the answers inside the model's context."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from gpupoor.errors import UserError


@dataclass
class Generator:
    model: object
    tokenizer: object
    encoder: object  # gpupoor.data.encoder.Encoder: renders and tokenizes prompts exactly as training did
    precision: object = None  # gpupoor.decisions.Choice: what the model computes in, and why
    device: str = "cpu"

    @property
    def precision_note(self) -> str | None:
        """What to tell a user whose CPU computes in bf16 (fp32 there is the default that needs no word)."""
        chosen = self.precision
        if self.device != "cpu" or chosen is None or chosen.value == "fp32":
            return None
        return f"computing in {chosen.value} ({chosen.reason})"


def load_generator(path: Path, checkpoint: str = "final", base: str | None = None, fmt: str | None = None,
                   device: str = "auto", force: bool = False, warn=print) -> Generator:
    """A run dir or adapter (base + adapter, quantized as trained) or a plain model directory. An adapter's base
    is refused when it is not the one the run trained on (`force`: `warn` and go on)."""

    from gpupoor.data.build import make_encoder
    from gpupoor.hardware import dtype_of, resolve_device, resolve_inference_precision
    from gpupoor.storage.checkpoint import read_manifest
    from gpupoor.model.merge import base_config, check_base_fits
    from gpupoor.model.identity import check_base_unchanged
    from gpupoor.model.load import load_tokenizer, quantization_config
    from gpupoor.recipe.schema import DataSection, ModelSection, QuantizationSection
    from gpupoor.storage.rundir import stored_recipe
    from gpupoor.storage.run_weights import locate_weights

    target = resolve_device(device).value
    weights = locate_weights(path, checkpoint)

    def compute_in(trained: str | None):
        """(the Choice, the dtype to load a model in): on a CPU, bf16 where its matrix units multiply faster, else
        fp32 (gpupoor.decisions.choose_inference_precision); on a GPU a model keeps its file's dtype (a full run's
        fp32 masters too) and an adapter's base loads in the precision the run trained in."""
        choice = resolve_inference_precision(target, trained)
        return choice, dtype_of(choice.value) if target == "cpu" else "auto"

    if weights.run_dir is not None and not weights.is_adapter:  # a full fine-tune: a model
        weights.verify()
        precision, dtype = compute_in(read_manifest(weights.path).get("precision"))
        model = _load_base(str(weights.path), dtype=dtype)
        tokenizer = load_tokenizer(str(weights.path), ModelSection(name_or_path=str(weights.path)))
        data = stored_recipe(path).data
    elif weights.is_adapter:
        from peft import PeftModel

        from gpupoor.quiet import bitsandbytes_unless_loaded

        weights.verify()
        source = weights
        recipe = stored_recipe(source.run_dir) if source.run_dir else None
        adapter_config = json.loads((source.path / "adapter_config.json").read_text())
        base_name = base or adapter_config["base_model_name_or_path"]
        revision = None if base else adapter_config.get("revision")
        check_base_unchanged(source.path, base, force, warn, "the answers")
        check_base_fits(source.path, base_config(base_name, revision), base_name)
        quant = recipe.quantization if recipe else QuantizationSection()
        precision, _ = compute_in(read_manifest(source.path).get("precision"))
        quantization = quantization_config(quant, precision.value) if quant.bits else None
        model = _load_base(base_name, dtype=dtype_of(precision.value), quantization_config=quantization,
                           revision=revision,
                           device_map={"": target} if quantization else None)
        try:
            with bitsandbytes_unless_loaded():
                model = PeftModel.from_pretrained(model, source.path)
        except (RuntimeError, ValueError, KeyError) as exc:  # size mismatches, target modules not found
            first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise UserError(f"the adapter in {source.path} does not fit the base {base_name}: it was trained "
                            f"on another model ({first_line[:300]})",
                            hint="pass --base with the model the run trained on, or leave --base out") from None
        tokenizer = load_tokenizer(str(source.path), ModelSection(name_or_path=str(source.path)))
        data = recipe.data if recipe else DataSection(path="-", format=fmt or "text")
    elif (path / "config.json").is_file():
        precision, dtype = compute_in(None)
        model = _load_base(str(path), dtype=dtype)
        tokenizer = load_tokenizer(str(path), ModelSection(name_or_path=str(path)))
        data = DataSection(path="-", format=fmt or ("chat" if tokenizer.chat_template else "text"))
    else:
        raise UserError(f"{path} is not a run directory, an adapter or a model directory",
                        hint="pass the run dir gpupoor train wrote, its final/ adapter, or a merged model")
    if fmt:
        data = data.model_copy(update={"format": fmt})
    if getattr(model, "hf_device_map", None) is None:
        model.to(target)
    model.eval()
    return Generator(model, tokenizer, make_encoder(data, tokenizer), precision, target)


def _load_base(name: str, **kwargs):
    """A base model by hub id, directory or GGUF file; what cannot be loaded is bad input, named."""
    from transformers import AutoModelForCausalLM

    from gpupoor.model.gguf import is_gguf

    if is_gguf(name):  # dequantized by transformers' GGUF loader, as training loaded it
        from gpupoor.model.load import load_gguf_model

        dtype = kwargs.get("dtype")
        return load_gguf_model(name, torch.float32 if dtype in (None, "auto") else dtype,
                               quantization=kwargs.get("quantization_config"))
    local = Path(name).expanduser()
    if local.is_dir() and not (local / "config.json").is_file():
        raise UserError(f"base model {local} has no config.json: it is not a model directory saved with "
                        "save_pretrained", hint="pass --base with the model directory (or hub id) the run trained on")
    try:
        return AutoModelForCausalLM.from_pretrained(name, **kwargs)
    except (OSError, ValueError) as exc:
        raise UserError(f"cannot load the base model {name!r}: {exc}",
                        hint="pass --base with a local model directory or a hub id you can reach") from None


def context_length(model) -> int | None:
    """Tokens the model attends over (prompt and generated together), when its config says."""
    config = getattr(model, "config", None)
    value = getattr(config, "max_position_embeddings", None) if config is not None else None
    return int(value) if isinstance(value, int) and value > 0 else None


def cap_new_tokens(model, prompts: list[list[int]], max_new_tokens: int) -> tuple[int, str | None]:
    """--max-new-tokens bounded by the context left after the longest prompt, and a note when it was capped."""
    context = context_length(model)
    if context is None:
        return max_new_tokens, None
    longest = max(len(p) for p in prompts)
    room = context - longest
    if room <= 0:
        raise UserError(f"a prompt has {longest} tokens but the model's context is {context}: nothing can be generated",
                        hint="shorten the prompt")
    if max_new_tokens > room:
        return room, (f"--max-new-tokens {max_new_tokens} capped at {room}: the model's context is {context} tokens "
                      f"and the longest prompt takes {longest}")
    return max_new_tokens, None


def _generated(row: list[int], eos: int | None) -> int:
    """The tokens an answer generated: up to and including its end of sequence (the rest is padding)."""
    return row.index(eos) + 1 if eos is not None and eos in row else len(row)


def _why_empty(new_ids: list[int], eos: int | None, pad: int | None, max_new_tokens: int) -> str:
    """Why a completion decodes to nothing: the model ended at once, or every token it wrote is special or blank."""
    if new_ids and new_ids[0] == eos:
        return "the model's first token was end-of-sequence (it ended its answer at once)"
    written = [token for token in new_ids if token not in (eos, pad)]
    limit = f"; it stopped at --max-new-tokens {max_new_tokens}" if len(written) >= max_new_tokens else ""
    return f"the {len(written)} tokens it wrote are special or blank tokens{limit}"


@torch.no_grad()
def complete(model, tokenizer, prompts: list[list[int]], max_new_tokens: int = 64, temperature: float = 0.0,
             batch_size: int = 16, seed: int = 0, reasons: list | None = None,
             counts: list | None = None) -> list[str]:
    """Completions of tokenized prompts: greedy (deterministic) unless temperature > 0. `reasons`, when given, gets
    one entry per prompt: None, or why the answer is empty; `counts`: the tokens each answer generated (its end of
    sequence included, the padding after it not)."""
    from gpupoor.model.decoding import decoder_for

    device = next(model.parameters()).device
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    torch.manual_seed(seed)
    # the decoding engine where it covers the model (its weights, the adapter merged, read once here); else generate
    decoder = decoder_for(model)
    draws = torch.Generator(device).manual_seed(seed) if temperature > 0 else None
    outputs = []
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start:start + batch_size]
        width = max(len(p) for p in chunk)
        # Left padding: a decoder-only model continues from the last position of every row.
        input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in chunk], device=device)
        attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk], device=device)
        if decoder is not None:
            new_tokens = decoder.generate(input_ids, attention_mask, max_new_tokens, tokenizer.eos_token_id, pad,
                                          temperature, draws)
        else:
            sampling = {"do_sample": True, "temperature": temperature} if temperature > 0 else {"do_sample": False}
            new_tokens = model.generate(input_ids=input_ids, attention_mask=attention_mask,
                                        max_new_tokens=max_new_tokens, pad_token_id=pad,
                                        eos_token_id=tokenizer.eos_token_id, **sampling)[:, width:]
        decoded = tokenizer.batch_decode(new_tokens, skip_special_tokens=True)
        outputs += decoded
        if counts is not None:
            counts += [_generated(row.tolist(), tokenizer.eos_token_id) for row in new_tokens]
        if reasons is not None:
            reasons += [None if text.strip() else _why_empty(row.tolist(), tokenizer.eos_token_id, pad, max_new_tokens)
                        for row, text in zip(new_tokens, decoded)]
    return [text.strip() for text in outputs]
