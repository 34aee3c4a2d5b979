"""The knowledge-distillation loss as a sum over target tokens; the caller divides by the window's target
count, exactly as for the cross-entropy (gpupoor.objectives.cross_entropy).

For a target position with student logits z and teacher logits u (temperature T, weight a):

    a * T^2 * KL(softmax(u/T) || softmax(z/T)) + (1 - a) * CE(z, target)

- `plain_distill_loss_sum`: both models' full logits, then the formula. The reference, and the fallback when
  a head cannot be fused. Two batch x length x vocab tensors: at a 152k vocabulary that is most of the memory.
- `distill_loss_sum`: only the decoders' last hidden states of the target positions; the two heads run chunk
  by chunk over those tokens, and each chunk's logits give its loss and, in the same pass, the gradient
  with respect to the student's hidden states and head, so neither model's full logits ever exist and
  backward needs no recomputation (as `gpupoor.objectives.cross_entropy.fused_loss_sum` does for the cross-entropy).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from gpupoor.data.assembly import IGNORE_INDEX
from gpupoor.decisions import loss_chunk_tokens
from gpupoor.errors import UserError
from gpupoor.objectives.cross_entropy import (FusedHead, accumulate_head_grads, head_logits, last_hidden_state, model_inputs,
                          precomputed_backward)
from gpupoor.profiling import span


class _LinearDistill(torch.autograd.Function):
    """sum_i [a T^2 KL(softmax(u_i/T) || softmax(z_i/T)) + (1 - a) CE(z_i, target_i)] with z = hidden @ weight.T
    and u = teacher_hidden @ teacher_weight.T, the KL over the first min(V_s, V_t) ids; gradients for the
    student's hidden states and head weight are computed chunk by chunk in forward."""

    @staticmethod
    def forward(ctx, hidden, weight, teacher_hidden, teacher_weight, targets, temperature, kd_weight, chunk):
        want_hidden = ctx.needs_input_grad[0]
        want_weight = ctx.needs_input_grad[1]
        # Softmax statistics in fp32 at least: a bf16 log-sum-exp over a large vocabulary loses precision.
        acc = torch.promote_types(hidden.dtype, torch.float32)
        T, a = float(temperature), float(kd_weight)
        common = min(weight.shape[0], teacher_weight.shape[0])  # a padded head's extra ids never occur
        loss = torch.zeros((), dtype=acc, device=hidden.device)
        grad_hidden = torch.empty_like(hidden) if want_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=acc, device=weight.device) if want_weight else None
        for start in range(0, hidden.shape[0], chunk):
            h = hidden[start:start + chunk]
            t = targets[start:start + chunk]
            logits = head_logits(h, weight, acc)
            if a > 0:
                teacher = head_logits(teacher_hidden[start:start + chunk], teacher_weight, acc)[:, :common]
                if T != 1:
                    teacher.div_(T)
                scaled = torch.div(logits[:, :common], T)
                lse_teacher = torch.logsumexp(teacher, dim=-1)
                lse_scaled = torch.logsumexp(scaled, dim=-1)
                # KL(p||q) = sum_v p_v (log p_v - log q_v). Buffers are reused in place: a chunk holds three
                # vocabulary-wide tensors (and logsumexp's temporary).
                log_ratio = scaled.sub_(teacher).sub_((lse_scaled - lse_teacher)[:, None])  # log q - log p
                p = teacher.sub_(lse_teacher[:, None]).exp_()
                kl = -log_ratio.mul_(p).sum(dim=-1)
                loss += a * T * T * kl.sum()
            if a < 1:
                lse = torch.logsumexp(logits, dim=-1)
                loss += (1 - a) * (lse - logits.gather(1, t[:, None]).squeeze(1)).sum()
            if not (want_hidden or want_weight):
                continue
            # d/dz = a T (softmax(z/T) - softmax(u/T)) + (1 - a) (softmax(z) - one_hot), built in place.
            if a > 0:
                q_minus_p = torch.div(logits[:, :common], T, out=scaled).sub_(lse_scaled[:, None]).exp_().sub_(p)
                del teacher, p
            if a < 1:
                grad = logits.sub_(lse[:, None]).exp_()
                grad[torch.arange(len(t), device=t.device), t] -= 1.0
                if a > 0:
                    grad.mul_(1 - a)
            else:
                grad = logits.zero_()  # the ids beyond the teacher's head get no KL gradient
            if a > 0:
                grad[:, :common].add_(q_minus_p, alpha=a * T)
            accumulate_head_grads(grad, h, weight, grad_hidden, grad_weight, slice(start, start + chunk))
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.weight_dtype = weight.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        return precomputed_backward(ctx, grad_loss, extra_inputs=6)


def linear_distill_sum(student_hidden: torch.Tensor, student_weight: torch.Tensor, teacher_hidden: torch.Tensor,
                       teacher_weight: torch.Tensor, targets: torch.Tensor, temperature: float, weight: float,
                       chunk: int | None = None) -> torch.Tensor:
    """The summed distillation loss of `student_hidden @ student_weight.T` against the teacher's
    `teacher_hidden @ teacher_weight.T` and `targets`, never holding either model's logits for all the
    tokens. Rows are target positions. The KL covers the ids both heads have (a head padded beyond the
    tokenizer has ids no target uses); the cross-entropy the student's whole head. `chunk`: target tokens per
    chunk (default: gpupoor.decisions.loss_chunk_tokens of the larger vocabulary)."""
    if student_hidden.shape[0] == 0:  # keeps the graph connected for an empty batch
        return student_hidden.sum() * 0.0 + student_weight.sum() * 0.0
    if chunk is None:
        chunk = loss_chunk_tokens(max(student_weight.shape[0], teacher_weight.shape[0]))
    # The teacher is frozen: no gradient flows into it, whatever its parameters say.
    with span("loss"):
        return _LinearDistill.apply(student_hidden, student_weight, teacher_hidden.detach(), teacher_weight.detach(),
                                    targets, temperature, weight, chunk)


def distill_loss_sum(student_model: torch.nn.Module, teacher_model: torch.nn.Module, batch: dict[str, torch.Tensor],
                     student_head: FusedHead, teacher_head: FusedHead, temperature: float,
                     weight: float) -> torch.Tensor:
    """The summed distillation loss of one micro-batch through both fused heads (gpupoor.objectives.cross_entropy.find_fused_head).
    The teacher runs under no_grad; putting it in eval mode is the caller's job. Its hidden states may be in
    another dtype (bf16, a 4-bit model's compute dtype): its logits are computed in fp32 per chunk."""
    student = last_hidden_state(student_model, batch, student_head)
    with torch.no_grad():
        teacher = last_hidden_state(teacher_model, batch, teacher_head)
    labels = batch["labels"][:, 1:]
    mask = labels != IGNORE_INDEX  # only positions whose next token is a target reach the heads
    return linear_distill_sum(student[:, :-1][mask], student_head.weight, teacher[:, :-1][mask],
                              teacher_head.weight, labels[mask], temperature, weight)


def plain_distill_loss_sum(student_model: torch.nn.Module, teacher_model: torch.nn.Module,
                           batch: dict[str, torch.Tensor], temperature: float, weight: float) -> torch.Tensor:
    """The same sum from both models' full logits: the reference for the fused loss, and the fallback when a
    head cannot be fused (an adapted head, post-processed logits)."""
    labels = batch["labels"][:, 1:]
    mask = labels != IGNORE_INDEX
    with span("forward"):
        logits = student_model(**model_inputs(batch), use_cache=False).logits[:, :-1][mask]
        # fp32 at least: a bf16 log-softmax over a large vocabulary loses precision.
        acc = torch.promote_types(logits.dtype, torch.float32)
        student = logits.to(acc)
        with torch.no_grad():
            teacher = teacher_model(**model_inputs(batch), use_cache=False).logits[:, :-1][mask].to(acc)
    with span("loss"):
        common = min(student.shape[-1], teacher.shape[-1])
        kl = F.kl_div(F.log_softmax(student[:, :common] / temperature, dim=-1),
                      F.log_softmax(teacher[:, :common] / temperature, dim=-1), log_target=True, reduction="sum")
        ce = F.cross_entropy(student, labels[mask], reduction="sum")
        return weight * temperature ** 2 * kl + (1 - weight) * ce


def check_vocabularies(student_tokenizer, teacher_tokenizer) -> None:
    """Distillation compares the two models' probabilities id by id: the tokenizers must map every token to
    the same id."""
    student, teacher = student_tokenizer.get_vocab(), teacher_tokenizer.get_vocab()
    if student == teacher:
        return
    differ = sum(1 for token, index in teacher.items() if student.get(token) != index)
    differ += sum(1 for token in student if token not in teacher)
    raise UserError(
        f"distill.teacher: the teacher's tokenizer ({len(teacher):,} tokens) differs from the student's "
        f"({len(student):,} tokens): {differ:,} tokens are missing from one or have another id",
        hint="the teacher must use the student's tokenizer (a larger model of the same family); distillation "
             "compares the two models' token probabilities id by id")
