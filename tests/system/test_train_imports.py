"""The system tier of test_train.py (the tiers are described in tests/conftest.py)."""

from __future__ import annotations

import pytest


def test_a_recipe_without_quantization_never_imports_bitsandbytes_and_a_later_one_still_can(make_recipe, tmp_path):
    """peft imports bitsandbytes whenever it is installed (a second at start-up and a line of noise); gpupoor keeps
    it out of a LoRA run, and a quantized run in the same process afterwards still gets peft's 4-bit layers."""
    pytest.importorskip("bitsandbytes")
    import subprocess
    import sys

    recipe = make_recipe(training={"max_steps": 1})
    quantized = make_recipe("q.yaml", training={"max_steps": 1}, quantization={"bits": 4})
    program = (
        "import sys\n"
        "from typer.testing import CliRunner\n"
        "from gpupoor.cli import app\n"
        f"result = CliRunner().invoke(app, ['train', {str(recipe)!r}, '--output-dir', {str(tmp_path / 'lora')!r}])\n"
        "assert result.exit_code == 0, result.output\n"
        "print('after lora:', 'bitsandbytes' in sys.modules, 'gemm_4bit' in result.output)\n"
        f"result = CliRunner().invoke(app, ['train', {str(quantized)!r}, '--output-dir', {str(tmp_path / 'q')!r}])\n"
        "assert result.exit_code == 0, result.output  # peft wraps 4-bit layers only with its bnb dispatch\n"
        "print('after qlora:', 'bitsandbytes' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "after lora: False False" in out.stdout and "after qlora: True" in out.stdout
