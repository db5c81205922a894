"""The house's rules, checked by tools: import-linter's contracts (pyproject.toml) keep the arrows
one-way, mypy (strict on the engine and the live layer, [tool.mypy] in pyproject.toml) checks the
types, and ruff keeps the code clean. Each runs as the developer would run it."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def run(tool: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / tool), *args], cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_import_contracts_hold():
    result = run("lint-imports")
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    # the contracts must actually have been checked, not skipped
    assert "broken" in result.stdout and " 0 broken" in result.stdout, result.stdout[-2000:]
    assert "Analyzed" in result.stdout


# The packages mypy checks with the strict flags of [tool.mypy] (what they import is checked too).
# One run for both: live imports the engine's vocabulary, so two runs would analyse it twice.
TYPED_PACKAGES = ("engine", "live")


def test_the_typed_packages_type_check():
    result = run("mypy", *TYPED_PACKAGES)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert result.stdout.startswith("Success: no issues found"), result.stdout[-2000:]
    # every module of the typed packages was checked, not a subset
    checked = int(re.search(r"in (\d+) source files", result.stdout).group(1))
    modules = sum(1 for package in TYPED_PACKAGES for _ in (ROOT / package).rglob("*.py"))
    assert checked == modules, result.stdout
