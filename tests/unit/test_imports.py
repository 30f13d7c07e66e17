"""The import contracts (pyproject.toml [tool.importlinter]) hold, and can fail: the
engine imports none of its callers, the policies only policy, errors and units."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")

pytestmark = pytest.mark.skipif(not LINT_IMPORTS.exists(),
                                reason="import-linter is not installed (pip install -e .[dev])")


def _lint(src: Path, config: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(src)}
    return subprocess.run([str(LINT_IMPORTS), "--no-cache", "--config", str(config)],
                          capture_output=True, text=True, env=env, cwd=src.parent, timeout=120)


def test_contracts_kept() -> None:
    r = _lint(ROOT / "src", ROOT / "pyproject.toml")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "BROKEN" not in r.stdout


def _tree_with(tmp_path: Path, module: str, line: str) -> Path:
    """A copy of src/ with ``line`` added to ``module``."""
    src = tmp_path / "src"
    shutil.copytree(ROOT / "src" / "livemig", src / "livemig",
                    ignore=shutil.ignore_patterns("__pycache__"))
    path = src / "livemig" / module
    path.write_text(path.read_text() + f"\n{line}\n")
    return src


@pytest.mark.parametrize(("module", "line", "contract"), [
    ("engine/monitor.py", "from livemig.lab import storage  # noqa", "engine"),
    ("engine/events.py", "import livemig.virt.plan  # noqa", "engine"),
    # indirect: the engine reaches the lab through a module it may import
    # (the report builder reads the engine's record, so it breaks too)
    ("settings.py", "from livemig.lab import storage  # noqa", "engine|report builder"),
    ("report.py", "import livemig.virt.record  # noqa", "report builder"),
    ("policy/base.py", "from livemig import settings  # noqa", "policies"),
    ("units.py", "from livemig import paths  # noqa", "errors and units"),
])
def test_a_violation_breaks_a_contract(tmp_path: Path, module: str, line: str,
                                       contract: str) -> None:
    src = _tree_with(tmp_path, module, line)
    r = _lint(src, ROOT / "pyproject.toml")
    assert r.returncode != 0
    broken = [ln for ln in r.stdout.splitlines() if " BROKEN" in ln]
    assert broken and all(re.search(contract, ln) for ln in broken), r.stdout
