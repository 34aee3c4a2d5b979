"""GRPO's time plan refitted after the 2026-11-29 review, from the stored runs of this folder (nothing run again).

The review added work the plan had left out: the head on each row's last position (the model's own logits) and the
fused head's logits computed again in backward, and the reference's attention. This script adds those terms to
each stored run's plan, using that run's measured rates. It fits the sampling coefficients again as
`bench/time_accuracy.py --calibrate-grpo` would, keeping every other coefficient. It then predicts the held-out
runs with the result. Run from the repository root:
    python bench/results/time-2026-11-29-grpo-xeon/replanned_after_review.py"""

import json
import re
import sys
from pathlib import Path

sys.path.insert(0, "bench")
import time_accuracy  # noqa: E402

from gpupoor.plan.time.estimate import COEFFICIENTS  # noqa: E402

HERE = Path(__file__).parent
# (hidden, layers) of each model the runs used: bench/plan_accuracy.py's deep models, and the real SmolLM2-135M
SHAPES = {"deep-24x384": (384, 24), "deep-12x576": (576, 12), "deep-16x768": (768, 16), "real": (576, 30)}


def spec(settings: dict) -> tuple:
    """(model, prompts, group, new tokens, checkpointed, beta, iterations) of a run, from the recipe settings
    bench/time_accuracy.py wrote for it."""
    model = settings["model.name_or_path"]
    return ("real" if model == time_accuracy.REAL_MODEL else Path(model).name,
            settings["training.micro_batch_size"], settings["grpo.group_size"], settings["grpo.max_new_tokens"],
            settings.get("memory.gradient_checkpointing", False), settings.get("grpo.beta", 0) > 0,
            settings.get("grpo.iterations", 1))


def added_terms(plan: dict, model: str, prompts: int, group: int, new: int, checkpointed: bool, beta: bool,
                iterations: int) -> list[dict]:
    """The review's terms for one run (gpupoor.plan.time.grpo_work: head_extra, reference's head rows and attention)."""
    hidden, layers = SHAPES[model]
    work = {w["key"]: w for w in plan["work"]}
    length = float(re.search(r"\(([\d,.]+) tokens each\)", work["prefill"]["detail"]).group(1).replace(",", ""))
    head, answers, shared = 49152 * hidden, prompts * group, not checkpointed
    position = (prompts if shared else 0) + answers
    terms = [{"key": "head_extra", "kind": "matmul", "amount": 2 * head * (position + answers * new), "detail": ""}]
    if beta:
        pairs = (prompts * (length - 1) ** 2 + answers * new * (length - 1 + new)) if shared \
            else answers * (length + new) ** 2
        terms += [{"key": "reference_head_extra", "kind": "matmul", "amount": 2 * head * position / iterations,
                   "detail": ""},
                  {"key": "reference_attention", "kind": "attention",
                   "amount": 4 * hidden * layers * pairs / iterations, "detail": ""}]
    return terms


def with_terms(results: list[dict], settings_of: dict) -> list[dict]:
    for r in results:
        r["plan"]["work"] += added_terms(r["plan"], *spec(settings_of[r["name"]]))
    return results


def predicted(r: dict, coefficients: dict) -> float:
    seconds = time_accuracy.unit_seconds(r["plan"])
    return (sum(coefficients[k] * s for k, s in seconds.items()) + coefficients["micro_batch_s"]
            * r["plan"]["accumulation"] + coefficients["step_s"])


def main() -> None:
    time_accuracy.replanned = lambda r: r["plan"]  # the stored plan (with the added terms), not a new one
    calibration = with_terms(json.loads((HERE / "calibration-grpo.json").read_text()),
                             time_accuracy.GRPO_CALIBRATION)
    fitted = time_accuracy.fit(calibration, time_accuracy.GRPO_FREE)
    coefficients = {**COEFFICIENTS["cpu"], **fitted}
    accuracy = with_terms(json.loads((HERE / "accuracy-grpo.json").read_text()),
                          {name: settings for name, (_, settings) in time_accuracy.ACCURACY.items()})
    out = {"fitted": fitted,
           "calibration": {r["name"]: round(predicted(r, coefficients) / r["measured_step_s"] - 1, 4)
                           for r in calibration},
           "accuracy": [{"name": r["name"], "measured_step_s": r["measured_step_s"],
                         "planned_step_s_before": round(r["plan"]["step_s"], 4),
                         "planned_step_s": round(predicted(r, coefficients), 4),
                         "error": round(predicted(r, coefficients) / r["measured_step_s"] - 1, 4)}
                        for r in accuracy]}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
