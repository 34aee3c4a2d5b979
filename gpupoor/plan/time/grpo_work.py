"""A GRPO step's work (gpupoor.objectives.grpo.objective), term by term, for the time plan: sampling the answers
token by token, the reference's forward (grpo.beta > 0), and the update on the sampled answers. Torch is not
imported.

Per micro-batch of P prompts (mean real length L, from the data as the loop collates it: each row's tokens
before its answer) and R = P x group_size answers of A = grpo.max_new_tokens tokens:
- sampling (gpupoor.objectives.grpo.rollout.sample_groups) reads each prompt once into the KV cache (a forward on P x L
  tokens), then A decode steps, each one forward of R rows of one token: every weight and the output head read
  for R rows (a matmul of R rows runs far below a training-shaped one: its own rate, probed at R rows), attention
  over the context so far, and a fixed cost per module call and per decode step (generate's own work: the
  logits' processing, the draw, the cache's update), counted in calls;
- the reference (beta > 0) and the update read each prompt once and the answers after it (P x L + R x A tokens;
  under DDP or checkpointing every answer's row whole: R x (L + A)), the loss on the answer tokens only (the fused
  head computes their logits again in backward);
- what every forward pays for its weights whatever its rows (k-bit weights expanded, DoRA's norms rebuilt), at
  each decode step.
With grpo.iterations N, answers are sampled (and the reference read) once every N steps: a step carries 1/N of it.
Answers are counted at A tokens: one that ends early shortens sampling and the update, so the plan is above the run
for answers that stop before max_new_tokens."""

from __future__ import annotations

from dataclasses import replace

from gpupoor.method_table import METHODS
from gpupoor.plan.time.work import BatchFacts, Work, adapter_weights, dora_work, module_calls_per_layer, step_work
from gpupoor.plan.settings import Settings, what_trains
from gpupoor.model.shape import LINEARS, Shape

HALF_CASTS_PER_LAYER = 4  # bf16/fp16: each of the two norms casts its input to fp32 and its output back


def grpo_step_work(shape: Shape, s: Settings, batch: BatchFacts, accumulation: int) -> list[Work]:
    """The work of one GRPO optimizer step: `accumulation` micro-batches of `batch`'s prompts, each sampled (every
    grpo.iterations steps), scored against the reference (beta > 0) and updated on, then the optimizer."""
    prompt_tokens, length, update = grpo_rows(s, batch)
    work = update_work(shape, s, update, prompt_tokens, accumulation)
    share = 1 / s.grpo_iterations
    return work + [_scaled(w, share * accumulation) for w in sampling_work(shape, s, prompt_tokens, length)
                   + reference_work(shape, s, update)]


def grpo_rows(s: Settings, batch: BatchFacts) -> tuple[float, float, BatchFacts]:
    """(a micro-batch's prompt tokens, their mean length, the update's rows) from the data's rows, whose answers
    are the expected ones (scored by the rewards, never trained on)."""
    prompt_tokens = max(batch.real_tokens - batch.targets, s.prompt_rows)  # each row's tokens before its answer
    length = prompt_tokens / s.prompt_rows
    return prompt_tokens, length, update_facts(s, batch.micro_batches, prompt_tokens, length)


def describe_rows(s: Settings, length: float, update: BatchFacts, accumulation: int) -> str:
    """The time plan's line for a GRPO step's rows (grpo_rows' prompt length and update)."""
    return (f"{accumulation} x {s.prompt_rows} prompts ({length:,.0f} tokens each) and their {s.sampled_answers} "
            f"answers of up to {s.new_tokens} tokens; the update on {update.tokens:,.0f} tokens a micro-batch, "
            f"{update.targets:,.0f} of them answers")


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
    """The update's forward and backward on `update`'s rows (each of the `accumulation` micro-batches) and the
    optimizer step. The head runs on the answer tokens alone where the answers are read after the prompts' cache
    or through the fused head; whole rows without it compute every position's logits."""
    work = step_work(shape, replace(s, fused_loss=_head_on_answers_only(s)), update, accumulation)
    if s.shared_prompts:
        work = _without_unused_prompt_backward(work, shape, s, prompt_tokens - s.prompt_rows, accumulation)
    position, recomputed = _head_extras(s, update)
    extra = Work("head_extra", "matmul", 2 * shape.embedding_params * (position + recomputed) * accumulation,
                 f"the head on {position:,.0f} last positions (the model's own logits, unused)"
                 + (f"; the fused log-probabilities' logits again in backward ({recomputed:,.0f} tokens)"
                    if recomputed else ""))
    after_head = next(i for i, w in enumerate(work) if w.key == "head") + 1
    return work[:after_head] + [extra] + work[after_head:]


def _head_on_answers_only(s: Settings) -> bool:
    return s.fused_loss or s.shared_prompts


def _head_extras(s: Settings, update: BatchFacts) -> tuple[float, float]:
    """(rows whose last position the model's own head computes besides the answers' log-probabilities, the
    answer tokens whose logits the fused head computes again in backward): the prompts' cache is read with
    logits_to_keep=1, and so is every answer row read through the fused head (gpupoor.objectives.cross_entropy
    .last_hidden_state); gpupoor.objectives.preference.target_logprobs keeps no logits for backward."""
    position = (s.prompt_rows if s.shared_prompts else 0) + (s.sampled_answers if s.fused_loss else 0)
    return position, (update.targets if s.fused_loss else 0)


def sampling_work(shape: Shape, s: Settings, prompt_tokens: float, length: float) -> list[Work]:
    """One micro-batch's sampling: the prompts into the cache, then max_new_tokens decode steps of every answer."""
    rows, new, layers = s.sampled_answers, s.new_tokens, shape.layers
    training = what_trains(shape, s)
    weights = shape.layer_linear_params * layers + adapter_weights(shape, s, training)  # peft's adapters unmerged
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
    adapted = max((len(layer.adapters) for layer in training.layers), default=0) \
        if METHODS[training.method].low_rank else 0
    per_layer = module_calls_per_layer(training)
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
    return work + _weights_per_forward(shape, s, new + 1, prompt_tokens - s.prompt_rows + decoded, "sampling")


def reference_work(shape: Shape, s: Settings, update: BatchFacts) -> list[Work]:
    """beta > 0: the answers' log-probabilities with the adapter switched off, once per sampling (no backward),
    read as the update reads them."""
    if not s.grpo_reference:
        return []
    head_tokens = (update.targets if _head_on_answers_only(s) else update.tokens) + _head_extras(s, update)[0]
    flops = 2 * shape.layer_linear_params * shape.layers * update.tokens + 2 * shape.embedding_params * head_tokens
    return [Work("reference", "matmul", flops, "GRPO's reference forward (the adapter switched off)"),
            Work("reference_attention", "attention", 4 * shape.q * shape.layers * update.row_pairs,
                 "GRPO's reference: attention, forward")] \
        + _weights_per_forward(shape, s, 1, update.tokens, "reference", adapter_on=False)


def _without_unused_prompt_backward(work: list[Work], shape: Shape, s: Settings, cached: float,
                                    accumulation: int) -> list[Work]:
    """The update's work less what torch never runs: the loss reads the prompts' cache only through each layer's
    keys and values, so in the last layer the `cached` prompt tokens of each micro-batch take no backward but
    through k_proj and v_proj (their queries, attention output and MLP feed nothing). flops.step_work counted a
    whole layer's."""
    training = what_trains(shape, s)
    last = training.layers[-1]
    unused = [name for name in LINEARS if name not in ("k_proj", "v_proj")]
    grads = 2 * sum(shape.linear_params(name) for name in unused) \
        + 2 * sum(shape.linear_params(name) for name in last.weights if name in unused)  # input, weight gradients
    lora = 4 * s.rank * sum(sum(shape.linear(name)) for name in last.adapters if name in unused) \
        if METHODS[training.method].low_rank else 0
    per_prompt = cached / max(s.prompt_rows, 1)  # each prompt's cached tokens: its queries attend to as many keys
    less = {"linears": grads * cached * accumulation, "lora": lora * cached * accumulation,
            "attention": 8 * shape.q * cached * per_prompt * accumulation}  # the prompts' queries' backward
    return [replace(w, amount=max(0.0, w.amount - less[w.key])) if w.key in less else w for w in work]


def _weights_per_forward(shape: Shape, s: Settings, forwards: int, tokens: float, what: str,
                         adapter_on: bool = True) -> list[Work]:
    """What each forward call pays for its weights, whatever its rows: k-bit weights expanded (bits), DoRA's
    W + BA rebuilt for its norms (DoRA with the adapter on; dropout is off in eval mode). Sampling makes one forward
    per decode step: these are paid max_new_tokens times."""
    work = []
    if s.bits is not None:
        work.append(Work(f"{what}_dequantize", "dequantize", shape.layer_linear_params * shape.layers * forwards,
                         f"{what}: {s.bits}-bit weights expanded in each of {forwards} forwards"))
    training = what_trains(shape, s)
    if adapter_on and METHODS[training.method].magnitude:
        work += [replace(w, key=f"{what}_{w.key}", detail=f"{what}: {w.detail}")
                 for w in dora_work(shape, s, training, tokens, forwards, passes=1, dropped_out=False)]
    return work


def _scaled(work: Work, factor: float) -> Work:
    return replace(work, amount=work.amount * factor)
