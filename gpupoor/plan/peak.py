"""One process's peak: the terms put together, the process's own overhead added (measured constants), and
shared out when several processes train."""

from __future__ import annotations

from gpupoor.decisions import needs_bitsandbytes
from gpupoor.method_table import METHODS
from gpupoor.plan.device import CUDA_CONTEXT, GpuFacts
from gpupoor.plan.distributed import distribute, distribution_notes
from gpupoor.plan.result import Term
from gpupoor.plan.settings import Settings, resolve_settings
from gpupoor.model.shape import Shape
from gpupoor.plan.terms import (DTYPE_BYTES, activation_bytes, generation_bytes, grpo_update_bytes, heap_retention,
                                loss_bytes, optimizer_bytes, reference_weight_bytes, teacher_weight_bytes,
                                tokenizer_bytes, trainable_params, weight_bytes)
from gpupoor.recipe.schema import Recipe
from gpupoor.units import MiB, format_bytes

# What a CPU process holds before the first tensor: Python, torch, transformers, peft, accelerate and gpupoor,
# as resident memory. Measured on the CI machine (torch 2.13 CPU wheel): 387 MiB after the imports, 416 MiB once
# the test fixture's tokenizer (a few thousand ids: under 2 MiB) and a small dataset are loaded. A real
# tokenizer is its own term (gpupoor.plan.terms.tokenizer_bytes). bitsandbytes adds its own.
CPU_PROCESS_BASELINE = 416 * MiB
CPU_BITSANDBYTES_BASELINE = 60 * MiB
# Fraction of the live tensors that torch's CUDA caching allocator holds on top as reserved-but-free
# blocks (fragmentation) at the peak. PyTorch's memory docs and our reading of published traces: 5-15%.
CUDA_ALLOCATOR_SLACK = 0.10
# cuBLAS's workspace, which torch takes from its allocator (so it counts in the measured peak) once per thread
# that runs matmuls: the training thread and autograd's device thread. torch's default size is 32 MiB on Hopper
# (compute capability 9) and 8 MiB + 128 KiB before; a plan for no visible GPU takes the larger.
CUDA_WORKSPACE_THREADS = 2


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
    if s.sampled_answers:  # GRPO: the update's rows are its answers, its loss on their tokens
        live, churn, act_detail, loss, loss_detail = grpo_update_bytes(shape, s)
    master = " (master weights)" if not METHODS[s.method].adapter else ""
    terms = [Term("base_weights", weights, weights_detail),
             Term("trainable", params * 4, f"{params / 1e6:,.2f}M trainable parameters in fp32{master}"),
             Term("gradients", params * 4, "fp32, one per trainable parameter"),
             Term("optimizer", optimizer, f"{s.optimizer}: {optimizer_detail}"),
             Term("activations", live, act_detail),
             Term("loss", loss, loss_detail)]
    if s.sampled_answers:
        # Sampling and the update never hold their working sets at once: what sampling holds beyond the update's.
        generation, generation_detail = generation_bytes(shape, s)
        terms.append(Term("generation", max(0, generation - live - loss), f"GRPO's sampling: {generation_detail}; "
                          "freed before the update, so counted where it exceeds the update's activations and loss"))
    if s.teacher is not None:
        terms.insert(1, Term("teacher_weights", *teacher_weight_bytes(s.teacher, s)))
    if s.reference == "copy":
        terms.insert(1, Term("reference_weights", *reference_weight_bytes(shape, s)))
    if s.device == "cpu":
        baseline = CPU_PROCESS_BASELINE + (CPU_BITSANDBYTES_BASELINE if uses_bitsandbytes else 0)
        tokenizer, tokenizer_detail = tokenizer_bytes(shape)
        kept = heap_retention(shape, s, churn, shape.layer_linear_params * s.act_bytes if s.bits else 0)
        terms.append(Term("overhead", baseline + tokenizer + kept,
                          f"process baseline {baseline / MiB:.0f} MiB (Python, torch, libraries); tokenizer "
                          f"{tokenizer / MiB:.0f} MiB ({tokenizer_detail}); freed step memory the C heap keeps "
                          f"{kept / MiB:.0f} MiB"))
    else:
        hopper = s.gpu_major is None or s.gpu_major >= 9
        workspace = 32 * MiB if hopper else 8 * MiB + 128 * 1024
        terms.append(Term("cuda_workspace", CUDA_WORKSPACE_THREADS * workspace,
                          f"cuBLAS workspace, {workspace / MiB:.1f} MiB for each of {CUDA_WORKSPACE_THREADS} threads "
                          "(forward, backward)"))
        slack = int(CUDA_ALLOCATOR_SLACK * (live + loss))
        terms.append(Term("overhead", CUDA_CONTEXT + slack, f"CUDA context ~{CUDA_CONTEXT / MiB:.0f} MiB; "
                          f"caching-allocator slack {slack / MiB:.0f} MiB"))
    assumptions = [f"every micro-batch row is {s.row_tokens} tokens (data.max_length): the longest batch"
                   if not s.sampled_answers else
                   f"every prompt is {s.prompt_tokens} tokens (data.max_length) and every answer "
                   f"{s.new_tokens} (grpo.max_new_tokens, never ending early); {s.sampled_answers} answers "
                   "(micro_batch_size x group_size)" + ("" if s.shared_prompts else
                                                        ", each read with its prompt (rows of both)")]
    if s.device == "cpu":  # docs/benchmarks.md, "On the real model": the real demo crept 19% over 10 steps
        assumptions.append("the peak of the first steps: on the CPU the C heap may keep more as a run goes on, "
                           "up to ~15% more over the first ten steps")
    if s.reference != "none":
        assumptions.append(f"DPO's reference ({s.reference}) runs its forward first, under no_grad: it keeps only "
                           "each sequence's log-probability, so it adds nothing at the peak")
    if not s.fused_loss:
        assumptions.append(f"the plain loss: {s.loss_reason}")
    terms = distribute(shape, s, terms)
    loading = loading_term(shape, s, uses_bitsandbytes, terms)
    return terms + ([loading] if loading else []), assumptions + distribution_notes(s)


def loading_term(shape: Shape, s: Settings, uses_bitsandbytes: bool, terms: list[Term]) -> Term | None:
    """On the CPU, a base whose file holds another dtype than the run's (an fp32 file trained in bf16) is read
    from the memory-mapped file and converted tensor by tensor, and every page of the file it read stays resident
    until the file is closed, beside the converted weights: the process's peak can be the load's, not a step's.
    Measured on the real model's fp32 directory trained in bf16 with checkpointing: 1191 MiB at load against a
    step's ~940 (the file 513 MiB + its bf16 copy 257 + the baseline). The excess over the step's terms, or None.
    (A quantized base is loaded by bitsandbytes' own route; a GGUF's config names no file dtype.) Counted only
    where it was measured: a file wider than the run's dtype. The other way (a bf16 file trained in fp32) a
    270M Gemma's load peaked at 1,984 MiB where this sum says 2,280, and its steps far above either. The pages
    are clean file cache: the kernel can drop them under pressure, so this is the peak RSS, not a hard need.
    Every process loads the whole base before FSDP shards it: the whole weights count."""
    if s.device != "cpu" or s.bits is not None or shape.file_dtype is None:
        return None
    if DTYPE_BYTES[shape.file_dtype] <= DTYPE_BYTES[s.precision]:
        return None
    file_bytes = shape.total_params * DTYPE_BYTES[shape.file_dtype]
    weights, _ = weight_bytes(shape, s)
    baseline = (CPU_PROCESS_BASELINE + (CPU_BITSANDBYTES_BASELINE if uses_bitsandbytes else 0)
                + tokenizer_bytes(shape)[0])  # the tokenizer is loaded before the model
    excess = baseline + file_bytes + weights - sum(t.bytes for t in terms)
    if excess <= 0:
        return None
    return Term("loading", excess, f"loading reads the {shape.file_dtype} file ({format_bytes(file_bytes)}) and "
                f"converts it to {s.precision}: its pages stay resident beside the converted weights until it is "
                "closed, a peak above the step's by this much")


def uses_bitsandbytes(recipe: Recipe) -> bool:
    """Whether the run imports bitsandbytes: its optimizer, a quantized base, or a quantized teacher."""
    teacher_bits = recipe.distill.bits if recipe.distill is not None else None
    return needs_bitsandbytes(recipe.training.optimizer, recipe.quantization.bits or teacher_bits
                              or recipe.preference.reference_bits)


def peak_bytes(shape: Shape, recipe: Recipe, device: str, gpu: GpuFacts, *, teacher: Shape | None = None,
               processes: int = 1) -> int:
    """The peak of one process out of `processes`: the sum of plan_terms."""
    settings = resolve_settings(recipe, device, shape, gpu, teacher=teacher, processes=processes)
    terms, _ = plan_terms(shape, settings, uses_bitsandbytes(recipe))
    return sum(t.bytes for t in terms)
