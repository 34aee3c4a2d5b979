"""How close `gpupoor plan` comes to the real peak: predicted peak vs the measured peak RSS of `gpupoor train`
on this CPU, for recipes that each stress a different term of the plan.

Builds its own random-weight models and data (gpupoor.model.tiny, Python's own documentation as text), so it needs
neither the network nor the peer kit. Each recipe trains a few steps in a fresh process; the measured peak is
the process's peak RSS as metrics.jsonl records it (the whole run: imports, loading, training). Every run is
bracketed by bench/machine.py's matmul probe (2048 x 2048 fp32, GFLOP/s): a peak is memory, not time, but a busy
machine changes what the C heap keeps, so a run whose lower probe fell more than 10% below the session's best is
repeated like everywhere else, and each row shows its probes.

    python bench/plan_accuracy.py [--only NAME,...] [--rounds 3] [--no-write] [--calibrate]
    python bench/plan_accuracy.py --calibrate-retention [--only NAME,...] [--at-once 3]
    python bench/plan_accuracy.py --real [--only NAME,...] [--no-write] [--at-once 3] [--reuse]
    python bench/plan_accuracy.py --held-out [--only NAME,...] [--no-write] [--at-once 1] [--reuse]
    python bench/plan_accuracy.py --calibrate-tokenizers

About 10 minutes for the 8 recipes x 3 rounds on a 2-core machine (the first run also builds the models).
`--real` plans and trains the real model instead (SmolLM2-135M-Instruct, `make fetch-real`; the demo's ISO-dates
rows): one round, its recipes `--at-once` at a time (3), no probes. A peak is memory, not time, so runs side by side measure
what they would alone, and one at a time they would take most of an hour on 2 cores (the GGUF alone loads in
half a minute). Its own section of docs/benchmarks.md. `--held-out` does the same for an architecture no constant
was fitted on (Gemma 3 270M's shape, random weights; about 3 minutes a recipe, 5 GiB each), `--calibrate-tokenizers`
measures what a loaded tokenizer keeps resident (gpupoor.plan.terms.TOKENIZER_BYTES; a minute or two).
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import ROOT, Steady, spread, write_recipe, write_section  # noqa: E402

WORK = ROOT / "build" / "plan-bench"
STEPS = 3
MODELS = {  # name: (hidden, layers, heads, kv_heads, intermediate, vocab)
    "h512-v32k": (512, 4, 8, 4, 1408, 32000),
    "h512-v152k": (512, 4, 8, 4, 1408, 152064),
    "h1024-v32k": (1024, 4, 16, 8, 2816, 32000),
}


def case(model: str, what: str, length: int, micro: int, checkpointing: bool, sampler: str = "random",
         **extra) -> tuple[str, str, dict]:
    """(model, what it stresses, recipe keys); `extra` keys use __ for the dot: peft__rank=64."""
    return (model, what, {"data.max_length": length, "training.micro_batch_size": micro, "data.sampler": sampler,
                          "memory.gradient_checkpointing": checkpointing,
                          **{key.replace("__", "."): value for key, value in extra.items()}})


RECIPES = {
    "vocab152k-plain-ce": case("h512-v152k", "large vocabulary, unchunked logits and loss", 512, 2, True,
                               memory__fused_cross_entropy=False),
    "vocab152k-fused-ce": case("h512-v152k", "large vocabulary, chunked loss", 512, 4, True),
    "seq2048-no-ckpt": case("h512-v32k", "long sequences, every activation kept", 2048, 2, False, "length_grouped"),
    "seq2048-ckpt": case("h512-v32k", "long sequences, gradient checkpointing", 2048, 2, True, "length_grouped"),
    "rank64": case("h1024-v32k", "LoRA rank 64: trainable weights, gradients, AdamW state", 512, 4, True,
                   peft__rank=64),
    "nf4-base": case("h1024-v32k", "4-bit NF4 base (QLoRA) with double quantization", 512, 4, True,
                     quantization__bits=4),
    "padded-batch": case("h512-v32k", "padded micro-batches (length-grouped)", 1024, 8, False, "length_grouped"),
    "packed-batch": case("h512-v32k", "packed micro-batches", 1024, 8, False, "packed"),
}
# The real model (issue #27): the demo's recipe (recipes/smollm2-iso-dates.yaml: LoRA r16 on every linear layer,
# fp32, packed, 8 x 128 tokens, no checkpointing) with one knob turned each; the base is the dequantized directory
# (`fetch_real.dequantized_copy`) but for the row that loads the GGUF itself.
REAL_RECIPES = {
    "real-gguf-8x128": ("gguf", "the demo's recipe, base loaded from the Q4_1 GGUF and dequantized", {}),
    "real-8x256": ("dir", "sequence length 256", {"data.max_length": 256}),
    "real-2x128": ("dir", "micro-batch 2", {"training.micro_batch_size": 2}),
    "real-8x128-ckpt": ("dir", "gradient checkpointing", {"memory.gradient_checkpointing": True}),
    "real-nf4-8x128": ("dir", "QLoRA: the dequantized base quantized to 4-bit NF4", {"quantization.bits": 4}),
}
# Calibration, in no accuracy table: the first six fit gpupoor.plan.terms.CPU_HEAP_RETENTION with the deep recipes
# below (`--calibrate-retention`), the 4-bit three CPU_DEQUANTIZED_RETENTION (`--calibrate`). One layer's
# forward allocations from ~60 MiB to ~1 GiB, with and without checkpointing.
CALIBRATION = {
    "calib-ckpt-small": case("h512-v32k", "calibration", 256, 2, True, "length_grouped"),
    "calib-ckpt-mid": case("h512-v32k", "calibration", 512, 8, True, "packed"),
    "calib-ckpt-large": case("h1024-v32k", "calibration", 1024, 4, True, "length_grouped"),
    "calib-none-small": case("h512-v32k", "calibration", 256, 2, False, "length_grouped"),
    "calib-none-mid": case("h1024-v32k", "calibration", 1024, 2, False, "length_grouped"),
    "calib-none-large": case("h1024-v32k", "calibration", 2048, 2, False, "packed"),
    # a 4-bit base: bitsandbytes' dequantized weights (CPU_DEQUANTIZED_RETENTION)
    "calib-nf4-h512": case("h512-v32k", "calibration", 512, 4, True, quantization__bits=4),
    "calib-nf4-h1024": case("h1024-v32k", "calibration", 1024, 2, True, quantization__bits=4),
    "calib-nf4-none": case("h512-v32k", "calibration", 512, 2, False, quantization__bits=4),
}


# Deep calibration (issue #27): on the real model the heap keeps more than the 4-layer fixtures' constant. These
# random-weight models carry the real model's tokenizer and tied 49,152-row head but other depths and widths (none
# is the real model's 30 x 576), and train the demo's recipe and data like the real rows: what the heap keeps
# against depth is fitted on them (`--calibrate-retention`), never on the real rows of the accuracy table.
DEEP_MODELS = {  # name: (hidden, layers, heads, kv_heads, intermediate)
    "deep-24x384": (384, 24, 6, 2, 1024),
    "deep-12x576": (576, 12, 9, 3, 1536),
    "deep-16x768": (768, 16, 12, 4, 2048),
}
DEEP_KNOBS = {  # what each deep run turns in the demo's recipe
    "8x128": {},
    "8x256": {"data.max_length": 256},
    "2x128": {"training.micro_batch_size": 2},
    "8x128-ckpt": {"memory.gradient_checkpointing": True},
    "8x256-ckpt": {"data.max_length": 256, "memory.gradient_checkpointing": True},
}
DEEP_CALIBRATION = {f"calib-{model}-{knob}": (model, keys) for model in DEEP_MODELS for knob, keys in DEEP_KNOBS.items()}
# CPU_HEAP_RETENTION's fit: the deep recipes and the 4-layer fixture ones (CALIBRATION, but the 4-bit three).
RETENTION_CALIBRATION = [*DEEP_CALIBRATION, *(name for name in CALIBRATION if "nf4" not in name)]


# A held-out architecture (issue #42): a random-weight model of Gemma 3 270M's exact shape, its file in bf16 as the
# real one is, with a synthetic tokenizer of the real one's size (262,144 ids, ~0.5M merges, loaded as a
# GemmaTokenizer), trained on the demo's chat rows at 4 x 512 tokens, LoRA r16 on every linear, fp32. The control
# has the same shape with SmolLM2's 49,152-id tokenizer (which transformers reads as it is): what the tokenizer adds.
GEMMA3_270M = dict(vocab_size=262144, hidden_size=640, intermediate_size=2048, num_hidden_layers=18,
                   num_attention_heads=4, num_key_value_heads=1, head_dim=256, sliding_window=512,
                   layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 3, query_pre_attn_scalar=256,
                   tie_word_embeddings=True, hidden_activation="gelu_pytorch_tanh", rms_norm_eps=1e-6,
                   max_position_embeddings=32768, rope_theta=1e6, rope_local_base_freq=10000,
                   final_logit_softcapping=None, attn_logit_softcapping=None)
HELD_OUT_MODELS = {"gemma3-270m": "synthetic", "gemma3-270m-smollm2-tokenizer": "smollm2"}  # name: its tokenizer
HELD_OUT = {  # name: (model, what it is, recipe keys)
    "gemma3-270m-chat": ("gemma3-270m", "Gemma 3 270M's shape; a 262,144-id tokenizer that transformers rebuilds", {}),
    "gemma3-270m-smollm2-tokenizer": ("gemma3-270m-smollm2-tokenizer",
                                      "the same shape with SmolLM2's 49,152-id tokenizer, read as it is", {}),
}
GEMMA_CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' "
                       "else m['role'] }}\n{{ m['content'] | trim }}<end_of_turn>\n{% endfor %}"
                       "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
# TOKENIZER_BYTES' calibration: (ids, layout) of synthetic tokenizers, each loaded as its model's own class
# (rebuilt from Python copies) and as TokenizersBackend (tokenizer.json read as it is).
TOKENIZER_CALIBRATION = {"bytelevel-49k": (49152, "bytelevel"), "bytelevel-152k": (151665, "bytelevel"),
                         "sentencepiece-66k": (65536, "sentencepiece"), "sentencepiece-131k": (131072, "sentencepiece"),
                         "sentencepiece-262k": (262144, "sentencepiece")}
OWN_CLASS = {"bytelevel": "Qwen2Tokenizer", "sentencepiece": "GemmaTokenizer"}


def synthetic_tokenizer(folder: Path, ids: int, layout: str, tokenizer_class: str) -> Path:
    """A BPE tokenizer.json of `ids` ids at `folder`, saved to load as `tokenizer_class`. `sentencepiece`: laid out as
    Gemma's (byte fallback, ▁ for spaces, its specials, ~1.9 merges per id: every piece x+y+z is made where x+y and
    y+z are pieces too, and every split into two pieces is a merge, as transformers' SentencePiece converter lists
    them; 262,144 ids give ~491k merges, Gemma 3's has 514,906). `bytelevel`: GPT-2's and Qwen's layout, one merge
    per piece. Pieces are grown one character at a time from a ~150-character alphabet (6 characters on average)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers

    sentencepiece = layout == "sentencepiece"
    rng = random.Random(0)
    if sentencepiece:
        specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>",
                    *(f"<unused{i}>" for i in range(ids * 6242 // 262144))]
        alphabet = ["▁", *map(chr, range(0x21, 0x7F)), *(chr(0x4E00 + k) for k in range(60))]
        vocab = {token: i for i, token in enumerate(specials + [f"<0x{byte:02X}>" for byte in range(256)])}
    else:
        specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
        alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
        vocab = {token: i for i, token in enumerate(specials)}
    vocab.update({char: len(vocab) + n for n, char in enumerate(alphabet)})
    pieces, made_of = list(alphabet), {}

    def add(piece: str, left: str, right: str) -> None:
        if piece not in vocab and len(vocab) < ids:
            vocab[piece] = len(vocab)
            pieces.append(piece)
            made_of[piece] = (left, right)

    while len(vocab) < ids:  # longer pieces grow more often; common characters are added more often
        grown = pieces[int(len(pieces) * rng.random() ** 0.5)]
        char = alphabet[int(len(alphabet) * rng.random() ** 2)]
        if grown in made_of:
            add(made_of[grown][1] + char, made_of[grown][1], char)
        add(grown + char, grown, char)
    if sentencepiece:
        merges = [(p[:i], p[i:]) for p in pieces for i in range(1, len(p)) if p[:i] in vocab and p[i:] in vocab]
    else:
        merges = [made_of[p] for p in pieces if p in made_of]
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>" if sentencepiece else None,
                                   byte_fallback=sentencepiece, fuse_unk=sentencepiece))
    if sentencepiece:
        backend.normalizer = normalizers.Replace(" ", "▁")
        backend.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
        backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
        tokens = {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>"}
    else:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        backend.decoder = decoders.ByteLevel()
        tokens = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
    backend.add_special_tokens(specials)
    folder.mkdir(parents=True, exist_ok=True)
    backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": tokenizer_class, **tokens}))
    if sentencepiece:
        (folder / "chat_template.jinja").write_text(GEMMA_CHAT_TEMPLATE)
    return folder


def build_held_out_models() -> None:
    """HELD_OUT_MODELS under WORK: random weights of GEMMA3_270M's shape (seed 0) in bf16, with their tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, Gemma3TextConfig

    for name, tokenizer_kind in HELD_OUT_MODELS.items():
        target = WORK / name
        if (target / "config.json").is_file():
            continue
        print(f"building {target} ...", flush=True)
        tmp = target.with_name(target.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        if tokenizer_kind == "synthetic":
            source = synthetic_tokenizer(WORK / "tokenizers" / "gemma3-like", 262144, "sentencepiece", "GemmaTokenizer")
        else:
            from gpupoor.model.pretrained import dequantized_copy, real_model_path

            source = dequantized_copy(real_model_path())
        tokenizer = AutoTokenizer.from_pretrained(source)
        config = Gemma3TextConfig(**GEMMA3_270M, bos_token_id=tokenizer.bos_token_id,
                                  eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        tmp.rename(target)


TOKENIZER_RESIDENT = """
import ctypes, gc, sys
import torch, transformers, peft, accelerate
from transformers import AutoTokenizer
libc = ctypes.CDLL("libc.so.6")
def resident():
    gc.collect(); libc.malloc_trim(0)  # what stays: freed memory back to the system first
    return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmRSS"))
before = resident()
tokenizer = AutoTokenizer.from_pretrained(sys.argv[1])
print(resident() - before, type(tokenizer).__name__)
"""


def calibrate_tokenizers() -> None:
    """What a loaded tokenizer keeps resident (TOKENIZER_BYTES): TOKENIZER_CALIBRATION's tokenizers loaded both ways,
    and SmolLM2's where the real model is in the cache, each in a fresh process (gc and malloc_trim before and after
    AutoTokenizer.from_pretrained); least squares over (ids, merges) per way."""
    import os

    import numpy

    from gpupoor.model.shape import tokenizer_size

    folders = []
    for name, (ids, layout) in TOKENIZER_CALIBRATION.items():
        for tokenizer_class in (OWN_CLASS[layout], "TokenizersBackend"):
            folder = WORK / "tokenizers" / f"{name}-{tokenizer_class}"
            if not (folder / "tokenizer.json").is_file():
                synthetic_tokenizer(folder, ids, layout, tokenizer_class)
            folders.append(folder)
    from gpupoor.model.pretrained import real_model_path

    if real_model_path().is_file():
        from gpupoor.model.pretrained import dequantized_copy

        folders.append(dequantized_copy(real_model_path()))
    points: dict[bool, list[tuple[int, int, int]]] = {True: [], False: []}
    for folder in folders:
        out = subprocess.run([sys.executable, "-c", TOKENIZER_RESIDENT, str(folder)], capture_output=True, text=True,
                             check=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
        resident, loaded_as = out.stdout.split()[-2:]
        size = tokenizer_size(str(folder), folder)
        points[size.rebuilt].append((size.rows, size.merges, int(resident)))
        print(f"{folder.name:40s} {loaded_as:18s} {size.rows:7d} ids {size.merges:7d} merges: "
              f"{int(resident) / 2**20:6.1f} MiB", flush=True)
    for rebuilt, rows in points.items():
        fit = numpy.linalg.lstsq(numpy.array([(ids, merges) for ids, merges, _ in rows], dtype=float),
                                 numpy.array([resident for *_, resident in rows], dtype=float), rcond=None)[0]
        worst = max(abs(ids * fit[0] + merges * fit[1] - resident) for ids, merges, resident in rows) / 2**20
        print(f"{'rebuilt' if rebuilt else 'read as it is'}: {fit[0]:.0f} bytes per id + {fit[1]:.0f} per merge "
              f"({len(rows)} tokenizers, worst {worst:.1f} MiB off)")


def build_deep_models() -> None:
    """DEEP_MODELS under WORK, with the real model's tokenizer (its dequantized directory)."""
    from transformers import AutoTokenizer

    from gpupoor.model.pretrained import dequantized_copy, real_model_path

    tokenizer = None
    for name, (hidden, layers, heads, kv_heads, intermediate) in DEEP_MODELS.items():
        target = WORK / name
        if (target / "config.json").is_file():
            continue
        tokenizer = tokenizer or AutoTokenizer.from_pretrained(dequantized_copy(real_model_path()))
        build_model(target, tokenizer, hidden=hidden, layers=layers, heads=heads, kv_heads=kv_heads,
                    intermediate=intermediate, tie_embeddings=True)


def build_model(target: Path, tokenizer, **shape) -> None:
    """gpupoor.model.tiny's random Llama at `target`, written beside it and renamed (never half there)."""
    from gpupoor.model.tiny import build_tiny_llama

    print(f"building {target} ...", flush=True)
    tmp = target.with_name(target.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    build_tiny_llama(tmp, tokenizer, **shape)
    tmp.rename(target)


def build_fixtures() -> None:
    from pydoc_data.topics import topics

    from gpupoor.model.tiny import train_tokenizer

    WORK.mkdir(parents=True, exist_ok=True)
    texts = [" ".join(text.split()) for _, text in sorted(topics.items())]
    data = WORK / "long.jsonl"
    if not data.is_file():
        rng = random.Random(0)
        words = " ".join(texts).split()
        rows = []
        for _ in range(64):  # every row longer than the longest max_length: every micro-batch is full, so the
            start = rng.randrange(len(words) - 4000)  # peak does not depend on which rows the first steps draw
            length = rng.randint(1800, 3000)
            rows.append({"instruction": "Continue the Python reference text.",
                         "input": " ".join(words[start:start + 60]),
                         "output": " ".join(words[start + 60:start + 60 + length])})
        data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    tokenizer = None
    for name, (hidden, layers, heads, kv_heads, intermediate, vocab) in MODELS.items():
        target = WORK / name
        if (target / "config.json").is_file():
            continue
        if tokenizer is None:
            tokenizer = train_tokenizer(texts, vocab_size=4000)
        build_model(target, tokenizer, hidden=hidden, layers=layers, heads=heads, kv_heads=kv_heads,
                    intermediate=intermediate, vocab_size=vocab)


def recipe_file(name: str) -> Path:
    if name in REAL_RECIPES:
        settings = real_settings(name)
    elif name in HELD_OUT:
        model, _, keys = HELD_OUT[name]
        settings = {"model.name_or_path": str(WORK / model), "data.format": "chat", "data.max_length": 512,
                    "data.path": str(ROOT / "recipes" / "data" / "iso-dates-train.jsonl"), "peft.rank": 16,
                    "precision": "fp32", "training.micro_batch_size": 4, "training.max_steps": STEPS,
                    "training.learning_rate": 1.0e-4, "logging.progress": "none", **keys}
    elif name in DEEP_CALIBRATION:
        model, keys = DEEP_CALIBRATION[name]
        settings = {"extends": str(ROOT / "recipes" / "smollm2-iso-dates.yaml"), "model.name_or_path": str(WORK / model),
                    "data.path": str(ROOT / "recipes" / "data" / "iso-dates-train.jsonl"), "data.eval_path": None,
                    "training.max_steps": STEPS, "logging.progress": "none", **keys}
    else:
        model, _, keys = {**RECIPES, **CALIBRATION}[name]
        settings = {"model.name_or_path": model, "data.path": "long.jsonl", "data.format": "alpaca",
                    "data.sampler": "random", "peft.rank": 16, "precision": "fp32", "training.max_steps": STEPS,
                    "training.micro_batch_size": 4, "training.learning_rate": 1.0e-4, "logging.progress": "none",
                    **keys}
    return write_recipe(WORK / f"{name}.yaml", settings)


def real_settings(name: str) -> dict:
    """The demo's recipe for one REAL_RECIPES row, its paths made absolute (the recipe is written under WORK)."""
    from gpupoor.model.pretrained import dequantized_copy, real_model_path

    base, _, keys = REAL_RECIPES[name]
    gguf = real_model_path()
    if not gguf.is_file():
        raise SystemExit(f"the real model is not in the cache ({gguf}): run `make fetch-real` first")
    return {"extends": str(ROOT / "recipes" / "smollm2-iso-dates.yaml"),
            "model.name_or_path": str(gguf if base == "gguf" else dequantized_copy(gguf)),
            "data.path": str(ROOT / "recipes" / "data" / "iso-dates-train.jsonl"), "data.eval_path": None,
            "training.max_steps": STEPS, "logging.progress": "none", **keys}


def gpupoor(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gpupoor", *args], capture_output=True, text=True,
                          env={**__import__("os").environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"})


def measure(name: str) -> float:
    recipe = recipe_file(name)
    run_dir = WORK / "runs" / name
    shutil.rmtree(run_dir, ignore_errors=True)
    out = gpupoor("train", str(recipe), "--output-dir", str(run_dir))
    if out.returncode != 0:
        raise SystemExit(f"gpupoor train {recipe} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return max(step_peaks(name)) * 2**20


def step_peaks(name: str) -> list[float]:
    """The peak RSS after each step (MiB) of the recipe's run under WORK/runs, as its metrics.jsonl records it."""
    records = [json.loads(line) for line in (WORK / "runs" / name / "metrics.jsonl").read_text().splitlines()]
    return [r["peak_mem_mb"] for r in records if "peak_mem_mb" in r]


def predict(name: str) -> dict:
    out = gpupoor("plan", str(recipe_file(name)), "--json")
    if out.returncode not in (0, 3):
        raise SystemExit(f"gpupoor plan failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return json.loads(out.stdout)


def measure_rounds(names: list[str], rounds: int,
                   steady: Steady) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Each recipe `rounds` times, round-robin (the C heap's retention varies from run to run), each run between
    two matmul probes. Returns (peak bytes, probe GFLOP/s before and after) per recipe."""
    peaks: dict[str, list[float]] = {name: [] for name in names}
    probes: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(rounds):
        for name in names:
            result = steady.run(f"{name}, round {round_ + 1}", lambda name=name: {"peak": measure(name)})
            peaks[name].append(result["peak"])
            probes[name] += [result["gflops_before"], result["gflops_after"]]
            print(f"  round {round_ + 1} {name}: {peaks[name][-1] / 2**20:.0f} MiB, GFLOP/s "
                  f"{result['gflops_before']:.0f}/{result['gflops_after']:.0f}"
                  f"{' (noisy)' if result['noisy'] else ''}", flush=True)
    return peaks, probes


def planned(name: str):
    """(shape, settings, plan terms, one layer's allocations) of a recipe on the CPU, as `gpupoor plan` computes them."""
    from gpupoor.plan.peak import plan_terms, uses_bitsandbytes
    from gpupoor.plan.settings import resolve_settings
    from gpupoor.model.shape import load_shape
    from gpupoor.plan.terms import activation_bytes
    from gpupoor.recipe.loading import load_recipe

    loaded = load_recipe(recipe_file(name))
    shape, _ = load_shape(loaded)
    settings = resolve_settings(loaded.recipe, "cpu", shape)
    terms, _ = plan_terms(shape, settings, uses_bitsandbytes(loaded.recipe))
    return shape, settings, terms, activation_bytes(shape, settings)[1]


def calibrate(rounds: int, only: list[str]) -> None:
    """The dequantized-weight retention each 4-bit calibration recipe implies (CPU_DEQUANTIZED_RETENTION): (median
    measured - the plan without that term) / one layer's linear weights in the compute dtype."""
    from gpupoor.plan.terms import heap_retention

    steady = Steady()
    steady.warm_up()
    names = [name for name in CALIBRATION if "nf4" in name and (not only or name in only)]
    peaks, _ = measure_rounds(names, rounds, steady)
    ratios = []
    for name in names:
        measured = statistics.median(peaks[name])
        shape, settings, terms, churn = planned(name)
        dequantized = shape.layer_linear_params * settings.act_bytes
        without = sum(t.bytes for t in terms) - heap_retention(shape, settings, churn, dequantized) \
            + heap_retention(shape, settings, churn)
        ratios.append((measured - without) / dequantized)
        print(f"{name}: median measured {measured / 2**20:.0f} MiB, plan without the dequantized term "
              f"{without / 2**20:.0f} MiB, one layer dequantized {dequantized / 2**20:.0f} MiB -> {ratios[-1]:.2f} x",
              flush=True)
    print(f"quantized: retained beyond the rest = {statistics.mean(ratios):.2f} x one layer's dequantized linear "
          f"weights (mean of {len(ratios)})")
    print(steady.summary(), *steady.notes(), sep="\n")


def train_side_by_side(names: list[str], at_once: int) -> dict[str, list[float]]:
    """Each recipe's peak after each step (MiB), `at_once` fresh `gpupoor train` processes at a time."""
    import os

    peaks = {}
    for start in range(0, len(names), at_once):
        runs = {}
        for name in names[start:start + at_once]:
            run_dir = WORK / "runs" / name
            shutil.rmtree(run_dir, ignore_errors=True)
            runs[name] = subprocess.Popen([sys.executable, "-m", "gpupoor", "train", str(recipe_file(name)),
                                           "--output-dir", str(run_dir)], stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, text=True,
                                          env={**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"})
        for name, process in runs.items():
            output, _ = process.communicate()
            if process.returncode != 0:
                raise SystemExit(f"gpupoor train {name} failed:\n{output[-3000:]}")
            peaks[name] = step_peaks(name)
    return peaks


def recorded_peaks(names: list[str]) -> dict[str, list[float]]:
    """The peaks after each step (MiB) of the runs already under WORK/runs (`--reuse`: nothing is trained)."""
    return {name: step_peaks(name) for name in names}


def calibrate_retention(names: list[str], at_once: int, reuse: bool = False) -> None:
    """What the heap keeps (CPU_HEAP_RETENTION), fitted on RETENTION_CALIBRATION: measured peak - the plan without
    its retention term, against (layers that keep activations) x (one layer's allocations the heap serves), least
    squares per mode. Each recipe once, `at_once` processes side by side (a peak is memory, not time)."""
    from gpupoor.plan.terms import heap_retention, heap_served_bytes, layers_keeping_activations

    build_fixtures()
    build_deep_models()
    peaks = recorded_peaks(names) if reuse else train_side_by_side(names, at_once)
    points: dict[str, list[tuple[float, float]]] = {"checkpointing": [], "none": []}
    for name in names:
        measured = max(peaks[name]) * 2**20
        shape, settings, terms, churn = planned(name)
        layers = layers_keeping_activations(shape, settings)
        served = layers * heap_served_bytes(shape, settings, churn) / 2**20
        retained = (measured - sum(t.bytes for t in terms) + heap_retention(shape, settings, churn)) / 2**20
        points["checkpointing" if settings.checkpointing else "none"].append((served, retained))
        print(f"{name:30s} measured {measured / 2**20:6.0f} MiB (after each step {peaks[name]}): retained "
              f"{retained:5.0f} MiB, {layers} layers x heap-served allocations = {served:6.0f} MiB", flush=True)
    for mode, xy in points.items():
        if len(xy) >= 2:
            fit = statistics.linear_regression([x for x, _ in xy], [y for _, y in xy])
            print(f"{mode}: retained = {fit.intercept:.0f} MiB + {fit.slope:.4f} x layers x heap-served allocations "
                  f"({len(xy)} recipes)")


def real_accuracy(names: list[str], write: bool, at_once: int, reuse: bool = False) -> None:
    """The real model's rows: each recipe trained in its own fresh process, `at_once` side by side (one round, no
    probes), then planned; the table goes to its own section."""
    side_by_side_accuracy(names, REAL_RECIPES, "what changes from the demo's recipe", "plan-accuracy-real", "--real",
                          write, at_once, reuse)


def held_out_accuracy(names: list[str], write: bool, at_once: int, reuse: bool = False) -> None:
    """The held-out architecture's rows (HELD_OUT), like the real model's."""
    build_held_out_models()
    side_by_side_accuracy(names, HELD_OUT, "model", "plan-accuracy-held-out", "--held-out", write, at_once, reuse)


def side_by_side_accuracy(names: list[str], table: dict[str, tuple], what: str, section: str, flag: str, write: bool,
                          at_once: int, reuse: bool) -> None:
    """Each recipe of `table` trained in its own fresh process, `at_once` side by side (one round, no probes), then
    planned; the table goes to docs/benchmarks.md's `section`, its second column headed `what`."""
    import os

    rows = []
    for name, steps in (recorded_peaks(names) if reuse else train_side_by_side(names, at_once)).items():
        predicted = predict(name)["peak_bytes"] / 2**20
        rows.append((name, predicted, max(steps), steps))
        print(f"{name:18s} predicted {predicted:6.0f} MiB  measured {max(steps):6.0f} MiB  "
              f"error {predicted / max(steps) - 1:+.1%}  (after each step: {steps})", flush=True)
    if not write:
        return
    command = f"python bench/plan_accuracy.py {flag} --at-once {at_once}" + (" --reuse" if reuse else "")
    reused = " (--reuse: the recipes' latest runs planned again, nothing trained)" if reuse else ""
    lines = [f"Command: `{command}`{reused} ({platform.processor() or platform.machine()}, "
             f"{os.cpu_count()} cores, torch CPU wheel; each recipe trains {STEPS} steps in a fresh process, the "
             f"recipes {at_once} at a time side by side, one round; measured = peak RSS of that `gpupoor train` process "
             "as metrics.jsonl records it: imports, loading and training).", "",
             f"| recipe | {what} | predicted MiB | measured MiB | error | peak after each step MiB |",
             "|---|---|---:|---:|---:|---|"]
    for name, predicted, measured, steps in rows:
        lines.append(f"| {name} | {table[name][1]} | {predicted:.0f} | {measured:.0f} | "
                     f"{predicted / measured - 1:+.1%} | {', '.join(f'{p:.0f}' for p in steps)} |")
    worst = max(abs(p / m - 1) for _, p, m, _ in rows)
    lines += ["", f"Largest error {worst:.1%} over {len(rows)} recipes."]
    write_section(ROOT / "docs" / "benchmarks.md", section, "\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", default="")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument("--calibrate", action="store_true", help="measure the 4-bit calibration recipes and "
                        "print the dequantized-weight retention (CPU_DEQUANTIZED_RETENTION) they imply")
    parser.add_argument("--calibrate-retention", action="store_true", help="measure RETENTION_CALIBRATION and "
                        "print the fit of the heap's retention (CPU_HEAP_RETENTION) they imply")
    parser.add_argument("--at-once", type=int, default=3, help="--calibrate-retention and --real: processes side by side")
    parser.add_argument("--reuse", action="store_true", help="--calibrate-retention and --real: the peaks of the "
                        "runs already in build/plan-bench/runs, nothing trained (a refit, or a replan after a change)")
    parser.add_argument("--real", action="store_true", help="the real model's recipes (REAL_RECIPES) instead")
    parser.add_argument("--held-out", action="store_true", help="the held-out architecture's recipes (HELD_OUT)")
    parser.add_argument("--calibrate-tokenizers", action="store_true", help="measure what loaded tokenizers keep "
                        "resident and print the fit (TOKENIZER_BYTES) they imply")
    args = parser.parse_args()
    if args.calibrate_tokenizers:
        calibrate_tokenizers()
        return
    if args.held_out:
        held_out_accuracy([n for n in args.only.split(",") if n] or list(HELD_OUT), not args.no_write, args.at_once,
                          args.reuse)
        return
    if args.calibrate_retention:
        calibrate_retention([n for n in args.only.split(",") if n] or RETENTION_CALIBRATION, args.at_once, args.reuse)
        return
    if args.real:
        real_accuracy([n for n in args.only.split(",") if n] or list(REAL_RECIPES), not args.no_write, args.at_once, args.reuse)
        return
    names = [n for n in args.only.split(",") if n] or list(RECIPES)
    build_fixtures()
    if args.calibrate:
        calibrate(args.rounds, [n for n in args.only.split(",") if n])
        return
    steady = Steady()
    steady.warm_up()
    peaks, probes = measure_rounds(names, args.rounds, steady)
    rows = []
    for name in names:
        measured = statistics.median(peaks[name])
        predicted = predict(name)["peak_bytes"]
        error = (predicted - measured) / measured
        rows.append((name, predicted, measured, error, peaks[name], probes[name]))
        print(f"{name:22s} predicted {predicted / 2**20:8.0f} MiB  measured {measured / 2**20:8.0f} MiB  "
              f"error {error:+.1%}", flush=True)
    if args.no_write:
        return
    command = "python bench/plan_accuracy.py" + (f" --only {args.only}" if args.only else "") + \
        (f" --rounds {args.rounds}" if args.rounds != 3 else "")
    lines = [f"Command: `{command}` ({platform.processor() or platform.machine()}, "
             f"{__import__('os').cpu_count()} cores, torch CPU wheel; each recipe trains {STEPS} steps in a fresh "
             f"process, {args.rounds} rounds round-robin; measured = median peak RSS of that `gpupoor train` "
             "process as metrics.jsonl records it). " + steady.summary(), "",
             "| recipe | stresses | predicted MiB | measured MiB (median) | error | every round MiB | "
             "GFLOP/s around its runs |",
             "|---|---|---:|---:|---:|---|---|"]
    for name, predicted, measured, error, every, around in rows:
        lines.append(f"| {name} | {RECIPES[name][1]} | {predicted / 2**20:.0f} | {measured / 2**20:.0f} | "
                     f"{error:+.1%} | {', '.join(f'{p / 2**20:.0f}' for p in every)} | {spread(around, '{:.0f}')} |")
    worst = max(abs(r[3]) for r in rows)
    lines += ["", f"Largest error {worst:.1%} over {len(rows)} recipes."]
    notes = steady.notes()
    if notes:
        lines += ["", "Runs the probe flagged:", *notes]
    write_section(ROOT / "docs" / "benchmarks.md", "plan-accuracy", "\n".join(lines))


if __name__ == "__main__":
    main()
