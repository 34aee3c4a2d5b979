"""The measured time plan (issue #57): the step probe's depths extrapolated to the whole model
(gpupoor.plan.time.probed), the weights' load from its measured parts, the plan's range and the sessions it needs at
each end of it (in --json too), and the model the probe builds (gpupoor.model.load.probe_depth). The probe's
accuracy in seconds is a benchmark (bench/time_accuracy.py), never a timed test: these feed it made-up times."""

from __future__ import annotations

import pytest
import torch

from gpupoor.model.load import cut_layers, layer_count, load_base_model, probe_depth, probing
from gpupoor.plan.time.work import BatchFacts
from gpupoor.plan.time.probed import GGUF_READS, MODULES_PER_TENSOR, probed_step, spread, weights_read_s
from gpupoor.plan.time.estimate import Rates, TimePlan
from gpupoor.recipe.schema import ModelSection, QuantizationSection
from gpupoor.run.step_probe import probe_depths, probe_recipe, timed_steps


def made_up_probe(rest: float, per_layer_token: float, tokens: list[int], depths=(1, 8), layers=30,
                  noise: dict | None = None) -> dict:
    """A probe whose steps cost `rest` plus `per_layer_token` x tokens a layer, exactly; `noise`: {(depth, step):
    seconds} added (another process's burst)."""
    noise = noise or {}
    runs = []
    for depth in depths:
        times = [rest + depth * per_layer_token * t + noise.get((depth, i), 0.0) for i, t in enumerate(tokens)]
        runs.append({"layers": depth, "step_s": times, "tokens": tokens, "startup": {
            "accelerator and tokenizer": 0.2, "data": 0.1, "model": 0.5 + depth * 0.01, "optimizer": 0.01}})
    return {"layers": layers, "cycle": 1, "depths": runs, "probe_s": 12.0}


def test_the_step_is_extrapolated_per_layer_and_per_token_to_the_whole_model():
    tokens = [640, 640, 640, 1024, 1024, 1024, 1024]  # the epoch's first batches: narrower than its mean
    probe = made_up_probe(rest=0.25, per_layer_token=1e-4, tokens=tokens)
    step = probed_step(probe, accumulation=1, optimizer_s=0.0, epoch_tokens=882.0, first_tokens=tokens)
    assert step.step_s == pytest.approx(0.25 + 30 * 1e-4 * 882)  # at the epoch's mean tokens, not the probe's
    assert step.layer_s == pytest.approx(1e-4 * 882) and step.rest_s == pytest.approx(0.25)
    assert step.depths == (1, 8) and step.probe_s == 12.0
    # the shallow model's build is the load's fixed part; the tokenizer and data as measured
    assert step.build_s == pytest.approx(0.51) and step.startup_parts["data"] == 0.1


def test_a_burst_of_other_work_in_one_step_does_not_move_the_plan():
    tokens = [1000] * 7
    quiet = probed_step(made_up_probe(0.3, 1e-4, tokens), accumulation=1, optimizer_s=0.0, epoch_tokens=1000.0,
                        first_tokens=tokens)
    burst = probed_step(made_up_probe(0.3, 1e-4, tokens, noise={(8, 3): 2.0}), accumulation=1, optimizer_s=0.0,
                        epoch_tokens=1000.0, first_tokens=tokens)
    assert burst.step_s == pytest.approx(quiet.step_s)  # a median over the batches, each paired across depths
    # a mean would have moved it by (2.0 / 7) x 29 / 7 layers' worth
    assert quiet.step_s == pytest.approx(0.3 + 30 * 0.1)


def test_accumulation_repeats_the_micro_batch_not_the_optimizer():
    tokens = [1000] * 7
    probe = made_up_probe(0.5, 1e-4, tokens)
    one = probed_step(probe, accumulation=1, optimizer_s=0.2, epoch_tokens=1000.0, first_tokens=tokens)
    four = probed_step(probe, accumulation=4, optimizer_s=0.2, epoch_tokens=1000.0, first_tokens=tokens)
    assert four.step_s == pytest.approx(4 * (one.step_s - 0.2) + 0.2)


def test_grpo_steps_are_timed_in_whole_sampling_cycles():
    # iterations 2: a step that samples (3 s) and one that reuses (1 s) at depth 1; each layer adds a tenth
    times = {1: [5.0, 3.0, 1.0, 3.0, 1.0], 4: [5.0, 3.3, 1.3, 3.3, 1.3]}
    probe = {"layers": 10, "cycle": 2, "probe_s": 1.0, "depths": [
        {"layers": d, "step_s": t, "tokens": [None] * 5, "startup": {}} for d, t in times.items()]}
    step = probed_step(probe, accumulation=1, optimizer_s=0.0, epoch_tokens=None, first_tokens=None)
    assert step.step_s == pytest.approx(2.0 + 9 * 0.1)  # the mean of a cycle, extrapolated


def test_the_weights_load_from_its_measured_parts():
    gguf = {"reader_s": 4.0, "name_map_s": 0.01, "tensors": 272, "tensor_bytes": 10**8,
            "dequantize_s_per_byte": 2e-8}
    assert weights_read_s(gguf, 0) == pytest.approx(GGUF_READS * 4.0 + MODULES_PER_TENSOR * 272 * 0.01 + 2.0)
    assert weights_read_s({"read_rate": 2e9}, 10**9) == pytest.approx(0.5)
    assert weights_read_s(None, 10**9) is None and weights_read_s({"read_rate": None}, 10**9) is None


def ranged_plan(step_s=2.0, startup_s=10.0, limit=None, steps=1000) -> TimePlan:
    plan = TimePlan(steps, 1, BatchFacts(100, 1024, 1000, 800, 0, 0), [], Rates(1e11), step_s, startup_s, 0.0, 2,
                    1.0, "test", time_limit_s=limit)
    plan.step_range_s, plan.startup_range_s = spread(step_s, 0.15), spread(startup_s, 0.25)
    return plan


def test_the_sessions_answer_holds_at_each_end_of_the_range_and_in_json():
    plan = ranged_plan(limit=400)
    fewest, most = plan.sessions_range()
    assert (fewest, plan.sessions(), most) == (5, 6, 7)  # 1000 steps of 1.7-2.3 s in sessions of 400 s
    low, high = plan.total_range_s
    assert low < plan.total_s < high
    answer = plan.to_json()
    assert answer["sessions"] == plan.sessions() and answer["sessions_range"] == [fewest, most]
    assert answer["total_range_s"] == pytest.approx([low, high])
    assert answer["step_range_s"] == pytest.approx([1.7, 2.3]) and answer["startup_range_s"] == pytest.approx([7.5, 12.5])
    # a step time `train` measured here is used as it is: no range left
    plan.measured_step_s = 2.0
    assert plan.sessions_range() == (plan.sessions(), plan.sessions())


def test_a_limit_that_fits_no_step_at_the_slow_end_says_none():
    plan = ranged_plan(step_s=1.0, startup_s=500.0, limit=600, steps=50)
    fewest, most = plan.sessions_range()
    assert fewest == 1 and most is None  # at 625 s of start-up no step fits: not a number of sessions


def test_the_probe_trains_a_quarter_of_the_layers_and_enough_steps():
    assert probe_depths(30, None) == (1, 8) and probe_depths(4, None) == (1, 3) and probe_depths(2, None) == (1, 2)
    assert probe_depths(30, 4) == (4, 8)  # the trained layers, then frozen ones below
    assert timed_steps(None, 1, 2.0) == 4 and timed_steps(2.5, 1, 2.0) == 4 and timed_steps(0.01, 1, 2.0) == 40
    assert timed_steps(0.5, 1, 2.0) == 4 and timed_steps(0.2, 1, 2.0) == 10 and timed_steps(3.0, 2, 2.0) == 4
    assert timed_steps(0.01, 1, 0.0) == 4  # GPUPOOR_PROBE_SECONDS=0: the fewest
    recipe = {"training": {"max_steps": 500, "epochs": 2, "gradient_accumulation_steps": 8, "eval_every_steps": 10},
              "checkpoint": {"every_steps": 5, "time_limit": "1h"}, "logging": {"report_to": ["tensorboard"]},
              "peft": {"init_adapter": "adapter"}, "output_dir": "runs/x", "precision": "auto"}
    probed = probe_recipe(recipe, device="cpu", precision="bf16", threads=2, cycle=1, timed=6)
    assert probed["training"]["max_steps"] == 7 and probed["training"]["gradient_accumulation_steps"] == 1
    assert probed["training"]["cpu_threads"] == 2 and probed["precision"] == "bf16"
    assert probed["checkpoint"]["time_limit"] is None and probed["logging"]["report_to"] == []
    assert probed["peft"]["init_adapter"] is None and "output_dir" not in probed
    assert recipe["training"]["max_steps"] == 500  # the caller's recipe untouched


def test_the_probe_builds_its_share_of_each_models_layers(tiny_model):
    import transformers

    config = transformers.AutoConfig.from_pretrained(tiny_model)
    assert layer_count(cut_layers(config, 1)) == 1 and layer_count(config) > 1
    model_cfg = ModelSection(name_or_path=str(tiny_model))
    with probe_depth(1, of=layer_count(config)):
        assert probing()
        model = load_base_model(str(tiny_model), model_cfg, quant=QuantizationSection(), precision="fp32",
                                attention="sdpa", device="cpu", seed=0)
    assert not probing()
    assert model.config.num_hidden_layers == 1 and len(model.model.layers) == 1
    assert model.config.hidden_size == config.hidden_size  # every dimension kept
    assert all(torch.isfinite(p).all() for p in model.parameters())
    # beside a trained model twice as deep (a teacher's student), this one keeps half the probe's layers
    with probe_depth(2, of=layer_count(config) * 2):
        assert load_base_model(str(tiny_model), model_cfg, quant=QuantizationSection(), precision="fp32",
                               attention="sdpa", device="cpu", seed=0).config.num_hidden_layers == 1
