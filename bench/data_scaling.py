"""Data bigger than memory: tokenization time and peak memory, and a warm training start, as the rows grow.

Generated alpaca rows (about 100 tokens each with the tokenizer below) at 10k, 100k and 1M rows. For each size,
each measurement is a process of its own, run under this file's `--worker` mode, which runs gpupoor in-process
and writes its own ru_maxrss (and its worker processes' largest), its resident memory split into anonymous and
file-backed pages at exit and when the data is ready, and timings:

- cold: `gpupoor tokenize RECIPE --output DIR` with an empty cache (reads, tokenizes and caches the rows, then
  writes DIR);
- warm: `gpupoor train RECIPE --set training.max_steps=1` with that cache: start-up to the first step, and the
  time build_data took;
- from DIR: the same run on `data.tokenized_path: DIR` (when build_data reads tokenized directories);
- where a warm start's data time goes, in a process of its own: hashing the data file (the data fingerprint),
  checking and mapping the cache entry, the batch plan.

`--cores 1,2` repeats the cold tokenization with the process's CPU affinity cut to that many cores (gpupoor
starts one worker process per core it may use). `--strategies` compares, on one size, three ways to use the
cores for tokenization (reading and encoding only): worker processes (gpupoor's), one process with the fast
tokenizer's own threads on each chunk's batched call, and one process on one thread.

No download: the tokenizer is trained here (as tests/conftest.py trains it) and the model is a tiny random
Llama (gpupoor.model.tiny). Run it on a quiet machine; nothing is written to docs/. The table is printed; the raw
figures go to WORK/results.json (default build/bench/data_scaling).

    python bench/data_scaling.py [--rows 10000,100000,1000000] [--cores 1,2] [--strategies] [--work DIR]
"""

from __future__ import annotations

import json
import os
import random
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORKER_FLAG, STRATEGY_FLAG, BREAKDOWN_FLAG = "--worker", "--strategy", "--breakdown"
WORDS = ("the model learns to stop when the answer is done and every token counts toward the loss "
         "python lists sort reverse add numbers quickly small large data memory speed resume").split()


# ----------------------------------------------------------------------------------------------------------
# Inside a measured process


def _status_kib() -> dict[str, int]:
    """Resident memory now (VmRSS = RssAnon + RssFile + RssShmem) and its high-water mark, in KiB."""
    keys = ("VmRSS", "VmHWM", "RssAnon", "RssFile")
    with open("/proc/self/status") as handle:
        return {line.split(":")[0]: int(line.split()[1]) for line in handle if line.startswith(keys)}


def _mib(kib: int | None) -> float | None:
    return None if kib is None else round(kib / 1024, 1)


def worker(result: Path, gpupoor_args: list[str]) -> None:
    """Run one gpupoor command here, timing build_data and the training loop, and write what was measured."""
    started = time.perf_counter()
    marks: dict = {}
    _watch(marks, started)
    code: int | str | None = 0
    try:
        from gpupoor.cli import app

        app(gpupoor_args, prog_name="gpupoor")
    except SystemExit as exc:
        code = exc.code
    finally:
        status = _status_kib()
        record = {"exit_code": code, "wall_s": round(time.perf_counter() - started, 3),
                  "maxrss_mib": _mib(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss),
                  "workers_maxrss_mib": _mib(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss),
                  "exit_anon_mib": _mib(status.get("RssAnon")), "exit_file_mib": _mib(status.get("RssFile")),
                  **marks}
        result.write_text(json.dumps(record))
    sys.exit(code)


def _watch(marks: dict, started: float) -> None:
    """Time build_data (the CLI and run.py import it when they call it, so the module attribute is what runs)
    and note when the training loop starts and returns (after its one step, before the final save)."""
    import gpupoor.data.build as build
    import gpupoor.train.loop as loop

    build_data, train = build.build_data, loop.train

    def timed_build(*args, **kwargs):
        begun = time.perf_counter()
        bundle = build_data(*args, **kwargs)
        status = _status_kib()
        marks.update(data_s=round(time.perf_counter() - begun, 3), cache_hit=bundle.cache_hit,
                     examples=len(bundle.train), tokens=bundle.train.stats.tokens,
                     data_anon_mib=_mib(status.get("RssAnon")), data_file_mib=_mib(status.get("RssFile")),
                     data_peak_mib=_mib(status.get("VmHWM")))
        return bundle

    def timed_train(*args, **kwargs):
        marks["loop_start_s"] = round(time.perf_counter() - started, 3)
        try:
            return train(*args, **kwargs)
        finally:
            marks["first_step_s"] = round(time.perf_counter() - started, 3)

    build.build_data, loop.train = timed_build, timed_train


def breakdown(recipe_path: Path, cache: Path, result: Path) -> None:
    """The pieces of a warm start's build_data, each timed: data fingerprint, cache entry check + map, plan."""
    from gpupoor.data.dataset import TokenizedDataset
    from gpupoor.data.loading import resolve_source
    from gpupoor.data.sampler import BatchPlan
    from gpupoor.recipe.loading import load_recipe

    loaded = load_recipe(recipe_path)
    data = loaded.recipe.data
    timings = {}
    begun = time.perf_counter()
    resolve_source(data.path, loaded.base_dir, data.split, "data.path").fingerprint()
    timings["fingerprint_s"] = time.perf_counter() - begun
    [entry] = sorted((cache / "tokenized").glob("*.safetensors"))
    begun = time.perf_counter()
    dataset = TokenizedDataset.load(entry)
    timings["cache_load_s"] = time.perf_counter() - begun
    begun = time.perf_counter()
    BatchPlan(dataset.lengths, loaded.recipe.training.micro_batch_size, 0, "random", data.max_length).epoch(0)
    timings["plan_s"] = time.perf_counter() - begun
    timings = {key: round(value, 3) for key, value in timings.items()}
    result.write_text(json.dumps({**timings, "data_file_mib": round(Path(data.path).stat().st_size / 2**20, 1),
                                  "cache_file_mib": round(entry.stat().st_size / 2**20, 1),
                                  "maxrss_mib": _mib(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)}))


def strategy(name: str, rows_file: Path, tokenizer_dir: Path, result: Path) -> None:
    """Read and encode every row (no writing) one way: `processes` (gpupoor's worker pool), `threads` (one
    process, the fast tokenizer's threads on each chunk's batched call), `serial` (one process, one thread)."""
    os.environ["TOKENIZERS_PARALLELISM"] = "true" if name == "threads" else "false"
    from transformers import AutoTokenizer

    from gpupoor.data.encoder import Encoder
    from gpupoor.data.loading import DataSource, iter_rows
    from gpupoor.data.tokenize import encode_chunks, usable_workers

    encoder = Encoder(AutoTokenizer.from_pretrained(tokenizer_dir), "alpaca", 512)
    workers = usable_workers() if name == "processes" else 1
    begun = time.perf_counter()
    rows = tokens = 0
    for chunk in encode_chunks(iter_rows(DataSource("file", str(rows_file), "train")), encoder, workers):
        rows, tokens = rows + chunk.stats.rows, tokens + chunk.stats.tokens
    seconds = time.perf_counter() - begun
    result.write_text(json.dumps({"strategy": name, "workers": workers, "rows": rows, "tokens": tokens,
                                  "seconds": round(seconds, 3), "rows_per_s": round(rows / seconds)}))


# ----------------------------------------------------------------------------------------------------------
# Driver


def _sentence(rng: random.Random, low: int, high: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(low, high)))


def fixture(work: Path) -> Path:
    """A tokenizer trained as tests/conftest.py trains it, and a tiny random Llama with it (built once)."""
    model = work / "tiny-llama"
    if (model / "config.json").is_file():
        return model
    from gpupoor.data.row_formats import alpaca_prompt
    from gpupoor.model.tiny import build_tiny_llama, train_tokenizer

    rng = random.Random(1)
    texts = [alpaca_prompt(_sentence(rng, 2, 9), _sentence(rng, 0, 5)) + _sentence(rng, 1, 9) for _ in range(300)]
    texts += ["<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nhello<|im_end|>\n"] * 20
    tokenizer = train_tokenizer(texts, vocab_size=400)
    return build_tiny_llama(model, tokenizer, hidden=32, layers=2, heads=4, kv_heads=2, seed=0)


def rows_file(work: Path, count: int) -> Path:
    """`count` alpaca rows, seeded; about 100 tokens each (prompt template included) with the fixture tokenizer."""
    path = work / f"rows-{count}.jsonl"
    if path.is_file():
        return path
    rng = random.Random(count)
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w") as handle:
        for index in range(count):
            row = {"instruction": _sentence(rng, 5, 15), "output": _sentence(rng, 10, 25)}
            if index % 3 == 0:
                row["input"] = _sentence(rng, 3, 8)
            handle.write(json.dumps(row) + "\n")
    tmp.rename(path)
    return path


def recipe(work: Path, model: Path, data: dict, name: str) -> Path:
    import yaml

    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump({
        "model": {"name_or_path": str(model)},
        "data": {**data, "format": "alpaca", "max_length": 512, "sampler": "random"},
        "peft": {"rank": 4},
        "training": {"micro_batch_size": 4, "max_steps": 1, "warmup_steps": 0},
        "logging": {"progress": "none"}, "seed": 0}, sort_keys=False))
    return path


def launch(work: Path, args: list[str], cache: Path, cores: int | None = None) -> dict:
    """One measured process: this file in a mode, its result read back, its wall time from outside."""
    result = work / "result.json"
    result.unlink(missing_ok=True)
    env = {**os.environ, "GPUPOOR_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    allowed = sorted(os.sched_getaffinity(0))[:cores] if cores else None
    begun = time.perf_counter()
    done = subprocess.run([sys.executable, __file__, *args[:1], str(result), *args[1:]], env=env, cwd=work,
                          capture_output=True, text=True,
                          preexec_fn=(lambda: os.sched_setaffinity(0, allowed)) if allowed else None)
    wall = time.perf_counter() - begun
    if done.returncode != 0 or not result.is_file():
        raise SystemExit(f"{' '.join(args)} failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return {**json.loads(result.read_text()), "process_wall_s": round(wall, 3)}


def _builds_from_dirs() -> bool:
    import gpupoor.data.build as build

    return "load_tokenized_dir" in Path(build.__file__).read_text()


def _streams() -> bool:
    import gpupoor.data.build as build

    return "tokenize_source" in Path(build.__file__).read_text()


def measure_size(work: Path, model: Path, count: int, cores: list[int]) -> dict:
    data = rows_file(work, count)
    cache, out = work / f"cache-{count}", work / f"tokenized-{count}"
    raw = recipe(work, model, {"path": str(data)}, f"raw-{count}")
    result: dict = {"rows": count, "data_file_mib": round(data.stat().st_size / 2**20, 1), "cold": {}}
    for limit in cores or [None]:
        shutil.rmtree(cache, ignore_errors=True)
        label = str(limit or len(os.sched_getaffinity(0)))
        result["cold"][label] = launch(work, [WORKER_FLAG, "tokenize", str(raw), "--output", str(out)], cache, limit)
    run_dir = work / f"run-{count}"
    shutil.rmtree(run_dir, ignore_errors=True)
    result["warm"] = launch(work, [WORKER_FLAG, "train", str(raw), "--output-dir", str(run_dir)], cache)
    result["breakdown"] = launch(work, [BREAKDOWN_FLAG, str(raw), str(cache)], cache)
    if _builds_from_dirs():
        shutil.rmtree(run_dir, ignore_errors=True)
        from_dir = recipe(work, model, {"tokenized_path": str(out)}, f"dir-{count}")
        result["from_dir"] = launch(work, [WORKER_FLAG, "train", str(from_dir), "--output-dir", str(run_dir)],
                                    cache)
    shutil.rmtree(run_dir, ignore_errors=True)
    return result


def render(results: list[dict], strategies: list[dict]) -> str:
    lines = ["| rows | tokens/row | data file | cores | tokenize: process wall | build_data (read, tokenize, cache) "
             "| rows/s | peak RSS: main / largest worker | RSS at exit: anon / file |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for item in results:
        for label, cold in item["cold"].items():
            lines.append(
                f"| {item['rows']:,} | {cold['tokens'] / max(cold['examples'], 1):.0f} | {item['data_file_mib']} MiB "
                f"| {label} | {cold['process_wall_s']:.1f} s | {cold['data_s']:.2f} s | "
                f"{item['rows'] / max(cold['data_s'], 1e-9):,.0f} | {cold['maxrss_mib']} / "
                f"{cold['workers_maxrss_mib']} MiB | {cold['exit_anon_mib']} / {cold['exit_file_mib']} MiB |")
    lines += ["", "| rows | warm train: to first step | build_data | cache hit | peak RSS | RSS when data ready: "
              "anon / file | from DIR: to first step | build_data | peak RSS |",
              "|---:|---:|---:|---|---:|---:|---:|---:|---:|"]
    for item in results:
        warm, from_dir = item["warm"], item.get("from_dir")
        tail = (f"{from_dir['first_step_s']:.2f} s | {from_dir['data_s']:.2f} s | {from_dir['maxrss_mib']} MiB"
                if from_dir else "- | - | -")
        lines.append(f"| {item['rows']:,} | {warm['first_step_s']:.2f} s | {warm['data_s']:.2f} s | "
                     f"{warm['cache_hit']} | {warm['maxrss_mib']} MiB | {warm['data_anon_mib']} / "
                     f"{warm['data_file_mib']} MiB | {tail} |")
    lines += ["", "| rows | warm build_data's pieces: data fingerprint (hashes the data file) | cache entry check + "
              "map | batch plan (epoch 0) | data file | cache file |", "|---:|---:|---:|---:|---:|---:|"]
    for item in results:
        b = item["breakdown"]
        lines.append(f"| {item['rows']:,} | {b['fingerprint_s']:.3f} s | {b['cache_load_s']:.3f} s | "
                     f"{b['plan_s']:.3f} s | {b['data_file_mib']} MiB | {b['cache_file_mib']} MiB |")
    if strategies:
        lines += ["", "| tokenization strategy (read + encode, no write) | workers | rows | s | rows/s |",
                  "|---|---:|---:|---:|---:|"]
        lines += [f"| {s['strategy']} | {s['workers']} | {s['rows']:,} | {s['seconds']:.1f} | {s['rows_per_s']:,} |"
                  for s in strategies]
    return "\n".join(lines)


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="10000,100000,1000000", help="comma-separated row counts")
    parser.add_argument("--cores", default="", help="also tokenize with the CPU affinity cut to these many cores, "
                        "e.g. 1,2 (default: only with every core this process may use)")
    parser.add_argument("--strategies", action="store_true", help="compare worker processes, tokenizer threads "
                        "and one thread, on the largest size of --rows up to 100k")
    parser.add_argument("--work", default=str(ROOT / "build" / "bench" / "data_scaling"))
    args = parser.parse_args()
    counts = [int(value) for value in args.rows.split(",")]
    cores = [int(value) for value in args.cores.split(",") if value]
    work = Path(args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    print(f"command: python bench/data_scaling.py {' '.join(sys.argv[1:])}")
    load = os.getloadavg()[0]
    print(f"timings are only valid when nothing else runs on the machine (load average now {load:.2f} on "
          f"{os.cpu_count()} cores{'; wait for a quiet machine' if load > 0.5 else ''})", flush=True)
    if not _streams():
        print("note: gpupoor/data/build.py does not call tokenize_source yet: the cold runs measure the old "
              "in-memory path", flush=True)
    model = fixture(work)
    results = []
    for count in counts:
        results.append(measure_size(work, model, count, cores))
        print(json.dumps(results[-1]), flush=True)
    strategies = []
    if args.strategies:
        size = max([c for c in counts if c <= 100_000] or [min(counts)])
        strategies = [launch(work, [STRATEGY_FLAG, name, str(rows_file(work, size)), str(model)], work / "cache")
                      for name in ("processes", "threads", "serial")]
    table = render(results, strategies)
    (work / "results.json").write_text(json.dumps({"command": sys.argv, "results": results,
                                                   "strategies": strategies}, indent=1))
    print(table)


if __name__ == "__main__":
    # Run as a script, this file's folder is first on sys.path: its module names must not shadow installed ones.
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
    if len(sys.argv) > 2 and sys.argv[1] == WORKER_FLAG:
        worker(Path(sys.argv[2]), sys.argv[3:])
    elif len(sys.argv) > 2 and sys.argv[1] == BREAKDOWN_FLAG:
        breakdown(Path(sys.argv[3]), Path(sys.argv[4]), Path(sys.argv[2]))
    elif len(sys.argv) > 2 and sys.argv[1] == STRATEGY_FLAG:
        strategy(sys.argv[3], Path(sys.argv[4]), Path(sys.argv[5]), Path(sys.argv[2]))
    else:
        main()
