"""Checks made before the QApplication exists, where Qt itself would only abort.

When no Qt platform plugin can start, Qt prints a paragraph about "xcb" and aborts the process
(a core dump, exit 134) without saying which system library is missing. `platform_problem()`
loads each platform plugin Qt would try, the way Qt loads it (dlopen), and reports the first
missing shared library by name, or the missing display, as one line. It only refuses a launch
when every candidate fails, so a check that is wrong about one platform cannot stop the app.
"""

from __future__ import annotations

import ctypes
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

# Debian/Ubuntu packages of the system libraries Qt's xcb and wayland plugins link against: the
# hint after the library's name. Others are named without a package.
DEBIAN_PACKAGES = {
    "libxcb-cursor.so.0": "libxcb-cursor0",
    "libxcb-icccm.so.4": "libxcb-icccm4",
    "libxcb-keysyms.so.1": "libxcb-keysyms1",
    "libxcb-image.so.0": "libxcb-image0",
    "libxcb-render-util.so.0": "libxcb-render-util0",
    "libxcb-shape.so.0": "libxcb-shape0",
    "libxcb-randr.so.0": "libxcb-randr0",
    "libxcb-xkb.so.1": "libxcb-xkb1",
    "libxkbcommon.so.0": "libxkbcommon0",
    "libxkbcommon-x11.so.0": "libxkbcommon-x11-0",
    "libX11-xcb.so.1": "libx11-xcb1",
    "libxcb.so.1": "libxcb1",
    "libGL.so.1": "libgl1",
    "libEGL.so.1": "libegl1",
    "libfontconfig.so.1": "libfontconfig1",
    "libdbus-1.so.3": "libdbus-1-3",
    "libwayland-client.so.0": "libwayland-client0",
    "libwayland-cursor.so.0": "libwayland-cursor0",
}

# glibc's dlerror(): "libxcb-cursor.so.0: cannot open shared object file: No such file or directory"
_MISSING = re.compile(r"([^\s:/]+\.so[.\d]*): cannot open shared object file")


@dataclass(frozen=True, slots=True)
class Candidate:
    name: str  # the platform's name as QT_QPA_PLATFORM spells it ("xcb", "wayland", ...)
    plugin: Path | None  # its plugin file, None when no plugin folder has it


def missing_library(error: str) -> str | None:
    """The library a dlopen error says is missing, or None for any other failure."""
    match = _MISSING.search(error)
    return match.group(1) if match else None


def library_problem(plugin: Path) -> str | None:
    """Why `plugin` cannot be loaded (a missing library named, with its package), or None."""
    try:
        ctypes.CDLL(str(plugin))
    except OSError as exc:
        # Frozen, PyInstaller's ctypes wrapper replaces dlerror()'s text with its own guess and
        # chains the original error: read that one.
        error = str(exc.__cause__ or exc)
        library = missing_library(error)
        if library is None:
            return f"its plugin {plugin.name} does not load ({error})"
        package = DEBIAN_PACKAGES.get(library)
        hint = f" (Debian/Ubuntu package {package})" if package else ""
        return f"it needs the system library {library}, which is not installed{hint}"
    return None


def display_problem(name: str, environ: os._Environ | dict) -> str | None:
    """Whether the display server the platform talks to is reachable, for xcb and wayland."""
    if name == "xcb":
        display = environ.get("DISPLAY")
        if not display:
            return "no X display (DISPLAY is not set)"
        return None if _x_display_answers(display) else f"the X display {display} does not answer"
    if name == "wayland":
        socket = environ.get("WAYLAND_DISPLAY") or "wayland-0"
        path = Path(socket) if socket.startswith("/") else Path(environ.get("XDG_RUNTIME_DIR", "")) / socket
        return None if path.exists() else f"no Wayland display ({path} does not exist)"
    return None


def _x_display_answers(display: str) -> bool:
    """Connect to the X server the way Qt's xcb plugin will (libxcb is loaded with the plugin)."""
    try:
        xcb = ctypes.CDLL("libxcb.so.1")
    except OSError:
        return True  # the library check reports this one
    xcb.xcb_connect.restype = ctypes.c_void_p
    xcb.xcb_connect.argtypes = [ctypes.c_char_p, ctypes.c_void_p]
    xcb.xcb_connection_has_error.argtypes = [ctypes.c_void_p]
    xcb.xcb_disconnect.argtypes = [ctypes.c_void_p]
    connection = xcb.xcb_connect(display.encode(), None)
    try:
        return connection is not None and xcb.xcb_connection_has_error(connection) == 0
    finally:
        if connection is not None:
            xcb.xcb_disconnect(connection)


def candidates(environ, plugin_dirs: list[Path]) -> list[Candidate]:
    """The platforms Qt will try, in order: QT_QPA_PLATFORM's list (arguments after ':' dropped),
    else X11, after Wayland in a Wayland session (Qt picks between them from the session; either
    may start, so both are tried and a launch is refused only when neither can)."""
    requested = environ.get("QT_QPA_PLATFORM", "")
    names = [part.split(":", 1)[0].strip() for part in requested.split(";") if part.strip()]
    wayland_session = environ.get("WAYLAND_DISPLAY") or environ.get("XDG_SESSION_TYPE") == "wayland"
    names = names or (["wayland", "xcb"] if wayland_session else ["xcb"])
    found = []
    for name in names:
        plugin = next(
            (d / f"libq{name}.so" for d in plugin_dirs if (d / f"libq{name}.so").is_file()),
            None,
        )
        found.append(Candidate(name, plugin))
    return found


def qt_platform_dirs() -> list[Path]:
    """The folders Qt searches for platform plugins (QT_PLUGIN_PATH and its own plugins folder)."""
    from PySide6.QtCore import QCoreApplication, QLibraryInfo

    roots = [Path(p) for p in QCoreApplication.libraryPaths()]
    roots.append(Path(QLibraryInfo.path(QLibraryInfo.LibraryPath.PluginsPath)))
    roots += [Path(p) for p in os.environ.get("QT_PLUGIN_PATH", "").split(os.pathsep) if p]
    return [root / "platforms" for root in dict.fromkeys(roots)]


def platform_problem(environ=None, plugin_dirs: list[Path] | None = None) -> str | None:
    """None when some platform can start; else one line naming what each one lacks."""
    if not sys.platform.startswith("linux"):
        return None
    environ = os.environ if environ is None else environ
    plugin_dirs = qt_platform_dirs() if plugin_dirs is None else plugin_dirs
    reasons = []
    for candidate in candidates(environ, plugin_dirs):
        if candidate.plugin is None:
            # Not ours to judge (a platform this Qt build lacks): Qt reports it itself.
            if environ.get("QT_QPA_PLATFORM"):
                return None
            continue
        problem = library_problem(candidate.plugin) or display_problem(candidate.name, environ)
        if problem is None:
            return None
        reasons.append(f"Qt's {candidate.name} platform cannot start: {problem}")
    if not reasons:
        return None
    return "cannot open a window. " + "; ".join(reasons) + "."
