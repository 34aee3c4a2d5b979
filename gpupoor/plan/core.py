"""`gpupoor plan`: the memory a recipe needs at its peak, term by term, from the model's config alone.

No weights are loaded and torch is not imported: every term is arithmetic over the config's dimensions and
the recipe. The activation term counts what autograd keeps for the backward pass of one decoder layer of
transformers' Llama-family code (the tensors saved by each op, per token, by dtype) for each peft.method, in
the layers that need a gradient (none below the first trained one) -- tests compare it with what autograd
really saves. A distillation teacher adds its weights and its share of the loss's working set. The terms that no formula gives (the process's baseline, what the allocator
holds beyond live tensors) are measured constants, named below with how they were measured.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path

from gpupoor.model.builtin import resolve_model_path
from gpupoor.decisions import (choose_attention, choose_device, choose_fused_loss, choose_precision, choose_reference,
                               choose_sampler, choose_strategy, ia3_modules, launch_layout, logit_postprocessing,
                               loss_chunk_tokens, needs_bitsandbytes, trained_layer_indices)
from gpupoor.errors import UserError
from gpupoor.recipe.loading import LoadedRecipe
from gpupoor.recipe.rules import FSDP_OPTIMIZERS
from gpupoor.recipe.schema import Recipe
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
# glibc keeps some freed tensors in its heap, so on the CPU the resident peak exceeds the live tensors. With
# torch's huge-page-aligned allocations (THP_MEM_ALLOC_ENABLE=1, which the gpupoor command sets) and the heap
# trimmed when it creeps up (gpupoor.train.heap) that is a roughly constant margin, not a multiple of
# the activations (it was 0.98-1.15 x one layer's forward allocations with torch's default allocation): retained
# MiB = base + slope x one layer's forward allocations, with and without gradient checkpointing, the slope fixed
# at 0 (least squares gave -0.03 and -0.15: noise around a constant), the base the mean of three calibration
# recipes each that are not in the accuracy table (`python bench/plan_accuracy.py --calibrate`,
# docs/benchmarks.md). It varies from run to run by about 5-10% of the peak.
CPU_HEAP_RETENTION = {"checkpointing": (63, 0.0), "none": (22, 0.0)}
# A quantized base on the CPU: bitsandbytes dequantizes each weight for its matmul (forward, recomputation and
# backward), and the heap keeps more of that churn within a step: this many times one layer's linear weights in
# the compute dtype. Fitted like the constant above, on three 4-bit calibration recipes (h512 and h1024, with and
# without checkpointing): 4.29, 2.65 and 3.89, the mean taken.
CPU_DEQUANTIZED_RETENTION = 3.6
# The fused loss: a chunk of logits (gpupoor.decisions.loss_chunk_tokens) in fp32, with their exponentials and
# gradient alive together.
FUSED_CHUNK_COPIES = 3
# The fused distillation loss (gpupoor.objectives.distill): per chunk the student's logits, the teacher's, the scaled
# difference and logsumexp's temporaries, chunk x vocabulary in fp32 each. Measured on the CPU (glibc's in-use
# bytes after each op, linear_distill_sum at vocabulary 32,000): 5.0 buffers in fp32; 6.0 with bf16 heads, which
# a CPU casts slice by slice into one more (the fused cross-entropy alone: 2.0 and 2.5, planned as 3).
DISTILL_CHUNK_COPIES = 5
# The teacher's forward under no_grad keeps nothing, but one layer's working set is alive at a time: measured
# the same way on 2-layer Llamas (hidden 256/512, intermediate 704/1376, fp32 and bf16), 4 x hidden + 3 x
# intermediate values per token within 1% (3.1 x intermediate: just above).
TEACHER_FORWARD_VALUES = (4, 3.1)  # per token: (x hidden, x intermediate)

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
BUNDLED_CONFIGS = Path(__file__).parent / "model_configs"

# The linear modules of a Llama-family decoder layer: name -> (input features, output features) as a function
# of the shape.
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
NORMS = ("input_layernorm", "post_attention_layernorm")
# Where each sits in transformers' module tree, under model.layers.N.
MODULE_PATHS = {**{name: f"self_attn.{name}" for name in LINEARS[:4]}, **{name: f"mlp.{name}" for name in LINEARS[4:]},
                **{name: name for name in NORMS}}
# The inputs of a layer's linears: consumers of one tensor (the attention norm's output, the MLP norm's, the
# MLP product), which in fp32 keep it once between them. o_proj's input is the attention output, counted apart.
INPUT_GROUPS = ((("q_proj", "k_proj", "v_proj"), "input_layernorm"),
                (("gate_proj", "up_proj"), "post_attention_layernorm"),
                (("down_proj",), None))


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

    def linear_params(self, name: str) -> int:
        """Parameters of one linear module: its weight, and its bias where the model has one."""
        a, b = self.linear(name)
        return a * b + (b if self.qkv_bias and name in ("q_proj", "k_proj", "v_proj") else 0)

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


def _read_json(path: Path, key: str = "model.name_or_path") -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise UserError(f"{key}: {path} is not readable JSON: {exc}") from None
    if not isinstance(data, dict):
        raise UserError(f"{key}: {path} is not a JSON object")
    return data


def require_model_dir(local: Path, key: str) -> None:
    """A local model path (named by recipe key `key`) is a directory with a config.json, or a UserError saying
    what it is instead: a file, nothing, or a directory of something else."""
    if local.exists() and not local.is_dir():
        raise UserError(f"{key}: {local} is a file; expected a model directory (config.json and weights, as "
                        "save_pretrained writes it) or a hub id (owner/name)", hint="name the directory that holds it")
    if not local.is_dir():
        raise UserError(f"{key}: {local} does not exist",
                        hint="relative paths resolve against the recipe file's directory")
    if not (local / "config.json").is_file():
        raise UserError(f"{key}: {local} has no config.json; it is not a model saved with save_pretrained")


def find_config(name_or_path: str, base_dir: Path, revision: str | None = None,
                key: str = "model.name_or_path") -> tuple[dict, str]:
    """The model's config.json without its weights: a local directory, the hub cache, the configs gpupoor
    ships for its own recipes, or (network allowing) the hub's config.json alone. Returns (config, source).
    `key`: the recipe key that named the model (the student's, or distill.teacher), for errors."""
    local = resolve_model_path(name_or_path, base_dir)
    if local is not None:
        require_model_dir(local, key)
        return _read_json(local / "config.json", key), str(local / "config.json")
    try:
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(name_or_path, "config.json", revision=revision)
    except Exception:  # a malformed id: handled below like an unknown one
        cached = None
    if isinstance(cached, str):
        return _read_json(Path(cached), key), cached
    bundled = BUNDLED_CONFIGS / (name_or_path.replace("/", "--") + ".json")
    if bundled.is_file():
        return _read_json(bundled, key), f"gpupoor's copy of {name_or_path}'s config.json"
    if os.environ.get("HF_HUB_OFFLINE") != "1":
        try:
            from huggingface_hub import hf_hub_download

            path = hf_hub_download(name_or_path, "config.json", revision=revision)
            return _read_json(Path(path), key), path
        except Exception as exc:
            raise UserError(f"{key}: cannot read {name_or_path}'s config.json ({type(exc).__name__}: "
                            f"{exc})", hint="check the name, or log in for a gated model (hf auth login)") from None
    raise UserError(f"{key}: {name_or_path}'s config.json is not in the local hub cache and "
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
class StrategyFit:
    """One strategy's per-process peak, for the comparison a plan of several processes prints."""

    peak: int
    fits: bool | None
    changes: dict  # the recipe changes that select it ({} for the recipe's own)


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
    fit_peak: int | None = None  # the peak predicted with fit_changes applied
    method: str = "lora"  # peft.method
    trainable_params: int | None = None
    method_detail: str = ""  # "method full: 494,032,768 trainable parameters (all)"
    processes: int = 1  # the plan describes one of them
    nodes: int = 1
    strategy: str = "single"  # single | ddp | fsdp
    share: int = 1  # processes whose peaks the memory must hold together: a CPU node's processes share its RAM
    strategies: dict[str, StrategyFit] | None = None  # several processes: the peak under each strategy
    offloaded: list[Term] = field(default_factory=list)  # fsdp's cpu_offload: in CPU memory, not in the peak

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
        return None if self.memory is None else self.peak * self.share <= self.memory

    def to_json(self) -> dict:
        return {"device": self.device, "precision": self.precision, "peak_bytes": self.peak,
                "memory_bytes": self.memory, "memory_source": self.memory_source, "fits": self.fits,
                "terms": {t.key: {"bytes": t.bytes, "detail": t.detail} for t in self.terms},
                "assumptions": self.assumptions,
                "suggestions": [{"changes": s.changes, "saving_bytes": s.saving, "peak_bytes": s.peak,
                                 "cost": s.cost} for s in self.suggestions],
                "fit_changes": self.fit_changes, "method": self.method, "trainable_params": self.trainable_params,
                "method_detail": self.method_detail, **self._distributed_json()}

    def _distributed_json(self) -> dict:
        if self.processes == 1:
            return {}  # the single-process plan stays as it was
        fits = {name: {"peak_bytes": f.peak, "fits": f.fits, "changes": f.changes}
                for name, f in (self.strategies or {}).items()}
        return {"processes": self.processes, "nodes": self.nodes, "strategy": self.strategy,
                "processes_sharing_memory": self.share, "strategies": fits,
                "offloaded": {t.key: {"bytes": t.bytes, "detail": t.detail} for t in self.offloaded},
                "offloaded_bytes": sum(t.bytes for t in self.offloaded)}


@dataclass(frozen=True)
class GpuFacts:
    """What plan knows of the GPU it plans for: the facts gpupoor.decisions takes. `major` None: no GPU is
    visible here (a plan for another machine): explicit requests stand, `auto` takes the larger memory bound."""

    major: int | None = None  # the CUDA compute capability's major version
    flash_installed: bool = False


@dataclass(frozen=True)
class LayerTraining:
    """What trains in one decoder layer: the linears carrying adapters (LoRA, DoRA, IA3), the linears and norms
    whose own weights train (`full`, or modules_to_save)."""

    adapters: tuple[str, ...] = ()
    weights: tuple[str, ...] = ()
    norms: tuple[str, ...] = ()

    @property
    def trains(self) -> bool:
        return bool(self.adapters or self.weights or self.norms)


@dataclass(frozen=True)
class Training:
    """What trains, resolved against the model's shape (peft.method, last_layers, target_modules, modules_to_save)."""

    method: str  # lora | dora | ia3 | full
    layers: tuple[LayerTraining, ...]  # one per decoder layer
    params: int  # trainable parameters
    embedding: bool  # the input embedding (or peft's copy of it) trains: gradients reach the first layer
    head: bool  # the output head (or peft's copy of it) trains
    scope: str  # where it trains, in words: "every layer", "the last 2 of 24 layers + lm_head", "all"
    feedforward: tuple[str, ...] = ()  # ia3: the modules scaled on their input
    final_norm: bool = False  # the norm after the last layer (or peft's copy of it) trains

    @property
    def first_active_layer(self) -> int:
        """The lowest decoder layer that keeps activations for backward: nothing below it needs a gradient."""
        if self.embedding:
            return 0
        return next((j for j, layer in enumerate(self.layers) if layer.trains), len(self.layers))


def _named(module: str, wanted: str) -> bool:
    """peft's rule for a module name in modules_to_save (and gpupoor's for `full`): the whole name, its dotted
    tail, or a dotted part of it (`mlp` names every layer's MLP, `layers.3` one layer)."""
    return f".{wanted}." in f".{module}."


def module_table(shape: Shape) -> list[tuple[str, int, str]]:
    """The base model's modules that hold parameters, named as transformers names them in the Llama family:
    (module, parameters, tensor). `tensor` names the storage: a tied head shares the embedding's."""
    table = [("model.embed_tokens", shape.embedding_params, "embedding")]
    for j in range(shape.layers):
        table += [(f"model.layers.{j}.{MODULE_PATHS[name]}", shape.linear_params(name), f"{j}.{name}")
                  for name in LINEARS]
        table += [(f"model.layers.{j}.{name}", shape.hidden, f"{j}.{name}") for name in NORMS]
    table += [("model.norm", shape.hidden, "norm"),
              ("lm_head", shape.embedding_params, "embedding" if shape.tied else "head")]
    return table


def resolve_training(shape: Shape, peft) -> Training:
    """What trains for a recipe's `peft` section on this model, as gpupoor.model.build builds it: adapters on the
    targets of the trained layers plus peft's trained copies of modules_to_save, or for `full` the model's own
    tensors (all, or those of the last layers and the named modules)."""
    indices = trained_layer_indices(peft.last_layers, shape.layers)
    table = module_table(shape)
    saved = {(module, params, tensor) for module, params, tensor in table
             if any(_named(module, wanted) for wanted in peft.modules_to_save)}
    if peft.method == "full":
        everything = peft.last_layers is None and not peft.modules_to_save
        prefixes = tuple(f"model.layers.{j}." for j in indices) if peft.last_layers is not None else ()
        trained = {tensor: params for module, params, tensor in table
                   if everything or module.startswith(prefixes) or (module, params, tensor) in saved}
        layers = tuple(LayerTraining(weights=tuple(n for n in LINEARS if f"{j}.{n}" in trained),
                                     norms=tuple(n for n in NORMS if f"{j}.{n}" in trained))
                       for j in range(shape.layers))
        return Training("full", layers, sum(trained.values()), "embedding" in trained,
                        ("embedding" if shape.tied else "head") in trained,
                        "all" if everything else _scope(peft, shape), final_norm="norm" in trained)
    feedforward: tuple[str, ...] = ()
    if peft.method == "ia3":
        targets, feedforward = ia3_modules(shape.model_type, peft.target_modules)
        targets = tuple(name for name in LINEARS if name in targets)
        per_module = {name: shape.linear(name)[0] if name in feedforward else shape.linear(name)[1] for name in targets}
    else:
        targets = tuple(LINEARS) if peft.target_modules == "all-linear" else \
            tuple(name for name in LINEARS if name in peft.target_modules)
        dora = peft.method == "dora"  # plus a magnitude per output feature
        per_module = {name: peft.rank * sum(shape.linear(name)) + (shape.linear(name)[1] if dora else 0)
                      for name in targets}
    in_layer = {module.split(".")[2] + "." + module.rsplit(".", 1)[1] for module, _, _ in saved
                if module.startswith("model.layers.")}
    layers = tuple(LayerTraining(adapters=targets if j in indices else (),
                                 weights=tuple(n for n in LINEARS if f"{j}.{n}" in in_layer),
                                 norms=tuple(n for n in NORMS if f"{j}.{n}" in in_layer))
                   for j in range(shape.layers))
    params = len(indices) * sum(per_module.values()) + sum(params for _, params, _ in saved)  # peft's copies
    names = {module for module, _, _ in saved}
    # (peft trains a copy of a saved embedding; a tied head is then still read from the original.)
    head = "lm_head" in names or ("model.embed_tokens" in names and shape.tied)
    return Training(peft.method, layers, params, "model.embed_tokens" in names, head, _scope(peft, shape),
                    feedforward, final_norm="model.norm" in names)


def _scope(peft, shape: Shape) -> str:
    where = (f"the last {peft.last_layers} of {shape.layers} layers" if peft.last_layers is not None
             else "" if peft.method == "full" else "every layer")
    return " + ".join(filter(None, [where, *peft.modules_to_save]))


@dataclass(frozen=True)
class Distribution:
    """The process the plan describes among `processes` (the recipe's `distributed` section, resolved)."""

    processes: int = 1
    strategy: str = "single"  # single | ddp | fsdp
    shard_frozen: bool = True  # fsdp: frozen (unquantized) base weights are sharded too
    reshard_after_forward: bool = True  # fsdp: a layer's gathered weights are freed after its forward
    cpu_offload: bool = False  # fsdp on cuda: the shards, their gradients and optimizer state live in CPU memory


def _strategy(recipe: Recipe, processes: int) -> str:
    """How `processes` share the work, as training decides it."""
    return choose_strategy(recipe.distributed.strategy, processes).value


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
    # The same condition: tensors loaded without conversion are views of the mapped file, which stays mapped
    # while any of them lives. A quantized base then keeps resident the file pages its linear weights were
    # quantized from (measured on the CPU: the whole 4-bit h1024 checkpoint's 180 MiB of linears).
    weights_mapped: bool = False
    loss_reason: str = ""  # why the fused loss is (not) used
    training: Training | None = None  # what trains (None: LoRA on `targets` in every layer, as before methods)
    teacher: Shape | None = None  # distill.teacher's dimensions
    teacher_bits: int | None = None  # distill.bits
    distribution: Distribution = Distribution()  # one process of several: what it holds of the model
    reference: str = "none"  # DPO's reference (gpupoor.decisions.choose_reference): none | adapter_off | copy
    reference_bits: int | None = None  # preference.reference_bits

    @property
    def half(self) -> bool:
        return self.precision in ("bf16", "fp16")

    @property
    def act_bytes(self) -> int:
        """Bytes of an activation value: half precision under autocast, else fp32."""
        return 2 if self.half else 4

    @property
    def method(self) -> str:
        return self.training.method if self.training else "lora"

    @property
    def residual_bytes(self) -> int:
        """Bytes of a residual-stream value: a trained embedding is fp32 (master weights), and so is every sum
        it feeds under autocast."""
        return 4 if not self.half or (self.training and self.training.embedding) else self.act_bytes


def resolve_settings(recipe: Recipe, device: str, shape: Shape, gpu: GpuFacts = GpuFacts(),
                     teacher: Shape | None = None, processes: int = 1) -> Settings:
    """The recipe on `device`, each `auto` decided as training decides it (gpupoor.decisions). `teacher`: the
    distillation teacher's shape, when the recipe has one; `processes`: how many run it (one is described)."""
    dist = recipe.distributed
    distribution = Distribution(processes, _strategy(recipe, processes), dist.shard_frozen,
                                dist.reshard_after_forward, dist.cpu_offload and device == "cuda")
    precision = choose_precision(recipe.precision, device, gpu.major).value
    attention = choose_attention(recipe.model.attention, device, gpu.flash_installed, gpu.major).value
    sampler = choose_sampler(recipe.data.sampler, attention, recipe.model.trust_remote_code).value
    targets = tuple(LINEARS) if recipe.peft.target_modules == "all-linear" else \
        tuple(name for name in LINEARS if name in recipe.peft.target_modules)
    # peft puts LoRA on the output head only when lm_head is named (all-linear leaves the output layer out)
    head_adapted = (recipe.peft.method != "full" and isinstance(recipe.peft.target_modules, list)
                    and "lm_head" in recipe.peft.target_modules)
    fused, loss_reason = choose_fused_loss(recipe.memory.fused_cross_entropy, shape.logit_postprocessing, head_adapted)
    if fused and teacher is not None:  # distillation fuses both heads: the teacher's must allow it too
        fused, why = choose_fused_loss(True, teacher.logit_postprocessing, False)
        loss_reason = loss_reason if fused else f"teacher: {why}"
    training = resolve_training(shape, recipe.peft)
    # Preference pairs: two sequences of up to max_length per example (padded: twice the rows; packed: rows
    # twice as long), and DPO's reference forward.
    pairs = 2 if recipe.training.objective != "sft" else 1
    reference = choose_reference(recipe.training.objective, recipe.preference.reference, recipe.peft.method).value
    mapped = device == "cpu" and shape.file_dtype == precision
    return Settings(device=device, precision=precision, attention=attention, sampler=sampler,
                    micro_batch=recipe.training.micro_batch_size * (pairs if sampler != "packed" else 1),
                    row_tokens=recipe.data.max_length * (pairs if sampler == "packed" else 1),
                    rank=recipe.peft.rank, targets=targets, modules_to_save=tuple(recipe.peft.modules_to_save),
                    dropout=recipe.peft.dropout if recipe.peft.method in ("lora", "dora") else 0.0,
                    bits=recipe.quantization.bits,
                    double_quant=recipe.quantization.double_quant, optimizer=recipe.training.optimizer,
                    momentum=recipe.training.momentum, checkpointing=recipe.memory.gradient_checkpointing,
                    fused_loss=fused, loss_reason=loss_reason,
                    max_gpu_weights=parse_size(recipe.memory.max_gpu_memory, "memory.max_gpu_memory")
                    if recipe.memory.max_gpu_memory and device == "cuda" else None,
                    resident_embedding_rows=shape.tokenizer_rows if mapped else None,
                    weights_mapped=mapped, training=training, teacher=teacher,
                    teacher_bits=recipe.distill.bits if recipe.distill is not None else None,
                    distribution=distribution, reference=reference,
                    reference_bits=recipe.preference.reference_bits if reference == "copy" else None)


def _training(shape: Shape, s: Settings) -> Training:
    """What trains; Settings built without a resolution get LoRA on every layer (the plan before methods)."""
    if s.training is not None:
        return s.training
    lora = shape.layers * sum(s.rank * (a + b) for a, b in map(shape.linear, s.targets))
    saved = sum(shape.embedding_params for name in s.modules_to_save if name in ("embed_tokens", "lm_head"))
    return Training("lora", (LayerTraining(adapters=s.targets),) * shape.layers, lora + saved,
                    "embed_tokens" in s.modules_to_save,
                    "lm_head" in s.modules_to_save or ("embed_tokens" in s.modules_to_save and shape.tied),
                    "every layer")


def describe_method(shape: Shape, s: Settings) -> str:
    """The plan's method line: what trains and how many parameters."""
    training = _training(shape, s)
    name = training.method + (f" (rank {s.rank})" if training.method in ("lora", "dora") else "")
    count = f"{training.params:,} trainable parameters"
    if training.scope == "all":
        return f"method {name}: {count} (all)"
    share = training.params / shape.total_params
    return f"method {name} on {training.scope}: {count} ({share:.2%} of the model's {shape.total_params:,})"


# ----------------------------------------------------------------------------------------------- the terms
def weight_bytes(shape: Shape, s: Settings) -> tuple[int, str]:
    dtype = DTYPE_BYTES[s.precision]
    training = _training(shape, s)
    linear = shape.layers * shape.layer_linear_params
    rest = shape.total_params - linear
    note = ""
    # (A tied head reads every row in the loss; a trained copy materializes them all. A quantized load on the
    # CPU keeps the embedding a view of the file like an unquantized one: measured.)
    if s.resident_embedding_rows is not None and s.resident_embedding_rows < shape.vocab \
            and not shape.tied and not training.embedding:
        unread = (shape.vocab - s.resident_embedding_rows) * shape.hidden
        rest -= unread
        note = f" ({unread / 1e6:,.1f}M embedding rows the tokenizer never produces stay unread on disk)"
    if training.method == "full":
        # The trained tensors are fp32 master weights (the trainable term); the frozen rest stays in the run's dtype.
        frozen = linear + rest - training.params
        return frozen * dtype, (f"{frozen / 1e6:,.1f}M frozen parameters in {s.precision}{note}; the "
                                f"{training.params / 1e6:,.1f}M that train are the trainable term")
    # A quantized base whose other tensors are views of the mapped file: the pages its linears were read from.
    source = linear * dtype if s.bits and s.weights_mapped else 0
    source_note = f"; the file's pages they were quantized from {source / MiB:.0f} MiB (still mapped)" if source else ""
    if s.bits == 4:
        # NF4/FP4: half a byte per weight + an absmax per 64 weights (fp32; or 8-bit with one fp32 per 256
        # absmax when double-quantized).
        constants = linear / 64 * (1 + 4 / 256) if s.double_quant else linear / 64 * 4
        total = linear / 2 + constants + rest * dtype + source
        return int(total), (f"{linear / 1e6:,.0f}M linear weights in 4-bit + constants "
                            f"{constants / MiB:.0f} MiB{source_note}; {rest / 1e6:,.0f}M others in "
                            f"{s.precision}{note}")
    if s.bits == 8:
        rows = shape.layers * sum(out for _, out in map(shape.linear, LINEARS))
        total = linear + rows * 4 + rest * dtype + source  # int8 + one fp32 scale per output row
        return int(total), (f"{linear / 1e6:,.0f}M linear weights in int8{source_note}; {rest / 1e6:,.0f}M others "
                            f"in {s.precision}{note}")
    return (linear + rest) * dtype, f"{shape.total_params / 1e6:,.1f}M parameters in {s.precision}{note}"


def trainable_params(shape: Shape, s: Settings) -> int:
    return _training(shape, s).params


def optimizer_bytes(params: int, s: Settings) -> tuple[int, str]:
    per_param = {"adamw": 8, "paged_adamw_32bit": 8, "adamw_8bit": 2, "paged_adamw_8bit": 2, "lion_8bit": 1,
                 "sgd": 4 if s.momentum else 0, "adafactor": 0.1}[s.optimizer]
    what = {"adamw": "two fp32 moments", "paged_adamw_32bit": "two fp32 moments (paged)",
            "adamw_8bit": "two 8-bit moments", "paged_adamw_8bit": "two 8-bit moments (paged)",
            "lion_8bit": "one 8-bit moment", "sgd": "fp32 momentum" if s.momentum else "no state",
            "adafactor": "factored second moments (rows + columns)"}[s.optimizer]
    return int(params * per_param), what


def layer_saved_bytes_per_token(shape: Shape, s: Settings, row_tokens: int, masked: bool,
                                layer: LayerTraining | None = None) -> float:
    """Bytes autograd keeps for the backward pass of one decoder layer, per token of the micro-batch, for a
    layer that trains `layer` (default: the last layer, which every method trains) with gradients flowing in.

    Counted from transformers' Llama-family layer (tests check it against saved-tensor hooks for each method):
    RMSNorm keeps its input and 1/rms (a trained norm weight also its normalized input), attention keeps
    rotated q, k, v, the output and the log-sum-exp (flash/SDPA) or the probabilities (eager), the gated MLP
    keeps gate, up and act(gate). A linear keeps its input when its weight trains or it carries a LoRA/DoRA
    adapter (which also keeps its rank-r projection; DoRA also the base and LoRA outputs for the magnitude's
    gradient); IA3 keeps the unscaled output of an output-scaled module, the input of an input-scaled one.
    """
    h, q, kv, i, heads = shape.hidden, shape.q, shape.kv, shape.intermediate, shape.heads
    half, b = s.half, s.act_bytes
    method = s.method
    layer = layer if layer is not None else _training(shape, s).layers[-1]
    lora = tuple(n for n in layer.adapters if n in LINEARS) if method in ("lora", "dora") else ()
    feedforward = tuple(n for n in layer.adapters if n in s.training.feedforward) if method == "ia3" else ()
    out_scaled = tuple(n for n in layer.adapters if n not in feedforward) if method == "ia3" else ()
    lora_inputs = {name: shape.linear(name)[0] for name in lora}
    total = 0.0
    if half:
        # RMSNorm upcasts its input to fp32 and keeps that copy; peft casts each LoRA input to the adapter's
        # fp32 and autocast casts it back: every adapted module keeps its own half-precision copy.
        total += 2 * (4 * h + 4)
        total += sum(lora_inputs.values()) * b
        for members, norm in INPUT_GROUPS:
            size = shape.linear(members[0])[0]
            trained = [n for n in members if n in layer.weights]
            # autocast casts a trained weight's input to half: an fp32 input (a norm's output when its fp32
            # weight trains, or an fp32 residual stream) into a copy per linear, a half one not at all (kept once).
            wide = norm is not None and (norm in layer.norms or s.residual_bytes == 4)
            total += (len(trained) if wide else min(len(trained), 1)) * size * b
            if any(n in feedforward for n in members):  # IA3 scales it in its vector's fp32
                total += size * 4
    else:
        total += 2 * (h * b + 4)  # each norm's input (the residual stream) and 1/rms
        if s.dropout:  # each adapter keeps its own dropped input instead of the shared one
            total += sum(lora_inputs.values()) * b
        for members, _ in INPUT_GROUPS:
            users = [n for n in members if (n in lora and not s.dropout) or n in layer.weights or n in feedforward]
            total += min(len(users), 1) * shape.linear(members[0])[0] * b
    total += len(layer.norms) * h * s.residual_bytes  # a trained norm weight's gradient needs its normalized input
    if s.dropout:  # the dropout mask: bool on CUDA, the scaled noise in the input's dtype on the CPU
        total += sum(lora_inputs.values()) * (1 if s.device == "cuda" else (4 if not half else b))
    total += len(lora_inputs) * s.rank * b  # x @ A, kept for the gradient of B
    if method == "dora":  # the base and LoRA outputs, for the magnitude's gradient
        total += 2 * sum(shape.linear(name)[1] for name in lora) * b
    total += sum(shape.linear(name)[1] for name in out_scaled) * b  # IA3: the unscaled output, for the scale's gradient
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


def dora_weight_norm_bytes(shape: Shape, s: Settings, targets: tuple[str, ...]) -> int:
    """What DoRA's forward allocates for one adapted module at a time to take the norm of W + s*B@A (peft
    builds B@A as lora_B(lora_A(eye(in)))): measured on the CPU (glibc's in-use bytes after each op, one
    module's forward) as the identity in fp32 plus three weight-sized fp32 matrices in fp32; under bf16
    autocast the larger of the identity with its half copy + one half matrix, and a half identity + 16 bytes
    per weight (fp32 copies for the norm). The largest adapted module counts."""
    sizes = [shape.linear(name) for name in targets]
    if not s.half:
        return max((4 * a * a + 12 * a * o for a, o in sizes), default=0)
    return max((max(6 * a * a + 2 * a * o, 2 * a * a + 16 * a * o) for a, o in sizes), default=0)


def saved_activation_bytes(shape: Shape, s: Settings, masked: bool) -> tuple[float, float, int, int]:
    """(what the decoder keeps for backward, the most one layer keeps, layers that keep any, the frozen layers
    below them that keep none), without checkpointing, for one micro-batch.

    Each layer from the first that trains (or from the first, when the embedding trains) keeps what
    `layer_saved_bytes_per_token` counts. The first of them keeps no input norm when its input needs no
    gradient, and the final norm keeps as much: they cancel, unless the embedding trains (then the final
    norm's input and 1/rms are on top), and a trained final norm weight also keeps its normalized input."""
    tokens = s.micro_batch * s.row_tokens
    training = _training(shape, s)
    first = training.first_active_layer
    active = Counter(training.layers[first:])
    per_layer = {layer: layer_saved_bytes_per_token(shape, s, s.row_tokens, masked, layer) * tokens
                 for layer in active}
    saved = sum(per_layer[layer] * count for layer, count in active.items())
    if active:
        norm_input = (4 * shape.hidden + 4) if s.half else (shape.hidden * s.act_bytes + 4)  # fp32 copy, 1/rms
        saved += ((norm_input if training.embedding else 0)
                  + (shape.hidden * s.residual_bytes if training.final_norm else 0)) * tokens
    return saved, max(per_layer.values(), default=0.0), len(training.layers) - first, first


def activation_bytes(shape: Shape, s: Settings) -> tuple[int, int, str]:
    """(live bytes at the peak, bytes the step allocates and frees on the way, description)."""
    tokens = s.micro_batch * s.row_tokens
    training = _training(shape, s)
    # Packed rows carry a block-diagonal mask. A random batch may pad a short example to a long one: a padding
    # mask. Length-grouped batches put the longest examples together: the longest batch has no padding.
    # flash-attn 2 needs neither.
    masked = s.attention != "flash_attention_2" and (
        s.sampler == "packed" or (s.sampler == "random" and s.micro_batch > 1))
    saved, per_layer, active, frozen = saved_activation_bytes(shape, s, masked)
    # Layers below the first trained one get no gradient: backward never reaches them, they keep nothing.
    transient = layer_transient_bytes_per_token(shape, s) * tokens if active else 0
    if s.checkpointing:
        kept = shape.hidden * s.residual_bytes * tokens  # each checkpointed layer keeps only its input
        on_device = 0 if (s.checkpointing == "offload" and s.device == "cuda") else active * kept
        live = on_device + per_layer + transient  # plus one layer recomputed during its backward
        mode = "checkpointing: layer inputs offloaded to CPU" if not on_device and active else "checkpointing"
        detail = (f"{mode}: {active} x {kept / MiB:.1f} MiB layer inputs + one layer recomputed "
                  f"{per_layer / MiB:.1f} MiB")
    else:
        live = saved + transient
        detail = f"{active} layers x {per_layer / MiB:.1f} MiB kept for backward"
    if frozen:
        detail += f" ({frozen} frozen layers below keep none)"
    layer_for_churn = per_layer or layer_saved_bytes_per_token(shape, s, s.row_tokens, masked) * tokens
    churn = layer_for_churn + layer_forward_temporaries_per_token(shape, s) * tokens
    if s.bits is not None:  # bitsandbytes dequantizes each weight for its matmul: buffers of a weight's size
        live += 2 * max(x * y for x, y in map(shape.linear, LINEARS)) * s.act_bytes
        churn += shape.layer_linear_params * s.act_bytes
    if s.half and s.distribution.strategy != "fsdp":  # FSDP gathers them already in half: nothing to cast
        # autocast caches a half copy of every fp32 weight that trains (full, modules_to_save) for the whole
        # forward and loss; backward keeps each until its layer is done.
        copies = 2 * (sum(shape.linear_params(name) for layer in training.layers for name in layer.weights)
                      + (shape.embedding_params if training.head else 0))
        if copies:
            live += copies
            detail += f"; half copies of the trained fp32 weights (autocast) {copies / MiB:.1f} MiB"
    if training.method == "dora" and active:
        norm = dora_weight_norm_bytes(shape, s, training.layers[-1].adapters)
        live += norm
        detail += f"; DoRA weight norm {norm / MiB:.1f} MiB"
    detail += f"; {s.micro_batch} x {s.row_tokens} tokens, {s.attention}" + (" + mask" if masked else "")
    return int(live), int(churn), detail


def teacher_weight_bytes(teacher: Shape, s: Settings) -> tuple[int, str]:
    """The frozen teacher's weights: in the run's dtype, or quantized (distill.bits) like a quantized base."""
    frozen = Settings(device=s.device, precision=s.precision, attention=s.attention, sampler=s.sampler,
                      micro_batch=s.micro_batch, row_tokens=s.row_tokens, rank=0, targets=(), modules_to_save=(),
                      dropout=0.0, bits=s.teacher_bits, double_quant=s.double_quant, optimizer=s.optimizer, momentum=0.0,
                      checkpointing=False, fused_loss=s.fused_loss)
    weights, detail = weight_bytes(teacher, frozen)
    return weights, f"teacher {detail}"


def reference_weight_bytes(shape: Shape, s: Settings) -> tuple[int, str]:
    """DPO's frozen reference copy (preference.reference: copy): the base once more, in the run's dtype or quantized
    with preference.reference_bits. (Its forward runs before the policy's, under no_grad: its working set is gone
    before the peak, and it keeps only each sequence's log-probability.)"""
    weights, detail = teacher_weight_bytes(shape, replace(s, teacher_bits=s.reference_bits))
    return weights, "DPO reference copy " + detail.removeprefix("teacher ")


def teacher_forward_bytes(teacher: Shape, s: Settings) -> int:
    """What the teacher's no-grad forward holds at once beside the student's activations (it runs after the
    student's forward): one layer's working set (TEACHER_FORWARD_VALUES), and with a quantized teacher the
    dequantized weight buffers."""
    tokens = s.micro_batch * s.row_tokens
    per_hidden, per_intermediate = TEACHER_FORWARD_VALUES
    working = int((per_hidden * teacher.hidden + per_intermediate * teacher.intermediate) * s.act_bytes * tokens)
    if s.teacher_bits is not None:
        working += 2 * max(x * y for x, y in map(teacher.linear, LINEARS)) * s.act_bytes
    return working


def loss_bytes(shape: Shape, s: Settings) -> tuple[int, str]:
    tokens = s.micro_batch * s.row_tokens
    teacher = s.teacher
    if s.fused_loss:
        vocab = max(shape.vocab, teacher.vocab) if teacher else shape.vocab
        chunk_tokens = loss_chunk_tokens(vocab)
        copies = FUSED_CHUNK_COPIES
        if teacher:
            copies = DISTILL_CHUNK_COPIES + (1 if s.half and s.device == "cpu" else 0)
        chunk = min(chunk_tokens, tokens) * vocab * 4
        hidden = tokens * shape.hidden * 4 * 2  # targets' hidden states and their gradient
        if _training(shape, s).head:
            hidden += shape.embedding_params * 4  # the trained head's fp32 gradient, built during the forward
        detail = f"chunked: {min(chunk_tokens, tokens)} tokens x {vocab:,} vocab at a time"
        if not teacher:
            return copies * chunk + hidden, detail
        # The teacher's last hidden states (every position, then the target ones), and the larger of its forward
        # working set and the fused KL's chunk buffers (one after the other).
        teacher_hidden = 2 * tokens * teacher.hidden * s.act_bytes
        forward = teacher_forward_bytes(teacher, s)
        return (hidden + teacher_hidden + max(copies * chunk, forward),
                f"fused distillation (KL + cross-entropy) {detail}, {copies} buffers; teacher hidden states "
                f"{teacher_hidden / MiB:.1f} MiB; teacher forward {forward / MiB:.1f} MiB")
    b = DTYPE_BYTES[s.precision]
    logits = tokens * shape.vocab
    # the logits, their fp32 copy (a no-op in fp32), log-softmax kept for backward, and its gradient
    total = logits * b + logits * 4 * (2 if b == 4 else 3)
    if not teacher:
        return total, f"full logits: {tokens:,} tokens x {shape.vocab:,} vocab, fp32 log-softmax and gradient"
    # plain distillation: the teacher's logits (and their fp32 copy), both models' scaled log-softmax and the
    # KL's elementwise terms, at the teacher's vocabulary; after the teacher's forward has freed its working set
    teacher_logits = tokens * teacher.vocab
    total += teacher_logits * (b + 4 * (3 if b == 4 else 4))
    return (max(total, logits * b + teacher_forward_bytes(teacher, s)),
            f"full logits of student and teacher: {tokens:,} tokens x {shape.vocab:,} vocab, fp32 log-softmax, "
            "KL and gradient")


def heap_retention(s: Settings, layer_allocations: int, dequantized_layer: int = 0) -> int:
    """Bytes of freed step memory the C heap keeps (CPU), from one layer's forward allocations and, with a
    quantized base, one layer's weights as bitsandbytes dequantizes them for each matmul."""
    base_mib, slope = CPU_HEAP_RETENTION["checkpointing" if s.checkpointing else "none"]
    return max(0, int(base_mib * MiB + slope * layer_allocations + CPU_DEQUANTIZED_RETENTION * dequantized_layer))


# ------------------------------------------------------------------------------------- several processes
@dataclass(frozen=True)
class ShardUnit:
    """The parameters of one fully_shard unit that FSDP shards: stored (frozen ones in the run's dtype, trainable
    ones in fp32) and as an all-gather materializes them (gpupoor.train.distributed's MixedPrecisionPolicy gathers
    every parameter in the compute dtype: bf16/fp16 under half precision, LoRA's fp32 adapters included)."""

    frozen: int  # bytes stored
    trainable: int  # bytes stored (fp32)
    gathered: int  # bytes of the whole unit once gathered
    trainable_params: int


def _adapter_params(shape: Shape, s: Settings, training: Training, layer: LayerTraining) -> int:
    """Parameters of the adapters in one decoder layer, counted as resolve_training counts them."""
    if training.method == "ia3":  # one vector per module: over its input for feed-forward ones, else its output
        return sum(shape.linear(n)[0] if n in training.feedforward else shape.linear(n)[1] for n in layer.adapters)
    dora = training.method == "dora"  # plus a magnitude per output feature
    return sum(s.rank * sum(shape.linear(n)) + (shape.linear(n)[1] if dora else 0) for n in layer.adapters)


def shard_units(shape: Shape, s: Settings) -> tuple[list[ShardUnit], ShardUnit]:
    """The units training wraps with fully_shard: each decoder layer, then the root (the embeddings, the final
    norm and the head: what no layer holds). FSDP shards every trainable parameter; the frozen ones unless
    distributed.shard_frozen is false, and never bitsandbytes' packed linear weights (whole on every process)."""
    training = _training(shape, s)
    dtype, shard_frozen = DTYPE_BYTES[s.precision], s.distribution.shard_frozen
    full = training.method == "full"
    units = []
    for layer in training.layers:
        # `full` trains these tensors in place; the other methods train peft's copies beside the frozen originals
        own = sum(map(shape.linear_params, layer.weights)) + shape.hidden * len(layer.norms)
        frozen = shape.layer_linear_params + shape.layer_other_params - (own if full else 0)
        if s.bits is not None:
            frozen -= shape.layer_linear_params
        units.append(_unit(frozen if shard_frozen else 0, own + _adapter_params(shape, s, training, layer), dtype))
    root_trainable = training.params - sum(unit.trainable_params for unit in units)  # what no layer trains
    root_frozen = shape.embedding_params * (1 if shape.tied else 2) + shape.hidden - (root_trainable if full else 0)
    return units, _unit(root_frozen if shard_frozen else 0, root_trainable, dtype)


def _unit(frozen_params: int, trainable_params: int, dtype: int) -> ShardUnit:
    return ShardUnit(frozen_params * dtype, trainable_params * 4, (frozen_params + trainable_params) * dtype,
                     trainable_params)


def fsdp_shares(shape: Shape, s: Settings) -> dict[str, tuple[int, int, str]]:
    """What one of N FSDP processes holds of the sharded terms: {term: (bytes every process keeps whole, bytes
    of its 1/N shard, detail)}. Gradients are reduce-scattered after every micro-batch's backward, so only
    their shard outlives it (no unsharded gradients accumulate)."""
    n = s.distribution.processes
    units, root = shard_units(shape, s)
    sharded = sum(unit.frozen for unit in units) + root.frozen
    # FSDP copies what it shards, so no sharded weight stays memory-mapped from the file (the CPU's unread rows).
    unmapped = replace(s, max_gpu_weights=None, resident_embedding_rows=None if sharded else s.resident_embedding_rows,
                       weights_mapped=s.weights_mapped and not sharded)
    whole = weight_bytes(shape, unmapped)[0] - sharded
    kept = "bitsandbytes' quantized linears" if s.bits else "frozen weights (distributed.shard_frozen: false)"
    weights = [f"1/{n} of {format_bytes(sharded)} frozen weights in {s.precision}"] if sharded else []
    weights += [f"{format_bytes(whole)} of {kept}, whole on every process"] if whole else []
    params = trainable_params(shape, s)
    optimizer, what = optimizer_bytes(params, s)
    master = " (master weights)" if s.method == "full" else ""
    return {"base_weights": (whole, -(-sharded // n), " + ".join(weights) or "none frozen: every weight trains"),
            "trainable": (0, -(-params * 4 // n),
                          f"1/{n} of {params / 1e6:,.2f}M trainable parameters in fp32{master}"),
            "gradients": (0, -(-params * 4 // n), f"fp32, 1/{n} of them: reduce-scattered after each micro-batch"),
            "optimizer": (0, -(-optimizer // n), f"{s.optimizer}: {what}, 1/{n} of them")}


def all_gather_bytes(shape: Shape, s: Settings) -> tuple[int, str]:
    """The all-gather working set of one FSDP process: whole units' parameters alive beside the shards.

    The root unit is gathered through the forward and the backward: the embedding runs first and the head
    last, the head's gradient comes first in the backward and the embedding's last (FSDP2 also leaves the root
    gathered after the forward for that reason). With reshard_after_forward a layer is freed after its forward
    and gathered again for its backward while FSDP2 prefetches the layer before it: two layers at a time.
    Without it every layer stays gathered from its forward to its backward, so at the start of the backward
    all of them are: the whole unsharded size, on top of the shards. A layer's backward also holds its
    trainable parameters' gradients unsharded (in the gathered dtype) and the reduce-scatter's fp32 copy of
    them (reduce_dtype fp32)."""
    units, root = shard_units(shape, s)
    if s.distribution.reshard_after_forward:
        layers = 2 * max((unit.gathered for unit in units), default=0)
        how = "2 layers (the one in backward, the one prefetched)"
    else:
        layers = sum(unit.gathered for unit in units)
        how = f"all {len(units)} layers (reshard_after_forward: false)"
    grads = (DTYPE_BYTES[s.precision] + 4) * max((unit.trainable_params for unit in units), default=0)
    return (root.gathered + layers + grads,
            f"gathered whole: root (embeddings, head, norm) {format_bytes(root.gathered)} + {how} "
            f"{format_bytes(layers)}; a layer's unsharded gradients and their reduce-scatter copy "
            f"{format_bytes(grads)}")


def distribute(shape: Shape, s: Settings, terms: list[Term]) -> list[Term]:
    """One process's terms on its device when several train. ddp: the whole model as one process holds it, plus
    DDP's gradient buckets. fsdp: a 1/N shard of the weights, gradients and optimizer state (with cpu_offload
    only what stays whole: the shards are in CPU memory, `offloaded_terms`), plus the all-gather working set.
    Activations and the loss come from each process's own micro-batch: unchanged."""
    strategy, offload = s.distribution.strategy, s.distribution.cpu_offload
    shares = fsdp_shares(shape, s) if strategy == "fsdp" else {}
    out = []
    for term in terms:
        if term.key in shares:
            whole, shard, detail = shares[term.key]
            term = Term(term.key, whole if offload else whole + shard,
                        detail + ("; the shard is in CPU memory (cpu_offload)" if offload and shard else ""))
        out.append(term)
        if term.key == "gradients" and strategy == "ddp":
            params = trainable_params(shape, s)  # trainable parameters are fp32: so are DDP's buckets
            out.append(Term("ddp_buckets", params * 4, "DDP's gradient buckets: each fp32 gradient copied once "
                            "more for the all-reduce"))
        if term.key == "optimizer" and strategy == "fsdp":
            out.append(Term("all_gather", *all_gather_bytes(shape, s)))
    return out


def offloaded_terms(shape: Shape, s: Settings) -> list[Term]:
    """What distributed.cpu_offload keeps in CPU memory instead of the GPU: each sharded term's 1/N."""
    if s.distribution.strategy != "fsdp" or not s.distribution.cpu_offload:
        return []
    return [Term(key, shard, detail) for key, (_, shard, detail) in fsdp_shares(shape, s).items() if shard]


def distribution_notes(s: Settings) -> list[str]:
    dist = s.distribution
    if dist.strategy == "single":
        return []
    notes = []
    if dist.strategy == "fsdp":
        notes.append(f"fully_shard on each decoder layer, then the root (kept gathered); every parameter gathered "
                     f"in {s.precision}, gradients reduce-scattered in fp32 (MixedPrecisionPolicy)")
        if s.teacher is not None:
            notes.append("the distillation teacher whole on every process (not sharded)")
        if s.reference == "copy":
            notes.append("DPO's reference copy whole on every process (not sharded)")
    if s.device == "cuda":
        notes.append("NCCL's communication buffers (allocated outside torch's allocator) on top: not counted")
    return notes


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
    master = " (master weights)" if s.method == "full" else ""
    terms = [Term("base_weights", weights, weights_detail),
             Term("trainable", params * 4, f"{params / 1e6:,.2f}M trainable parameters in fp32{master}"),
             Term("gradients", params * 4, "fp32, one per trainable parameter"),
             Term("optimizer", optimizer, f"{s.optimizer}: {optimizer_detail}"),
             Term("activations", live, act_detail),
             Term("loss", loss, loss_detail)]
    if s.teacher is not None:
        terms.insert(1, Term("teacher_weights", *teacher_weight_bytes(s.teacher, s)))
    if s.reference == "copy":
        terms.insert(1, Term("reference_weights", *reference_weight_bytes(shape, s)))
    if s.device == "cpu":
        baseline = CPU_PROCESS_BASELINE + (CPU_BITSANDBYTES_BASELINE if uses_bitsandbytes else 0)
        kept = heap_retention(s, churn, shape.layer_linear_params * s.act_bytes if s.bits else 0)
        terms.append(Term("overhead", baseline + kept,
                          f"process baseline {baseline / MiB:.0f} MiB (Python, torch, libraries); freed "
                          f"step memory the C heap keeps {kept / MiB:.0f} MiB"))
    else:
        slack = int(CUDA_ALLOCATOR_SLACK * (live + loss))
        terms.append(Term("overhead", CUDA_CONTEXT + slack, f"CUDA context ~{CUDA_CONTEXT / MiB:.0f} MiB; "
                          f"caching-allocator slack {slack / MiB:.0f} MiB"))
    assumptions = [f"every micro-batch row is {s.row_tokens} tokens (data.max_length): the longest batch"]
    if s.reference != "none":
        assumptions.append(f"DPO's reference ({s.reference}) runs its forward first, under no_grad: it keeps only "
                           "each sequence's log-probability, so it adds nothing at the peak")
    if not s.fused_loss:
        assumptions.append(f"the plain loss: {s.loss_reason}")
    return distribute(shape, s, terms), assumptions + distribution_notes(s)


# ------------------------------------------------------------------------------------------ whole plan
CANDIDATES = (  # cheapest first: what a user gives up for the saving
    ("memory.fused_cross_entropy", "none: the same loss, computed in chunks"),
    ("training.optimizer", "8-bit optimizer moments: negligible effect on fine-tuning quality"),
    ("memory.gradient_checkpointing", "~25% slower steps: each layer's forward runs again in backward "
     "(offload: also copies layer inputs to and from the CPU)"),
    ("training.micro_batch_size", "about the same examples per optimizer step (accumulation raised); smaller "
     "kernels, a little slower"),
    ("distill.bits", "a 4-bit NF4 teacher: slower teacher forward, its distributions shift a little"),
    ("quantization.bits", "QLoRA: 4-bit NF4 base weights, slower matmuls, a small quality loss"),
    ("data.max_length", "examples longer than this are truncated"),
)


def candidate_change(recipe: Recipe, key: str, device: str) -> dict | None:
    """The next step on one knob from the recipe's current value, or None when there is none."""
    if key == "memory.fused_cross_entropy":
        return None if recipe.memory.fused_cross_entropy else {key: True}
    if key == "training.optimizer":  # (fsdp cannot step an 8-bit optimizer: the recipe refuses the pair)
        fp32_state = recipe.training.optimizer in ("adamw", "paged_adamw_32bit")
        return {key: "adamw_8bit"} if fp32_state and recipe.distributed.strategy != "fsdp" else None
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
    if key == "distill.bits":
        return {key: 4} if recipe.distill is not None and recipe.distill.bits != 4 else None
    if key == "quantization.bits":  # full fine-tuning trains the base weights: they cannot be quantized
        return {key: 4} if recipe.quantization.bits is None and recipe.peft.method != "full" else None
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


def uses_bitsandbytes(recipe: Recipe) -> bool:
    """Whether the run imports bitsandbytes: its optimizer, a quantized base, or a quantized teacher."""
    teacher_bits = recipe.distill.bits if recipe.distill is not None else None
    return needs_bitsandbytes(recipe.training.optimizer, recipe.quantization.bits or teacher_bits
                              or recipe.preference.reference_bits)


def _peak(shape: Shape, recipe: Recipe, device: str, gpu: GpuFacts, teacher: Shape | None = None,
          processes: int = 1) -> int:
    settings = resolve_settings(recipe, device, shape, gpu, teacher, processes)
    terms, _ = plan_terms(shape, settings, uses_bitsandbytes(recipe))
    return sum(t.bytes for t in terms)


def suggest(shape: Shape, recipe: Recipe, device: str, memory: int, gpu: GpuFacts = GpuFacts(),
            teacher: Shape | None = None, processes: int = 1) -> tuple[list[Suggestion], dict | None]:
    """Single changes that each make the recipe fit (cheapest first), or, when none does alone, every
    change that saves something; and the cheapest combination that fits (what --fit writes), if any.
    `teacher`: the distillation teacher's shape, when the recipe has one; `memory`: one process's share."""

    def peak_of(candidate: Recipe) -> int:
        return _peak(shape, candidate, device, gpu, teacher, processes)

    base = peak_of(recipe)
    singles = []
    for key, cost in CANDIDATES:
        changes = candidate_change(recipe, key, device)
        if changes is None:
            continue
        peak = peak_of(apply_changes(recipe, changes))
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
            trial_peak = peak_of(trial)
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
        if peak_of(trial) <= memory:
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


def load_teacher_shape(loaded: LoadedRecipe) -> tuple[Shape | None, str | None]:
    """The distillation teacher's dimensions, found like the student's (a local path is relative to the
    recipe); (None, None) without distillation."""
    distill = loaded.recipe.distill
    if distill is None:
        return None, None
    config, source = find_config(distill.teacher, loaded.base_dir, distill.revision, key="distill.teacher")
    return shape_from_config(config, source), source


def load_shape(loaded: LoadedRecipe) -> tuple[Shape, str]:
    model = loaded.recipe.model
    config, source = find_config(model.name_or_path, loaded.base_dir, model.revision)
    return shape_from_config(config, source, tokenizer_rows(model.name_or_path, loaded.base_dir)), source


def strategy_changes(recipe: Recipe, strategy: str, processes: int) -> dict:
    """The recipe changes that train it with `strategy` ({} when it already does): fsdp also needs an optimizer
    that steps sharded parameters and no memory.max_gpu_memory (the recipe refuses either beside it)."""
    changes = {} if _strategy(recipe, processes) == strategy else {"distributed.strategy": strategy}
    if strategy == "fsdp" and recipe.training.optimizer not in FSDP_OPTIMIZERS:
        changes["training.optimizer"] = "adamw"  # sharding splits its fp32 moments N ways
    if strategy == "fsdp" and recipe.memory.max_gpu_memory is not None:
        changes["memory.max_gpu_memory"] = None
    return changes


def compare_strategies(shape: Shape, recipe: Recipe, device: str, gpu: GpuFacts, teacher: Shape | None,
                       processes: int, budget: int | None) -> dict[str, StrategyFit]:
    """One process's peak under ddp and under fsdp, and whether it fits `budget` (one process's memory)."""
    fits = {}
    for strategy in ("ddp", "fsdp"):
        changes = strategy_changes(recipe, strategy, processes)
        peak = _peak(shape, apply_changes(recipe, changes), device, gpu, teacher, processes)
        fits[strategy] = StrategyFit(peak, None if budget is None else peak <= budget, changes)
    return fits


def make_plan(loaded: LoadedRecipe, device: str | None = None, memory: int | None = None, processes: int = 1,
              nodes: int = 1) -> Plan:
    """The plan of one process out of `processes` (on `nodes`), each `auto` decided as training decides it."""
    recipe = loaded.recipe
    device = device or default_device(recipe)
    gpu = gpu_facts(device)
    shape, source = load_shape(loaded)
    teacher, teacher_source = load_teacher_shape(loaded)
    settings = resolve_settings(recipe, device, shape, gpu, teacher, processes)
    terms, assumptions = plan_terms(shape, settings, uses_bitsandbytes(recipe))
    if memory is not None:
        memory_source = "--memory"
    else:
        memory, memory_source = device_memory(device)
    assumptions.insert(0, f"model config: {source}")
    if teacher_source:
        assumptions.insert(1, f"teacher config: {teacher_source}")
    if recipe.precision == "auto" and device == "cuda" and gpu.major is None:
        assumptions.append("precision auto taken as bf16 (a GPU without bf16 uses fp16: the same bytes)")
    # Processes on one machine share its RAM; on GPUs each has its own device.
    share = -(-processes // nodes) if device == "cpu" else 1
    if share > 1:
        assumptions.append(f"the {share} processes on a node share its RAM: they must fit together")
    plan = Plan(device, settings.precision, terms, memory, memory_source, assumptions, method=recipe.peft.method,
                trainable_params=trainable_params(shape, settings), method_detail=describe_method(shape, settings),
                processes=processes, nodes=nodes, strategy=settings.distribution.strategy, share=share,
                offloaded=offloaded_terms(shape, settings))
    if processes > 1:
        budget = None if memory is None else memory // share
        plan.strategies = compare_strategies(shape, recipe, device, gpu, teacher, processes, budget)
    if recipe.distill is not None:
        distill = recipe.distill
        plan.method_detail += (f"; distilled from {distill.teacher} (temperature {distill.temperature:g}, KL weight "
                               f"{distill.weight:g}" + (f", {distill.bits}-bit" if distill.bits else "") + ")")
    if recipe.training.objective != "sft":
        plan.method_detail += "; " + describe_preference(recipe, settings)
    if plan.fits is False:
        plan.suggestions, plan.fit_changes = suggest(shape, recipe, device, memory // share, gpu, teacher, processes)
        if plan.fit_changes:
            plan.fit_peak = _peak(shape, apply_changes(recipe, plan.fit_changes), device, gpu, teacher, processes)
    return plan


def describe_preference(recipe: Recipe, s: Settings) -> str:
    """The plan's line for a preference objective: pairs, and DPO's reference."""
    objective = recipe.training.objective
    pairs = "pairs of sequences of up to data.max_length each"
    if objective == "orpo":
        return f"ORPO on {pairs} (no reference model)"
    where = {"adapter_off": "the model with its adapter switched off", "copy": "a frozen copy of the base"}
    return f"DPO on {pairs}; reference: {where[s.reference]}"


def render(plan: Plan, recipe_name: str) -> str:
    several = "" if plan.processes == 1 else (
        f", one of {plan.processes} processes on {plan.nodes} node{'s' * (plan.nodes > 1)} ({plan.strategy})")
    lines = [f"memory plan for {recipe_name} on {plan.device} ({plan.precision}){several}, at the peak of a "
             "training step:"]
    if plan.method_detail:
        lines.append(f"  {plan.method_detail}")
    width = max(len(t.key) for t in plan.terms)
    for term in plan.terms:
        lines.append(f"  {term.key:<{width}}  {format_bytes(term.bytes):>10}  {term.detail}")
    lines.append(f"  {'peak':<{width}}  {format_bytes(plan.peak):>10}" + (" per process" if several else ""))
    if plan.offloaded:
        lines.append(f"  in CPU memory (distributed.cpu_offload), not in the peak: "
                     f"{format_bytes(sum(t.bytes for t in plan.offloaded))} per process ("
                     + ", ".join(f"{t.key} {format_bytes(t.bytes)}" for t in plan.offloaded) + ")")
    if plan.memory is None:
        lines.append(f"fits: unknown ({plan.memory_source})")
    else:
        verdict = "yes" if plan.fits else "NO"
        held = plan.peak * plan.share
        together = f"{plan.share} x {format_bytes(plan.peak)}" if plan.share > 1 else format_bytes(plan.peak)
        lines.append(f"fits: {verdict}: {together} of {format_bytes(plan.memory)} "
                     f"({plan.memory_source}), {held / plan.memory:.0%}")
        lines += render_strategies(plan)
    for note in plan.assumptions:
        lines.append(f"  assumes {note}")
    advice = render_suggestions(plan)
    return "\n".join(lines + ([advice] if advice else []))


def _changes_text(changes: dict) -> str:
    return ", ".join(f"{key}: {value if isinstance(value, str) else json.dumps(value)}"
                     for key, value in changes.items())


def render_strategies(plan: Plan) -> list[str]:
    """Several processes and a known memory: each strategy's per-process peak, and which one lets it fit."""
    if not plan.strategies:
        return []
    lines = [f"per process with each distributed.strategy ({plan.processes} processes):"]
    for name, fit in plan.strategies.items():
        also = f"  (with {_changes_text(fit.changes)})" if fit.changes else "  (this recipe)"
        lines.append(f"  {name:<5} {format_bytes(fit.peak):>10}  {'fits' if fit.fits else 'does not fit'}{also}")
    ddp, fsdp = plan.strategies["ddp"], plan.strategies["fsdp"]

    def named(name: str, fit: StrategyFit) -> str:
        return _changes_text({"distributed.strategy": name, **fit.changes})

    if ddp.fits and fsdp.fits:  # ddp moves only gradients: the faster while the whole model fits each process
        lines.append(f"fits with {named('ddp', ddp)} ({format_bytes(ddp.peak)} per process; the faster) and with "
                     f"fsdp ({format_bytes(fsdp.peak)})")
    elif ddp.fits or fsdp.fits:
        (good, fit), (bad, miss) = sorted(plan.strategies.items(), key=lambda item: not item[1].fits)
        lines.append(f"fits with {named(good, fit)} ({format_bytes(fit.peak)} per process), not with {bad} "
                     f"({format_bytes(miss.peak)})")
    else:
        lines.append(f"fits with neither ddp ({format_bytes(ddp.peak)} per process) nor fsdp "
                     f"({format_bytes(fsdp.peak)})")
    return lines


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


def write_fit(loaded: LoadedRecipe, changes: dict, plan: Plan | None = None) -> Path:
    """Write RECIPE.fit.yaml beside the recipe: `extends: RECIPE` and only the keys the plan changed (and those
    `--set` gave it), so the user's file stays the source of truth; a comment says what was predicted (`plan`)."""
    import yaml

    from gpupoor.storage.files import write_text_atomic
    from gpupoor.recipe.loading import EXTENDS

    if loaded.source is None:
        raise UserError("plan --fit writes a recipe that extends the recipe file: it needs one")
    source = loaded.source
    target = source.with_name(source.stem + ".fit.yaml")
    fitted = apply_changes(loaded.recipe, changes).model_dump(mode="json")
    keys = list(dict.fromkeys([*loaded.overridden, *changes]))
    body = {EXTENDS: source.name}  # beside the recipe: its relative paths resolve as they did
    for key in keys:
        _set_dotted(body, key, _get_dotted(fitted, key))
    try:
        write_text_atomic(target, _fit_header(source.name, changes, loaded.overridden, plan)
                          + yaml.safe_dump(body, sort_keys=False))
    except OSError as exc:
        raise UserError(f"cannot write {target}: {exc.strerror or exc}",
                        hint="copy the recipe to a writable folder and run plan --fit there") from None
    return target


def _fit_header(name: str, changes: dict, overridden: tuple[str, ...], plan: Plan | None) -> str:
    lines = ["Written by gpupoor plan --fit: only the keys the plan changed. " + name + " stays the source of",
             "truth: edit it, then run plan --fit again."]
    if plan is not None and plan.memory is not None:
        per_process = f" per process ({plan.share} share it)" if plan.share > 1 else ""
        lines.append(f"Predicted on {plan.device} ({plan.precision}): {name} peaks at {format_bytes(plan.peak)}, over "
                     f"the {format_bytes(plan.memory // plan.share)}{per_process} of memory ({plan.memory_source})"
                     + (f";\nwith the changes below, {format_bytes(plan.fit_peak)}." if plan.fit_peak else "."))
    lines.append("Changed to fit: " + ", ".join(changes))
    planned_with = [key for key in overridden if key not in changes]
    if planned_with:
        lines.append(f"From --set (the plan was made with them): {', '.join(planned_with)}")
    return "".join(f"# {line}\n" for text in lines for line in text.split("\n"))


def _get_dotted(tree: dict, key: str):
    for part in key.split("."):
        tree = tree[part]
    return tree


def _set_dotted(tree: dict, key: str, value) -> None:
    *parents, leaf = key.split(".")
    for part in parents:
        tree = tree.setdefault(part, {})
    tree[leaf] = value


def _launched() -> tuple[None, None, int, int]:
    """make_plan's (device, memory, processes, nodes) for a run this launcher started: one of its processes."""
    processes, nodes = launch_layout(os.environ)
    return None, None, processes, nodes


def preflight_plan(loaded: LoadedRecipe, force: bool, warn) -> Plan | None:
    """The plan before anything is loaded. On CUDA a recipe predicted not to fit stops here (exit 2) unless
    `force`; elsewhere a predicted miss is a warning. A model the plan cannot describe is a warning too."""
    try:
        plan = make_plan(loaded, *_launched())
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
