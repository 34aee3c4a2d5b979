"""`gpupoor plan`: the memory a recipe needs at its peak, term by term, from the model's config alone.

No weights are loaded and torch is not imported: every term is arithmetic over the config's dimensions and
the recipe. The activation term counts what autograd keeps for the backward pass of one decoder layer of
transformers' Llama-family code (the tensors saved by each op, per token, by dtype) -- tests compare it with
what autograd really saves. The terms that no formula gives (the process's baseline, what the allocator
holds beyond live tensors) are measured constants, named below with how they were measured.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from gpupoor.builtin_models import resolve_model_path
from gpupoor.decisions import (choose_attention, choose_device, choose_fused_loss, choose_precision, choose_sampler,
                               logit_postprocessing, loss_chunk_tokens, needs_bitsandbytes)
from gpupoor.errors import UserError
from gpupoor.recipe import LoadedRecipe, Recipe
from gpupoor.units import MiB, format_bytes, parse_size

# What a CPU process holds before the first tensor: Python, torch, transformers, peft, accelerate, the
# tokenizer and gpupoor, as resident memory. Measured on the CI machine (torch 2.13 CPU wheel): 387 MiB after
# the imports, 416 MiB once the tokenizer and a small dataset are loaded. bitsandbytes adds its own.
CPU_PROCESS_BASELINE = 416 * MiB
CPU_BITSANDBYTES_BASELINE = 60 * MiB
# A CUDA process: the context (driver, cuBLAS and cuDNN kernels) outside torch's allocator. 400-600 MiB on
# recent GPUs with torch 2.x; we take the middle. Plus the Python/torch host side is not GPU memory.
CUDA_CONTEXT = 500 * MiB
# Fraction of the live tensors that torch's CUDA caching allocator holds on top as reserved-but-free
# blocks (fragmentation) at the peak. PyTorch's memory docs and our reading of published traces: 5-15%.
CUDA_ALLOCATOR_SLACK = 0.10
# glibc keeps freed activation-sized blocks in its heap (tensors below its dynamic mmap threshold, up to
# 32 MiB, are not returned to the system when freed), so on the CPU the resident peak exceeds the live
# tensors. Modelled as a line in what one decoder layer allocates in its forward (kept + temporaries): MiB
# retained = base + slope x those MiB, with and without gradient checkpointing, fitted by least squares on
# three calibration recipes each that are not in the accuracy table (`python bench/plan_accuracy.py
# --calibrate`, docs/benchmarks.md). It varies from run to run by about 5-10% of the peak.
CPU_HEAP_RETENTION = {"checkpointing": (82, 0.98), "none": (156, 1.15)}
# The fused loss: a chunk of logits (gpupoor.decisions.loss_chunk_tokens) in fp32, with their exponentials and
# gradient alive together.
FUSED_CHUNK_COPIES = 3

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
BUNDLED_CONFIGS = Path(__file__).parent / "model_configs"

# The linear modules of a Llama-family decoder layer: name -> (input features, output features) as a function
# of the shape.
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class Shape:
    """The dimensions of a decoder-only transformer that decide its memory."""

    model_type: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    qkv_bias: bool
    file_dtype: str | None = None  # dtype of the weights on disk (config's dtype), fp32 | bf16 | fp16
    logit_postprocessing: str | None = None  # the config key that soft-caps or scales the logits (Gemma 2, Cohere)
    tokenizer_rows: int | None = None  # ids the tokenizer can produce, when its files are at hand

    @property
    def q(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv(self) -> int:
        return self.kv_heads * self.head_dim

    def linear(self, name: str) -> tuple[int, int]:
        h, i = self.hidden, self.intermediate
        return {"q_proj": (h, self.q), "k_proj": (h, self.kv), "v_proj": (h, self.kv), "o_proj": (self.q, h),
                "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}[name]

    @property
    def layer_linear_params(self) -> int:
        return sum(a * b for a, b in map(self.linear, LINEARS))

    @property
    def layer_other_params(self) -> int:
        return 2 * self.hidden + ((self.q + 2 * self.kv) if self.qkv_bias else 0)  # norms, biases

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def total_params(self) -> int:
        head = 0 if self.tied else self.embedding_params
        return (self.embedding_params + head + self.hidden
                + self.layers * (self.layer_linear_params + self.layer_other_params))


FILE_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def tokenizer_rows(name_or_path: str, base_dir: Path) -> int | None:
    """How many ids a local model's tokenizer can produce (tokenizer.json), or None when unknown."""
    local = resolve_model_path(name_or_path, base_dir)
    path = local / "tokenizer.json" if local is not None else None
    if path is None or not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        vocab = data["model"]["vocab"]
        ids = set(vocab.values()) if isinstance(vocab, dict) else set(range(len(vocab)))
        ids |= {token["id"] for token in data.get("added_tokens", [])}
        return len(ids)
    except (ValueError, KeyError, TypeError):
        return None


# Configs that leave tie_word_embeddings out mean their class default, which is True for these.
TIED_BY_DEFAULT = ("gemma", "gemma2", "gemma3", "gemma3_text")
MOE_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")


def shape_from_config(config: dict, where: str, tokenizer_rows: int | None = None) -> Shape:
    file_dtype = FILE_DTYPES.get(str(config.get("dtype") or config.get("torch_dtype")))
    config = config.get("text_config") or config  # multimodal wrappers keep the language model here
    moe = [key for key in MOE_KEYS if config.get(key)]
    if moe:
        raise UserError(f"{where}: a mixture-of-experts model ({moe[0]} = {config[moe[0]]}): gpupoor plan models "
                        "dense decoders of the Llama family only")
    try:
        hidden = config["hidden_size"]
        heads = config["num_attention_heads"]
        shape = Shape(
            model_type=config.get("model_type", "?"), hidden=hidden, intermediate=config["intermediate_size"],
            layers=config["num_hidden_layers"], heads=heads, kv_heads=config.get("num_key_value_heads") or heads,
            head_dim=config.get("head_dim") or hidden // heads, vocab=config["vocab_size"],
            tied=bool(config.get("tie_word_embeddings", config.get("model_type") in TIED_BY_DEFAULT)),
            qkv_bias=bool(config.get("attention_bias", False)) or config.get("model_type") == "qwen2",
            file_dtype=file_dtype, tokenizer_rows=tokenizer_rows, logit_postprocessing=logit_postprocessing(config.get))
    except KeyError as exc:
        raise UserError(f"{where}: the model config has no {exc.args[0]!r}: gpupoor plan models decoder-only "
                        "transformers of the Llama family (Llama, Qwen2/3, Mistral, Gemma ...)") from None
    except (TypeError, ZeroDivisionError):
        shape = None
    dims = ("hidden", "intermediate", "layers", "heads", "kv_heads", "head_dim", "vocab")
    if shape is None or not all(isinstance(getattr(shape, d), int) and getattr(shape, d) > 0 for d in dims):
        raise UserError(f"{where}: the model config's dimensions (hidden_size, intermediate_size, "
                        "num_hidden_layers, num_attention_heads, vocab_size ...) must be positive integers")
    return shape


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise UserError(f"model.name_or_path: {path} is not readable JSON: {exc}") from None
    if not isinstance(data, dict):
        raise UserError(f"model.name_or_path: {path} is not a JSON object")
    return data


def find_config(name_or_path: str, base_dir: Path, revision: str | None = None) -> tuple[dict, str]:
    """The model's config.json without its weights: a local directory, the hub cache, the configs gpupoor
    ships for its own recipes, or (network allowing) the hub's config.json alone. Returns (config, source)."""
    local = resolve_model_path(name_or_path, base_dir)
    if local is not None:
        path = local / "config.json"
        if not path.is_file():
            raise UserError(f"model.name_or_path: {local} has no config.json")
        return _read_json(path), str(path)
    try:
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(name_or_path, "config.json", revision=revision)
    except Exception:  # a malformed id: handled below like an unknown one
        cached = None
    if isinstance(cached, str):
        return _read_json(Path(cached)), cached
    bundled = BUNDLED_CONFIGS / (name_or_path.replace("/", "--") + ".json")
    if bundled.is_file():
        return _read_json(bundled), f"gpupoor's copy of {name_or_path}'s config.json"
    if os.environ.get("HF_HUB_OFFLINE") != "1":
        try:
            from huggingface_hub import hf_hub_download

            path = hf_hub_download(name_or_path, "config.json", revision=revision)
            return _read_json(Path(path)), path
        except Exception as exc:
            raise UserError(f"model.name_or_path: cannot read {name_or_path}'s config.json ({type(exc).__name__}: "
                            f"{exc})", hint="check the name, or log in for a gated model (hf auth login)") from None
    raise UserError(f"model.name_or_path: {name_or_path}'s config.json is not in the local hub cache and "
                    "HF_HUB_OFFLINE=1", hint="unset HF_HUB_OFFLINE (plan downloads config.json only)")


@dataclass
class Term:
    key: str
    bytes: int
    detail: str


@dataclass
class Suggestion:
    changes: dict  # dotted recipe key -> new value
    saving: int  # bytes
    cost: str
    peak: int


@dataclass
class Plan:
    device: str
    precision: str
    terms: list[Term]
    memory: int | None  # bytes available, None when unknown
    memory_source: str
    assumptions: list[str] = field(default_factory=list)
    suggestions: list[Suggestion] = field(default_factory=list)
    fit_changes: dict | None = None  # the combination `--fit` writes

    @property
    def peak(self) -> int:
        return sum(term.bytes for term in self.terms)

    @property
    def comparable_peak(self) -> int:
        """The peak as gpupoor measures it (metrics' peak_mem_mb): on the CPU the process's RSS, on CUDA the
        tensors torch allocated -- without the context and the allocator's slack."""
        if self.device == "cpu":
            return self.peak
        return sum(t.bytes for t in self.terms if t.key != "overhead")

    @property
    def fits(self) -> bool | None:
        return None if self.memory is None else self.peak <= self.memory

    def to_json(self) -> dict:
        return {"device": self.device, "precision": self.precision, "peak_bytes": self.peak,
                "memory_bytes": self.memory, "memory_source": self.memory_source, "fits": self.fits,
                "terms": {t.key: {"bytes": t.bytes, "detail": t.detail} for t in self.terms},
                "assumptions": self.assumptions,
                "suggestions": [{"changes": s.changes, "saving_bytes": s.saving, "peak_bytes": s.peak,
                                 "cost": s.cost} for s in self.suggestions],
                "fit_changes": self.fit_changes}


@dataclass(frozen=True)
class GpuFacts:
    """What plan knows of the GPU it plans for: the facts gpupoor.decisions takes. `major` None: no GPU is
    visible here (a plan for another machine): explicit requests stand, `auto` takes the larger memory bound."""

    major: int | None = None  # the CUDA compute capability's major version
    flash_installed: bool = False


@dataclass(frozen=True)
class Settings:
    """What the plan needs from the recipe, resolved for one device."""

    device: str  # cpu | cuda
    precision: str  # fp32 | bf16 | fp16
    attention: str  # sdpa | eager | flash_attention_2
    sampler: str  # packed | random | length_grouped
    micro_batch: int
    row_tokens: int  # tokens of one micro-batch row: max_length (the longest batch)
    rank: int
    targets: tuple[str, ...]
    modules_to_save: tuple[str, ...]
    dropout: float
    bits: int | None
    double_quant: bool
    optimizer: str
    momentum: float
    checkpointing: bool | str
    fused_loss: bool
    max_gpu_weights: int | None = None  # memory.max_gpu_memory: accelerate keeps the rest of the weights in RAM
    # On the CPU, weights whose file dtype is the run's stay memory-mapped from the safetensors file, and
    # pages of embedding rows the tokenizer never produces are never read: rows that become resident.
    resident_embedding_rows: int | None = None
    loss_reason: str = ""  # why the fused loss is (not) used

    @property
    def half(self) -> bool:
        return self.precision in ("bf16", "fp16")

    @property
    def act_bytes(self) -> int:
        """Bytes of an activation value: half precision under autocast, else fp32."""
        return 2 if self.half else 4


def resolve_settings(recipe: Recipe, device: str, shape: Shape, gpu: GpuFacts = GpuFacts()) -> Settings:
    """The recipe on `device`, each `auto` decided as training decides it (gpupoor.decisions)."""
    precision = choose_precision(recipe.precision, device, gpu.major).value
    attention = choose_attention(recipe.model.attention, device, gpu.flash_installed, gpu.major).value
    sampler = choose_sampler(recipe.data.sampler, attention, recipe.model.trust_remote_code).value
    targets = tuple(LINEARS) if recipe.peft.target_modules == "all-linear" else \
        tuple(name for name in LINEARS if name in recipe.peft.target_modules)
    # peft puts LoRA on the output head only when lm_head is named (all-linear leaves the output layer out)
    head_adapted = isinstance(recipe.peft.target_modules, list) and "lm_head" in recipe.peft.target_modules
    fused, loss_reason = choose_fused_loss(recipe.memory.fused_cross_entropy, shape.logit_postprocessing, head_adapted)
    return Settings(device=device, precision=precision, attention=attention, sampler=sampler,
                    micro_batch=recipe.training.micro_batch_size, row_tokens=recipe.data.max_length,
                    rank=recipe.peft.rank, targets=targets, modules_to_save=tuple(recipe.peft.modules_to_save),
                    dropout=recipe.peft.dropout, bits=recipe.quantization.bits,
                    double_quant=recipe.quantization.double_quant, optimizer=recipe.training.optimizer,
                    momentum=recipe.training.momentum, checkpointing=recipe.memory.gradient_checkpointing,
                    fused_loss=fused, loss_reason=loss_reason,
                    max_gpu_weights=parse_size(recipe.memory.max_gpu_memory, "memory.max_gpu_memory")
                    if recipe.memory.max_gpu_memory and device == "cuda" else None,
                    resident_embedding_rows=shape.tokenizer_rows if device == "cpu" and shape.file_dtype == precision
                    else None)


# ----------------------------------------------------------------------------------------------- the terms
def weight_bytes(shape: Shape, s: Settings) -> tuple[int, str]:
    dtype = DTYPE_BYTES[s.precision]
    linear = shape.layers * shape.layer_linear_params
    rest = shape.total_params - linear
    note = ""
    # (A tied head reads every row in the loss; a quantized load or a trained copy materializes them all.)
    if s.resident_embedding_rows is not None and s.resident_embedding_rows < shape.vocab and s.bits is None \
            and not shape.tied and "embed_tokens" not in s.modules_to_save:
        unread = (shape.vocab - s.resident_embedding_rows) * shape.hidden
        rest -= unread
        note = f" ({unread / 1e6:,.1f}M embedding rows the tokenizer never produces stay unread on disk)"
    if s.bits == 4:
        # NF4/FP4: half a byte per weight + an absmax per 64 weights (fp32; or 8-bit with one fp32 per 256
        # absmax when double-quantized).
        constants = linear / 64 * (1 + 4 / 256) if s.double_quant else linear / 64 * 4
        total = linear / 2 + constants + rest * dtype
        return int(total), (f"{linear / 1e6:,.0f}M linear weights in 4-bit + constants "
                            f"{constants / MiB:.0f} MiB; {rest / 1e6:,.0f}M others in {s.precision}")
    if s.bits == 8:
        rows = shape.layers * sum(out for _, out in map(shape.linear, LINEARS))
        total = linear + rows * 4 + rest * dtype  # int8 + one fp32 scale per output row
        return int(total), f"{linear / 1e6:,.0f}M linear weights in int8; {rest / 1e6:,.0f}M others in {s.precision}"
    return (linear + rest) * dtype, f"{shape.total_params / 1e6:,.1f}M parameters in {s.precision}{note}"


def trainable_params(shape: Shape, s: Settings) -> int:
    lora = shape.layers * sum(s.rank * (a + b) for a, b in map(shape.linear, s.targets))
    full = sum(shape.embedding_params for name in s.modules_to_save if name in ("embed_tokens", "lm_head"))
    return lora + full


def optimizer_bytes(params: int, s: Settings) -> tuple[int, str]:
    per_param = {"adamw": 8, "paged_adamw_32bit": 8, "adamw_8bit": 2, "paged_adamw_8bit": 2, "lion_8bit": 1,
                 "sgd": 4 if s.momentum else 0, "adafactor": 0.1}[s.optimizer]
    what = {"adamw": "two fp32 moments", "paged_adamw_32bit": "two fp32 moments (paged)",
            "adamw_8bit": "two 8-bit moments", "paged_adamw_8bit": "two 8-bit moments (paged)",
            "lion_8bit": "one 8-bit moment", "sgd": "fp32 momentum" if s.momentum else "no state",
            "adafactor": "factored second moments (rows + columns)"}[s.optimizer]
    return int(params * per_param), what


def layer_saved_bytes_per_token(shape: Shape, s: Settings, row_tokens: int, masked: bool) -> float:
    """Bytes autograd keeps for the backward pass of one decoder layer, per token of the micro-batch.

    Counted from transformers' Llama-family layer with peft LoRA on `s.targets` (tests check it against
    saved-tensor hooks): RMSNorm keeps its input and 1/rms, attention keeps rotated q, k, v, the output and
    the log-sum-exp (flash/SDPA) or the probabilities (eager), the gated MLP keeps gate, up and act(gate), and
    each LoRA module keeps its input and its rank-r projection.
    """
    h, q, kv, i, heads = shape.hidden, shape.q, shape.kv, shape.intermediate, shape.heads
    half, b = s.half, s.act_bytes
    lora_inputs = {name: shape.linear(name)[0] for name in s.targets}
    total = 0.0
    if half:
        # RMSNorm upcasts its input to fp32 and keeps that copy; peft casts each LoRA input to the adapter's
        # fp32 and autocast casts it back: every adapted module keeps its own half-precision copy.
        total += 2 * (4 * h + 4)
        total += sum(lora_inputs.values()) * b
    else:
        total += 2 * (h * b + 4)  # each norm's input (the residual stream) and 1/rms
        if s.dropout:  # each adapter keeps its own dropped input instead of the shared one
            total += sum(lora_inputs.values()) * b
        else:
            shared = {"attn_norm": any(n in lora_inputs for n in ("q_proj", "k_proj", "v_proj")),
                      "mlp_norm": any(n in lora_inputs for n in ("gate_proj", "up_proj")),
                      "down_input": "down_proj" in lora_inputs}
            total += (shared["attn_norm"] + shared["mlp_norm"]) * h * b + shared["down_input"] * i * b
    if s.dropout:  # the dropout mask: bool on CUDA, the scaled noise in the input's dtype on the CPU
        total += sum(lora_inputs.values()) * (1 if s.device == "cuda" else (4 if not half else b))
    total += len(lora_inputs) * s.rank * b  # x @ A, kept for the gradient of B
    # attention: rotated q, k and v, and the output (kept by SDPA/flash for its backward; o_proj's input)
    total += (2 * q + 2 * kv) * b
    if s.attention == "eager":
        total += heads * row_tokens * (b + (4 if half else 0))  # the probabilities (fp32 softmax, then cast)
        total += 2 * (q - kv) * b  # k and v repeated to every query head
    else:
        total += heads * 4  # log-sum-exp per head
    if masked and s.attention != "flash_attention_2":
        total += row_tokens * (4 if s.device == "cpu" else b)  # the mask as an additive float bias, per layer
    total += 3 * i * b  # gate, up, act(gate)
    return total


def layer_transient_bytes_per_token(shape: Shape, s: Settings) -> float:
    """What one layer's backward allocates beyond the saved tensors: the gradients flowing through it (the
    residual stream, the MLP's intermediate products) before they are freed."""
    return (2 * shape.hidden + 3 * shape.intermediate) * s.act_bytes


def layer_forward_temporaries_per_token(shape: Shape, s: Settings) -> float:
    """Bytes one layer's forward allocates and frees again (projections before rotation and before the
    LoRA sum, norm intermediates ...): counted with a dispatch-mode tally of every op output of transformers'
    Llama layer with LoRA on every linear, minus what autograd keeps."""
    return (9.75 * (shape.hidden + shape.q) + 10.5 * shape.kv + 6 * shape.intermediate) * s.act_bytes


def activation_bytes(shape: Shape, s: Settings) -> tuple[int, int, str]:
    """(live bytes at the peak, bytes the step allocates and frees on the way, description)."""
    tokens = s.micro_batch * s.row_tokens
    # Packed rows carry a block-diagonal mask. A random batch may pad a short example to a long one: a padding
    # mask. Length-grouped batches put the longest examples together: the longest batch has no padding.
    # flash-attn 2 needs neither.
    masked = s.attention != "flash_attention_2" and (
        s.sampler == "packed" or (s.sampler == "random" and s.micro_batch > 1))
    per_layer = layer_saved_bytes_per_token(shape, s, s.row_tokens, masked) * tokens
    transient = layer_transient_bytes_per_token(shape, s) * tokens
    b = s.act_bytes
    if s.checkpointing:
        kept = shape.hidden * b * tokens  # each checkpointed layer keeps only its input
        on_device = 0 if (s.checkpointing == "offload" and s.device == "cuda") else shape.layers * kept
        live = on_device + per_layer + transient  # plus one layer recomputed during its backward
        mode = "checkpointing: layer inputs offloaded to CPU" if not on_device and shape.layers else "checkpointing"
        detail = (f"{mode}: {shape.layers} x {kept / MiB:.1f} MiB layer inputs + one layer recomputed "
                  f"{per_layer / MiB:.1f} MiB")
    else:
        live = shape.layers * per_layer + transient
        detail = f"{shape.layers} layers x {per_layer / MiB:.1f} MiB kept for backward"
    churn = per_layer + layer_forward_temporaries_per_token(shape, s) * tokens
    if s.bits is not None:  # bitsandbytes dequantizes each weight for its matmul: buffers of a weight's size
        live += 2 * max(x * y for x, y in map(shape.linear, LINEARS)) * b
        churn += shape.layer_linear_params * b
    detail += f"; {s.micro_batch} x {s.row_tokens} tokens, {s.attention}" + (" + mask" if masked else "")
    return int(live), int(churn), detail


def loss_bytes(shape: Shape, s: Settings) -> tuple[int, str]:
    tokens = s.micro_batch * s.row_tokens
    if s.fused_loss:
        chunk_tokens = loss_chunk_tokens(shape.vocab)
        chunk = min(chunk_tokens, tokens) * shape.vocab * 4
        hidden = tokens * shape.hidden * 4 * 2  # targets' hidden states and their gradient
        if "lm_head" in s.modules_to_save or ("embed_tokens" in s.modules_to_save and shape.tied):
            hidden += shape.embedding_params * 4  # the trained head's fp32 gradient, built during the forward
        return (FUSED_CHUNK_COPIES * chunk + hidden,
                f"chunked: {min(chunk_tokens, tokens)} tokens x {shape.vocab:,} vocab at a time")
    b = DTYPE_BYTES[s.precision]
    logits = tokens * shape.vocab
    # the logits, their fp32 copy (a no-op in fp32), log-softmax kept for backward, and its gradient
    total = logits * b + logits * 4 * (2 if b == 4 else 3)
    return total, f"full logits: {tokens:,} tokens x {shape.vocab:,} vocab, fp32 log-softmax and gradient"


def heap_retention(s: Settings, layer_allocations: int) -> int:
    """Bytes of freed step memory the C heap keeps (CPU), from one layer's forward allocations."""
    base_mib, slope = CPU_HEAP_RETENTION["checkpointing" if s.checkpointing else "none"]
    return max(0, int(base_mib * MiB + slope * layer_allocations))


def plan_terms(shape: Shape, s: Settings, uses_bitsandbytes: bool) -> tuple[list[Term], list[str]]:
    weights, weights_detail = weight_bytes(shape, s)
    if s.max_gpu_weights is not None and weights > s.max_gpu_weights:
        weights_detail += (f"; memory.max_gpu_memory keeps {format_bytes(s.max_gpu_weights)} on the GPU, "
                           f"{format_bytes(weights - s.max_gpu_weights)} in CPU memory")
        weights = s.max_gpu_weights
    params = trainable_params(shape, s)
    optimizer, optimizer_detail = optimizer_bytes(params, s)
    live, churn, act_detail = activation_bytes(shape, s)
    loss, loss_detail = loss_bytes(shape, s)
    terms = [Term("base_weights", weights, weights_detail),
             Term("trainable", params * 4, f"{params / 1e6:,.2f}M trainable parameters in fp32"),
             Term("gradients", params * 4, "fp32, one per trainable parameter"),
             Term("optimizer", optimizer, f"{s.optimizer}: {optimizer_detail}"),
             Term("activations", live, act_detail),
             Term("loss", loss, loss_detail)]
    if s.device == "cpu":
        baseline = CPU_PROCESS_BASELINE + (CPU_BITSANDBYTES_BASELINE if uses_bitsandbytes else 0)
        kept = heap_retention(s, churn)
        terms.append(Term("overhead", baseline + kept,
                          f"process baseline {baseline / MiB:.0f} MiB (Python, torch, libraries); freed "
                          f"step memory the C heap keeps {kept / MiB:.0f} MiB"))
    else:
        slack = int(CUDA_ALLOCATOR_SLACK * (live + loss))
        terms.append(Term("overhead", CUDA_CONTEXT + slack, f"CUDA context ~{CUDA_CONTEXT / MiB:.0f} MiB; "
                          f"caching-allocator slack {slack / MiB:.0f} MiB"))
    assumptions = [f"every micro-batch row is {s.row_tokens} tokens (data.max_length): the longest batch"]
    if not s.fused_loss:
        assumptions.append(f"the plain loss: {s.loss_reason}")
    return terms, assumptions


# ------------------------------------------------------------------------------------------ whole plan
CANDIDATES = (  # cheapest first: what a user gives up for the saving
    ("memory.fused_cross_entropy", "none: the same loss, computed in chunks"),
    ("training.optimizer", "8-bit optimizer moments: negligible effect on LoRA quality"),
    ("memory.gradient_checkpointing", "~25% slower steps: each layer's forward runs again in backward "
     "(offload: also copies layer inputs to and from the CPU)"),
    ("training.micro_batch_size", "about the same examples per optimizer step (accumulation raised); smaller "
     "kernels, a little slower"),
    ("quantization.bits", "QLoRA: 4-bit NF4 base weights, slower matmuls, a small quality loss"),
    ("data.max_length", "examples longer than this are truncated"),
)


def candidate_change(recipe: Recipe, key: str, device: str) -> dict | None:
    """The next step on one knob from the recipe's current value, or None when there is none."""
    if key == "memory.fused_cross_entropy":
        return None if recipe.memory.fused_cross_entropy else {key: True}
    if key == "training.optimizer":
        return {key: "adamw_8bit"} if recipe.training.optimizer in ("adamw", "paged_adamw_32bit") else None
    if key == "memory.gradient_checkpointing":
        current = recipe.memory.gradient_checkpointing
        if not current:
            return {key: True}
        return {key: "offload"} if current is True and device == "cuda" else None
    if key == "training.micro_batch_size":
        micro, accumulation = recipe.training.micro_batch_size, recipe.training.gradient_accumulation_steps
        if micro == 1:
            return None
        half = micro // 2  # the same examples per optimizer step, in smaller micro-batches
        return {key: half, "training.gradient_accumulation_steps": -(-micro * accumulation // half)}
    if key == "quantization.bits":
        return {key: 4} if recipe.quantization.bits is None else None
    if key == "data.max_length":
        return {key: recipe.data.max_length // 2} if recipe.data.max_length >= 512 else None
    raise KeyError(key)


def apply_changes(recipe: Recipe, changes: dict) -> Recipe:
    tree = recipe.model_dump()
    for key, value in changes.items():
        node = tree
        *parents, leaf = key.split(".")
        for parent in parents:
            node = node[parent]
        node[leaf] = value
    return Recipe.model_validate(tree)


def _peak(shape: Shape, recipe: Recipe, device: str, gpu: GpuFacts) -> int:
    settings = resolve_settings(recipe, device, shape, gpu)
    terms, _ = plan_terms(shape, settings, needs_bitsandbytes(recipe.training.optimizer, recipe.quantization.bits))
    return sum(t.bytes for t in terms)


def suggest(shape: Shape, recipe: Recipe, device: str, memory: int,
            gpu: GpuFacts = GpuFacts()) -> tuple[list[Suggestion], dict | None]:
    """Single changes that each make the recipe fit (cheapest first), or, when none does alone, every
    change that saves something; and the cheapest combination that fits (what --fit writes), if any."""
    base = _peak(shape, recipe, device, gpu)
    singles = []
    for key, cost in CANDIDATES:
        changes = candidate_change(recipe, key, device)
        if changes is None:
            continue
        peak = _peak(shape, apply_changes(recipe, changes), device, gpu)
        if peak < base:
            singles.append(Suggestion(changes, base - peak, cost, peak))
    fitting = [s for s in singles if s.peak <= memory]
    steps: list[dict] = []
    current, current_peak = recipe, base
    for key, _ in CANDIDATES:  # cheapest first; a knob with several steps (micro-batch halving) may repeat
        while current_peak > memory:
            changes = candidate_change(current, key, device)
            if changes is None:
                break
            trial = apply_changes(current, changes)
            trial_peak = _peak(shape, trial, device, gpu)
            if trial_peak >= current_peak:
                break
            current, current_peak = trial, trial_peak
            steps.append(changes)
    if current_peak > memory:
        return (fitting or singles), None
    # Drop what the last (most expensive) change made unnecessary: try each earlier step without it.
    for step in reversed(steps[:-1]):
        rest = [s for s in steps if s is not step]
        trial = recipe
        for changes in rest:
            trial = apply_changes(trial, changes)
        if _peak(shape, trial, device, gpu) <= memory:
            steps = rest
    combined = {key: value for changes in steps for key, value in changes.items()}
    return (fitting or singles), combined


def default_device(recipe: Recipe) -> str:
    """The device training would use here (gpupoor.decisions.choose_device), found without importing torch."""
    requested = recipe.training.device
    return choose_device(requested, _cuda_visible() if requested == "auto" else None).value


def _cuda_visible() -> bool:
    if "torch" in sys.modules:
        import torch

        return torch.cuda.is_available()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return False
    gpus = Path("/proc/driver/nvidia/gpus")
    if gpus.is_dir() and any(gpus.iterdir()):
        return True
    import shutil

    return bool(shutil.which("nvidia-smi"))  # WSL2 and some containers have no /proc entry


def _nvidia_smi(fields: str) -> list[str] | None:
    """`fields` (nvidia-smi --query-gpu) of the first GPU this process may use, or None when nothing answers."""
    import shutil
    import subprocess

    if not shutil.which("nvidia-smi"):
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip() or "0"
    try:
        out = subprocess.run(["nvidia-smi", "-i", visible, f"--query-gpu={fields}", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10).stdout.splitlines()
        return [value.strip() for value in out[0].split(",", fields.count(","))]
    except (OSError, IndexError, subprocess.SubprocessError):
        return None


def gpu_facts(device: str) -> GpuFacts:
    """What the decisions need to know of the GPU a run on `device` would use here: torch's answer when a
    caller already imported it, else nvidia-smi's; none when no GPU is visible."""
    flash_installed = importlib.util.find_spec("flash_attn") is not None
    if device != "cuda":
        return GpuFacts(None, flash_installed)
    if "torch" in sys.modules:
        import torch

        if torch.cuda.is_available():
            return GpuFacts(torch.cuda.get_device_capability(0)[0], flash_installed)
    answer = _nvidia_smi("compute_cap")
    try:
        return GpuFacts(int(answer[0].split(".")[0]), flash_installed)
    except (TypeError, IndexError, ValueError):  # no GPU here, or an nvidia-smi too old to know compute_cap
        return GpuFacts(None, flash_installed)


def device_memory(device: str) -> tuple[int | None, str]:
    """Bytes the run may use on `device`, and where that figure comes from."""
    if device == "cpu":
        try:
            meminfo = Path("/proc/meminfo").read_text()
            available = int(next(line.split()[1] for line in meminfo.splitlines()
                                 if line.startswith("MemAvailable:"))) * 1024
            status = Path("/proc/self/status").read_text()
            own = int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS:"))) * 1024
        except (OSError, StopIteration, ValueError):
            return None, "unknown (no /proc/meminfo)"
        return available + own, "available RAM (MemAvailable) + this process"
    if "torch" in sys.modules:
        import torch

        if torch.cuda.is_available():
            free, _ = torch.cuda.mem_get_info()
            # the context this process just created is counted in the plan's overhead term: give it back
            return free + CUDA_CONTEXT, f"free memory of {torch.cuda.get_device_name(0)}"
    answer = _nvidia_smi("memory.free,name")
    try:
        return int(answer[0]) * MiB, f"free memory of {answer[1]} (nvidia-smi)"
    except (TypeError, IndexError, ValueError):
        return None, "unknown: no GPU visible (pass --memory)"


def load_shape(loaded: LoadedRecipe) -> tuple[Shape, str]:
    model = loaded.recipe.model
    config, source = find_config(model.name_or_path, loaded.base_dir, model.revision)
    return shape_from_config(config, source, tokenizer_rows(model.name_or_path, loaded.base_dir)), source


def make_plan(loaded: LoadedRecipe, device: str | None = None, memory: int | None = None) -> Plan:
    recipe = loaded.recipe
    device = device or default_device(recipe)
    gpu = gpu_facts(device)
    shape, source = load_shape(loaded)
    settings = resolve_settings(recipe, device, shape, gpu)
    terms, assumptions = plan_terms(shape, settings, needs_bitsandbytes(recipe.training.optimizer,
                                                                         recipe.quantization.bits))
    if memory is not None:
        memory_source = "--memory"
    else:
        memory, memory_source = device_memory(device)
    assumptions.insert(0, f"model config: {source}")
    if recipe.precision == "auto" and device == "cuda" and gpu.major is None:
        assumptions.append("precision auto taken as bf16 (a GPU without bf16 uses fp16: the same bytes)")
    plan = Plan(device, settings.precision, terms, memory, memory_source, assumptions)
    if memory is not None and plan.peak > memory:
        plan.suggestions, plan.fit_changes = suggest(shape, recipe, device, memory, gpu)
    return plan


def render(plan: Plan, recipe_name: str) -> str:
    lines = [f"memory plan for {recipe_name} on {plan.device} ({plan.precision}), at the peak of a training step:"]
    width = max(len(t.key) for t in plan.terms)
    for term in plan.terms:
        lines.append(f"  {term.key:<{width}}  {format_bytes(term.bytes):>10}  {term.detail}")
    lines.append(f"  {'peak':<{width}}  {format_bytes(plan.peak):>10}")
    if plan.memory is None:
        lines.append(f"fits: unknown ({plan.memory_source})")
    else:
        verdict = "yes" if plan.fits else "NO"
        lines.append(f"fits: {verdict}: {format_bytes(plan.peak)} of {format_bytes(plan.memory)} "
                     f"({plan.memory_source}), {plan.peak / plan.memory:.0%}")
    for note in plan.assumptions:
        lines.append(f"  assumes {note}")
    advice = render_suggestions(plan)
    return "\n".join(lines + ([advice] if advice else []))


def render_suggestions(plan: Plan) -> str:
    if not plan.suggestions:
        return ""
    lines = ["what to change (cheapest first; predicted peak after the change):"]
    for s in plan.suggestions:
        change = ", ".join(f"{k}: {json.dumps(v)}" for k, v in s.changes.items())
        lines.append(f"  {change:<58} -{format_bytes(s.saving)} -> {format_bytes(s.peak)}; cost: {s.cost}")
    if plan.fit_changes:
        change = ", ".join(f"{k}: {json.dumps(v)}" for k, v in plan.fit_changes.items())
        lines.append(f"  the cheapest set that fits: {change} (gpupoor plan --fit writes it)")
    else:
        lines.append("  no combination of these fits: a GPU with more memory, or a smaller model")
    return "\n".join(lines)


def write_fit(loaded: LoadedRecipe, changes: dict) -> Path:
    """Write RECIPE.fit.yaml beside the recipe (relative paths still resolve): the recipe with `changes`."""
    from gpupoor.recipe import recipe_to_yaml
    from gpupoor.files import write_text_atomic

    source = loaded.source or Path("recipe.yaml")
    target = source.with_name(source.stem + ".fit.yaml")
    header = (f"# written by gpupoor plan --fit from {source.name}, with the cheapest changes predicted to fit:\n"
              + "".join(f"#   {key}: {json.dumps(value)}\n" for key, value in changes.items()))
    write_text_atomic(target, recipe_to_yaml(apply_changes(loaded.recipe, changes), header))
    return target


def preflight_plan(loaded: LoadedRecipe, force: bool, warn) -> Plan | None:
    """The plan before anything is loaded. On CUDA a recipe predicted not to fit stops here (exit 2) unless
    `force`; elsewhere a predicted miss is a warning. A model the plan cannot describe is a warning too."""
    try:
        plan = make_plan(loaded)
    except Exception as exc:  # the plan advises; a model it cannot describe must not stop the run
        warn(f"no memory plan: {exc}")
        return None
    if plan.fits is False:
        message = (f"predicted peak memory {format_bytes(plan.peak)} does not fit {format_bytes(plan.memory)} "
                   f"({plan.memory_source}) on {plan.device}")
        advice = render_suggestions(plan)
        if plan.device == "cuda" and not force:
            raise UserError(message + (f"\n{advice}" if advice else ""),
                            hint="apply a change (gpupoor plan RECIPE --fit writes them), or pass --force to try anyway")
        warn(message + (" (--force: trying anyway)" if force else "") + (f"\n{advice}" if advice else ""))
    return plan
