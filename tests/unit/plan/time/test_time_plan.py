"""The time plan (gpupoor.plan.time.work, gpupoor.plan.time.estimate): each term's FLOPs against what torch's own FLOP counter
counts for the same forward and backward, and the arithmetic of sessions, saves and the time fit. Its accuracy in
seconds is a benchmark (bench/time_accuracy.py, docs/benchmarks.md), never a timed test."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from gpupoor.plan.time.work import BatchFacts, step_work, total_flops
from gpupoor.plan.time.estimate import COEFFICIENTS, RATE_OF_KIND, Rates, TimePlan, count_saves, predict_step_s
from gpupoor.recipe.schema import Recipe
from support.plan import tiny_llama_with, tiny_settings

BATCH, SEQ = 2, 16


def counted_flops(method: str, checkpointing: bool = False, last_layers=None) -> float:
    """torch's FlopCounterMode over one forward and backward of the tiny Llama with eager attention (its matmuls
    are bmm's the counter sees: the whole square, as a masked call computes it), the plain loss on every token."""
    model, _ = tiny_llama_with(method, layers=2, rank=8, checkpointing=checkpointing, last_layers=last_layers,
                               fused=False, attention="eager")
    ids = torch.randint(0, 300, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    with FlopCounterMode(display=False) as counter:
        model(input_ids=ids, labels=ids).loss.backward()
    return counter.get_total_flops()


def planned_flops(method: str, checkpointing: bool = False, last_layers=None) -> dict[str, float]:
    shape, settings = tiny_settings(layers=2, seq=SEQ, batch=BATCH, checkpointing=checkpointing, fused=False,
                                    attention="eager", method=method, rank=8, last_layers=last_layers)
    settings = replace(settings, fused_loss=False)  # the counted model computes the head on every token
    batch = BatchFacts(1, BATCH * SEQ, BATCH * SEQ, BATCH * SEQ, BATCH * SEQ**2, BATCH * SEQ**2)
    work = step_work(shape, settings, batch, accumulation=1)
    return {"matmul": sum(w.amount for w in work if w.kind in ("matmul", "recompute", "lora")),
            "attention": sum(w.amount for w in work if w.kind == "attention")}


@pytest.mark.parametrize("method, checkpointing, last_layers", [
    ("lora", False, None), ("full", False, None), ("lora", True, None), ("lora", False, 1), ("full", True, None),
    ("dora", False, None), ("dora", True, None)])
def test_the_planned_flops_are_what_torch_counts(method, checkpointing, last_layers):
    """Every linear, the head, LoRA's A and B and attention's two matmuls; backward only where gradients are
    needed (no weight gradient for a frozen weight, nothing below the lowest trained layer), and one more
    forward under checkpointing. DoRA: peft's rebuild of W + BA for its norms in each forward, no backward."""
    counted = counted_flops(method, checkpointing, last_layers)
    planned = planned_flops(method, checkpointing, last_layers)
    assert planned["attention"] > 0
    # (checkpointing: torch's non-reentrant recomputation stops once it has what backward needs, so a layer's
    # last ops may not run again; the plan counts the whole forward)
    tolerance = 0.06 if checkpointing else 0.01
    assert planned["matmul"] + planned["attention"] == pytest.approx(counted, rel=tolerance), (planned, counted)


def test_frozen_layers_below_run_no_backward_and_checkpointing_one_more_forward():
    every, last = planned_flops("lora"), planned_flops("lora", last_layers=1)
    assert last["matmul"] < every["matmul"]
    again = planned_flops("lora", checkpointing=True)
    assert again["matmul"] > every["matmul"]


def test_the_head_runs_on_target_tokens_only_under_the_fused_loss():
    shape, settings = tiny_settings(layers=2, seq=SEQ, batch=BATCH)
    batch = BatchFacts(1, 1000, 1000, 100, 0, 0)
    head = {w.key: w for w in step_work(shape, settings, batch, 1)}["head"]
    plain = {w.key: w for w in step_work(shape, replace(settings, fused_loss=False), batch, 1)}["head"]
    assert settings.fused_loss and plain.amount == pytest.approx(10 * head.amount)


def test_accumulation_multiplies_the_micro_batches_but_not_the_optimizer():
    shape, settings = tiny_settings(layers=2, seq=SEQ, batch=BATCH)
    batch = BatchFacts(10, 512, 500, 300, 10_000, 20_000)
    one, four = step_work(shape, settings, batch, 1), step_work(shape, settings, batch, 4)
    assert total_flops(four) == pytest.approx(4 * total_flops(one))
    assert [w.amount for w in four if w.kind == "optimizer"] == [w.amount for w in one if w.kind == "optimizer"]


def _plan(steps=100, step_s=2.0, startup_s=10.0, save_s=1.0, saves=2, limit=None) -> TimePlan:
    batch = BatchFacts(100, 1024, 1000, 800, 0, 0)
    return TimePlan(steps, 1, batch, [], Rates(1e11), step_s, startup_s, 0.0, saves, save_s, "test",
                    time_limit_s=limit)


def test_a_run_longer_than_its_limit_needs_sessions_that_each_save_before_the_end():
    plan = _plan(steps=1000, step_s=2.0, startup_s=10.0, save_s=1.0, saves=3, limit=600)
    per = plan.steps_per_session()
    # each session: start-up, the reserve training keeps (two saves and a step), its share of the saves
    assert per == int((600 - 10 - 2 - 2) / (2 + 3 / 1000))
    assert plan.sessions() == -(-1000 // per) and plan.sessions() > 1
    assert _plan(steps=10, limit=600).sessions() == 1
    assert _plan(steps=10, startup_s=700, limit=600).sessions() is None  # no step fits after start-up


def test_saves_follow_the_recipes_cadence():
    recipe = Recipe.model_validate({"model": {"name_or_path": "x"}, "data": {"path": "x.jsonl"},
                                    "checkpoint": {"every_steps": 10}})
    assert count_saves(recipe, 100, 1.0) == 9  # steps 10..90; step 100's is final/
    default = Recipe.model_validate({"model": {"name_or_path": "x"}, "data": {"path": "x.jsonl"}})
    assert count_saves(default, 3600, 1.0) == 2  # every 30 minutes by default


def test_the_step_time_grows_with_each_kind_of_work():
    shape, settings = tiny_settings(layers=2, seq=SEQ, batch=BATCH)
    batch = BatchFacts(1, 1024, 1024, 900, 1024 * 128, 1024 * 256)
    base = predict_step_s(step_work(shape, settings, batch, 1), Rates(1e11), 1, "cpu")
    bigger = predict_step_s(step_work(shape, settings, replace(batch, tokens=2048), 1), Rates(1e11), 1, "cpu")
    slower = predict_step_s(step_work(shape, settings, batch, 1), Rates(5e10), 1, "cpu")
    assert bigger > base and slower > base


def test_each_kind_of_work_goes_at_the_rate_measured_for_it():
    """Elementwise work at the elementwise probe's values a second, attention and LoRA at their own probes' rates,
    the optimizer at an AdamW step's parameters a second, calls at a call's measured seconds; where a rate was not
    probed (a GPU) the matmul rate, and a call's coefficient in seconds."""
    probed = Rates(matmul=1e12, lora=1e11, attention=1e10, values=1e9, optimizer=1e8, call=2e-5)
    assert probed.unit_s("matmul") == 1e-12 and probed.unit_s("lora") == 1e-11
    assert probed.unit_s("attention") == 1e-10
    assert probed.unit_s("elementwise") == probed.unit_s("dora") == probed.unit_s("dequantize") == 1e-9
    assert probed.unit_s("optimizer") == 1e-8 and probed.unit_s("recompute") == 1e-12
    assert probed.unit_s("calls") == 2e-5
    gpu = Rates(matmul=1e12)
    assert gpu.unit_s("elementwise") == gpu.unit_s("attention") == gpu.unit_s("lora") == 1e-12
    assert gpu.unit_s("calls") == 1.0
    shape, settings = tiny_settings(layers=2, seq=SEQ, batch=BATCH, checkpointing=True)
    batch = BatchFacts(1, 1024, 1024, 900, 1024 * 128, 1024 * 256)
    work = step_work(shape, settings, batch, 1)
    base = predict_step_s(work, probed, 1, "cpu")
    for field in ("matmul", "lora", "attention", "values", "optimizer"):  # each rate is used where it weighs
        uses = {w.kind for w in work if RATE_OF_KIND[w.kind] == field and COEFFICIENTS["cpu"][w.kind] > 0}
        slower = predict_step_s(work, replace(probed, **{field: getattr(probed, field) / 2}), 1, "cpu")
        assert (slower > base) == bool(uses), field


def test_the_attention_probe_takes_the_datas_mean_example():
    from gpupoor.plan.time.measure import attention_probe_shape

    # 4 examples of 100 tokens packed in 400 real tokens: per example 100 -> 96 (multiples of 16), 4 of them
    data = {"tokens": 512, "real_tokens": 400, "example_pairs": 4 * 100**2, "row_pairs": 512**2}
    assert attention_probe_shape(data, per_example=True) == (96, 4)
    assert attention_probe_shape(data, per_example=False) == (512, 1)


def test_the_probes_measure_training_shaped_work():
    """The child's probes (run here in process, on tiny shapes): finite rates, training's own attention function
    forward and backward, both layouts and precisions."""
    import math

    from gpupoor.plan.time import measure

    for precision in ("fp32", "bf16"):
        for per_example in (True, False):
            rate = measure.attention_rate("cpu", precision, 1, 4, 2, 16, 32, 3, per_example)
            assert math.isfinite(rate) and rate > 0
        assert measure.values_rate("cpu", precision, 1, 64, 32, 64) > 0
        assert measure.lora_rate("cpu", precision, 1, 64, 32, 64, 4) > 0
    assert 0 < measure.call_seconds(1, chain=4) < 1
    assert measure.optimizer_rate(1, params=2**12) > 0


def test_dora_with_dropout_runs_the_base_linears_again():
    """peft's DoRA with dropout computes the base linear once more on the dropped-out input (its base_result is
    not reused): a forward and an input gradient per adapted linear."""
    batch = BatchFacts(1, 1024, 1024, 900, 1024 * 128, 1024 * 256)
    shape, settings = tiny_settings(layers=2, seq=SEQ, batch=BATCH, method="dora")
    plain = step_work(shape, settings, batch, 1)
    dropped = step_work(*tiny_settings(layers=2, seq=SEQ, batch=BATCH, method="dora", dropout=0.1), batch, 1)
    assert "dora_base" not in {w.key for w in plain}
    extra = next(w.amount for w in dropped if w.key == "dora_base")
    # every linear of every layer adapted: 2 x weights x tokens, forward and input gradient
    assert extra == 2 * shape.layer_linear_params * shape.layers * 1024 * 2
