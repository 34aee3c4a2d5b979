"""Shared by the serve tests (integration/test_serve.py, integration/test_serve_contract.py,
system/test_serve_signals.py) and the bad-input harness: a free port, and a tiny alpaca run to serve."""

from __future__ import annotations

import socket
from pathlib import Path


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def tiny_alpaca_run(root: Path, tiny_model: Path, name: str = "run", rows: int = 16, steps: int = 2) -> Path:
    """A LoRA run of the tiny model on `rows` alpaca rows, trained for `steps` into root/name."""
    from support.cli import invoke
    from support.recipes import write_recipe
    from support.rows import alpaca_rows, write_jsonl

    data = write_jsonl(root / "train.jsonl", alpaca_rows(rows))
    assert invoke("train", write_recipe(root / "r.yaml", tiny_model, data, training={"max_steps": steps}),
                  "--output-dir", root / name).exit_code == 0
    return root / name
