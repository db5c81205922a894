"""./dev asks Qt's xcb platform plugin what it links against (ldd) and installs or names the
Debian packages of what is missing (packaging/qt_runtime.py), tested on ldd output without root."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "packaging"))

import qt_runtime  # noqa: E402

LDD_WITHOUT_ICCCM = """\
\tlinux-vdso.so.1 (0x00007ffd)
\tlibQt6XcbQpa.so.6 => /venv/PySide6/Qt/plugins/platforms/../../lib/libQt6XcbQpa.so.6 (0x00007f8f)
\tlibxcb-icccm.so.4 => not found
\tlibxcb-cursor.so.0 => /lib/x86_64-linux-gnu/libxcb-cursor.so.0 (0x00007f8f)
\tlibxcb-keysyms.so.1 => not found
\tlibxkbcommon-x11.so.0 => not found
\tlibX11-xcb.so.1 => not found
\tlibxcb-render-util.so.0 => not found
\tlibxcb-icccm.so.4 => not found
"""


def test_missing_libraries_are_read_from_ldd_output_once_each():
    assert qt_runtime.missing_libraries(LDD_WITHOUT_ICCCM) == [
        "libxcb-icccm.so.4", "libxcb-keysyms.so.1", "libxkbcommon-x11.so.0", "libX11-xcb.so.1",
        "libxcb-render-util.so.0",
    ]  # fmt: skip
    assert qt_runtime.missing_libraries("\tlibc.so.6 => /lib/libc.so.6 (0x1)\n") == []


def test_debian_package_names():
    assert qt_runtime.packages_for([LDD_WITHOUT_ICCCM]) == [
        "libxcb-icccm4", "libxcb-keysyms1", "libxkbcommon-x11-0", "libx11-xcb1", "libxcb-render-util0",
    ]  # fmt: skip
    assert qt_runtime.debian_package("libxcb-xinerama.so.0") == "libxcb-xinerama0"
    assert qt_runtime.debian_package("libfoo2.so.0") == "libfoo2-0"
    assert qt_runtime.debian_package("libEGL.so.1") == "libegl1"


def test_the_plugin_and_its_library_are_looked_up_in_pyside6(tmp_path):
    files = qt_runtime.plugin_files(tmp_path / "PySide6")
    assert [f.name for f in files] == ["libqxcb.so", "libQt6XcbQpa.so.6"]
    assert files[0].parent.name == "platforms"


def fake_pyside(tmp_path, monkeypatch, outputs):
    pyside = tmp_path / "PySide6"
    for f in qt_runtime.plugin_files(pyside):
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_bytes(b"")
    monkeypatch.setattr(qt_runtime, "_pyside_dir", lambda: pyside)
    monkeypatch.setattr(qt_runtime, "_ldd", lambda path: outputs.pop(0) if outputs else "")


def test_without_root_the_packages_are_named(tmp_path, monkeypatch, capsys):
    fake_pyside(tmp_path, monkeypatch, [LDD_WITHOUT_ICCCM, ""])
    ran = []
    monkeypatch.setattr(qt_runtime.subprocess, "run", lambda *a, **k: ran.append(a) or None)
    assert qt_runtime.main([]) == 0
    err = capsys.readouterr().err
    assert "libxcb-icccm4" in err and "libx11-xcb1" in err and "apt-get install" in err
    assert not ran, "nothing is installed without --install"


def test_as_root_they_are_installed_with_apt_get(tmp_path, monkeypatch, capsys):
    fake_pyside(tmp_path, monkeypatch, [LDD_WITHOUT_ICCCM, "", "", ""])  # after the install: found
    ran = []

    def run(cmd, **kwargs):
        ran.append(cmd)
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(qt_runtime.subprocess, "run", run)
    assert qt_runtime.main(["--install"]) == 0
    install = next(cmd for cmd in ran if "install" in cmd)
    assert install[:4] == ["apt-get", "install", "-y", "-qq"] and "libxcb-icccm4" in install
    assert "warning" not in capsys.readouterr().err


def test_dev_runs_the_check_after_installing_pyside6():
    dev = (ROOT / "dev").read_text()
    assert "packaging/qt_runtime.py" in dev and dev.count("qt_xcb_libraries") >= 3
    assert subprocess.run(["bash", "-n", str(ROOT / "dev")]).returncode == 0
