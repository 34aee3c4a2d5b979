"""The causal-LM loss as a sum over target tokens; the caller divides by the token count of the whole
accumulation window, so every target token weighs the same however the batch was split.

Two ways to compute it:
- `plain_loss_sum`: the model's logits for every position, then cross-entropy. Simple; the logits tensor
  (batch x length x vocab, in fp32 for the loss) dominates memory at large vocabularies.
- `fused_loss_sum` (default): the decoder's last hidden states for the *target* positions only go through
  the output head chunk by chunk; each chunk's logits give its loss and, in the same pass, the gradient
  with respect to the hidden states (softmax - one-hot) @ W, so the full logits never exist and backward
  needs no recomputation. Prompt and padding positions never reach the head at all.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from gpupoor.data.assembly import IGNORE_INDEX
from gpupoor.decisions import choose_fused_loss, logit_postprocessing, loss_chunk_tokens
from gpupoor.profiling import span


def model_inputs(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What the model gets: padded batches carry an attention_mask, packed ones restarted position_ids."""
    return {key: batch[key] for key in ("input_ids", "attention_mask", "position_ids") if key in batch}


def plain_loss_sum(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    with span("forward"):
        logits = model(**model_inputs(batch), use_cache=False).logits
    with span("loss"):
        # Position t predicts token t+1. Compute in fp32: a bf16 log-softmax over a large vocab loses precision.
        shifted = logits[:, :-1, :].float()
        targets = batch["labels"][:, 1:]
        return F.cross_entropy(shifted.reshape(-1, shifted.size(-1)), targets.reshape(-1),
                               ignore_index=IGNORE_INDEX, reduction="sum")


class _LinearCrossEntropy(torch.autograd.Function):
    """sum_i CE(hidden_i @ weight.T, target_i), with gradients computed chunk by chunk in forward."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk):
        want_hidden = ctx.needs_input_grad[0]
        want_weight = ctx.needs_input_grad[1]
        # Softmax statistics in fp32 at least: a bf16 log-sum-exp over a large vocabulary loses precision.
        acc = torch.promote_types(hidden.dtype, torch.float32)
        loss = torch.zeros((), dtype=acc, device=hidden.device)
        grad_hidden = torch.empty_like(hidden) if want_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=acc, device=weight.device) if want_weight else None
        for start in range(0, hidden.shape[0], chunk):
            h = hidden[start:start + chunk]
            t = targets[start:start + chunk]
            logits = (h @ weight.t()).to(acc)
            target = logits.gather(1, t[:, None]).squeeze(1)
            # The log-sum-exp in place over the logits buffer, which then holds exp(logit - max): torch.logsumexp
            # would allocate a chunk-sized temporary and the softmax would read the chunk twice more (measured:
            # the head's forward and backward take 20-25% less time at a 152k vocabulary).
            top = logits.amax(dim=1)
            sums = logits.sub_(top[:, None]).exp_().sum(dim=1)
            loss += (sums.log() + top - target).sum()
            if want_hidden or want_weight:
                accumulate_softmax_grads(logits, sums, t, h, weight, grad_hidden, grad_weight,
                                         slice(start, start + chunk))
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.weight_dtype = weight.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        return precomputed_backward(ctx, grad_loss, extra_inputs=2)


def accumulate_softmax_grads(exps: torch.Tensor, sums: torch.Tensor, targets: torch.Tensor, hidden: torch.Tensor,
                             weight: torch.Tensor, grad_hidden: torch.Tensor | None, grad_weight: torch.Tensor | None,
                             rows: slice) -> None:
    """accumulate_head_grads for the cross-entropy, whose d(loss)/d(logits) is softmax - one_hot = exps / sums
    - one_hot (`exps`: the chunk's exp(logit - row max), `sums`: their row sums), made in place in fp32 before
    any matmul. (Applying the 1/sums and the one-hot to the small products instead, exps @ W / sums - W[target],
    subtracts two nearly equal terms once the model is confident: under bf16 matmuls their rounding, ~0.4% of
    each, swamped a gradient of p - 1 = -0.02, and the CPU demo stalled at 58% held-out accuracy against 100%.)"""
    exps.mul_(sums.reciprocal()[:, None])
    exps[torch.arange(targets.shape[0], device=exps.device), targets] -= 1
    accumulate_head_grads(exps, hidden, weight, grad_hidden, grad_weight, rows)


def accumulate_head_grads(grad_logits: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor,
                          grad_hidden: torch.Tensor | None, grad_weight: torch.Tensor | None, rows: slice) -> None:
    """From d(loss)/d(logits) of one chunk: its rows of d(loss)/d(hidden), and its share of d(loss)/d(weight)
    (accumulated in grad_weight's dtype, fp32 at least)."""
    if grad_hidden is not None:
        grad_hidden[rows] = (grad_logits.to(weight.dtype) @ weight).to(grad_hidden.dtype)
    if grad_weight is not None:
        grad_weight += grad_logits.t() @ hidden.to(grad_weight.dtype)


@functools.lru_cache(maxsize=None)
def _mm_has_out_dtype(device_type: str, dtype: torch.dtype, acc: torch.dtype) -> bool:
    """Whether torch.mm can multiply `dtype` matrices straight into an `acc` result on this device (its
    out_dtype: CUDA only, bf16/fp16 -> fp32; the CPU has no kernel for it). Asked once per device and dtype."""
    try:
        ones = torch.ones(2, 2, dtype=dtype, device=device_type)
        product = torch.mm(ones, ones, out_dtype=acc)
        return product.dtype == acc and bool((product == 2).all())
    except (RuntimeError, TypeError, NotImplementedError):
        return False


def head_logits(hidden: torch.Tensor, weight: torch.Tensor, acc: torch.dtype) -> torch.Tensor:
    """hidden @ weight.T in `acc` (fp32 at least). A bf16 head is never copied to fp32 whole: where the device
    cannot write an fp32 product of bf16 matrices, the head is cast slice by slice, each slice no larger than
    the logits themselves. (Rounded to bf16, a logit of 10 moves by up to 0.03 and its probability by 3%.)"""
    if weight.dtype == acc:
        return hidden.to(acc) @ weight.t()
    if _mm_has_out_dtype(weight.device.type, weight.dtype, acc):
        return torch.mm(hidden.to(weight.dtype), weight.t(), out_dtype=acc)
    out = torch.empty(hidden.shape[0], weight.shape[0], dtype=acc, device=hidden.device)
    hidden = hidden.to(acc)
    rows = max(1, out.numel() // max(1, weight.shape[1]))
    for start in range(0, weight.shape[0], rows):
        out[:, start:start + rows] = hidden @ weight[start:start + rows].to(acc).t()
    return out


def precomputed_backward(ctx, grad_loss: torch.Tensor, extra_inputs: int) -> tuple:
    """Backward of a chunked head loss whose forward already computed d(loss)/d(hidden) and d(loss)/d(weight)
    (saved as ctx's tensors): scale them by the upstream gradient; no gradient for the other inputs."""
    grad_hidden, grad_weight = ctx.saved_tensors
    return (grad_hidden * grad_loss.to(grad_hidden.dtype) if grad_hidden is not None else None,
            (grad_weight * grad_loss).to(ctx.weight_dtype) if grad_weight is not None else None,
            *([None] * extra_inputs))


def linear_cross_entropy_sum(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed cross-entropy of `hidden @ weight.T` against `targets`, never holding all the logits."""
    if hidden.shape[0] == 0:
        return hidden.sum() * 0.0 + weight.sum() * 0.0  # keeps the graph connected for an empty batch
    chunk = loss_chunk_tokens(weight.shape[0])
    if weight.requires_grad and weight.dtype == torch.float32 and torch.is_autocast_enabled(hidden.device.type):
        # A trained head (full fine-tuning, or modules_to_save) keeps its fp32 master weights in fp32 matmuls: in
        # bf16 the CPU demo's trained head stalled at eval loss 0.10-0.17 (58-98% held-out accuracy) where fp32
        # reaches 0.02 (100%); single runs of its 225 steps took 26.8 s with this against 24.2 s without (an AMX
        # Xeon, 2 cores; not a benchmark). A frozen head stays in bf16.
        with span("loss"), torch.autocast(hidden.device.type, enabled=False):
            return _LinearCrossEntropy.apply(hidden.float(), weight, targets, chunk)
    with span("loss"):
        return _LinearCrossEntropy.apply(hidden, weight, targets, chunk)


@dataclass
class FusedHead:
    """Where the fused loss reads from: the decoder (hooked for its last hidden state) and the head weight."""

    decoder: torch.nn.Module
    head: torch.nn.Module

    @property
    def weight(self) -> torch.Tensor:
        return self.head.weight


def find_fused_head(model: torch.nn.Module, enabled: bool = True) -> tuple[FusedHead | None, str]:
    """The decoder and output head to fuse, or None and why the plain loss must be used (the rule is
    gpupoor.decisions.choose_fused_loss; `enabled` is memory.fused_cross_entropy)."""
    causal_lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    head = causal_lm.get_output_embeddings()
    if hasattr(head, "modules_to_save"):  # peft trains a copy of the head: use the active copy
        head = head.modules_to_save[head.active_adapter if isinstance(head.active_adapter, str) else head.active_adapter[0]]
    decoder = causal_lm.get_decoder() if hasattr(causal_lm, "get_decoder") else None
    fused, reason = choose_fused_loss(
        enabled, logit_postprocessing(lambda key: getattr(causal_lm.config, key, None)),
        head_adapted=type(head) is not torch.nn.Linear or head.bias is not None, has_decoder=decoder is not None)
    return (FusedHead(decoder, head) if fused else None), reason


def last_hidden_state(model: torch.nn.Module, batch: dict[str, torch.Tensor], fused: FusedHead, **forward):
    """The decoder's output for every position, taken from a hook while the model's own forward runs (so
    DDP/FSDP wrappers and peft hooks do their part); the model computes the logits of one position only.
    `forward`: further arguments of the forward (GRPO's prompt cache)."""
    captured = {}

    def keep_hidden(module, args, output):
        captured["hidden"] = output[0] if isinstance(output, tuple) else output.last_hidden_state

    handles = [fused.decoder.register_forward_hook(keep_hidden),
               # That one position's logits come from a slice of the hidden states: on a CPU a bf16 linear of a
               # non-contiguous 3-D slice copies the head weight once per row (0.44 s a step at micro-batch 8
               # and SmolLM2's 49,152 x 384 head, measured; 3 ms contiguous).
               fused.head.register_forward_pre_hook(lambda module, args: (args[0].contiguous(), *args[1:]))]
    try:
        with span("forward"):
            model(**model_inputs(batch), **{"use_cache": False, "logits_to_keep": 1, **forward})
    finally:
        for handle in handles:
            handle.remove()
    return captured["hidden"]


def fused_loss_sum(model: torch.nn.Module, batch: dict[str, torch.Tensor], fused: FusedHead) -> torch.Tensor:
    hidden = last_hidden_state(model, batch, fused)
    labels = batch["labels"][:, 1:]
    mask = labels != IGNORE_INDEX
    hidden = hidden[:, :-1][mask]  # only positions whose next token is a target
    return linear_cross_entropy_sum(hidden, fused.weight, labels[mask])


# ----------------------------------------------------------------------------------------------------- eval
def plain_eval_sums(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed cross-entropy, number of targets the model ranks first) from the model's full logits."""
    logits = model(**model_inputs(batch), use_cache=False).logits[:, :-1, :]
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # fp32 at least, as the fused path
    targets = batch["labels"][:, 1:]
    loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1), ignore_index=IGNORE_INDEX,
                           reduction="sum")
    correct = ((logits.argmax(-1) == targets) & (targets != IGNORE_INDEX)).sum()
    return loss, correct


@torch.no_grad()
def fused_eval_sums(model: torch.nn.Module, batch: dict[str, torch.Tensor],
                    fused: FusedHead) -> tuple[torch.Tensor, torch.Tensor]:
    """The same two sums through the fused head, chunk by chunk over the target positions: token accuracy
    costs one argmax per chunk of logits that the loss computes anyway, and no vocabulary-sized tensor per batch."""
    hidden = last_hidden_state(model, batch, fused)
    labels = batch["labels"][:, 1:]
    mask = labels != IGNORE_INDEX
    hidden, targets, weight = hidden[:, :-1][mask], labels[mask], fused.weight
    acc = torch.promote_types(hidden.dtype, torch.float32)
    loss = torch.zeros((), dtype=acc, device=hidden.device)
    correct = torch.zeros((), dtype=torch.long, device=hidden.device)
    chunk = loss_chunk_tokens(weight.shape[0])
    for start in range(0, hidden.shape[0], chunk):
        logits = (hidden[start:start + chunk] @ weight.t()).to(acc)
        t = targets[start:start + chunk]
        loss += (torch.logsumexp(logits, dim=-1) - logits.gather(1, t[:, None]).squeeze(1)).sum()
        correct += (logits.argmax(-1) == t).sum()
    return loss, correct


def mean_nll(model, examples: list[tuple[torch.Tensor, torch.Tensor]], batch_size: int = 4) -> tuple[float, int]:
    """(mean negative log-likelihood per target token, target tokens) of `model` on the examples, in float64 sums:
    `gpupoor eval`'s loss column and `export`'s perplexity (of the model, and of each file read back)."""
    from gpupoor.data.build import collate
    from gpupoor.errors import UserError

    total, count = 0.0, 0
    model.eval()
    with torch.no_grad():
        for start in range(0, len(examples), batch_size):
            rows = examples[start:start + batch_size]
            batch = collate(rows, list(range(len(rows))), pad_id=0)  # padding is masked out: any id works
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
            labels = batch["labels"][:, 1:]
            losses = torch.nn.functional.cross_entropy(logits[:, :-1].double().flatten(0, 1), labels.flatten(),
                                                       ignore_index=IGNORE_INDEX, reduction="sum")
            total += float(losses)
            count += int((labels != IGNORE_INDEX).sum())
    if count == 0:
        raise UserError("the eval text has no target tokens to score")
    return total / count, count
