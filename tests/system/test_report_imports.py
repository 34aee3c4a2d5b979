"""The system tier of test_report.py (the tiers are described in tests/conftest.py)."""

from __future__ import annotations

import subprocess
import sys


def test_the_cli_does_not_import_matplotlib_until_report_runs():
    code = "import sys, gpupoor.cli, gpupoor.commands.report, gpupoor.commands.status; assert 'matplotlib' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
