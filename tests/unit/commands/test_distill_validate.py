"""The unit tier of test_distill.py (the tiers are described in tests/conftest.py)."""

from __future__ import annotations

from support.cli import invoke


def test_a_missing_teacher_fails_validate(make_recipe, tmp_path):
    result = invoke("validate", make_recipe(distill={"teacher": str(tmp_path / "nowhere")}))
    assert result.exit_code == 2 and "distill.teacher" in result.output and "does not exist" in result.output
