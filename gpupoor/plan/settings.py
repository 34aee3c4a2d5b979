"""The recipe resolved for the plan on one device: each `auto` decided as training decides it (gpupoor.decisions),
what trains, and what one process of several holds."""

from __future__ import annotations

from dataclasses import dataclass

from gpupoor.decisions import (CpuBf16, FusedPaths, choose_attention, choose_fused_loss, choose_fused_paths, choose_precision,
                               choose_reference, choose_sampler, choose_strategy)
from gpupoor.data.row_formats import sequences_per_example
from gpupoor.method_table import METHODS
from gpupoor.objective_table import objective_of
from gpupoor.plan.device import GpuFacts
from gpupoor.model.shape import LINEARS, Shape
from gpupoor.plan.training import LayerTraining, Training, resolve_training
from gpupoor.recipe.schema import Recipe
from gpupoor.units import parse_size


@dataclass(frozen=True)
class Distribution:
    """The process the plan describes among `processes` (the recipe's `distributed` section, resolved)."""

    processes: int = 1
    strategy: str = "single"  # single | ddp | fsdp
    shard_frozen: bool = True  # fsdp: frozen (unquantized) base weights are sharded too
    reshard_after_forward: bool = True  # fsdp: a layer's gathered weights are freed after its forward
    cpu_offload: bool = False  # fsdp on cuda: the shards, their gradients and optimizer state live in CPU memory


def strategy_of(recipe: Recipe, processes: int) -> str:
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
    gpu_major: int | None = None  # the CUDA compute capability's major version; None: no GPU visible here
    # model.fused_layers as training installs it (gpupoor.decisions.choose_fused_paths); None: the plain modules
    fused_paths: FusedPaths | None = None
    # GRPO: the answers sampled at once (micro_batch_size x group_size, each a row of its prompt and answer) and
    # the tokens sampled per answer; 0 for other objectives
    sampled_answers: int = 0
    new_tokens: int = 0
    prompt_rows: int = 0  # the prompts of a micro-batch (training.micro_batch_size)
    prompt_tokens: int = 0  # the longest prompt (data.max_length)
    # the update reads each prompt once for its group (one process, no checkpointing: gpupoor.objectives.choose)
    shared_prompts: bool = False
    grpo_iterations: int = 1  # grpo.iterations: updates per sampling (the time plan spreads sampling over them)
    grpo_reference: bool = False  # grpo.beta > 0: the reference's forward (the adapter switched off) per sampling

    @property
    def fused_mlp(self) -> bool:
        return self.fused_paths is not None and self.fused_paths.mlp

    @property
    def attention_per_example(self) -> bool:
        """gpupoor.model.packed_attention's own path: batches without a padding mask (a padded random batch goes
        through transformers' SDPA with its mask)."""
        padded = self.sampler == "random" and self.micro_batch > 1
        return self.fused_paths is not None and self.fused_paths.attention and not padded

    @property
    def packed_attention(self) -> bool:
        """Packed rows attended per example: no block-diagonal mask."""
        return self.attention_per_example and self.sampler == "packed"

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


def resolve_settings(recipe: Recipe, device: str, shape: Shape, gpu: GpuFacts = GpuFacts(), *,
                     teacher: Shape | None = None, processes: int = 1) -> Settings:
    """The recipe on `device`, each `auto` decided as training decides it (gpupoor.decisions; on a CPU the
    precision on what its flags say of bf16 units, unmeasured: gpupoor.cpu). `teacher`: the distillation teacher's
    shape, when the recipe has one; `processes`: how many run it (one is described)."""
    from gpupoor.cpu import bf16_facts_from_flags

    cpu = bf16_facts_from_flags() if device == "cpu" else CpuBf16()
    dist = recipe.distributed
    distribution = Distribution(processes, strategy_of(recipe, processes), dist.shard_frozen,
                                dist.reshard_after_forward, dist.cpu_offload and device == "cuda")
    precision = choose_precision(recipe.precision, device, gpu.major, cpu).value
    attention = choose_attention(recipe.model.attention, device, gpu.flash_installed, gpu.major).value
    sampler = choose_sampler(recipe.data.sampler, attention, recipe.model.trust_remote_code,
                             recipe.training.objective).value
    targets = tuple(LINEARS) if recipe.peft.target_modules == "all-linear" else \
        tuple(name for name in LINEARS if name in recipe.peft.target_modules)
    # peft puts LoRA on the output head only when lm_head is named (all-linear leaves the output layer out)
    head_adapted = (METHODS[recipe.peft.method].adapter and isinstance(recipe.peft.target_modules, list)
                    and "lm_head" in recipe.peft.target_modules)
    fused, loss_reason = choose_fused_loss(recipe.memory.fused_cross_entropy, shape.logit_postprocessing, head_adapted)
    if fused and teacher is not None:  # distillation fuses both heads: the teacher's must allow it too
        fused, why = choose_fused_loss(True, teacher.logit_postprocessing, False)
        loss_reason = loss_reason if fused else f"teacher: {why}"
    training = resolve_training(shape, recipe.peft)
    # Preference pairs: two sequences of up to max_length per example (padded: twice the rows; packed: rows
    # twice as long), and DPO's reference forward.
    pairs = sequences_per_example(source.format for source in recipe.data.sources())
    reference = choose_reference(recipe.training.objective, recipe.preference.reference, recipe.peft.method).value
    mapped = device == "cpu" and shape.file_dtype == precision
    # GRPO: group_size rows per prompt, each the prompt (under max_length) and an answer of up to max_new_tokens
    grpo = objective_of(recipe).samples
    answers = recipe.training.micro_batch_size * recipe.grpo.group_size if grpo else 0
    new_tokens = recipe.grpo.max_new_tokens if grpo else 0
    return Settings(device=device, precision=precision, attention=attention, sampler=sampler,
                    micro_batch=answers or recipe.training.micro_batch_size * (pairs if sampler != "packed" else 1),
                    row_tokens=recipe.data.max_length * (pairs if sampler == "packed" else 1) + new_tokens,
                    sampled_answers=answers, new_tokens=new_tokens,
                    prompt_rows=recipe.training.micro_batch_size if grpo else 0,
                    prompt_tokens=recipe.data.max_length if grpo else 0,
                    shared_prompts=grpo and processes == 1 and not recipe.memory.gradient_checkpointing,
                    grpo_iterations=recipe.grpo.iterations if grpo else 1, grpo_reference=grpo and recipe.grpo.beta > 0,
                    rank=recipe.peft.rank, targets=targets, modules_to_save=tuple(recipe.peft.modules_to_save),
                    dropout=recipe.peft.dropout if METHODS[recipe.peft.method].low_rank else 0.0,
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
                    reference_bits=recipe.preference.reference_bits if reference == "copy" else None,
                    gpu_major=gpu.major,
                    fused_paths=choose_fused_paths(recipe.model.fused_layers, shape.model_type, recipe.peft.method,
                                                   recipe.peft.dropout, recipe.quantization.bits, precision,
                                                   attention, device))


def what_trains(shape: Shape, s: Settings) -> Training:
    """What trains; Settings built without a resolution get LoRA on every layer (the plan before methods)."""
    if s.training is not None:
        return s.training
    lora = shape.layers * sum(s.rank * (a + b) for a, b in map(shape.linear, s.targets))
    saved = sum(shape.embedding_params for name in s.modules_to_save if name in ("embed_tokens", "lm_head"))
    return Training("lora", (LayerTraining(adapters=s.targets),) * shape.layers, lora + saved,
                    "embed_tokens" in s.modules_to_save,
                    "lm_head" in s.modules_to_save or ("embed_tokens" in s.modules_to_save and shape.tied),
                    "every layer")
