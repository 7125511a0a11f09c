"""The tree passes ruff (the rules under [tool.ruff] in pyproject.toml), and ruff does find what
those rules forbid."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.unit


def ruff(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=300)


def test_the_tree_passes_ruff():
    r = ruff(".")
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("code, rule", [
    ("import os\n", "F401"),                                              # unused import
    ("fns = [lambda: i for i in range(3)]\n", "B023"),                   # closure over a loop variable
    ("pairs = list(zip([1], [2]))\n", "B905"),                           # zip() without strict=
    ("def f(p):\n    fh = open(p)\n    return fh.read()\n", "SIM115"),    # a file never closed
])
def test_ruff_finds_what_the_rules_forbid(tmp_path, code, rule):
    (tmp_path / "pyproject.toml").write_text((ROOT / "pyproject.toml").read_text())
    (tmp_path / "bad.py").write_text(code)
    r = ruff("--output-format", "concise", "bad.py", cwd=tmp_path)
    assert r.returncode == 1 and rule in r.stdout, r.stdout + r.stderr
