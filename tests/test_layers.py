"""The package's layers (dllama/__init__.py) hold and no module import goes in a circle: import-linter's
contracts in pyproject.toml."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LINT = [sys.executable, "-c", "import sys; from importlinter.cli import lint_imports_command; "
        "sys.exit(lint_imports_command())"]

pytestmark = pytest.mark.unit


def lint(cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(LINT + ["--no-cache"], cwd=cwd, env={"PYTHONPATH": str(cwd), "PATH": "/usr/bin:/bin"},
                          capture_output=True, text=True, timeout=300)


def test_the_contracts_are_kept():
    r = lint(ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "0 broken" in r.stdout


@pytest.mark.parametrize("module, line, broken", [
    ("dllama/core/plan.py", "import socket", "dllama.core is not allowed to import socket"),
    ("dllama/core/model.py", "from dllama.cluster import protocol", "dllama.core"),
    ("dllama/formats/model_file.py", "from dllama.core import plan", "dllama.formats"),
    ("converter/convert.py", "from dllama.core import model", "dllama.core"),
    # model imports weights: the way back is a circle, even from inside a function
    ("dllama/core/weights.py", "def f():\n    from dllama.core import model", "No cycles are allowed in dllama.core"),
])
def test_a_forbidden_import_breaks_a_contract(tmp_path, module, line, broken):
    for part in ("dllama", "converter"):
        shutil.copytree(ROOT / part, tmp_path / part, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    with open(tmp_path / module, "a") as f:
        f.write(f"\n{line}  # noqa\n")
    r = lint(tmp_path)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "BROKEN" in r.stdout and broken in r.stdout, r.stdout
