"""`precision: auto` on the CPU, decided on the CPU's bf16 matrix units and a matmul probe (injected here both ways
through GPUPOOR_CPU_BF16, so the test decides the same on every CPU): what training builds and says, what the plan
predicts, and what generate computes in."""

from __future__ import annotations

import json

from support.cli import invoke
from support.runs import read_metrics
from gpupoor.cpu import PIN_VARIABLE


def train(make_recipe, tmp_path, monkeypatch, pin: str, precision: str = "auto"):
    monkeypatch.setenv(PIN_VARIABLE, pin)
    run = tmp_path / "run"
    result = invoke("train", make_recipe(precision=precision, training={"max_steps": 2}), "--output-dir", run)
    assert result.exit_code == 0, result.output
    return run, result.output


def test_auto_trains_in_bf16_where_the_probe_says_the_units_are_faster(make_recipe, tmp_path, monkeypatch):
    run, output = train(make_recipe, tmp_path, monkeypatch, "AMX bf16:7.6")
    assert "precision bf16 (CPU has AMX bf16: bf16 matmuls 7.6x fp32)" in output
    # the fused layers compute natively in bf16 there, and the plan was made for bf16
    assert "fused layers: on (llama: LoRA linears" in output
    manifest = json.loads((run / "final" / "manifest.json").read_text())
    assert manifest["precision"] == "bf16"
    planned = {json.loads(invoke("plan", make_recipe(precision=precision), "--json").output)["peak_bytes"]
               for precision in ("bf16", "fp32")}
    predicted = {r["predicted_peak_mb"] for r in read_metrics(run) if "predicted_peak_mb" in r}
    assert len(planned) == 2 and predicted == {round(min(planned) / 2**20, 1)}  # bf16's plan: the smaller
    note = invoke("generate", run, "--prompt", "sort the lists", "--max-new-tokens", "4")
    assert note.exit_code == 0, note.output
    assert "computing in bf16 (CPU has AMX bf16: bf16 matmuls 7.6x fp32)" in note.output


def test_auto_keeps_fp32_where_the_units_measure_too_little(make_recipe, tmp_path, monkeypatch):
    run, output = train(make_recipe, tmp_path, monkeypatch, "AVX-512 bf16:1.2")
    assert "precision fp32 (CPU has AVX-512 bf16, but bf16 matmuls measured only 1.2x fp32: fp32)" in output
    assert json.loads((run / "final" / "manifest.json").read_text())["precision"] == "fp32"
    answer = invoke("generate", run, "--prompt", "sort the lists", "--max-new-tokens", "4")
    assert answer.exit_code == 0 and "computing in" not in answer.output


def test_bf16_on_a_cpu_without_units_trains_with_one_warning(make_recipe, tmp_path, monkeypatch):
    run, output = train(make_recipe, tmp_path, monkeypatch, "none:0.02", precision="bf16")
    assert output.count("warning: precision: bf16 on a CPU without bf16 matrix units: bf16 matmuls measured 50.0x "
                        "slower than fp32 here") == 1
    assert "precision bf16 (precision: bf16 on a CPU without bf16 matrix units)" in output
    assert json.loads((run / "final" / "manifest.json").read_text())["precision"] == "bf16"


def test_the_plan_takes_the_flags_word_and_says_training_confirms_it(make_recipe, monkeypatch):
    monkeypatch.setenv(PIN_VARIABLE, "AMX bf16")
    recipe = make_recipe()
    result = invoke("plan", recipe)
    assert result.exit_code == 0, result.output
    assert "precision auto taken as bf16 on the CPU's flags" in result.output
    monkeypatch.setenv(PIN_VARIABLE, "none")
    assert json.loads(invoke("plan", recipe, "--json").output)["precision"] == "fp32"


def test_a_resume_keeps_the_precision_auto_chose_at_the_start(make_recipe, tmp_path, monkeypatch):
    """A run started in bf16 on a CPU with units, preempted and resumed on one without, goes on in bf16 (with the
    warning that it is emulated there) instead of changing its trajectory; the plan follows."""
    monkeypatch.setenv(PIN_VARIABLE, "AMX bf16:7.6")
    run = tmp_path / "run"
    recipe = make_recipe(training={"max_steps": 4}, checkpoint={"every_steps": 2})
    cut = invoke("train", recipe, "--output-dir", run, fault="sigterm@2", monkeypatch=monkeypatch)
    assert cut.exit_code == 75, cut.output
    monkeypatch.setenv(PIN_VARIABLE, "none:0.05")
    resumed = invoke("resume", run)
    assert resumed.exit_code == 0, resumed.output
    assert "precision bf16 (precision auto chose bf16 at the run's start: a resume keeps it" in resumed.output
    assert resumed.output.count("measured 20.0x slower than fp32") == 1
    assert json.loads((run / "final" / "manifest.json").read_text())["precision"] == "bf16"
    planned = json.loads(invoke("plan", make_recipe(precision="bf16"), "--json").output)["peak_bytes"]
    predicted = [r["predicted_peak_mb"] for r in read_metrics(run) if "predicted_peak_mb" in r]
    assert predicted and all(mb == round(planned / 2**20, 1) for mb in predicted)


def test_exports_perplexity_follows_the_rule_and_says_so(make_recipe, tmp_path, monkeypatch):
    """On a CPU with units the quality table is computed in bf16 (the reference and each file alike, so the f32
    file still reads exactly the merged model's perplexity), and quality.json records it."""
    run = tmp_path / "run"
    result = invoke("train", make_recipe(data={"eval_rows": 8}, training={"max_steps": 2}), "--output-dir", run)
    assert result.exit_code == 0, result.output
    monkeypatch.setenv(PIN_VARIABLE, "AMX bf16:7.6")
    exported = invoke("export", run, "-q", "f32", "-q", "q8_0")
    assert exported.exit_code == 0, exported.output
    assert "computing in bf16 (CPU has AMX bf16: bf16 matmuls 7.6x fp32)" in exported.output
    report = json.loads((run / "gguf" / "run.quality.json").read_text())
    assert report["eval"]["computed_in"] == "bf16"
    rows = {row["type"]: row["perplexity"] for row in report["rows"]}
    assert rows["f32"] == rows["full precision"] and all(value > 1 for value in rows.values())
