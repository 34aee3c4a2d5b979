"""What the plan knows of the machine here, without importing torch: the device training would use, the GPU's
facts the decisions take (nvidia-smi, or torch when a caller imported it) and the memory free on the device."""

from __future__ import annotations

import importlib.util
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from gpupoor.decisions import choose_device
from gpupoor.recipe.schema import Recipe
from gpupoor.units import MiB

# A CUDA process: the context (driver, cuBLAS and cuDNN kernels) outside torch's allocator. 400-600 MiB on
# recent GPUs with torch 2.x; we take the middle. Plus the Python/torch host side is not GPU memory.
CUDA_CONTEXT = 500 * MiB


@dataclass(frozen=True)
class GpuFacts:
    """What plan knows of the GPU it plans for: the facts gpupoor.decisions takes. `major` None: no GPU is
    visible here (a plan for another machine): explicit requests stand, `auto` takes the larger memory bound."""

    major: int | None = None  # the CUDA compute capability's major version
    flash_installed: bool = False


def default_device(recipe: Recipe) -> str:
    """The device training would use here (gpupoor.decisions.choose_device), found without importing torch."""
    requested = recipe.training.device
    return choose_device(requested, _cuda_visible() if requested == "auto" else None).value


def _cuda_visible() -> bool:
    if "torch" in sys.modules:
        import torch

        return torch.cuda.is_available()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return False
    gpus = Path("/proc/driver/nvidia/gpus")
    if gpus.is_dir() and any(gpus.iterdir()):
        return True
    import shutil

    return bool(shutil.which("nvidia-smi"))  # WSL2 and some containers have no /proc entry


def _nvidia_smi(fields: str) -> list[str] | None:
    """`fields` (nvidia-smi --query-gpu) of the first GPU this process may use, or None when nothing answers."""
    import shutil
    import subprocess

    if not shutil.which("nvidia-smi"):
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip() or "0"
    try:
        out = subprocess.run(["nvidia-smi", "-i", visible, f"--query-gpu={fields}", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10).stdout.splitlines()
        return [value.strip() for value in out[0].split(",", fields.count(","))]
    except (OSError, IndexError, subprocess.SubprocessError):
        return None


def gpu_facts(device: str) -> GpuFacts:
    """What the decisions need to know of the GPU a run on `device` would use here: torch's answer when a
    caller already imported it, else nvidia-smi's; none when no GPU is visible."""
    flash_installed = importlib.util.find_spec("flash_attn") is not None
    if device != "cuda":
        return GpuFacts(None, flash_installed)
    if "torch" in sys.modules:
        import torch

        if torch.cuda.is_available():
            return GpuFacts(torch.cuda.get_device_capability(0)[0], flash_installed)
    answer = _nvidia_smi("compute_cap")
    try:
        return GpuFacts(int(answer[0].split(".")[0]), flash_installed)
    except (TypeError, IndexError, ValueError):  # no GPU here, or an nvidia-smi too old to know compute_cap
        return GpuFacts(None, flash_installed)


def device_memory(device: str) -> tuple[int | None, str]:
    """Bytes the run may use on `device`, and where that figure comes from."""
    if device == "cpu":
        try:
            meminfo = Path("/proc/meminfo").read_text()
            available = int(next(line.split()[1] for line in meminfo.splitlines()
                                 if line.startswith("MemAvailable:"))) * 1024
            status = Path("/proc/self/status").read_text()
            own = int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS:"))) * 1024
        except (OSError, StopIteration, ValueError):
            return None, "unknown (no /proc/meminfo)"
        return available + own, "available RAM (MemAvailable) + this process"
    if "torch" in sys.modules:
        import torch

        if torch.cuda.is_available():
            free, _ = torch.cuda.mem_get_info()
            # the context this process just created is counted in the plan's overhead term: give it back
            return free + CUDA_CONTEXT, f"free memory of {torch.cuda.get_device_name(0)}"
    answer = _nvidia_smi("memory.free,name")
    try:
        return int(answer[0]) * MiB, f"free memory of {answer[1]} (nvidia-smi)"
    except (TypeError, IndexError, ValueError):
        return None, "unknown: no GPU visible (pass --memory)"
