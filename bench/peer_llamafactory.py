"""The LLaMA-Factory side of the peer benchmarks: its dataset files and YAML config for a fixture, the command that
trains it, and its results read back from its output directory.

LLaMA-Factory lives in its own venv (it pins transformers, peft, trl and datasets apart from gpupoor's), found at
`--lf-python` / $GPUPOOR_BENCH_LF_PYTHON, by default ../lf-venv/bin/python beside the project. `make bench-lf-venv`
builds it on a CPU machine:

    python3 -m venv ../lf-venv
    ../lf-venv/bin/pip install torch==2.13.0
    ../lf-venv/bin/pip install -c <(echo torch==2.13.0) --no-deps llamafactory==0.9.5
    ../lf-venv/bin/pip install -c <(echo torch==2.13.0) "accelerate<=1.11.0" "av<=16.0.0" "datasets<=4.0.0" einops \
        fastapi fire "gradio<=5.50.0" matplotlib modelscope numpy omegaconf packaging pandas "peft<=0.18.1" protobuf \
        pydantic pyyaml safetensors scipy sentencepiece sse-starlette tiktoken "transformers<=5.6.0" "trl<=0.24.0" \
        "tyro<0.9.0" uvicorn psutil

(its own requirements, less torchvision, torchaudio and torchdata: the constraint keeps pip from pulling another
torch or CUDA). LLaMA-Factory 0.9.5 imports torchaudio at start-up for its audio plugin, and PyPI has no CPU
torchaudio for torch 2.13 (its wheels need CUDA's libraries), so the run puts bench/lf_shims/ first on
PYTHONPATH: a torchaudio that imports and fails if anything calls it. Text SFT never does.

The settings match the other sides (compare_trl.SETTINGS): micro batch 8, `cutoff_len` 512, LoRA r16 alpha 32
dropout 0 on all linear layers (`lora_target: all`), fp32 (no bf16/fp16: LF logs "compute dtype: None"), one epoch,
lr 2e-4 with the Trainer's default linear schedule and no warm-up (as TRL and gpupoor's recipe), loss on the
response only (LF's SFT default, `train_on_prompt: false`), no eval, no mid-run saves (LF's final adapter save is
in the whole-process time), CPU (LF picks it by itself on a machine without CUDA: "device: cpu"), one data loader
process. Gradient checkpointing is explicit both ways: LF turns it on unless `disable_gradient_checkpointing`.

Packing, two sides. Both pack greedily (a knapsack by length) into rows of exactly cutoff_len (padded with the pad
token, unlabeled), 8 rows a step, with position ids restarting at 0 for every example.
- lf-packed: `packing: true`, LF's default packing. The attention mask is all ones, so a packed row is one causal
  sequence in which later examples attend to earlier ones, at restarted positions. That is not the per-example
  loss: on the first 16 demo rows the untrained model's loss reads 2.40 this way against 1.427 per example.
- lf-neat: `neat_packing: true`, a block-diagonal 4D mask (attention never crosses examples, as in gpupoor's
  packed rows): the same loss as gpupoor's, 1.4271 on those 16 rows for both.

Text: `template: empty` (no chat markup, no BOS, no separator, no EOS of its own) over an alpaca file written from
the fixture's prompt-completion.jsonl: instruction = the prompt exactly as the other sides see it (the peer kit's
instruction + "\\n" + input + "\\n"), output = the completion + the tokenizer's EOS text (TRL and gpupoor append
EOS; the tokenizer reads the EOS text as the EOS token). So every side trains the same text and the same tokens
(LF encodes prompt and response apart; on the first 16 demo rows LF and gpupoor both count 721, and the table's
"tokens each side counted" line shows it for every run). The `default` template would add "Human: " /
"Assistant:" markup, so `empty` is the closer one.

Results: `train_runtime` and `train_loss` (the epoch's mean step loss, as TRL's `training_loss`) from LF's
all_results.json; tokens = the non-padding tokens of the epoch, counted here with the fixture's tokenizer exactly
as the `empty` template encodes each row (transformers 5 dropped `include_tokens_per_second`, and LF's packed
attention mask counts the padding too).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHIMS = Path(__file__).resolve().parent / "lf_shims"
PYTHON_ENV = "GPUPOOR_BENCH_LF_PYTHON"
DATASET = "gpupoor_bench"  # the name dataset_info.json gives the fixture's rows
DATA_FILE = "lf-alpaca.jsonl"


def default_python() -> str:
    return os.environ.get(PYTHON_ENV) or str(ROOT.parent / "lf-venv" / "bin" / "python")


def environment() -> dict[str, str]:
    """What the LF process needs on top of the benchmark's environment: the torchaudio shim first on its path."""
    path = os.environ.get("PYTHONPATH", "")
    return {"PYTHONPATH": f"{SHIMS}{os.pathsep}{path}" if path else str(SHIMS)}


def check_install(python: str) -> str:
    """LLaMA-Factory's version in `python`'s environment, or exit 2 saying how to install it."""
    how = (f"the LLaMA-Factory side needs LLaMA-Factory in its own venv, looked for at {python} (--lf-python PATH or "
           f"${PYTHON_ENV} to point elsewhere). `make bench-lf-venv` builds ../lf-venv; the pip commands are in "
           "bench/peer_llamafactory.py's docstring.")
    if not Path(python).is_file():
        print(how)
        raise SystemExit(2)
    found = subprocess.run([python, "-c", "import llamafactory.data, sys; print(llamafactory.__version__)"],
                           capture_output=True, text=True, env={**os.environ, **environment()})
    if found.returncode != 0:
        print(f"{how}\nImporting it failed:\n{found.stderr[-1500:]}")
        raise SystemExit(2)
    return found.stdout.strip().splitlines()[-1]


def write_dataset(fixture: Path) -> int:
    """The fixture's prompt/completion rows as LF's alpaca file plus the dataset_info.json naming it; returns the
    epoch's tokens as LF encodes them with `template: empty` (prompt ids + response ids, no special tokens added)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(fixture / "model")
    eos = tokenizer.eos_token or ""
    rows = [json.loads(line) for line in (fixture / "prompt-completion.jsonl").read_text().splitlines() if line]
    alpaca = [{"instruction": row["prompt"], "input": "", "output": row["completion"] + eos} for row in rows]
    (fixture / DATA_FILE).write_text("".join(json.dumps(row) + "\n" for row in alpaca))
    (fixture / "dataset_info.json").write_text(json.dumps({DATASET: {
        "file_name": DATA_FILE, "formatting": "alpaca",
        "columns": {"prompt": "instruction", "query": "input", "response": "output"}}}, indent=2) + "\n")
    return sum(len(tokenizer.encode(row[key], add_special_tokens=False))
               for row in alpaca for key in ("instruction", "output"))


def write_config(fixture: Path, run_dir: Path, settings: dict, neat: bool, checkpointing: bool,
                 bf16: bool = False) -> Path:
    """LF's training YAML (JSON is YAML) for one epoch of the fixture under the benchmark's settings; `neat`: the
    block-diagonal packing; `bf16`: LF's `bf16: true` (the base loaded in bf16, LoRA in fp32, autocast)."""
    config = {
        "model_name_or_path": str(fixture / "model"),
        "stage": "sft", "do_train": True, "finetuning_type": "lora",
        "lora_rank": settings["rank"], "lora_alpha": 2 * settings["rank"], "lora_dropout": 0.0, "lora_target": "all",
        "dataset": DATASET, "dataset_dir": str(fixture), "template": "empty",
        "cutoff_len": settings["seq"], "packing": True, "neat_packing": neat,
        "overwrite_cache": True, "dataloader_num_workers": 0,
        "per_device_train_batch_size": settings["batch"], "gradient_accumulation_steps": 1,
        "learning_rate": 2.0e-4, "num_train_epochs": 1.0, "seed": 0, "bf16": bf16, "fp16": False,
        "disable_gradient_checkpointing": not checkpointing,
        "output_dir": str(run_dir), "overwrite_output_dir": True, "save_strategy": "no", "logging_steps": 1,
        "report_to": "none",
    }
    path = fixture / f"{run_name(neat, checkpointing, bf16)}.yaml"
    path.write_text(json.dumps(config, indent=2) + "\n")
    return path


def run_name(neat: bool, checkpointing: bool, bf16: bool = False) -> str:
    return f"llamafactory{'-neat' if neat else ''}{'-gc' if checkpointing else ''}{'-bf16' if bf16 else ''}"


def prepare(fixture: Path, settings: dict, neat: bool, checkpointing: bool,
            bf16: bool = False) -> tuple[list[str], Path, int]:
    """(the command to measure, its output directory, the epoch's tokens) for one LF run of the fixture."""
    run_dir = fixture / f"run-{run_name(neat, checkpointing, bf16)}"
    shutil.rmtree(run_dir, ignore_errors=True)
    tokens = write_dataset(fixture)
    config = write_config(fixture, run_dir, settings, neat, checkpointing, bf16)
    cli = Path(default_python()).parent / "llamafactory-cli"
    return [str(cli), "train", str(config)], run_dir, tokens


def results(run_dir: Path, tokens: int) -> dict:
    """train_s, tokens_per_s, tokens and loss from LF's all_results.json (the measured run adds wall and RSS)."""
    found = json.loads((run_dir / "all_results.json").read_text())
    return {"train_s": found["train_runtime"], "tokens_per_s": tokens / found["train_runtime"], "tokens": tokens,
            "loss": found["train_loss"], "run_dir": str(run_dir)}
