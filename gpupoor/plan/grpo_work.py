"""A GRPO step's work (gpupoor.objectives.grpo_objective), term by term, for the time plan: sampling the answers
token by token, the reference's forward (grpo.beta > 0), and the update on the sampled answers. Torch is not
imported.

Per micro-batch of P prompts (mean real length L, from the data as the loop collates it: each row's tokens
before its answer) and R = P x group_size answers of A = grpo.max_new_tokens tokens:
- sampling (gpupoor.objectives.rollout.sample_groups) reads each prompt once into the KV cache (a forward on P x L
  tokens), then A decode steps, each one forward of R rows of one token: every weight and the output head read
  for R rows (a matmul of R rows runs far below a training-shaped one: its own rate, probed at R rows), attention
  over the context so far, and a fixed cost per module call and per decode step (generate's own work: the
  logits' processing, the draw, the cache's update), counted in calls;
- the reference (beta > 0) and the update read each prompt once and the answers after it (P x L + R x A tokens;
  under DDP or checkpointing every answer's row whole: R x (L + A)), the loss on the answer tokens only.
With grpo.iterations N, answers are sampled (and the reference read) once every N steps: a step carries 1/N of it.
Answers are counted at A tokens: one that ends early shortens sampling and the update, so the plan is an upper
bound for answers that stop before max_new_tokens."""

from __future__ import annotations

from dataclasses import replace

from gpupoor.methods import METHODS
from gpupoor.plan.flops import BatchFacts, Work, step_work
from gpupoor.plan.settings import Settings, what_trains
from gpupoor.plan.shape import LINEARS, Shape

# Module calls per decoder layer in one decode step: the linears, the norms, rotary, the activation, the cache's
# update and the residual adds (what a training layer's forward counts, flops.step_work's per_layer).
OTHER_CALLS_PER_LAYER = 6
HALF_CASTS_PER_LAYER = 4  # bf16/fp16: each of the two norms casts its input to fp32 and its output back


def grpo_step_work(shape: Shape, s: Settings, batch: BatchFacts, accumulation: int) -> list[Work]:
    """The work of one GRPO optimizer step: `accumulation` micro-batches of `batch`'s prompts, each sampled (every
    grpo.iterations steps), scored against the reference (beta > 0) and updated on, then the optimizer."""
    prompts = s.prompt_rows
    prompt_tokens = max(batch.real_tokens - batch.targets, prompts)  # each row's tokens before its answer
    length = prompt_tokens / prompts
    update = update_facts(s, batch.micro_batches, prompt_tokens, length)
    work = update_work(shape, s, update, prompt_tokens, accumulation)
    share = 1 / s.grpo_iterations
    return work + [_scaled(w, share * accumulation) for w in sampling_work(shape, s, prompt_tokens, length)
                   + reference_work(shape, s, update)]


def update_facts(s: Settings, micro_batches: int, prompt_tokens: float, length: float) -> BatchFacts:
    """The update's rows as BatchFacts: each prompt once and its group's answers after it, or every answer's row
    whole. Attention as whole rows: a prompt's square, then each answer against its prompt and itself."""
    answers, new = s.sampled_answers, s.new_tokens
    if s.shared_prompts:  # each prompt but its last token into the cache, then [last prompt token, answer[:-1]]
        cached = length - 1
        tokens = prompt_tokens - s.prompt_rows + answers * new
        pairs = s.prompt_rows * cached * cached + answers * new * (cached + new)
    else:
        tokens = answers * (length + new)
        pairs = answers * (length + new) ** 2
    return BatchFacts(micro_batches=micro_batches, tokens=tokens, real_tokens=tokens, targets=answers * new,
                      example_pairs=2 * pairs, row_pairs=pairs)


def update_work(shape: Shape, s: Settings, update: BatchFacts, prompt_tokens: float, accumulation: int) -> list[Work]:
    """The update's forward and backward on `update`'s rows and the optimizer step. The head runs on the answer
    tokens alone (their log-probabilities), whatever the loss setting."""
    work = step_work(shape, replace(s, fused_loss=True), update, accumulation)
    if s.shared_prompts:
        work = _without_unused_prompt_backward(work, shape, s, (prompt_tokens - s.prompt_rows) * accumulation)
    return work


def sampling_work(shape: Shape, s: Settings, prompt_tokens: float, length: float) -> list[Work]:
    """One micro-batch's sampling: the prompts into the cache, then max_new_tokens decode steps of every answer."""
    rows, new, layers = s.sampled_answers, s.new_tokens, shape.layers
    weights = shape.layer_linear_params * layers + _adapter_weights(shape, s)  # peft's adapters run unmerged
    # Each prompt but its last token into the cache (the head on one position of each); the first decode step
    # reads the last prompt token of every answer's row.
    cached = length - 1
    prefill = [Work("prefill", "matmul", 2 * weights * (prompt_tokens - s.prompt_rows)
                    + 2 * shape.embedding_params * s.prompt_rows,
                    f"sampling: the {s.prompt_rows} prompts ({length:,.0f} tokens each) into the KV cache"),
               # left-padded prompts: one masked call per row computes its whole square
               Work("prefill_attention", "attention", 4 * shape.q * layers * s.prompt_rows * cached * cached,
                    "sampling: the prompts' attention (whole rows, one masked call), forward")]
    decoded = rows * new
    context = length + (new - 1) / 2  # the mean keys a decode step attends to (the cache and itself)
    flops = 2 * weights * decoded + 2 * shape.embedding_params * decoded + 4 * shape.q * layers * decoded * context
    training = what_trains(shape, s)
    adapted = max((len(layer.adapters) for layer in training.layers), default=0) \
        if METHODS[training.method].low_rank else 0
    per_layer = len(LINEARS) + 2 * adapted + OTHER_CALLS_PER_LAYER
    work = prefill + [
        Work("decode", "decode", flops, f"sampling: {new} decode steps of {rows} answers (linears, the "
             f"{shape.vocab:,}-word head and attention for {rows} rows at a time)"),
        Work("decode_calls", "decode_calls", per_layer * layers * new,
             f"sampling: {per_layer} module calls a layer, {layers} layers, {new} decode steps"),
        Work("decode_steps", "decode_steps", new, f"sampling: generate's own work at each of {new} decode steps")]
    if s.half:  # the norms computed in fp32, the fp32 adapters fed from the half base: a cast there and back
        casts = HALF_CASTS_PER_LAYER + 2 * adapted
        work.append(Work("decode_casts", "decode_casts", casts * layers * new,
                         f"sampling in {s.precision}: {casts} casts a layer at each decode step"))
    return work


def reference_work(shape: Shape, s: Settings, update: BatchFacts) -> list[Work]:
    """beta > 0: the answers' log-probabilities with the adapter switched off, once per sampling (no backward)."""
    if not s.grpo_reference:
        return []
    flops = 2 * shape.layer_linear_params * shape.layers * update.tokens + 2 * shape.embedding_params * update.targets
    return [Work("reference", "matmul", flops, "GRPO's reference forward (the adapter switched off)")]


def _without_unused_prompt_backward(work: list[Work], shape: Shape, s: Settings, cached: float) -> list[Work]:
    """The update's work less what torch never runs: the loss reads the prompts' cache only through each layer's
    keys and values, so in the last layer the `cached` prompt tokens take no backward but through k_proj and v_proj
    (their queries, attention output and MLP feed nothing). flops.step_work counted a whole layer's."""
    training = what_trains(shape, s)
    last = training.layers[-1]
    unused = [name for name in LINEARS if name not in ("k_proj", "v_proj")]
    grads = 2 * sum(shape.linear_params(name) for name in unused) \
        + 2 * sum(shape.linear_params(name) for name in last.weights if name in unused)  # input, weight gradients
    lora = 4 * s.rank * sum(sum(shape.linear(name)) for name in last.adapters if name in unused) \
        if METHODS[training.method].low_rank else 0
    per_prompt = cached / max(s.prompt_rows, 1)
    less = {"linears": grads * cached, "lora": lora * cached,
            "attention": 8 * shape.q * cached * per_prompt}  # the prompts' queries' part of the backward
    return [replace(w, amount=max(0.0, w.amount - less[w.key])) if w.key in less else w for w in work]


def _adapter_weights(shape: Shape, s: Settings) -> int:
    """LoRA's weights over all layers (0 for a method without low-rank adapters), as flops.step_work counts them."""
    training = what_trains(shape, s)
    if not METHODS[training.method].low_rank:
        return 0
    return sum(s.rank * sum(shape.linear(name)) for layer in training.layers for name in layer.adapters)


def _scaled(work: Work, factor: float) -> Work:
    return replace(work, amount=work.amount * factor)
