"""`./dev package [--smoke] [--no-freeze]`: the frozen one-folder
bundle dist/kvscope/, its size by biggest parts, and the tarball a person installs.

Steps: freeze with PyInstaller (packaging/kvscope.spec, at low CPU priority), report the bundle's
size, validate the desktop entry and the AppStream metainfo (when desktop-file-validate and
appstreamcli are installed), and pack dist/kvscope-<version>-linux-<arch>.tar.gz:

    kvscope-<version>/install.sh      installs into ~/.local (or --prefix), --remove undoes it
    kvscope-<version>/kvscope/        the bundle (the `kvscope` executable and _internal/)
    kvscope-<version>/share/          desktop entry, icon, metainfo for the XDG folders

--smoke then runs packaging/smoke.py on that tarball. --no-freeze reuses dist/kvscope/.
"""

from __future__ import annotations

import argparse
import platform
import re
import shutil
import subprocess
import sys
import tarfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DIST = ROOT / "dist"
BUNDLE = DIST / "kvscope"
APP_ID = "io.github.kvscope.kvscope"
# Where each shipped desktop file goes under share/ (the XDG data folders' layout).
SHARE_FILES = {
    f"assets/{APP_ID}.desktop": f"applications/{APP_ID}.desktop",
    f"assets/{APP_ID}.metainfo.xml": f"metainfo/{APP_ID}.metainfo.xml",
    "assets/kvscope.svg": f"icons/hicolor/scalable/apps/{APP_ID}.svg",
}
MIB = 1024 * 1024


def version() -> str:
    text = (ROOT / "pyproject.toml").read_text()
    try:
        import tomllib
    except ImportError:  # Python 3.10: the one line is enough
        return re.search(r'^version = "([^"]+)"', text, re.M).group(1)
    return tomllib.loads(text)["project"]["version"]


def freeze() -> float:
    """Run PyInstaller on the spec; returns the seconds it took."""
    command = [sys.executable, "-m", "PyInstaller", "--noconfirm", "--log-level", "WARN"]
    command += ["--distpath", str(DIST), "--workpath", str(ROOT / "build" / "pyinstaller")]
    command.append(str(ROOT / "packaging" / "kvscope.spec"))
    if shutil.which("nice"):
        command = ["nice", "-n", "15", *command]  # freezing is CPU heavy; others share the cores
    print(f"[package] freezing: {' '.join(command)}", flush=True)
    start = time.monotonic()
    subprocess.run(command, cwd=ROOT, check=True)
    return time.monotonic() - start


def size_by_part(bundle: Path, depth: int = 2) -> tuple[int, list[tuple[str, int]]]:
    """Total bytes of the bundle and the bytes under each path of `depth` parts below _internal/
    (e.g. torch/lib, PySide6/Qt), biggest first. Symlinks are not counted twice."""
    parts: Counter[str] = Counter()
    total = 0
    internal = bundle / "_internal"
    for path in bundle.rglob("*"):
        if path.is_symlink() or not path.is_file():
            continue
        size = path.stat().st_size
        total += size
        rel = path.relative_to(internal if internal in path.parents else bundle)
        key = "/".join(rel.parts[:depth]) if len(rel.parts) > depth else str(rel)
        parts[key] += size
    return total, parts.most_common()


def size_report(bundle: Path, top: int = 15) -> str:
    total, parts = size_by_part(bundle)
    lines = [f"bundle {bundle}: {total / MIB:.0f} MiB in all; biggest parts:"]
    for name, size in parts[:top]:
        if name == "kvscope":  # one-folder mode appends the archive of Python modules to it
            name = "kvscope (the executable, with the compiled Python modules appended)"
        lines.append(f"  {size / MIB:8.1f} MiB  {size / total:5.1%}  {name}")
    rest = sum(size for _, size in parts[top:])
    lines.append(f"  {rest / MIB:8.1f} MiB  {rest / total:5.1%}  ({len(parts) - top} smaller parts)")
    return "\n".join(lines)


def validate_desktop_files() -> list[str]:
    """Run the validators that are installed; returns their output. Raises when one fails."""
    checks = [
        ("desktop-file-validate", [str(ROOT / "assets" / f"{APP_ID}.desktop")]),
        ("appstreamcli", ["validate", "--no-net", str(ROOT / "assets" / f"{APP_ID}.metainfo.xml")]),
    ]
    out = []
    for tool, args in checks:
        if shutil.which(tool) is None:
            out.append(f"{tool}: not installed, skipped")
            continue
        proc = subprocess.run([tool, *args], capture_output=True, text=True)
        text = (proc.stdout + proc.stderr).strip() or "no complaints"
        out.append(f"$ {tool} {' '.join(args)}\n{text}")
        if proc.returncode != 0:
            raise SystemExit(f"packaging: {tool} rejected the file:\n{text}")
    return out


def make_tarball(bundle: Path) -> Path:
    name = f"kvscope-{version()}"
    tarball = DIST / f"{name}-linux-{platform.machine()}.tar.gz"
    print(f"[package] packing {tarball.name}", flush=True)
    with tarfile.open(tarball, "w:gz", compresslevel=6) as tar:
        tar.add(ROOT / "packaging" / "install.sh", f"{name}/install.sh")
        for source, target in SHARE_FILES.items():
            tar.add(ROOT / source, f"{name}/share/{target}")
        tar.add(bundle, f"{name}/kvscope")
    return tarball


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="./dev package", description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="then run the frozen app (packaging/smoke.py)")
    parser.add_argument("--no-freeze", action="store_true", help="reuse dist/kvscope/ as it is")
    args = parser.parse_args(argv)

    timings = {}
    if not args.no_freeze:
        timings["freeze"] = freeze()
    if not (BUNDLE / "kvscope").is_file():
        raise SystemExit(f"packaging: no frozen app at {BUNDLE}; run ./dev package without --no-freeze")
    report = size_report(BUNDLE)
    print(report)
    (DIST / "kvscope-size.txt").write_text(report + "\n")
    for text in validate_desktop_files():
        print(text)
    start = time.monotonic()
    tarball = make_tarball(BUNDLE)
    timings["tarball"] = time.monotonic() - start
    print(f"[package] {tarball} ({tarball.stat().st_size / MIB:.0f} MiB)")
    if args.smoke:
        from smoke import SmokeFailure, run_smoke  # packaging/, this script's folder, is on sys.path

        start = time.monotonic()
        try:
            run_smoke(tarball)
        except SmokeFailure as failure:
            print(failure, file=sys.stderr)
            return 1
        except subprocess.TimeoutExpired as timeout:
            print(f"[smoke] FAILED: {timeout.cmd[0]} ran past {timeout.timeout:.0f} s", file=sys.stderr)
            return 1
        timings["smoke"] = time.monotonic() - start
    print("[package] took " + ", ".join(f"{k} {v:.0f} s" for k, v in timings.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
