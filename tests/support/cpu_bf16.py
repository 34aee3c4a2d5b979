"""Shared by the cpu_bf16 tests (moved from integration/test_cpu_bf16.py, whose tests still use them)."""

from __future__ import annotations


U = 2.0 ** -8


# The first step's gradient norm (the whole backward, before any update): measured <= 4.2e-3 (1.1 U). Bound 8 U.
GRAD_REL = 8 * U


# The first step's loss: measured <= 3.6e-5 (U / 108). It is far closer than the logits because it is an fp32
# log-softmax averaged over ~100 target tokens, whose bf16 errors have random signs, and the tiny random model's
# logits are small (|logit| < 0.5), so the loss sits near ln(vocab) and moves little. Bound U / 8 = 4.9e-4, 13x.
LOSS_REL = U / 8
