"""The time plan's child process (`python -m gpupoor.run.measuring REQUEST.json`, started by
gpupoor.plan.time.facts.measure): it imports torch, measures what the request asks (gpupoor.plan.time.measure's probes and
data count, gpupoor.run.step_probe's steps at two depths and the weights' load) and prints one JSON answer. It
lives with the run, not the plan: the step probe trains, and the plan imports nothing that does."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from gpupoor.plan.time.measure import (attention_probe_shape, attention_rate, call_seconds, data_facts, lora_rate,
                                  matmul_rate, optimizer_rate, values_rate)


def main() -> None:
    request = json.loads(Path(sys.argv[1]).read_text())
    # imported by the command line before a run's clock starts (its "python and cli" part, planned apart): not timed
    import typer  # noqa: F401

    import gpupoor.recipe.loading  # noqa: F401
    from gpupoor.run.session import import_libraries

    started = time.perf_counter()

    import_libraries()  # what a run imports, in its order: their time is start-up the plan predicts
    import torch

    answer: dict = {"import_s": round(time.perf_counter() - started, 3), "torch": torch.__version__}
    from gpupoor.model.load import remember_loads

    remember_loads()  # the data's count and each depth of the step probe load the same tokenizer and config
    for kind in ("rate", "decode"):  # the decode step's matmul: the same probe at its rows
        if kind in request:
            r = request[kind]
            answer[kind] = matmul_rate(r["device"], r["precision"], r.get("threads"), r["m"], r["k"], r["n"])
    if "data" in request:
        d = request["data"]
        answer["data"] = data_facts(d["recipe"], d["sampler"])
    if "attention" in request:  # its shape from the data facts: measured just now or cached (sent with the request)
        a = request["attention"]
        length, count = attention_probe_shape(answer.get("data") or a["data"], a["per_example"])
        answer["attention"] = {"length": length, "rate": attention_rate(
            a["device"], a["precision"], a.get("threads"), a["heads"], a["kv_heads"], a["head_dim"], length, count,
            a["per_example"])}
    if "lora" in request:
        r = request["lora"]
        answer["lora"] = lora_rate(r["device"], r["precision"], r.get("threads"), r["m"], r["k"], r["n"], r["rank"])
    if "values" in request:
        v = request["values"]
        answer["values"] = values_rate(v["device"], v["precision"], v.get("threads"), v["m"], v["hidden"],
                                       v["intermediate"])
    if "optimizer" in request:
        answer["optimizer"] = optimizer_rate(request["optimizer"].get("threads"))
    if "call" in request:
        answer["call"] = call_seconds(request["call"].get("threads"))
    if "load" in request:
        from gpupoor.run.step_probe import gguf_load_facts, read_rate

        weights = request["load"]
        answer["load"] = gguf_load_facts(weights["gguf"]) if "gguf" in weights else {
            "read_rate": read_rate(weights["read"])}
    if "steps" in request:  # last: the data is tokenized and cached by now, as a run after the plan finds it
        from gpupoor.run.step_probe import probe_steps

        answer["steps"] = probe_steps(request["steps"])
    if "write_to" in request:
        from gpupoor.plan.time.facts import write_rate

        answer["write_rate"] = write_rate(Path(request["write_to"]))
    print(json.dumps(answer))


if __name__ == "__main__":
    main()
