"""The frozen app's smoke test (`./dev package --smoke`): what a person gets from the tarball.

Outside the checkout, with a fresh HOME and a PATH with no venv or Python of ours on it:
unpack the tarball, run its install.sh, then start the installed `kvscope` under Xvfb with
`--prompt ... --screenshot ... --quit-after-reply` and check the reply (in the conversation
database the app wrote) and the screenshot; run the bundle's headless CLI (`kvscope generate
--json`) and check it gives the same greedy tokens as the engine run from source, on the packaged
model and on a tiny random Qwen2 folder (another architecture); check that an
unwritable data or cache folder, a missing display and a missing system Qt library each end in a
one-line message (exit 2), not a traceback or an abort; finally uninstall with install.sh --remove.
Any failed check raises SmokeFailure; the screenshot is kept as dist/smoke/kvscope-frozen.png.
"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from app.runtime import gui_torch_threads

ROOT = Path(__file__).resolve().parent.parent
KEPT = ROOT / "dist" / "smoke"
APP_ID = "io.github.kvscope.kvscope"
PROMPT = "Name a colour."
CLI_TOKENS = 12
# The first run converts the packaged GGUF (about 40 s on 2 cores); a slow CI machine gets room.
RUN_TIMEOUT_S = 900
# A platform plugin's dependency renamed to one no system has (same length, so the ELF stays
# valid): the "missing system Qt library" case, made real in the installed copy of the bundle.
XCB_DEPENDENCY = b"libxcb-icccm.so.4"
MISSING_DEPENDENCY = b"libkvscope-x.so.4"


class SmokeFailure(AssertionError):
    pass


PASSED: list[str] = []  # the checks that held, for the closing "N passed, N failed" line


def check(condition: bool, what: str, proc: subprocess.CompletedProcess | None = None) -> None:
    if condition:
        PASSED.append(what)
        print(f"[smoke] ok: {what}", flush=True)
        return
    detail = ""
    if proc is not None:
        detail = f"\n--- exit {proc.returncode}; stderr (last 3000 chars):\n{proc.stderr[-3000:]}"
    raise SmokeFailure(f"[smoke] FAILED: {what}{detail}")


def clean_env(home: Path, runtime: Path, **extra: str) -> dict[str, str]:
    """A login-like environment: nothing of this checkout, its venv or the caller's settings."""
    path = ":".join(p for p in ("/usr/local/bin", "/usr/bin", "/bin") if Path(p).is_dir())
    env = {"HOME": str(home), "PATH": path, "LANG": "C.UTF-8", "XDG_RUNTIME_DIR": str(runtime)}
    env.update(extra)
    return env


def run(command: list[str], env: dict[str, str], cwd: Path, timeout: float = RUN_TIMEOUT_S):
    start = time.monotonic()
    proc = subprocess.run(command, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    # A script passed with -c is shown by its first line only.
    words = [c if "\n" not in c else repr(c.strip().splitlines()[0] + " ...") for c in command]
    shown = " ".join(words[:1] + [w if " " not in w or w[0] == "'" else repr(w) for w in words[1:]])
    print(f"[smoke] $ {shown}  -> exit {proc.returncode} in {time.monotonic() - start:.0f} s", flush=True)
    return proc


class Xvfb:
    """An X server of our own on a free display number (Xvfb picks it and writes it to a pipe)."""

    def __enter__(self) -> str:
        if shutil.which("Xvfb") is None:
            raise SmokeFailure("[smoke] Xvfb is not installed (Debian/Ubuntu: apt-get install xvfb)")
        read, write = os.pipe()
        self.proc = subprocess.Popen(
            ["Xvfb", "-displayfd", str(write), "-screen", "0", "1600x1000x24", "-nolisten", "tcp"],
            pass_fds=(write,),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        os.close(write)
        with os.fdopen(read) as pipe:
            number = pipe.readline().strip()
        if not number:
            raise SmokeFailure("[smoke] Xvfb did not start")
        return f":{number}"

    def __exit__(self, *exc) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)


def check_screenshot(path: Path) -> None:
    from PySide6.QtGui import QImage

    check(path.is_file(), f"the screenshot {path.name} was written")
    image = QImage(str(path))
    check(not image.isNull(), "the screenshot is a PNG Qt can read")
    check(
        image.width() >= 1000 and image.height() >= 600,
        f"the screenshot is a window ({image.width()}x{image.height()})",
    )
    # A drawn window has text, plots and panels: many colours. A black or blank grab has one or two.
    step = max(1, image.width() // 200)
    colours = {
        image.pixel(x, y) for x in range(0, image.width(), step) for y in range(0, image.height(), step)
    }
    check(len(colours) > 50, f"the screenshot shows a drawn window ({len(colours)} colours sampled)")


def stored_reply(home: Path) -> tuple[str, str, str | None]:
    """The prompt and the reply the app stored, read from its conversation database."""
    db = home / ".local" / "share" / "kvscope" / "conversations.sqlite3"
    check(db.is_file(), f"the app created its conversation database under the fresh HOME ({db.name})")
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
        rows = conn.execute("SELECT role, content, finish_reason FROM messages ORDER BY id").fetchall()
    check(len(rows) == 2, f"one prompt and one reply stored ({len(rows)} messages)")
    (user_role, prompt, _), (reply_role, reply, finish) = rows
    check(user_role == "user" and reply_role == "assistant", "a user message, then the assistant's")
    return prompt, reply, finish


# The CLI runs with as many torch threads as the window (app/runtime.py: all cores but one): the
# engine times its kernels once per thread count on a new machine (engine/kernels/policy.py),
# minutes on a busy 2-core box, and the window's first run has just done so for that count.
CLI_THREADS = {"OMP_NUM_THREADS": str(gui_torch_threads(os.cpu_count()))}


def source_tokens(home: Path, *model: str) -> list[int]:
    """The same greedy request through the engine from source (this checkout's venv). It reads
    the frozen run's cache, so both use the kernels that one measured: tokens depend on them."""
    command = [sys.executable, "-m", "engine", "generate", *model, "--prompt", PROMPT]
    command += ["--max-new-tokens", str(CLI_TOKENS), "--temperature", "0", "--json"]
    env = dict(os.environ, KVSCOPE_CACHE_DIR=str(home / ".cache" / "kvscope"), **CLI_THREADS)
    proc = run(command, env, ROOT)
    check(proc.returncode == 0, "the engine from source answers the same request", proc)
    return json.loads(proc.stdout)["token_ids"]


# A tiny random Qwen2 (not the default model's llama) saved as a model folder with the packaged
# tokenizer: the frozen bundle must load other architectures as the source does. A wide weight
# init so that greedy decoding varies from token to token (a near-uniform model repeats one).
TINY_QWEN2 = """
import sys, torch
from transformers import Qwen2Config, Qwen2ForCausalLM
from engine.model.default_model import load_default_tokenizer
tok = load_default_tokenizer()
torch.manual_seed(0)
config = Qwen2Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True, initializer_range=0.5,
    bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
Qwen2ForCausalLM(config).eval().save_pretrained(sys.argv[1])
tok.save_pretrained(sys.argv[1])
"""


def tiny_qwen2_folder(folder: Path) -> Path:
    proc = run([sys.executable, "-c", TINY_QWEN2, str(folder)], dict(os.environ), ROOT)
    check(proc.returncode == 0, "made a tiny random Qwen2 model folder", proc)
    return folder


def break_xcb_dependency(bundle: Path) -> str:
    """Rename one shared library the xcb plugin needs, in this installed copy only."""
    plugin = bundle / "_internal" / "PySide6" / "Qt" / "plugins" / "platforms" / "libqxcb.so"
    data = plugin.read_bytes()
    needle = XCB_DEPENDENCY + b"\0"
    check(data.count(needle) == 1, f"the bundled xcb plugin names {XCB_DEPENDENCY.decode()} once")
    plugin.write_bytes(data.replace(needle, MISSING_DEPENDENCY + b"\0"))
    return MISSING_DEPENDENCY.decode()


def run_smoke(tarball: Path) -> None:
    work = Path(tempfile.mkdtemp(prefix="kvscope-smoke-"))
    PASSED.clear()
    try:
        check(ROOT not in work.parents, f"working outside the checkout ({work})")
        _smoke(tarball, work)
    except (SmokeFailure, subprocess.TimeoutExpired):
        print(f"smoke: {len(PASSED)} passed, 1 failed", flush=True)
        raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"smoke: {len(PASSED)} passed, 0 failed", flush=True)


def _smoke(tarball: Path, work: Path) -> None:
    home, runtime, unpacked = work / "home", work / "run", work / "unpacked"
    for folder in (home, runtime, unpacked):
        folder.mkdir(mode=0o700)
    with tarfile.open(tarball) as tar:
        tar.extractall(unpacked, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
    (top,) = unpacked.iterdir()
    env = clean_env(home, runtime)

    # ---- install like a person: the tarball's install.sh into ~/.local -------------------------
    proc = run(["bash", str(top / "install.sh")], env, work)
    check(proc.returncode == 0, "install.sh installs the bundle", proc)
    share = home / ".local" / "share"
    entry = share / "applications" / f"{APP_ID}.desktop"
    for path in (
        entry,
        share / "metainfo" / f"{APP_ID}.metainfo.xml",
        share / "icons/hicolor/scalable/apps" / f"{APP_ID}.svg",
    ):
        check(path.is_file(), f"installed {path.relative_to(home)}")
    binary = home / ".local" / "bin" / "kvscope"
    check(
        f'Exec="{home}/.local/lib/kvscope/kvscope"' in entry.read_text(),
        "the desktop entry launches the installed binary",
    )
    if shutil.which("desktop-file-validate"):
        proc = run(["desktop-file-validate", str(entry)], env, work)
        check(proc.returncode == 0, "the installed desktop entry validates", proc)

    with Xvfb() as display:
        shown = dict(env, DISPLAY=display)
        # ---- the window: one scripted reply and its screenshot ------------------------------
        shot = work / "kvscope-frozen.png"
        proc = run(
            [str(binary), "--prompt", PROMPT, "--screenshot", str(shot), "--quit-after-reply"], shown, work
        )
        check(
            proc.returncode == 0 and "Traceback" not in proc.stderr,
            "the frozen app replied and quit with 0",
            proc,
        )
        prompt, reply, finish = stored_reply(home)
        check(prompt == PROMPT, "the stored prompt is the one sent")
        check(
            bool(reply.strip()) and finish in ("stop", "length"),
            f"a finished reply ({finish}): {reply[:80]!r}...",
        )
        check_screenshot(shot)
        KEPT.mkdir(parents=True, exist_ok=True)
        shutil.copy2(shot, KEPT / shot.name)

        # ---- the headless CLI of the same binary ---------------------------------------------
        command = [str(binary), "generate", "--prompt", PROMPT, "--max-new-tokens", str(CLI_TOKENS)]
        cli_env = dict(env, **CLI_THREADS)
        proc = run([*command, "--temperature", "0", "--json"], cli_env, work)
        check(proc.returncode == 0, "kvscope generate --json ran", proc)
        out = json.loads(proc.stdout)
        check(
            out["text"].strip() != "" and len(out["token_ids"]) <= CLI_TOKENS,
            f"generate replied: {out['text']!r}",
        )
        check(out["model"]["name"] == "SmolLM2-135M-Instruct", "it ran the packaged default model")
        kernels = [n for n in out["model"].get("notes", []) if n.startswith("GGUF kernels: kvk")]
        check(
            bool(kernels),
            f"on the bundled C kernels ({kernels[0] if kernels else out['model'].get('notes')})",
        )
        check(
            out["kv"]["peak_blocks_used"] > 0 and out["kv"]["blocks_used_end"] == 0,
            "its KV blocks were used and freed",
        )
        check(
            out["token_ids"] == source_tokens(home), "frozen and source engines chose the same greedy tokens"
        )
        qwen2 = tiny_qwen2_folder(work / "tiny-qwen2")
        proc = run([*command, "--model", str(qwen2), "--temperature", "0", "--json"], cli_env, work)
        check(proc.returncode == 0, "the frozen CLI loads a Qwen2 model folder", proc)
        tokens = json.loads(proc.stdout)["token_ids"]
        check(
            len(set(tokens)) > 1 and tokens == source_tokens(home, "--model", str(qwen2)),
            f"and decodes it as the source does: {tokens}",
        )

        # ---- bad input: one-line messages, exit 2, no traceback ------------------------------
        blocker = work / "a-file"
        blocker.write_text("a file where a folder would go\n")
        cases = [
            ("an unwritable data folder (app)", [str(binary), "--prompt", PROMPT, "--quit-after-reply"],
             dict(shown, XDG_DATA_HOME=str(blocker / "data")), "cannot write the data folder"),
            ("an unwritable cache folder (CLI)", [*command, "--json"],
             dict(env, XDG_CACHE_HOME=str(blocker / "cache")), "cannot write its cache folder"),
            ("no display", [str(binary)], env, "no X display (DISPLAY is not set)"),
        ]  # fmt: skip
        for what, argv, case_env, message in cases:
            proc = run(argv, case_env, work)
            clean = proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr
            check(clean, f"{what}: exit 2 with {message!r}", proc)
        missing = break_xcb_dependency(home / ".local" / "lib" / "kvscope")
        proc = run([str(binary)], shown, work)
        check(
            proc.returncode == 2 and missing in proc.stderr,
            f"a missing Qt library is named: {proc.stderr.strip()}",
            proc,
        )

    # ---- uninstall ---------------------------------------------------------------------------
    proc = run(["bash", str(top / "install.sh"), "--remove"], env, work)
    check(
        proc.returncode == 0 and not binary.exists() and not entry.exists(),
        "install.sh --remove removes it",
        proc,
    )
    check(not (home / ".local" / "lib" / "kvscope").exists(), "the bundle folder is gone")
    check((share / "kvscope" / "conversations.sqlite3").is_file(), "the conversations are kept")
    print(f"[smoke] passed; screenshot kept at {KEPT / shot.name}", flush=True)


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tarball", type=Path)
    run_smoke(parser.parse_args().tarball)
