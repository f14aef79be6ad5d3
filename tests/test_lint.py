"""The linter, at the project's line length (pyproject's [tool.ruff]), over the package, the tests and the examples."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _ruff() -> list[str]:
    beside = Path(sys.executable).with_name("ruff")
    found = str(beside) if beside.exists() else shutil.which("ruff")
    if found is None:
        pytest.fail("ruff is not installed: ./dev setup installs the test extras, ruff among them")
    return [found]


def test_the_code_passes_the_linter():
    done = subprocess.run([*_ruff(), "check", "--no-cache", "meshws", "tests", "examples"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]


def test_the_linter_reads_the_projects_rules(tmp_path):
    (tmp_path / "pyproject.toml").write_text((ROOT / "pyproject.toml").read_text())
    (tmp_path / "bad.py").write_text("import os\n" + "x = " + "1 + " * 40 + "1\n")
    done = subprocess.run([*_ruff(), "check", "--no-cache", "bad.py"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 1
    assert "F401" in done.stdout and "E501" in done.stdout
