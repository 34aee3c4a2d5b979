"""`training.objective: grpo` as the loop's loss and eval functions: each micro-batch of prompts (rows of the data,
padded) gets a group of sampled answers per prompt, scored by the recipe's rewards, and the GRPO loss of those
answers (gpupoor.objectives.grpo.loss) is returned as a sum over prompts, which the loop divides by the prompts of the
whole accumulation window (`count_prompts`).

Exact resume: the answers of step s are sampled from the weights at step s with a seed made of the recipe's seed,
s, the micro-batch and the process (gpupoor.objectives.grpo.rollout.sample_groups leaves the global RNG alone), so a
run resumed from step s's checkpoint samples the same answers. With `grpo.iterations` N > 1 the answers sampled at
step s serve steps s .. s + N - 1 (the old policy's log-probabilities with them); they are kept in
`TrainState.rollout`, saved with every checkpoint, so a resume in between continues on the same answers.

A row's prompt is its tokens before its last run of targets (the last answer: a chat's earlier turns are prompt),
its expected answer that run's text. Evaluation answers each eval prompt greedily: eval_loss is minus the mean
reward (lower is better, as for every objective: early stopping and keep_best read it), eval_accuracy the share
of answers equal to the row's (the `exact` scorer), and each reward's mean."""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from typing import Callable

import torch

from gpupoor.data.assembly import IGNORE_INDEX
from gpupoor.objectives.grpo.loss import group_advantages, policy_loss
from gpupoor.objectives.grpo.rollout import (Sampled, answer_batch, answer_logprobs, sample_groups,
                                       shared_prompt_logprobs)
from gpupoor.profiling import span
from gpupoor.scorers import combined_scores, parse_scorer

# What each step record gains beside the per-reward means (reward_NAME): the mean reward, its spread within the
# groups (the mean of each group's standard deviation: 0 means nothing to learn from), the KL to the reference, the
# share of answer tokens the clip held, the mean answer length in tokens.
STEP_METRICS = ("reward", "reward_std", "kl", "clip_fraction", "answer_tokens")
EVAL_METRICS = ("reward", "answer_tokens")
SAMPLES_SHOWN = 1  # groups written to samples.jsonl at each log step (the first prompt's answers)


def count_prompts(batch: dict[str, torch.Tensor]) -> int:
    """Prompts in a micro-batch: one per row (GRPO's rows are never packed)."""
    return int(batch["input_ids"].shape[0])


def reward_names(specs: list[str]) -> list[str]:
    """Each reward's metric name: reward_ + its scorer reduced to letters, digits and _ (reward_exact,
    reward_regex_d, reward_mymod_score), numbered where two would be the same."""
    names = []
    for spec in specs:
        base = "reward_" + (re.sub(r"\W+", "_", spec).strip("_")[:32] or "custom")
        name, n = base, 2
        while name in names:
            name, n = f"{base}_{n}", n + 1
        names.append(name)
    return names


def prompts_and_answers(batch: dict[str, torch.Tensor]) -> tuple[list[list[int]], list[list[int]]]:
    """Each row's prompt ids (everything before its last run of targets) and that run's ids (the answer)."""
    prompts, answers = [], []
    for ids, labels, mask in zip(batch["input_ids"].tolist(), batch["labels"].tolist(),
                                 batch["attention_mask"].tolist()):
        length = sum(mask)
        ids, labels = ids[:length], labels[:length]
        targets = [i for i, label in enumerate(labels) if label != IGNORE_INDEX]
        if not targets:
            raise ValueError("a GRPO row has no answer tokens: its prompt filled data.max_length")
        start = targets[-1]
        while start > 0 and labels[start - 1] != IGNORE_INDEX:
            start -= 1
        prompts.append(ids[:start])
        answers.append(ids[start:targets[-1] + 1])
    return prompts, answers


def sampling_seed(seed: int, step: int, micro: int, rank: int) -> int:
    """The seed of one micro-batch's answers: a function of where they are in the run, nothing else."""
    digest = hashlib.sha256(f"grpo:{seed}:{step}:{micro}:{rank}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


@dataclass
class Rollout:
    """One micro-batch's sampled answers and what the update needs of them: JSON-safe (TrainState.rollout)."""

    sampled_at: int  # the step whose weights sampled them
    prompts: list[list[int]]  # each answer's prompt (a prompt repeated group_size times)
    answers: list[list[int]]
    advantages: list[float]
    rewards: list[float]
    scores: dict[str, list[float]]
    old_logp: list[list[float]] = field(default_factory=list)  # each answer token's log p when sampled
    ref_logp: list[list[float]] | None = None  # under the reference (beta > 0)

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def _padded(rows: list[list[float]], width: int, device) -> torch.Tensor:
    return torch.tensor([row + [0.0] * (width - len(row)) for row in rows], dtype=torch.float32, device=device)


def _unpadded(values: torch.Tensor, mask: torch.Tensor) -> list[list[float]]:
    return [row[:int(n)] for row, n in zip(values.tolist(), mask.sum(dim=1).tolist())]


class GrpoObjective:
    """The loop's loss_fn (training) and eval_fn for `training.objective: grpo`."""

    def __init__(self, grpo, tokenizer, *, generator, head, seed: int, rank: int, state_of: Callable,
                 reference: bool, share_prompts: bool = True):
        """`generator`: the bare model (samples; the reference with its adapter switched off); `head`: the fused
        head or None; `state_of()`: the run's TrainState now (its step; where rollouts are kept);
        `share_prompts`: the update reads each prompt once for its group (one process, no gradient
        checkpointing: a DDP forward cannot run twice before its backward, and checkpointing drops the cache)."""
        self.grpo, self.tokenizer, self.generator, self.head = grpo, tokenizer, generator, head
        self.seed, self.rank, self.state_of, self.reference = seed, rank, state_of, reference
        self.share_prompts = share_prompts
        self.scorers = [(parse_scorer(r.scorer, f"grpo.rewards[{i}].scorer", unit_range=False), r.weight)
                        for i, r in enumerate(grpo.rewards)]
        self.names = reward_names([r.scorer for r in grpo.rewards])
        self.metric_names = STEP_METRICS + tuple(self.names)
        self.eval_metric_names = EVAL_METRICS + tuple(self.names)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.samples: list[dict] = []  # the latest step's first groups, for samples.jsonl
        # Called between sampling and the update (the run sets it: on a CPU, gpupoor.train.heap's trimmer, since
        # sampling's many cache-sized blocks fragment the C heap the update's activations then grow into).
        self.after_sampling: Callable[[], None] | None = None
        self._step, self._micro = -1, 0

    def describe(self) -> str:
        """The startup summary's line."""
        g = self.grpo
        clip = f"{g.epsilon:g}" if g.epsilon_high is None else f"{g.epsilon:g}/{g.epsilon_high:g}"
        rewards = " + ".join(f"{w:g} x {s.name}" for s, w in self.scorers)
        return (f"GRPO: {g.group_size} answers per prompt of up to {g.max_new_tokens} tokens (temperature "
                f"{g.temperature:g}, top-p {g.top_p:g}), reward {rewards}, advantages "
                f"{'scaled by the group' + chr(39) + 's spread' if g.scale_rewards else 'unscaled (Dr. GRPO)'}, "
                f"clip {clip}, {g.loss_normalization}-normalised, "
                + (f"KL to the adapter-off base (beta {g.beta:g})" if g.beta else "no KL term (beta 0)")
                + (f", {g.iterations} updates per sampling" if g.iterations > 1 else "")
                + ("; each prompt read once for its group" if self.share_prompts else
                   "; each prompt read once per answer in the update (several processes or checkpointing)"))

    # ----------------------------------------------------------------------------------------- training
    def __call__(self, model, batch: dict[str, torch.Tensor]):
        state = self.state_of()
        if state.step != self._step:
            self._step, self._micro = state.step, 0
        micro, self._micro = self._micro, self._micro + 1
        iteration = state.step % self.grpo.iterations
        if iteration == 0:
            rollout = self._rollout(batch, state.step, micro)
            loss = self._loss(model, rollout, count_prompts(batch))  # (fills the rollout's old_logp)
            if self.grpo.iterations > 1:  # the next N - 1 steps update on these answers: kept with the state
                state.rollout = ([] if micro == 0 else state.rollout) + [rollout.to_dict()]
            return loss
        kept = state.rollout[micro] if micro < len(state.rollout) else None
        if kept is None or kept["sampled_at"] != state.step - iteration:
            raise RuntimeError(f"GRPO step {state.step + 1}: the answers sampled at step "
                               f"{state.step - iteration + 1} are not in the run's state")
        return self._loss(model, Rollout(**kept), count_prompts(batch))

    def _rollout(self, batch, step: int, micro: int) -> Rollout:
        """Sample, score and rank the answers of one micro-batch (and the reference's log-probabilities)."""
        grpo, group = self.grpo, self.grpo.group_size
        prompts, expected_ids = prompts_and_answers(batch)
        with span("generate"):
            sampled = sample_groups(self.generator, prompts, group_size=group, max_new_tokens=grpo.max_new_tokens,
                                    pad_id=self.pad_id, eos_id=self.tokenizer.eos_token_id,
                                    seed=sampling_seed(self.seed, step, micro, self.rank),
                                    temperature=grpo.temperature, top_p=grpo.top_p, share_prompts=True)
        if self.after_sampling is not None:
            self.after_sampling()
        rewards, scores, rows = self._score(prompts, expected_ids, sampled.answers, group, f"step {step + 1}")
        advantages = group_advantages(torch.tensor(rewards, dtype=torch.float64), group, scale=grpo.scale_rewards)
        rollout = Rollout(step, sampled.prompts, sampled.answers, advantages.tolist(), rewards, scores)
        if self.reference:
            with torch.no_grad(), self.generator.disable_adapter(), span("reference"):
                ref, mask = self._logprobs(self.generator, rollout, share=self.share_prompts)
            rollout.ref_logp = _unpadded(ref.float(), mask)
        self.samples = [{"step": step + 1, "prompt": row["prompt"], "expected": row["expected"],
                         "answers": [{"text": text, "reward": rewards[i], **{n: scores[s][i] for n, s in
                                                                              zip(self.names, scores)}}
                                     for i, text in enumerate(row["answers"], start=p * group)]}
                        for p, row in enumerate(rows[:SAMPLES_SHOWN])]
        return rollout

    def _score(self, prompts, expected_ids, answers, group: int, when: str):
        """(each answer's reward, each scorer's scores, each prompt's texts) of answers stored group by group."""
        decode = self.tokenizer.decode
        texts = self.tokenizer.batch_decode(answers, skip_special_tokens=True)
        # The expected answer without the whitespace a template puts after its end-of-turn token ("...\n").
        rows = [{"prompt": decode(p, skip_special_tokens=True),
                 "expected": decode(e, skip_special_tokens=True).strip(),
                 "answers": texts[i * group:(i + 1) * group]} for i, (p, e) in enumerate(zip(prompts, expected_ids))]
        each = [i // group for i in range(len(texts))]
        fields = [{"prompt": rows[i]["prompt"], "expected": rows[i]["expected"]} for i in each]
        wheres = [f"{when}, prompt {i + 1} of its micro-batch ({rows[i]['prompt'][-60:]!r})" for i in each]
        rewards, scores = combined_scores(self.scorers, texts, [f["expected"] for f in fields], fields, wheres)
        return rewards, scores, rows

    def _logprobs(self, model, rollout: Rollout, share: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Each answer token's log-probability under `model` at the sampling temperature, and where they are:
        each prompt read once for its group (`share`), or every prompt + answer row whole."""
        grpo, sampled = self.grpo, Sampled(rollout.prompts, rollout.answers)
        if share:
            return shared_prompt_logprobs(model, sampled, grpo.group_size, grpo.max_new_tokens, self.pad_id,
                                          self.head, grpo.temperature)
        device = next(self.generator.parameters()).device
        batch = {k: v.to(device) for k, v in answer_batch(sampled, self.pad_id).items()}
        return answer_logprobs(model, batch, grpo.max_new_tokens, self.head, grpo.temperature)

    def _loss(self, model, rollout: Rollout, prompts: int):
        """(the loss summed over prompts, each metric summed over prompts)."""
        grpo = self.grpo
        logp, mask = self._logprobs(model, rollout, self.share_prompts)
        width, device = logp.shape[1], logp.device
        if not rollout.old_logp:  # sampled by these very weights: the ratio is 1, only its gradient counts
            rollout.old_logp = _unpadded(logp.detach().float(), mask)
        old = logp.detach() if rollout.sampled_at == self.state_of().step else \
            _padded(rollout.old_logp, width, device).to(logp.dtype)
        ref = None if rollout.ref_logp is None else _padded(rollout.ref_logp, width, device).to(logp.dtype)
        advantages = torch.tensor(rollout.advantages, dtype=logp.dtype, device=device)
        result = policy_loss(logp, old, advantages, mask, epsilon=grpo.epsilon, epsilon_high=grpo.epsilon_high,
                             beta=grpo.beta, ref_logp=ref, normalization=grpo.loss_normalization,
                             max_new_tokens=grpo.max_new_tokens)
        rewards = torch.tensor(rollout.rewards, dtype=torch.float64).view(-1, grpo.group_size)
        lengths = [len(a) for a in rollout.answers]
        means = {"reward": float(rewards.mean()), "reward_std": float(rewards.std(dim=1).mean()),
                 "kl": result.kl, "clip_fraction": result.clip_fraction,
                 "answer_tokens": sum(lengths) / len(lengths)}
        means.update({name: sum(values) / len(values) for name, values in zip(self.names, rollout.scores.values())})
        return result.loss * prompts, {k: torch.tensor(v * prompts, device=device) for k, v in means.items()}

    # ----------------------------------------------------------------------------------------- evaluation
    def evaluate(self, model, batch: dict[str, torch.Tensor]):
        """(minus the summed reward, answers equal to the row's, each eval metric summed) of greedy answers."""
        prompts, expected_ids = prompts_and_answers(batch)
        sampled = sample_groups(self.generator, prompts, group_size=1, max_new_tokens=self.grpo.max_new_tokens,
                                pad_id=self.pad_id, eos_id=self.tokenizer.eos_token_id, seed=0, temperature=0.0)
        rewards, scores, rows = self._score(prompts, expected_ids, sampled.answers, 1, "eval")
        device = batch["input_ids"].device
        right = sum(row["answers"][0].strip() == row["expected"].strip() for row in rows)
        sums = {"reward": sum(rewards), "answer_tokens": float(sum(len(a) for a in sampled.answers))}
        sums.update({name: sum(values) for name, values in zip(self.names, scores.values())})
        return (torch.tensor(-sum(rewards), device=device), torch.tensor(float(right), device=device),
                {k: torch.tensor(v, device=device) for k, v in sums.items()})
