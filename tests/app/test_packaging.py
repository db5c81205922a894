"""The desktop entry installer writes a launcher that points at this checkout's app."""

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_desktop_entry_points_at_the_checkout(tmp_path):
    env = dict(os.environ, XDG_DATA_HOME=str(tmp_path))
    script = ROOT / "packaging" / "install-desktop-entry.sh"
    proc = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    entry = (tmp_path / "applications" / "kvscope.desktop").read_text()
    assert f"Exec={ROOT}/.venv/bin/kvscope" in entry and "Icon=kvscope" in entry
    assert (tmp_path / "icons/hicolor/scalable/apps/kvscope.svg").read_text().lstrip().startswith("<")
    subprocess.run(["bash", str(script), "--remove"], env=env, check=True, timeout=60)
    assert not (tmp_path / "applications" / "kvscope.desktop").exists()
