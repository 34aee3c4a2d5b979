"""The real-model demo's judge (docs/demo-real.md): held-out exact match of a base model, and of the same base
with a PEFT adapter, with greedy decoding through plain transformers + peft (not gpupoor's own generate, so the
figure does not depend on the code it judges), plus a no-collapse check: after fine-tuning the model must still
answer an unrelated question sensibly. Prints a before/after table.

    python -m gpupoor.scripts.demo_real --base path/to/SmolLM2-135M-Instruct.Q4_1.gguf \\
        --eval recipes/data/iso-dates-eval.jsonl [--adapter runs/demo-real/final] [--limit N]

The base is a `.gguf` file (loaded with transformers' GGUF support, dequantized to fp32) or a transformers
directory. With an adapter the last line is the verdict, PASS or FAIL and why: exit 1 when the adapter's exact
match is under --min-after, or it gained less than --min-gain over the base, or a general answer lost its word;
exit 2 on bad input."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

# Unrelated questions and a word any sensible answer contains; SmolLM2-135M-Instruct answers both before training.
# The first is of the kind the train file's replay rows teach (with France left out), the second of none.
GENERAL = [("What is the capital of France?", "paris"), ("What is the opposite of hot?", "cold")]
MAX_NEW_TOKENS = 16
BATCH = 16


@dataclass
class Scores:
    exact: int  # held-out rows answered exactly
    total: int
    answers: list[str]
    general_answers: list[str]
    seconds: float

    @property
    def accuracy(self) -> float:
        return self.exact / self.total

    @property
    def general_answered(self) -> int:
        """General questions whose answer says its word."""
        return sum(word in answer.lower() for (_, word), answer in zip(GENERAL, self.general_answers))


def read_eval_rows(path: Path) -> list[tuple[list[dict], str]]:
    """(prompt messages, expected answer) per chat row: the messages up to the last assistant turn, whose
    content is the answer."""
    rows = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            messages = json.loads(line)["messages"]
        except (json.JSONDecodeError, KeyError, TypeError) as error:
            raise SystemExit(_bad_input(f"{path}:{number}: not a chat row ({error}); each line must be "
                                        '{"messages": [..., {"role": "assistant", "content": ANSWER}]}'))
        if not messages or messages[-1].get("role") != "assistant":
            raise SystemExit(_bad_input(f"{path}:{number}: the last message is not the assistant's answer; "
                                        "end each row with the expected assistant reply"))
        rows.append((messages[:-1], messages[-1]["content"].strip()))
    if not rows:
        raise SystemExit(_bad_input(f"{path}: no rows; give a JSONL file of chat rows"))
    return rows


def _bad_input(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2


def load_base(base: Path):
    """Model and tokenizer from a .gguf file (dequantized to fp32) or a transformers directory."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not base.exists():
        raise SystemExit(_bad_input(f"{base}: no such file or directory; give the base model's .gguf file "
                                    "or a transformers model directory"))
    if base.suffix == ".gguf":
        where, extra = str(base.parent), {"gguf_file": base.name}
    else:
        where, extra = str(base), {}
    tokenizer = AutoTokenizer.from_pretrained(where, **extra)
    model = AutoModelForCausalLM.from_pretrained(where, dtype=torch.float32, **extra)
    tokenizer.padding_side = "left"  # batched greedy decoding: every prompt ends where generation starts
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model.eval(), tokenizer


def greedy_answers(model, tokenizer, conversations: list[list[dict]], label: str = "") -> list[str]:
    """Each conversation's next assistant reply, greedy, rendered with the model's own chat template; with a
    `label`, a progress line on stderr every 10 s (judging a column takes about 40 s on 2 cores)."""
    import torch

    from gpupoor.units import ProgressLine

    progress = ProgressLine(len(conversations), lambda text: print(text, file=sys.stderr), label, "rows answered") \
        if label else None
    answers = []
    for start in range(0, len(conversations), BATCH):
        prompts = [tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
                   for messages in conversations[start:start + BATCH]]
        batch = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            out = model.generate(**batch, max_new_tokens=MAX_NEW_TOKENS, do_sample=False,
                                 pad_token_id=tokenizer.pad_token_id)
        new = out[:, batch["input_ids"].shape[1]:]
        answers += [text.strip() for text in tokenizer.batch_decode(new, skip_special_tokens=True)]
        if progress is not None:
            progress.tick(len(new))
    return answers


def score(model, tokenizer, rows: list[tuple[list[dict], str]], label: str = "") -> Scores:
    started = time.perf_counter()
    answers = greedy_answers(model, tokenizer, [prompt for prompt, _ in rows], label)
    general = greedy_answers(model, tokenizer, [[{"role": "user", "content": question}] for question, _ in GENERAL])
    exact = sum(answer == expected for answer, (_, expected) in zip(answers, rows))
    return Scores(exact, len(rows), answers, general, time.perf_counter() - started)


def verdict(before: Scores, after: Scores, min_after: float, min_gain: float) -> list[str]:
    """Why the adapter fails the demo, one reason each; empty when it passes."""
    reasons = []
    if after.accuracy < min_after:
        reasons.append(f"the exact match after training is {after.exact}/{after.total} ({after.accuracy:.0%}), "
                       f"under the {min_after:.0%} asked (--min-after)")
    if after.accuracy - before.accuracy < min_gain:
        reasons.append(f"the gain is {after.accuracy - before.accuracy:+.0%} ({before.exact}/{before.total} -> "
                       f"{after.exact}/{after.total}), under the {min_gain:+.0%} asked (--min-gain)")
    for (question, word), answer in zip(GENERAL, after.general_answers):
        if word not in answer.lower():
            reasons.append(f"after training, {question!r} got {answer!r}, which does not say {word!r} (collapse)")
    return reasons


def print_table(rows: list[tuple[list[dict], str]], before: Scores, after: Scores | None, examples: int) -> None:
    """Two figures per column a person reads at a glance (exact match, general questions kept), then each general
    question's answers and the first held-out rows' answers, a mark before each: = exact, x not."""
    columns = ["before (base)"] + (["after (+ adapter)"] if after else [])
    scores = [before] + ([after] if after else [])
    print(f"\n{'':34}" + "".join(f"{name:>20}" for name in columns))
    print(f"{f'held-out exact match ({len(rows)} rows)':34}"
          + "".join(f"{f'{s.exact}/{s.total} ({s.accuracy:.0%})':>20}" for s in scores))
    print(f"{'general questions still answered':34}"
          + "".join(f"{f'{s.general_answered}/{len(GENERAL)}':>20}" for s in scores))
    for i, (question, word) in enumerate(GENERAL):
        print(f"\n{question} (must say {word!r})")
        for name, s in zip(columns, scores):
            print(f"  {name:>17}: {s.general_answers[i]!r}")
    if examples > 0:
        print(f"\nfirst {min(examples, len(rows))} held-out rows: expected, then {' and '.join(columns)}")
    for i, (prompt, expected) in enumerate(rows[:examples]):
        question = prompt[-1]["content"].split(":", 1)[-1].strip()
        marks = "  ".join(f"{'=' if s.answers[i] == expected else 'x'} {s.answers[i]!r}" for s in scores)
        print(f"  {question}\n    {expected}  {marks}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", type=Path, required=True, help="the base model: a .gguf file or a directory")
    parser.add_argument("--eval", type=Path, default=Path("recipes/data/iso-dates-eval.jsonl"))
    parser.add_argument("--adapter", type=Path, default=None, help="a PEFT adapter directory (e.g. RUN/final)")
    parser.add_argument("--examples", type=int, default=5, help="held-out rows to print with their answers")
    parser.add_argument("--min-after", type=float, default=0.8, help="the exact match the adapter must reach")
    parser.add_argument("--min-gain", type=float, default=0.5,
                        help="the least rise of the exact match from base to adapter (0.5: 50 points)")
    parser.add_argument("--limit", type=int, default=None, metavar="N",
                        help="score only the first N held-out rows (default: all); the test tier's short run")
    args = parser.parse_args(argv)
    if args.limit is not None and args.limit < 1:
        return _bad_input(f"--limit {args.limit}: must be at least 1 (the held-out rows to score); leave it out "
                          "to score them all")

    # transformers' GGUF loader draws its own tqdm bar; tqdm reads TQDM_DISABLE when it is imported
    os.environ.setdefault("TQDM_DISABLE", "1")
    from gpupoor.quiet import quiet_libraries

    quiet_libraries()
    import torch

    torch.manual_seed(0)
    rows = read_eval_rows(args.eval)[:args.limit]
    if args.adapter is not None and not (args.adapter / "adapter_config.json").is_file():
        return _bad_input(f"{args.adapter}: no adapter_config.json; give a PEFT adapter directory "
                          "(a run's final/ or checkpoints/step-N)")
    model, tokenizer = load_base(args.base)
    after = None
    if args.adapter is None:
        before = score(model, tokenizer, rows, "judging the base")
    else:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(args.adapter)).eval()
        with model.disable_adapter():  # the same weights with the adapter off: "before"
            before = score(model, tokenizer, rows, "judging the base")
        after = score(model, tokenizer, rows, "judging base + adapter")
    print_table(rows, before, after, args.examples)
    seconds = before.seconds + (after.seconds if after else 0)
    print(f"\n(greedy decoding of {len(rows)} rows per column; {seconds:.0f} s)")
    if after is None:
        return 0
    reasons = verdict(before, after, args.min_after, args.min_gain)
    if reasons:
        print("\nFAIL: " + "; ".join(reasons))
        return 1
    print(f"\nPASS: held-out exact match {before.exact}/{before.total} -> {after.exact}/{after.total} "
          f"({after.accuracy - before.accuracy:+.0%}), and both general questions still answered")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
