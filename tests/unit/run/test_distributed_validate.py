"""The unit tier of test_distributed.py (the tiers are described in tests/conftest.py)."""

from __future__ import annotations

import pytest

from support.cli import invoke


@pytest.mark.parametrize("key, value, named", [
    ("training.optimizer", "adamw_8bit", "training.optimizer adamw_8bit"),
    ("training.optimizer", "adafactor", "training.optimizer adafactor"),
    ("memory.max_gpu_memory", "4GiB", "memory.max_gpu_memory"),
])
def test_fsdp_combinations_that_cannot_work_are_refused_at_validate(make_recipe, key, value, named):
    result = invoke("validate", make_recipe(), "--set", "distributed.strategy=fsdp", "--set", f"{key}={value}")
    assert result.exit_code == 2 and "distributed.strategy fsdp" in result.output and named in result.output


def test_launch_layout_counts_nodes():
    from gpupoor.decisions import launch_layout

    assert launch_layout({}) == (1, 1)
    assert launch_layout({"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4"}) == (8, 2)
    assert launch_layout({"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1"}) == (2, 2)


def test_the_launcher_leaves_a_sighup_the_process_ignores_ignored():
    """torchrun's launcher installs a handler for each signal of --signals-to-handle without asking whether it was
    ignored: under `nohup` it took the closed terminal's SIGHUP and stopped every process."""
    import signal

    from gpupoor.run.launch import torchrun_args

    def handled(disposition) -> str:
        previous = signal.signal(signal.SIGHUP, disposition)
        try:
            args = torchrun_args(2, "1", 0, "127.0.0.1", None, None)
        finally:
            signal.signal(signal.SIGHUP, previous)
        return args[args.index("--signals-to-handle") + 1]

    assert handled(signal.SIG_DFL) == "SIGHUP,SIGQUIT"
    assert handled(signal.SIG_IGN) == "SIGQUIT"
