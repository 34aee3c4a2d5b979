"""`gpupoor merge-lora`: the verb over gpupoor.model.merge. It checks the options, finds the adapter (a run's
final/ or step-N, verified against its manifest, or a PEFT directory), merges it into its base with the run's last
metrics on the model card, and with `--verify` compares the merged model's logits with base + adapter."""

from __future__ import annotations

from pathlib import Path

from gpupoor.errors import UserError


def merge(source: Path, output: Path, *, checkpoint: str = "final", dtype: str = "auto", base: str | None = None,
          max_shard_size: str = "2GB", qlora_base: str = "dequantized", verify: bool = False,
          check_files: bool = True, force: bool = False, say=print) -> Path:
    """merge-lora's options checked, then the merge; returns the merged directory."""
    from gpupoor.hardware import DTYPES
    from gpupoor.model.merge import merge_lora, verify_merge
    from gpupoor.quiet import quiet_libraries
    from gpupoor.storage.run_weights import resolve_adapter
    from gpupoor.train.metrics import last_metrics
    from gpupoor.units import parse_size

    if dtype != "auto" and dtype not in DTYPES:
        raise UserError(f"--dtype {dtype!r}: use auto, fp16, bf16 or fp32")
    if qlora_base not in ("dequantized", "original"):
        raise UserError(f"--qlora-base {qlora_base!r}: use dequantized or original")
    shard_bytes = parse_size(max_shard_size, "--max-shard-size")
    if shard_bytes < 1:
        raise UserError(f"--max-shard-size {max_shard_size!r}: a shard must hold at least 1 byte; use a size "
                        "like 2GB, 500MB or 4GiB (a tensor larger than it gets a shard of its own)")
    quiet_libraries()
    adapter = resolve_adapter(source, checkpoint, check_files=check_files)
    metrics = last_metrics(adapter.run_dir) if adapter.run_dir is not None else {}
    merged = merge_lora(adapter, output, dtype=dtype, base=base, max_shard_bytes=shard_bytes, qlora_base=qlora_base,
                        say=say, force=force, metrics=metrics)
    say(f"merged model written to {merged}")
    if verify:
        gap = verify_merge(adapter, merged, base)
        say(f"verify: max |logit difference| merged vs base + adapter as trained = {gap:.2e}")
    return merged
