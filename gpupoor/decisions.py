"""What training builds, decided once: the one place that answers each question both training and `plan` ask.

Each decision is a function of plain facts (what the recipe requests, what the machine has, what the model
is) that returns what to use and why. Training gathers the facts from torch and the loaded model
(`gpupoor.hardware`, `gpupoor.objectives`, `gpupoor.train.optim`, `gpupoor.model`); `gpupoor plan` gathers them from
nvidia-smi, the model's config.json and the recipe, without importing torch. Both call these functions, so a
memory plan cannot describe a stack that training does not build.

- device, precision, attention backend, sampler: `choose_device`, `choose_precision`, `choose_attention`,
  `choose_sampler`, each returning a `Choice(value, reason)` and raising `UserError` for a request the
  machine cannot serve. A GPU that `plan` cannot see (`gpu_major=None` on cuda: planning for another machine)
  leaves explicit requests standing and takes `auto` as the choice with the larger memory bound.
- the loss path: `choose_fused_loss` (and `logit_postprocessing`, the config keys that rule it out); the
  fused loss's chunk size: `loss_chunk_tokens`.
- optimizer families: `BITSANDBYTES_OPTIMIZERS`, `needs_bitsandbytes`.
- how several processes share the work: `launch_layout` (from the launcher's environment), `choose_strategy`.
- DPO's reference model: `choose_reference`.

A new training method, optimizer or distributed strategy that changes what is built (a precision, a loss path,
a library it needs, an attention backend, a sampler) adds its rule here, as a function of facts, and both its
builder and `plan` call it. Imports nothing of gpupoor's but its errors and the optimizer table, and no torch.
"""

from __future__ import annotations

import math

from dataclasses import dataclass
from typing import Callable, Mapping

from gpupoor.errors import UserError
from gpupoor.method_table import METHODS
from gpupoor.objective_table import OBJECTIVES
from gpupoor.optimizers import OPTIMIZERS


@dataclass
class Choice:
    value: str
    reason: str
    warning: str = ""  # said once at start: a choice that stands but costs the user (bf16 emulated on a CPU)


@dataclass(frozen=True)
class CpuBf16:
    """What a CPU does with bf16 matrices: the matrix units its flags name ("" for none: gpupoor.cpu) and the
    measured ratio of bf16 to fp32 matmul throughput at the model's shapes (None: not measured, as in `plan`,
    which runs no torch; gpupoor.hardware.bf16_matmul_speedup measures it)."""

    units: str = ""
    speedup: float | None = None


# bf16 must multiply at least this much faster than fp32 for `auto` to train in it on a CPU. The matmuls are
# most of a CPU step but not all of it (the attention, norms, casts and the optimizer are not sped up, and bf16
# adds casts), and bf16 costs precision: a unit that gains less than this is not worth it. Units measure far
# above it (AMX 7-8x); a CPU without units far below (emulated: 0.01-0.1x).
MIN_BF16_SPEEDUP = 1.5


# ------------------------------------------------------------------------------------------------ hardware
def choose_cpu_threads(explicit: int | None, usable: int, processes: int, busy: float | None) -> Choice:
    """torch's threads on the CPU. A thread whose core another process runs on stalls every parallel op of the
    step (torch's threads wait for the slowest), so a shared machine trains faster on the cores that are free:
    this process's share of the usable cores, less the cores found busy at start (`busy`, None: unknown)."""
    if explicit:
        return Choice(str(explicit), "training.cpu_threads")
    share = max(1, usable // max(1, processes))
    if busy is None or busy < 0.5:
        return Choice(str(share), f"{usable} cores free" + (f", {processes} processes" if processes > 1 else ""))
    free = max(1, min(share, round(usable - busy) // max(1, processes)))
    if free == share:
        return Choice(str(share), f"{usable} cores, {busy:.1f} busy at start")
    return Choice(str(free), f"{busy:.1f} of {usable} cores busy at start; training.cpu_threads sets it")



def choose_device(requested: str, cuda_available: bool | None, gpu_name: str | None = None,
                  torch_build: str = "") -> Choice:
    """`cuda_available` None: not known (plan for another machine): an explicit cuda stands. `torch_build`
    (e.g. 'torch 2.13, built for CUDA 12.4') goes into the error when cuda is asked for and absent."""
    if requested == "cpu":
        return Choice("cpu", "training.device: cpu")
    if cuda_available:
        return Choice("cuda", f"{gpu_name or 'a CUDA GPU'} found")
    if requested == "cuda":
        if cuda_available is None:
            return Choice("cuda", "training.device: cuda")
        build = f" ({torch_build})" if torch_build else ""
        raise UserError(f"training.device = 'cuda' but torch sees no CUDA GPU{build}",
                        hint="install a CUDA build of torch, or set training.device: auto to use the CPU")
    return Choice("cpu", "no CUDA GPU found")


def choose_precision(requested: str, device: str, gpu_major: int | None, cpu: CpuBf16 = CpuBf16()) -> Choice:
    """`gpu_major`: the CUDA compute capability's major version (None: a GPU not visible here). `cpu`: what the CPU
    does with bf16 matrices (a CPU run: `auto` trains in bf16 where the units are there and, when measured,
    multiply at least MIN_BF16_SPEEDUP x faster than fp32)."""
    if device == "cpu":
        return _cpu_precision(requested, cpu)
    if gpu_major is None:
        if requested == "auto":
            return Choice("bf16", "GPU not visible here: bf16 assumed (a GPU without bf16 uses fp16: the same bytes)")
        return Choice(requested, f"precision: {requested}")
    # torch's is_bf16_supported() answers yes on a T4 (sm75) through emulation, which is slow: ask for real support.
    native_bf16 = gpu_major >= 8
    if requested == "auto":
        if native_bf16:
            return Choice("bf16", f"GPU compute capability {gpu_major}.x supports bf16")
        return Choice("fp16", f"GPU compute capability {gpu_major}.x has no native bf16: fp16 + GradScaler")
    if requested == "bf16" and not native_bf16:
        raise UserError(f"precision = 'bf16' but this GPU (compute capability {gpu_major}.x) has no native bf16",
                        hint="use precision: fp16 or auto")
    return Choice(requested, f"precision: {requested}")


def _cpu_precision(requested: str, cpu: CpuBf16) -> Choice:
    if requested == "fp16":
        raise UserError("precision = 'fp16' needs a CUDA GPU; this run is on the CPU",
                        hint="use precision: auto (bf16 where the CPU has bf16 matrix units, else fp32), bf16 or fp32")
    measured = f": bf16 matmuls {cpu.speedup:.1f}x fp32" if cpu.speedup is not None else ""
    if requested == "fp32":
        return Choice("fp32", "precision: fp32")
    if requested == "bf16":
        if cpu.units or (cpu.speedup is not None and cpu.speedup >= 1):
            return Choice("bf16", "precision: bf16" + (f"; CPU has {cpu.units}{measured}" if cpu.units else ""))
        cost = (f"bf16 matmuls measured {1 / cpu.speedup:.1f}x slower than fp32 here" if cpu.speedup is not None
                else "bf16 matmuls are emulated there (5-90x slower than fp32 where measured)")
        return Choice("bf16", "precision: bf16 on a CPU without bf16 matrix units",
                      warning=f"precision: bf16 on a CPU without bf16 matrix units: {cost}; precision: fp32 (or "
                              "auto, for a new run) trains in fp32")
    if not cpu.units:
        return Choice("fp32", "CPU has no bf16 matrix units: fp32")
    if cpu.speedup is None:
        return Choice("bf16", f"CPU has {cpu.units}")
    if cpu.speedup < MIN_BF16_SPEEDUP:
        return Choice("fp32", f"CPU has {cpu.units}, but bf16 matmuls measured only {cpu.speedup:.1f}x fp32: fp32")
    return Choice("bf16", f"CPU has {cpu.units}{measured}")


def choose_resumed_precision(requested: str, device: str, trained_in: str | None,
                             trained_on: str | None) -> Choice:
    """What a resumed run asks for: on a CPU, `auto` keeps the precision its checkpoint was written in on a CPU
    (`trained_on`: the checkpoint's device; auto decided it at the run's start, on that machine's CPU), so that
    a run preempted on a CPU with bf16 units and resumed on one without (or the other way round) goes on as it
    started instead of changing its trajectory. A checkpoint from a GPU moved to a CPU, and any run on a GPU,
    decides again (an A100's bf16 run on a T4 must go on in fp16)."""
    if requested == "auto" and device == "cpu" and trained_on == "cpu" and trained_in in ("fp32", "bf16"):
        return Choice(trained_in, f"precision auto chose {trained_in} at the run's start: a resume keeps it; "
                                  "--set precision=... --force changes it")
    return Choice(requested, "")


def choose_inference_precision(device: str, trained: str | None, gpu_major: int | None,
                               cpu: CpuBf16 = CpuBf16()) -> Choice:
    """What `generate`, `chat` and export's perplexity compute in: on a CPU what `auto` would train in there (bf16
    where its matrix units multiply faster, fp32 otherwise, whatever the run trained in: emulated bf16 is far
    slower); on a GPU the precision the run trained in where the GPU has it (fp16 for a bf16 run on a GPU
    without native bf16), else what `auto` would train in."""
    if device == "cpu":
        return _cpu_precision("auto", cpu)
    if trained == "bf16" and gpu_major is not None and gpu_major < 8:
        return Choice("fp16", "the run trained in bf16; this GPU has no native bf16")
    if trained in ("fp32", "fp16", "bf16"):
        return Choice(trained, f"the run trained in {trained}")
    return choose_precision("auto", device, gpu_major)


def choose_attention(requested: str, device: str, flash_installed: bool, gpu_major: int | None) -> Choice:
    unseen = device == "cuda" and gpu_major is None  # plan for a GPU elsewhere: flash's fit is unknown
    flash_fits = device == "cuda" and flash_installed and not unseen and gpu_major >= 8
    if requested == "flash_attention_2":
        if not (flash_fits or unseen):
            raise UserError("model.attention = 'flash_attention_2' needs flash-attn installed and an Ampere or "
                            "newer GPU", hint="pip install -e .[flash] on a CUDA machine, or use attention: auto")
        return Choice(requested, "model.attention: flash_attention_2")
    if requested != "auto":
        return Choice(requested, f"model.attention: {requested}")
    if flash_fits:
        return Choice("flash_attention_2", "flash-attn installed and GPU supports it")
    # sdpa is also the bound when the GPU is unseen: flash-attention 2 needs no mask, so it never takes more.
    why = ("flash-attn not installed" if not flash_installed else "CPU run" if device == "cpu"
           else "GPU not visible here" if unseen else "GPU older than Ampere")
    return Choice("sdpa", f"{why}: torch SDPA")


def choose_sampler(requested: str, attention: str, trust_remote_code: bool, objective: str = "sft") -> Choice:
    """Packing is exact when the model's attention follows transformers' packed-sequence masks (restarted
    position_ids, no attention mask, no KV cache): its own model code with sdpa, eager or flash-attention 2.
    GRPO samples answers to each prompt of a micro-batch: rows one prompt each, never packed."""
    if requested != "auto":
        return Choice(requested, f"data.sampler: {requested}")
    if OBJECTIVES[objective].samples:
        return Choice("length_grouped", f"{OBJECTIVES[objective].title} generates from one prompt per row")
    if trust_remote_code:
        return Choice("length_grouped", "remote model code may not isolate packed examples")
    if attention in ("sdpa", "eager", "flash_attention_2"):
        return Choice("packed", f"{attention} isolates packed examples")
    return Choice("length_grouped", f"{attention} attention may not isolate packed examples")


# ------------------------------------------------------------------------------------------- distribution
def launch_layout(environ: Mapping[str, str]) -> tuple[int, int]:
    """(processes, nodes) as the launcher (torchrun, or accelerate launch, which runs torchrun) exported them."""
    processes = int(environ.get("WORLD_SIZE", "1"))
    per_node = int(environ.get("LOCAL_WORLD_SIZE", processes))
    return processes, max(1, -(-processes // max(per_node, 1)))


def choose_strategy(requested: str, processes: int) -> Choice:
    """How N processes share the work: `single` (one process), `ddp` (replicas, gradients averaged) or `fsdp`
    (FSDP2: weights, gradients and optimizer state sharded)."""
    if processes <= 1:
        return Choice("single", "one process: nothing to shard" if requested == "fsdp" else "one process")
    if requested == "fsdp":
        return Choice("fsdp", "distributed.strategy: fsdp")
    return Choice("ddp", "distributed.strategy: ddp" if requested == "ddp" else "auto: ddp")


# ---------------------------------------------------------------------------------------------------- loss
# Config keys by which a model post-processes its logits (Gemma 2 soft-capping, Cohere's scale...): the loss
# must see the post-processed logits, which only the model's own forward computes.
LOGIT_POSTPROCESSING = ("final_logit_softcapping", "logit_scale", "output_multiplier_scale")

# Logit elements computed at once by the fused loss: 2^22 fp32 values = 16 MiB, e.g. 131 tokens at a 32k
# vocabulary (at least MIN_CHUNK_TOKENS at any vocabulary). Measured on a 2-core CPU (1800 tokens, h256,
# vocab 32k, forward+backward): 2^21 0.58 s, 2^22 0.49 s, 2^23 0.50 s, 2^24 0.57 s: smaller is not slower.
CHUNK_ELEMENTS = 2**22
MIN_CHUNK_TOKENS = 64


def logit_postprocessing(get: Callable[[str], object]) -> str | None:
    """The first config key that post-processes the logits, or None; `get(key)` reads the model's config
    (an attribute of a transformers config, or a key of config.json)."""
    return next((key for key in LOGIT_POSTPROCESSING if get(key) not in (None, 1, 1.0)), None)


def choose_fused_loss(enabled: bool, postprocessing: str | None, head_adapted: bool,
                      has_decoder: bool = True) -> tuple[bool, str]:
    """Whether the output head is fused with the loss, and why (not). `enabled`: memory.fused_cross_entropy;
    `postprocessing`: what `logit_postprocessing` found; `head_adapted`: the head is not a plain bias-free
    linear layer (LoRA on lm_head, or a bias); `has_decoder`: the model exposes its decoder separately."""
    if not enabled:
        return False, "memory.fused_cross_entropy: false"
    if postprocessing is not None:
        return False, f"the model post-processes its logits ({postprocessing})"
    if head_adapted:
        return False, "the output head is adapted or has a bias"
    if not has_decoder:
        return False, "the model has no separate decoder"
    return True, "output head fused with the loss"


# Families the fused decoder paths (gpupoor.model.fast_paths) are tested on: tests/unit/model/test_fused_layers.py.
FUSED_FAMILIES = ("llama", "qwen2", "mistral", "gemma")


@dataclass(frozen=True)
class FusedPaths:
    """Which fused decoder paths a run takes (model.fused_layers), as training installs them and the plan counts
    them: the gated MLP as one function (plain LoRA on a dense base, or none), attention per packed example
    (sdpa)."""

    mlp: bool
    attention: bool
    reason: str


def choose_fused_paths(enabled: bool, family: str | None, method: str, dropout: float, bits: int | None,
                       precision: str, attention: str, device: str) -> FusedPaths:
    """The fused LoRA linears and gated MLP compute in the frozen base's dtype: fp32 or bf16 (the fp32 adapters
    cast to bf16 for the matmuls, their gradients back to fp32). In bf16 on an H100 they made a 1.5B LoRA step 16%
    faster and its peak 36% lower than peft's modules (docs/benchmarks.md, "On a GPU"); fp16 keeps peft's."""
    if not enabled:
        return FusedPaths(False, False, "model.fused_layers: false")
    if family not in FUSED_FAMILIES:
        return FusedPaths(False, False, f"{family} is not one of {', '.join(FUSED_FAMILIES)}, where they are "
                          "tested")
    dtype_fits = precision in ("fp32", "bf16")
    fused = METHODS[method].fused
    why_not_mlp = ("" if fused and not dropout and bits is None and dtype_fits else
                   f"peft.method {method}" if not fused else "peft.dropout > 0" if dropout else
                   "a quantized base" if bits is not None else
                   f"{precision} weights under fp32 adapters")
    # Attention per packed example loops over the examples in Python: on a CPU that skips the masked-out
    # len^2 work, on a GPU the loop's small kernels and host syncs cost 4x the step (bench/gpu.py, H100).
    per_example = attention == "sdpa" and device == "cpu"
    reasons = [f"LoRA linears and MLP as loaded ({why_not_mlp})" if why_not_mlp else "",
               "" if per_example else f"attention {attention} as loaded" + (
                   " (one masked call is faster on a GPU than a call per packed example)" if attention == "sdpa" else "")]
    return FusedPaths(not why_not_mlp, per_example, "; ".join(filter(None, reasons)))


def count_steps(max_steps: int | None, epochs: float | None, accumulation: int, batches_per_epoch: int,
                processes: int = 1) -> int:
    """Optimizer steps in a run: training.max_steps, else its epochs (1 when unset) of micro-batches, each step
    taking `accumulation` of them on each of `processes`."""
    if max_steps is not None:
        return max_steps
    per_step = accumulation * processes
    return max(1, math.ceil((epochs if epochs is not None else 1.0) * batches_per_epoch / per_step))


def loss_chunk_tokens(vocab: int) -> int:
    """Target tokens whose logits the fused loss computes at once."""
    return max(MIN_CHUNK_TOKENS, CHUNK_ELEMENTS // vocab)


# -------------------------------------------------------------------------------------- preference tuning
def choose_reference(objective: str, requested: str, method: str) -> Choice:
    """Where DPO's reference log-probabilities come from: `adapter_off` (the trained model with its adapter
    switched off), `copy` (a frozen copy of the base) or `none` (sft and ORPO need none). `requested`:
    preference.reference; `method`: peft.method."""
    kind = OBJECTIVES[objective]
    if not kind.reference:
        return Choice("none", f"{kind.title} needs no reference model" if kind.pairs else "no preference objective")
    if requested == "adapter_off" and not METHODS[method].adapter:
        raise UserError("preference.reference adapter_off needs an adapter to switch off; peft.method full has none",
                        hint="set preference.reference: copy (or auto)")
    if requested != "auto":
        return Choice(requested, f"preference.reference: {requested}")
    if not METHODS[method].adapter:
        return Choice("copy", "peft.method full: no adapter to switch off, so a frozen copy of the base")
    return Choice("adapter_off", "the base is the model with its adapter switched off: no second copy")


# ------------------------------------------------------------------------------------------------ optimizer
# Optimizers that bitsandbytes provides (gpupoor.optimizers says which).
BITSANDBYTES_OPTIMIZERS = tuple(name for name, optimizer in OPTIMIZERS.items() if optimizer.bitsandbytes)


def evaluates_in_train_mode(quantization_bits: int | None, device: str) -> bool:
    """Whether a quantized model must stay in train mode where it only evaluates (eval loss, DPO's reference, the
    merge check). bitsandbytes 4-bit layers in eval mode repack their weights on the CPU (other logits; an error
    for a layer narrower than a quantization block), and 8-bit ones have always evaluated as they train: on the
    CPU a quantized model runs its eval passes in train mode. The one place this is decided (it was four copies
    with three conditions; a DPO reference copy in 8-bit on the CPU used to evaluate in eval mode)."""
    return quantization_bits is not None and device.startswith("cpu")


def needs_bitsandbytes(optimizer: str, quantization_bits: int | None) -> bool:
    """Whether the run imports bitsandbytes: a quantized base model or one of its optimizers."""
    return quantization_bits is not None or optimizer in BITSANDBYTES_OPTIMIZERS


# ------------------------------------------------------------------------------------------ what trains
# peft's IA3 defaults (peft.utils.constants) for the dense decoders gpupoor plans: the modules IA3 scales, and
# among them the feedforward ones, whose *input* is scaled (every other module's output is).
IA3_DEFAULT_TARGETS = {
    "llama": ("k_proj", "v_proj", "down_proj"), "mistral": ("k_proj", "v_proj", "down_proj"),
    "llama4": ("q_proj", "v_proj", "down_proj"), "qwen2": ("q_proj", "v_proj", "down_proj"),
    "qwen3": ("q_proj", "v_proj", "down_proj"), "gemma": ("q_proj", "v_proj", "down_proj"),
    "gemma2": ("q_proj", "v_proj", "down_proj"), "gemma3_text": ("q_proj", "v_proj", "down_proj"),
}
IA3_FEEDFORWARD = ("down_proj", "fc2", "w2", "dense_4h_to_h")


def ia3_modules(model_type: str, target_modules: list[str] | str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(modules IA3 scales, those scaled on their input) for `peft.target_modules` (`all-linear`: peft's
    defaults for the architecture; an unknown model type is taken as Llama)."""
    if target_modules == "all-linear":
        targets = IA3_DEFAULT_TARGETS.get(model_type, IA3_DEFAULT_TARGETS["llama"])
    else:
        targets = tuple(target_modules)
    return targets, tuple(name for name in targets if name in IA3_FEEDFORWARD)


def trained_layer_indices(last_layers: int | None, layers: int) -> range:
    """The decoder layers a method adapts (or `full` trains): the last `last_layers` of `layers`, or all."""
    if last_layers is None:
        return range(layers)
    if last_layers > layers:
        raise UserError(f"peft.last_layers = {last_layers} but the model has {layers} decoder layers",
                        hint=f"use at most {layers}, or unset it to train every layer")
    return range(layers - last_layers, layers)
