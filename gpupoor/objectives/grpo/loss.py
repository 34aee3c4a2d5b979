"""GRPO's arithmetic (group relative policy optimisation): advantages relative to each prompt's group of sampled
answers, and the clipped policy loss with a KL penalty to the reference. Plain tensor functions of per-token
log-probabilities, so the generation, the reference and the loop around them are separate parts.

- Advantages: each answer's reward minus its group's mean, divided by the group's standard deviation (GRPO, Shao
  et al. 2024, "DeepSeekMath", section 4.1), or not divided (`scale=False`: Dr. GRPO, Liu et al. 2025,
  "Understanding R1-Zero-Like Training", which shows the division weights easy and hard prompts unequally).
- The policy loss per answer token: -min(r A, clip(r, 1 - epsilon, 1 + epsilon_high) A), r = pi / pi_old (PPO's
  clipped surrogate; epsilon_high > epsilon is DAPO's "clip-higher", Yu et al. 2025), plus beta times the KL to
  the reference by Schulman's unbiased non-negative estimator k3 = pi_ref / pi - log(pi_ref / pi) - 1 (as GRPO).
- Normalisation over tokens: `sequence` (each answer's mean over its tokens, then the mean over answers: GRPO as
  published), `token` (the sum over all answer tokens divided by their number: DAPO's token-level loss, which
  stops long answers counting less per token), `constant` (the sum divided by answers x max_new_tokens: Dr. GRPO,
  no length bias at all)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

NORMALIZATIONS = ("sequence", "token", "constant")


def group_advantages(rewards: torch.Tensor, group_size: int, scale: bool = True, eps: float = 1e-4) -> torch.Tensor:
    """Advantages of answers stored group after group (`group_size` answers to each prompt, in order)."""
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not make groups of {group_size}")
    grouped = rewards.view(-1, group_size)
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    if scale:
        centred = centred / (grouped.std(dim=1, keepdim=True) + eps)  # a group of equal rewards: all 0
    return centred.flatten()


@dataclass
class PolicyLoss:
    loss: torch.Tensor
    kl: float  # the mean k3 estimate over answer tokens (0 when beta is 0 and no reference is given)
    clip_fraction: float  # answer tokens whose ratio the clip held (no gradient through them)


def policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, *,
                epsilon: float = 0.2, epsilon_high: float | None = None, beta: float = 0.0,
                ref_logp: torch.Tensor | None = None, normalization: str = "sequence",
                max_new_tokens: int | None = None) -> PolicyLoss:
    """The GRPO loss of a batch of answers. `logp`, `old_logp`, `ref_logp`, `mask`: (answers, tokens), the
    policy's log-probabilities of the sampled tokens now (with gradient), when they were sampled, and under the
    reference; `mask` 1 on answer tokens. `advantages`: (answers,)."""
    if normalization not in NORMALIZATIONS:
        raise ValueError(f"normalization {normalization!r}: one of {', '.join(NORMALIZATIONS)}")
    if beta and ref_logp is None:
        raise ValueError("beta > 0 needs the reference's log-probabilities")
    mask = mask.to(logp.dtype)
    ratio = torch.exp(logp - old_logp)
    high = epsilon if epsilon_high is None else epsilon_high
    unclipped = ratio * advantages[:, None]
    clipped = ratio.clamp(1 - epsilon, 1 + high) * advantages[:, None]
    per_token = -torch.minimum(unclipped, clipped)
    kl = torch.zeros_like(logp)
    if ref_logp is not None:
        log_ratio = ref_logp - logp
        kl = torch.exp(log_ratio) - log_ratio - 1
        if beta:
            per_token = per_token + beta * kl
    tokens = mask.sum()
    if normalization == "sequence":
        loss = ((per_token * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1)).mean()
    elif normalization == "token":
        loss = (per_token * mask).sum() / tokens.clamp(min=1)
    else:
        if max_new_tokens is None:
            raise ValueError("normalization constant needs max_new_tokens")
        loss = (per_token * mask).sum() / (logp.shape[0] * max_new_tokens)
    held = (clipped < unclipped).to(logp.dtype) * mask  # where min() chose the clipped term: no gradient
    count = float(tokens.clamp(min=1))
    return PolicyLoss(loss, float((kl.detach() * mask).sum()) / count, float(held.sum()) / count)
