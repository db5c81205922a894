"""Startup checks: a Qt platform that cannot start is named with its missing library or display,
unwritable folders give a message and exit 2, and `kvscope COMMAND` runs the engine CLI."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

import app.main as app_main
from app.paths import DirectoryError, config_dir, data_dir
from app.startup import candidates, missing_library, platform_problem, qt_platform_dirs

# A dependency of Qt's offscreen plugin, renamed in a copy to one no system has (same length, so
# the ELF stays valid): the real dynamic loader then fails on it as on an uninstalled library.
PRESENT = b"libxkbcommon.so.0"
ABSENT = b"libkvscope-x.so.0"


@pytest.fixture
def app_state(qapp, monkeypatch):
    """main() would theme the shared QApplication: not here (a style, palette or stylesheet set
    re-polishes every widget alive, and beside those earlier app tests leave that took 218 s, and
    as long again to put back). It sets process-wide names and threads: put them back."""
    import torch

    import widgets.theme

    monkeypatch.setattr(widgets.theme, "apply_theme", lambda app, stylesheet=None: None)
    saved = (qapp.applicationName(), qapp.desktopFileName())
    threads, interval = torch.get_num_threads(), sys.getswitchinterval()
    yield qapp
    qapp.setApplicationName(saved[0])
    qapp.setDesktopFileName(saved[1])
    torch.set_num_threads(threads)
    sys.setswitchinterval(interval)


def real_platform_dir() -> Path:
    return next(d for d in qt_platform_dirs() if (d / "libqoffscreen.so").is_file())


@pytest.fixture
def broken_plugins(tmp_path) -> Path:
    """plugins/platforms/libqoffscreen.so needing ABSENT, beside a lib/ link to Qt's own libraries
    (the plugin finds them through its RUNPATH, $ORIGIN/../../lib)."""
    real = real_platform_dir()
    platforms = tmp_path / "qt" / "plugins" / "platforms"
    platforms.mkdir(parents=True)
    (tmp_path / "qt" / "lib").symlink_to(real.parent.parent / "lib")
    data = (real / "libqoffscreen.so").read_bytes()
    assert data.count(PRESENT + b"\0") == 1
    (platforms / "libqoffscreen.so").write_bytes(data.replace(PRESENT + b"\0", ABSENT + b"\0"))
    return platforms


def test_a_missing_system_library_is_named(broken_plugins):
    problem = platform_problem({"QT_QPA_PLATFORM": "offscreen"}, [broken_plugins])
    assert problem is not None
    assert ABSENT.decode() in problem and "offscreen" in problem and "\n" not in problem


def test_a_known_library_is_named_with_its_package():
    error = "libxcb-cursor.so.0: cannot open shared object file: No such file or directory"
    assert missing_library(error) == "libxcb-cursor.so.0"
    assert missing_library("undefined symbol: foo") is None


def test_a_loadable_platform_passes():
    assert platform_problem({"QT_QPA_PLATFORM": "offscreen"}, [real_platform_dir()]) is None


def test_xcb_without_a_display_is_reported():
    problem = platform_problem({"QT_QPA_PLATFORM": "xcb"}, [real_platform_dir()])
    assert (
        problem == "cannot open a window. Qt's xcb platform cannot start: no X display (DISPLAY is not set)."
    )


def test_one_usable_platform_is_enough(broken_plugins, tmp_path):
    shutil.copy(real_platform_dir() / "libqminimal.so", broken_plugins / "libqminimal.so")
    assert platform_problem({"QT_QPA_PLATFORM": "offscreen;minimal"}, [broken_plugins]) is None


def test_wayland_is_tried_only_in_a_wayland_session():
    dirs = [real_platform_dir()]
    assert [c.name for c in candidates({}, dirs)] == ["xcb"]
    assert [c.name for c in candidates({"WAYLAND_DISPLAY": "wayland-0"}, dirs)] == ["wayland", "xcb"]
    assert [c.name for c in candidates({"QT_QPA_PLATFORM": "vnc:size=800x600"}, dirs)] == ["vnc"]


def test_folders_that_cannot_be_written_raise_a_message(tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("KVSCOPE_DATA_DIR", str(blocker / "data"))
    monkeypatch.setenv("KVSCOPE_CONFIG_DIR", str(blocker / "config"))
    with pytest.raises(DirectoryError, match=r"cannot write the data folder .* KVSCOPE_DATA_DIR"):
        data_dir()
    with pytest.raises(DirectoryError, match=r"cannot write the settings folder .* KVSCOPE_CONFIG_DIR"):
        config_dir()


def test_the_app_with_an_unwritable_data_folder_exits_2_with_a_message(
    tmp_path, monkeypatch, capsys, app_state
):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("KVSCOPE_DATA_DIR", str(blocker / "data"))
    monkeypatch.setenv("KVSCOPE_CONFIG_DIR", str(tmp_path / "config"))
    dialogs = []
    monkeypatch.setattr(app_main, "show_startup_error", dialogs.append)
    # A scripted run: the message on stderr only.
    assert app_main.main(["--prompt", "hi", "--quit-after-reply"]) == app_main.EXIT_CANNOT_START
    assert "kvscope: cannot write the data folder" in capsys.readouterr().err and dialogs == []
    # Started from a menu: the same message in a dialog too (stderr is not seen there).
    assert app_main.main([]) == app_main.EXIT_CANNOT_START
    assert len(dialogs) == 1 and dialogs[0].startswith("cannot write the data folder")


def test_an_unusable_platform_exits_2_before_qt_aborts(monkeypatch, capsys):
    monkeypatch.setattr("app.startup.platform_problem", lambda: "cannot open a window. test")
    assert app_main.main([]) == app_main.EXIT_CANNOT_START
    assert capsys.readouterr().err == "kvscope: cannot open a window. test\n"


def test_kvscope_command_runs_the_engine_cli(capsys):
    with pytest.raises(SystemExit) as exit_info:
        app_main.main(["generate", "--help"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.startswith("usage: kvscope generate")
    assert {"generate", "chat", "inspect-model"} <= set(app_main.engine_commands())


def test_the_engine_cli_with_an_unwritable_cache_exits_2(tmp_path, monkeypatch, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("KVSCOPE_CACHE_DIR", str(blocker / "cache"))
    code = app_main.main(["generate", "--prompt", "hi", "--max-new-tokens", "1"])
    err = capsys.readouterr().err
    assert code == 2 and "cannot write its cache folder" in err and "KVSCOPE_CACHE_DIR" in err
    assert "Traceback" not in err


def test_the_frozen_apps_wrapped_loader_error_still_names_the_library(monkeypatch, tmp_path):
    """PyInstaller's ctypes.CDLL raises its own message, chaining dlopen's: the latter is read."""
    import app.startup as startup

    def frozen_cdll(name):
        try:
            raise OSError("libxcb-cursor.so.0: cannot open shared object file: No such file or directory")
        except OSError as base:
            raise OSError(f"Failed to load dynlib/dll {name!r}. Most likely ...") from base

    monkeypatch.setattr(startup.ctypes, "CDLL", frozen_cdll)
    problem = startup.library_problem(tmp_path / "libqxcb.so")
    assert problem == (
        "it needs the system library libxcb-cursor.so.0, which is not installed (Debian/Ubuntu package libxcb-cursor0)"
    )
