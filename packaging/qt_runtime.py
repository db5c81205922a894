"""What Qt's xcb platform plugin needs from the system, found by asking it: `ldd` on the plugin in
the venv's PySide6 (platforms/libqxcb.so) and on the library it loads (lib/libQt6XcbQpa.so.6).
Every library ldd reports "not found" is named with the Debian package that ships it, and
installed when `--install` is given (./dev passes it as root with apt-get), else named so the
user can.

A list of libraries to look for goes stale (a Debian machine with the six ./dev checked, but
without libxcb-icccm4, could not open a window: issue 24); the plugin's own links do not.

    python packaging/qt_runtime.py [--install]      (run by ./dev setup; exit 0 either way)
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path

# sonames whose Debian package is not the usual lib<name><version>; the rest are guessed (below).
DEBIAN_PACKAGES = {
    "libxkbcommon-x11.so.0": "libxkbcommon-x11-0",
    "libX11-xcb.so.1": "libx11-xcb1",
    "libX11.so.6": "libx11-6",
    "libXau.so.6": "libxau6",
    "libXdmcp.so.6": "libxdmcp6",
    "libSM.so.6": "libsm6",
    "libICE.so.6": "libice6",
    "libGL.so.1": "libgl1",
    "libGLX.so.0": "libglx0",
    "libGLdispatch.so.0": "libglvnd0",
    "libEGL.so.1": "libegl1",
    "libdbus-1.so.3": "libdbus-1-3",
    "libglib-2.0.so.0": "libglib2.0-0t64",
    "libgthread-2.0.so.0": "libglib2.0-0t64",
    "libpcre2-8.so.0": "libpcre2-8-0",
    "libstdc++.so.6": "libstdc++6",
    "libgcc_s.so.1": "libgcc-s1",
    "libz.so.1": "zlib1g",
    "libzstd.so.1": "libzstd1",
}
_NOT_FOUND = re.compile(r"^\s*(\S+)\s+=>\s+not found", re.MULTILINE)


def plugin_files(pyside_dir: Path) -> list[Path]:
    """The xcb plugin and the library it loads, where PySide6's wheel puts them."""
    qt = pyside_dir / "Qt"
    return [qt / "plugins" / "platforms" / "libqxcb.so", qt / "lib" / "libQt6XcbQpa.so.6"]


def missing_libraries(ldd_output: str) -> list[str]:
    """The sonames ldd could not find, in its order, each once."""
    seen: dict[str, None] = {}
    for name in _NOT_FOUND.findall(ldd_output):
        seen.setdefault(name, None)
    return list(seen)


def debian_package(soname: str) -> str:
    """libxcb-icccm.so.4 -> libxcb-icccm4; libfoo2.so.0 -> libfoo2-0; the table above first."""
    if soname in DEBIAN_PACKAGES:
        return DEBIAN_PACKAGES[soname]
    stem, _, version = soname.partition(".so")
    version = version.lstrip(".").split(".")[0]
    stem = stem.lower()
    if not version:
        return stem
    return f"{stem}-{version}" if stem[-1].isdigit() else f"{stem}{version}"


def packages_for(ldd_outputs: list[str]) -> list[str]:
    names: dict[str, None] = {}
    for output in ldd_outputs:
        for soname in missing_libraries(output):
            names.setdefault(debian_package(soname), None)
    return list(names)


def _pyside_dir() -> Path | None:
    spec = importlib.util.find_spec("PySide6")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def _ldd(path: Path) -> str:
    done = subprocess.run(["ldd", str(path)], capture_output=True, text=True, check=False)
    return done.stdout + done.stderr


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="What Qt's xcb platform plugin needs from the system.")
    parser.add_argument("--install", action="store_true", help="apt-get install what is missing (root)")
    args = parser.parse_args(argv)
    pyside = _pyside_dir()
    if pyside is None or shutil.which("ldd") is None:
        return 0  # no PySide6 yet, or not a glibc system: nothing to ask
    files = [f for f in plugin_files(pyside) if f.exists()]
    packages = packages_for([_ldd(f) for f in files])
    if not packages:
        return 0
    if args.install:
        print(f"[dev] installing what Qt's xcb platform needs: {' '.join(packages)}")
        env = {"DEBIAN_FRONTEND": "noninteractive", "PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}
        subprocess.run(["apt-get", "update", "-qq"], check=False, env=env, capture_output=True)
        done = subprocess.run(["apt-get", "install", "-y", "-qq", *packages], check=False, env=env)
        still = packages_for([_ldd(f) for f in files])
        if done.returncode == 0 and not still:
            return 0
        packages = still or packages
    print(
        f"[dev] warning: Qt's xcb platform plugin cannot load without: {' '.join(packages)} "
        f"(Debian package names; install them, e.g. sudo apt-get install {' '.join(packages)})",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
