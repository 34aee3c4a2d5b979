"""The system tier of test_cli.py (the tiers are described in tests/conftest.py)."""

from __future__ import annotations

import subprocess
import sys


def test_help_does_not_import_torch():
    code = "import sys; from gpupoor.cli import app; print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_validate_runs_without_importing_torch(make_recipe):
    """What keeps validate well under 2 s per recipe: it never loads torch or transformers."""
    code = ("import sys\nfrom gpupoor.cli import app\ntry:\n    app(['validate', sys.argv[1]])\n"
            "except SystemExit as exit:\n    code = exit.code\n"
            "print(code, sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code, str(make_recipe())], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip().splitlines()[-1] == "0 []"
