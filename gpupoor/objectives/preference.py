"""Preference tuning on pairs (data.format: preference): the DPO and ORPO losses as sums over pairs; the caller
divides by the pairs of the whole accumulation window (summed over processes), so every pair weighs the same
however the batch was split.

A micro-batch holds whole pairs (gpupoor.data.build.collate_pairs): `sequence_index` names the sequence of each
target (2p: pair p's chosen answer, 2p + 1: its rejected one), padded or packed alike. What both losses need is
each sequence's summed log-probability of its answer tokens:

- fused (default): the decoder's last hidden states of the target positions go through the output head chunk by
  chunk; `_TargetLogProbs` keeps no logits, only each token's log-sum-exp, and its backward recomputes each
  chunk's logits for d log p / d logits = one_hot - softmax, scaled by the token's upstream gradient. (Unlike the
  cross-entropy, the gradient is not known in the forward: it depends on each pair's margin.)
- plain: the model's full logits, when the head cannot be fused (gpupoor.objectives.cross_entropy.find_fused_head says why).

DPO's reference log-probabilities come from the same micro-batch, under no_grad, before the policy's forward (its
working set is gone before the policy's activations exist): the trained model with its adapter switched off
(peft's disable_adapter: no second copy of the weights), or a frozen copy (`full` fine-tuning). ORPO has none.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from gpupoor.data.assembly import IGNORE_INDEX
from gpupoor.decisions import loss_chunk_tokens
from gpupoor.objectives.cross_entropy import FusedHead, accumulate_head_grads, head_logits, last_hidden_state, model_inputs
from gpupoor.profiling import span

# What each step and eval record gains, summed over pairs and divided by the pairs (TRL's names).
REWARDS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
           "logps/rejected")
METRICS = {"dpo": REWARDS, "orpo": REWARDS + ("nll_loss", "log_odds_ratio", "log_odds_chosen")}


# ------------------------------------------------------------------------------------- log-probabilities
def _chunked_logps(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                   chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p(target), log-sum-exp) of each row of hidden @ weight.T, chunk by chunk, in fp32 at least."""
    acc = torch.promote_types(hidden.dtype, torch.float32)
    logps = torch.empty(hidden.shape[0], dtype=acc, device=hidden.device)
    lse = torch.empty_like(logps)
    for start in range(0, hidden.shape[0], chunk):
        rows = slice(start, start + chunk)
        logits = head_logits(hidden[rows], weight, acc)
        lse[rows] = torch.logsumexp(logits, dim=-1)
        logps[rows] = logits.gather(1, targets[rows, None]).squeeze(1) - lse[rows]
    return logps, lse


class _TargetLogProbs(torch.autograd.Function):
    """log softmax(hidden @ weight.T)[target] per row, never holding more than one chunk of logits. Autocast is
    off inside, so the forward and the backward's recomputation multiply in the same dtypes."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk):
        with torch.autocast(hidden.device.type, enabled=False):
            logps, lse = _chunked_logps(hidden, weight, targets, chunk)
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.chunk = chunk
        return logps

    @staticmethod
    def backward(ctx, grad_logps):
        hidden, weight, targets, lse = ctx.saved_tensors
        want_hidden, want_weight = ctx.needs_input_grad[:2]
        acc = lse.dtype
        grad_hidden = torch.empty_like(hidden) if want_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=acc, device=weight.device) if want_weight else None
        with torch.autocast(hidden.device.type, enabled=False):
            for start in range(0, hidden.shape[0], ctx.chunk):
                rows = slice(start, start + ctx.chunk)
                h, t, g = hidden[rows], targets[rows], grad_logps[rows].to(acc)
                # d log p_t / d logits = one_hot(t) - softmax, times the token's upstream gradient, in place.
                grad = head_logits(h, weight, acc).sub_(lse[rows, None]).exp_().mul_(-g[:, None])
                grad[torch.arange(len(t), device=t.device), t] += g
                accumulate_head_grads(grad, h, weight, grad_hidden, grad_weight, rows)
        return grad_hidden, grad_weight.to(weight.dtype) if grad_weight is not None else None, None, None


def target_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                    chunk: int | None = None) -> torch.Tensor:
    """log p(target) of each row of `hidden @ weight.T` (rows: target positions), chunk by chunk (`chunk` target
    tokens at a time; default gpupoor.decisions.loss_chunk_tokens of the vocabulary)."""
    chunk = chunk or loss_chunk_tokens(weight.shape[0])
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        return _TargetLogProbs.apply(hidden, weight, targets, chunk)
    with torch.autocast(hidden.device.type, enabled=False):
        return _chunked_logps(hidden, weight, targets, chunk)[0]  # (the reference: nothing kept for a backward)


def sequence_logps(model: torch.nn.Module, batch: dict[str, torch.Tensor],
                   head: FusedHead | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed log-probability of each sequence's targets, its target count), indexed by sequence_index: through
    the fused head, or (`head` None) from the model's full logits."""
    labels = batch["labels"][:, 1:]
    mask = labels != IGNORE_INDEX  # position t predicts token t + 1
    sequence = batch["sequence_index"][:, 1:][mask]
    if head is not None:
        hidden = last_hidden_state(model, batch, head)
        with span("loss"):
            logps = target_logprobs(hidden[:, :-1][mask], head.weight, labels[mask])
    else:
        with span("forward"):
            logits = model(**model_inputs(batch), use_cache=False).logits[:, :-1][mask]
        with span("loss"):  # fp32 at least: a bf16 log-softmax over a large vocabulary loses precision
            logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
            logps = logits.log_softmax(-1).gather(1, labels[mask][:, None]).squeeze(1)
    count = int(sequence.max()) + 1  # every sequence of a pair has targets (gpupoor.data.dataset.encoded_chunk)
    sums = torch.zeros(count, dtype=logps.dtype, device=logps.device).index_add(0, sequence, logps)
    return sums, torch.bincount(sequence, minlength=count).to(logps.dtype)


@dataclass
class Reference:
    """DPO's frozen reference: `model` with its adapter switched off (the peft model being trained, unwrapped from
    DDP), or a frozen copy; `head`: its fused head (for adapter_off, the head as the base has it), or None."""

    model: torch.nn.Module
    head: FusedHead | None
    adapter_off: bool
    # The reference is a fixed function: its pass runs in eval mode, so the base model's own dropout (GPT-2, OPT,
    # Phi...) does not make it noisy. Off where a quantized model must evaluate in train mode (on the CPU: the one
    # rule is gpupoor.decisions.evaluates_in_train_mode).
    eval_mode: bool = True

    def logps(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        switch = self.model.disable_adapter() if self.adapter_off else contextlib.nullcontext()
        modes = [(module, module.training) for module in self.model.modules()] if self.eval_mode else []
        if self.eval_mode:
            self.model.eval()
        try:
            with torch.no_grad(), switch:
                return sequence_logps(self.model, batch, self.head)[0]
        finally:
            for module, training in modes:
                module.training = training


def frozen_head(model: torch.nn.Module, head: FusedHead | None) -> FusedHead | None:
    """The fused head of `model` (a peft model) with its adapter switched off: where peft trains a copy of the head
    (modules_to_save), the original."""
    if head is None:
        return None
    causal_lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    output = causal_lm.get_output_embeddings()
    return FusedHead(head.decoder, output.original_module) if hasattr(output, "original_module") else head


# ------------------------------------------------------------------------------------------- the objectives
def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, accurate near 0 and far from it (Maechler's two branches)."""
    x = x.clamp(max=-1e-7)  # an answer of probability 1 has infinite odds: capped
    return torch.where(x > -0.6931471805599453, torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def dpo_losses(chosen, rejected, ref_chosen, ref_rejected, chosen_tokens, rejected_tokens, beta: float,
               loss_type: str = "sigmoid", label_smoothing: float = 0.0) -> tuple[torch.Tensor, dict]:
    """Per-pair DPO losses from the sequences' summed log-probabilities (policy and reference), and the summed
    metrics. The reward of an answer is beta * (log pi - log pi_ref); accuracy counts a tie as half a pair (an
    untrained policy equals its reference: chance, 50%)."""
    chosen_ratio, rejected_ratio = chosen - ref_chosen, rejected - ref_rejected
    margin = chosen_ratio - rejected_ratio
    if loss_type == "sigmoid":  # with label smoothing: conservative DPO
        losses = -(1 - label_smoothing) * F.logsigmoid(beta * margin) - label_smoothing * F.logsigmoid(-beta * margin)
    elif loss_type == "hinge":
        losses = torch.relu(1 - beta * margin)
    elif loss_type == "ipo":  # per answer token, as TRL (and the IPO authors' experiments) normalize it
        losses = (chosen_ratio / chosen_tokens - rejected_ratio / rejected_tokens - 1 / (2 * beta)) ** 2
    else:
        raise ValueError(f"unknown DPO loss type {loss_type!r}")
    return losses, _reward_sums(beta * chosen_ratio.detach(), beta * rejected_ratio.detach(), chosen, rejected)


def orpo_losses(chosen, rejected, chosen_tokens, rejected_tokens, orpo_lambda: float) -> tuple[torch.Tensor, dict]:
    """Per-pair ORPO losses: the chosen answer's cross-entropy per token plus lambda times the odds-ratio term
    -log sigmoid(log odds(chosen) - log odds(rejected)), odds from the per-token log-probabilities (the paper, TRL);
    and the summed metrics (rewards: lambda x the per-token log-probabilities, as TRL logs them)."""
    chosen_mean, rejected_mean = chosen / chosen_tokens, rejected / rejected_tokens
    log_odds = (chosen_mean - rejected_mean) - (_log1mexp(chosen_mean) - _log1mexp(rejected_mean))
    ratio = F.logsigmoid(log_odds)
    losses = -chosen_mean - orpo_lambda * ratio
    sums = _reward_sums(orpo_lambda * chosen_mean.detach(), orpo_lambda * rejected_mean.detach(), chosen_mean,
                        rejected_mean)
    sums.update({"nll_loss": -chosen_mean.detach().sum(), "log_odds_ratio": ratio.detach().sum(),
                 "log_odds_chosen": log_odds.detach().sum()})
    return losses, sums


def _reward_sums(chosen_reward, rejected_reward, chosen_logps, rejected_logps) -> dict[str, torch.Tensor]:
    margin = chosen_reward - rejected_reward
    right = (margin > 0).to(margin.dtype) + 0.5 * (margin == 0).to(margin.dtype)
    return {"rewards/chosen": chosen_reward.sum(), "rewards/rejected": rejected_reward.sum(),
            "rewards/margins": margin.sum(), "rewards/accuracies": right.sum(),
            "logps/chosen": chosen_logps.detach().sum(), "logps/rejected": rejected_logps.detach().sum()}


@dataclass
class PreferenceLoss:
    """The training loss `(model, batch) -> (summed loss over pairs, {metric: sum over pairs})` for
    LoopSettings.loss_fn, and `evaluate` for its eval_fn."""

    objective: str  # dpo | orpo
    head: FusedHead | None  # the policy's fused head, or None for full logits
    reference: Reference | None  # dpo only
    beta: float = 0.1
    loss_type: str = "sigmoid"
    label_smoothing: float = 0.0
    orpo_lambda: float = 0.1

    def __call__(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict]:
        reference = self.reference.logps(batch) if self.reference is not None else None
        logps, tokens = sequence_logps(model, batch, self.head)
        with span("loss"):
            pairs = (logps[0::2], logps[1::2], tokens[0::2], tokens[1::2])
            if self.objective == "dpo":
                losses, sums = dpo_losses(pairs[0], pairs[1], reference[0::2], reference[1::2], pairs[2], pairs[3],
                                          self.beta, self.loss_type, self.label_smoothing)
            else:
                losses, sums = orpo_losses(*pairs, self.orpo_lambda)
        return losses.sum(), sums

    def evaluate(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple:
        """(summed loss, pairs ranked right, metric sums): eval_loss is the loss per pair, eval_accuracy the
        reward accuracy."""
        loss, sums = self(model, batch)
        return loss, sums["rewards/accuracies"], sums
