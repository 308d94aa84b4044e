"""`ruff check` is clean over the whole tree, with the rules pyproject.toml's [tool.ruff] sets.

ruff comes with the test extra (CI installs it); elsewhere the test uses the ruff beside the
interpreter, on PATH, or named by $RUFF, and skips when there is none.
"""

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def ruff_command() -> list[str] | None:
    if os.environ.get("RUFF"):
        return [os.environ["RUFF"]]
    if importlib.util.find_spec("ruff") is not None:
        return [sys.executable, "-m", "ruff"]
    found = shutil.which("ruff")
    return [found] if found else None


def test_ruff_check_is_clean():
    ruff = ruff_command()
    if ruff is None:
        pytest.skip("ruff is not installed (pip install -e '.[test]' brings it, or set $RUFF to a ruff binary)")
    out = subprocess.run([*ruff, "check", "--no-cache", "--output-format", "concise", "."], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, f"ruff check found problems (fix them; see [tool.ruff] in pyproject.toml):\n" \
                                f"{out.stdout}{out.stderr}"
