"""GRPO's rollouts: a group of sampled answers to each prompt, and the per-token log-probabilities of those answers
under a model (the policy now, the policy when it sampled, the reference with the adapter switched off).

Sampling is seeded from the caller's seed alone (not the global RNG's history), so a resumed run that must
sample a rollout again draws the same answers from the same weights. Generation runs the model in eval mode with
its KV cache, the prompts left-padded in one batch, every prompt repeated `group_size` times; the cache is freed
before anything trains. An answer ends at the first end-of-sequence token (kept, as training keeps EOS) or at
`max_new_tokens`."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gpupoor.data.assembly import IGNORE_INDEX


@dataclass
class Sampled:
    prompts: list[list[int]]  # each answer's prompt ids (a prompt repeated group_size times, in order)
    answers: list[list[int]]  # each answer's ids, up to and including its end-of-sequence token


@torch.no_grad()
def sample_groups(model, prompts: list[list[int]], *, group_size: int, max_new_tokens: int, pad_id: int,
                  eos_id: int | None, seed: int, temperature: float = 1.0, top_p: float = 1.0,
                  share_prompts: bool = False) -> Sampled:
    """`group_size` answers to each prompt, sampled with the model's KV cache in eval mode (temperature 0:
    greedy). `share_prompts`: each prompt's cache computed once for its group (gpupoor.objectives.grpo.rollout
    .prompt_cache) rather than once per answer."""
    device = next(model.parameters()).device
    repeated = [prompt for prompt in prompts for _ in range(group_size)]
    width = max(len(p) for p in repeated)
    input_ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in repeated], device=device)
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in repeated], device=device)
    training = model.training
    model.eval()
    extra = {}
    if share_prompts and group_size > 1 and width > 1:
        # Each prompt read once, not once per answer: all but its last token into the KV cache, which each of
        # its group's answers then continues (generate reads only the last prompt token and what follows).
        extra[_cache_argument(model)] = prompt_cache(model, prompts, group_size, pad_id)
    # The caller's RNG streams (the CPU's and this device's) are put back afterwards: the draw depends on the seed
    # and the weights only, and nothing after it on how much was drawn.
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(seed)
            sampling = {"do_sample": True, "temperature": temperature, "top_p": top_p, "top_k": 0} \
                if temperature > 0 else {"do_sample": False, "temperature": None, "top_p": None, "top_k": None}
            out = model.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=max_new_tokens,
                                 pad_token_id=pad_id, eos_token_id=eos_id, use_cache=True, **sampling, **extra)
    finally:
        model.train(training)
    answers = []
    for row in out[:, width:].tolist():
        if eos_id is not None and eos_id in row:
            row = row[:row.index(eos_id) + 1]
        answers.append(row)
    del out  # (the KV cache went with generate's return; nothing of it is kept for the update)
    return Sampled(repeated, answers)


def _left_padded(rows: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids, attention mask, position ids) of rows left-padded to the longest, positions counted as transformers'
    generate counts them (from each row's first real token; padding at 1)."""
    width = max(len(r) for r in rows)
    ids = torch.tensor([[pad_id] * (width - len(r)) + r for r in rows], device=device)
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=device)
    return ids, mask, (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)


def prompt_cache(model, prompts: list[list[int]], group_size: int, pad_id: int):
    """The KV cache of every prompt but its last token, left-padded to the longest, computed once per prompt and
    repeated for each of its group's `group_size` answers. With gradient when grad is enabled and the model
    trains: the answers' backward reaches the prompt's activations through it, once per prompt."""
    ids, mask, positions = _left_padded([p[:-1] for p in prompts], pad_id, next(model.parameters()).device)
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, logits_to_keep=1)
    cache = getattr(out, "cache", None) or out.past_key_values
    cache.batch_repeat_interleave(group_size)
    return cache


def _cache_argument(model) -> str:
    """The forward's name for a KV cache: `cache` from transformers 5.2x on (`past_key_values` deprecated)."""
    import inspect

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return "cache" if "cache" in inspect.signature(base.forward).parameters else "past_key_values"


def shared_prompt_logprobs(model, sampled: Sampled, group_size: int, max_new_tokens: int, pad_id: int, head=None,
                           temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """`answer_logprobs` of answers stored group by group, each prompt read once for its group instead of once per
    answer (`prompt_cache`): the update's forward and backward over P + G x A tokens instead of G x (P + A). The
    answers continue the cache from each prompt's last token: rows [last prompt token, answer[:-1]] whose every
    position predicts the answer's next token. Equal to answer_logprobs up to float rounding (other matrix
    shapes), in values and gradients."""
    device = next(model.parameters()).device
    prompts = sampled.prompts[::group_size]
    _, prefix_mask, _ = _left_padded([p[:-1] for p in prompts], pad_id, device)
    cache = prompt_cache(model, prompts, group_size, pad_id)
    width = max(len(a) for a in sampled.answers)
    rows = [[p[-1]] + a[:-1] + [pad_id] * (width - len(a)) for p, a in zip(sampled.prompts, sampled.answers)]
    labels = torch.tensor([a + [IGNORE_INDEX] * (width - len(a)) for a in sampled.answers], device=device)
    mask = labels != IGNORE_INDEX
    attention = torch.cat([prefix_mask.repeat_interleave(group_size, dim=0), mask.long()], dim=1)
    positions = torch.tensor([[len(p) - 1 + t for t in range(width)] for p in sampled.prompts], device=device)
    inputs = {"input_ids": torch.tensor(rows, device=device), "attention_mask": attention,
              "position_ids": positions}
    if head is not None:
        from gpupoor.objectives.cross_entropy import last_hidden_state
        from gpupoor.objectives.preference import target_logprobs

        hidden = last_hidden_state(model, inputs, head, use_cache=True, **{_cache_argument(model): cache})[mask]
        tokens = target_logprobs(hidden / temperature if temperature != 1.0 else hidden, head.weight, labels[mask])
    else:
        logits = model(**inputs, use_cache=True, **{_cache_argument(model): cache}).logits[mask]
        tokens = torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature, dim=-1) \
            .gather(1, labels[mask][:, None]).squeeze(1)
    del cache
    return _left_aligned(tokens, mask, max_new_tokens)


def _left_aligned(tokens: torch.Tensor, mask: torch.Tensor, max_new_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each answer's tokens (`tokens`, the masked positions in row order) left-aligned in (answers,
    max_new_tokens), and where they are."""
    lengths = mask.sum(dim=1)
    keep = torch.arange(max_new_tokens, device=tokens.device)[None, :] < lengths[:, None]
    out = torch.zeros(mask.shape[0], max_new_tokens, dtype=tokens.dtype, device=tokens.device)
    return out.masked_scatter(keep, tokens), keep


def answer_batch(sampled: Sampled, pad_id: int) -> dict[str, torch.Tensor]:
    """Prompt + answer rows, right-padded, labels on the answer tokens only: what a forward pass scores."""
    rows = [p + a for p, a in zip(sampled.prompts, sampled.answers)]
    width = max(len(r) for r in rows)
    input_ids = torch.tensor([r + [pad_id] * (width - len(r)) for r in rows])
    attention_mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    labels = torch.tensor([[IGNORE_INDEX] * len(p) + a + [IGNORE_INDEX] * (width - len(p) - len(a))
                           for p, a in zip(sampled.prompts, sampled.answers)])
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def answer_logprobs(model, batch: dict[str, torch.Tensor], max_new_tokens: int, head=None,
                    temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p of each answer token, (answers, max_new_tokens); 1 where there is an answer token) under `model`, with
    gradient when grad is enabled and the model trains. With `head` (gpupoor.objectives.cross_entropy.FusedHead)
    the vocabulary's logits are never held whole: chunk by chunk through the head, as the fused losses do.
    `temperature`: the distribution answers were sampled from, softmax(logits / temperature), whose
    log-probabilities the policy gradient and the ratio are of (as TRL's GRPOTrainer)."""
    labels = batch["labels"][:, 1:]
    mask = labels != IGNORE_INDEX  # position t predicts token t + 1
    if head is not None:
        from gpupoor.objectives.cross_entropy import last_hidden_state
        from gpupoor.objectives.preference import target_logprobs

        hidden = last_hidden_state(model, batch, head)[:, :-1][mask]
        # the head is linear with no bias: (h / t) W^T = (h W^T) / t
        tokens = target_logprobs(hidden / temperature if temperature != 1.0 else hidden, head.weight, labels[mask])
    else:
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False).logits
        logits = logits[:, :-1][mask]
        tokens = torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature, dim=-1) \
            .gather(1, labels[mask][:, None]).squeeze(1)
    return _left_aligned(tokens, mask, max_new_tokens)
