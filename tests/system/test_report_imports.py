"""The system tier of test_report.py (the tiers are described in tests/conftest.py)."""

from __future__ import annotations
import base64
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
import pytest
import yaml
from conftest import alpaca_rows, invoke, write_jsonl


def test_the_cli_does_not_import_matplotlib_until_report_runs():
    code = "import sys, gpupoor.cli, gpupoor.commands.report, gpupoor.commands.status; assert 'matplotlib' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
