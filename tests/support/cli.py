"""Shared by the cli tests (moved from unit/test_cli.py, whose tests still use them)."""

from __future__ import annotations

from typer.testing import CliRunner


runner = CliRunner()
