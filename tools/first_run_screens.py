"""Screenshots of the main window's first run on the screens people have, to look at.

    python -m tools.first_run_screens [OUT_DIR]          (default: ./first-run-screens)

For each screen (1366x768, 1920x1080 and 2560x1440 at scale 1; 1920x1080 and 2560x1440 at scale
2) it starts a virtual X screen that size (xvfb-run), and in it a first-run kvscope (empty settings
and conversations in a temporary folder, QT_SCALE_FACTOR for the scale) that loads the packaged
model, sends one message, waits for the whole reply and saves the window (the scripted
`--prompt ... --screenshot ... --quit-after-reply` run). One screen after the other: each loads
the model. Needs xvfb-run (Debian: xvfb) and a built kvscope; nothing here is a test.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

# (width, height, scale): a laptop, a desktop, a 1440p screen, and the last two at 200%
SCREENS = ((1366, 768, 1), (1920, 1080, 1), (2560, 1440, 1), (1920, 1080, 2), (2560, 1440, 2))
PROMPT = "Name three colours."
TIMEOUT_S = 600


def shoot(width: int, height: int, scale: int, out: Path) -> tuple[Path, int]:
    """One first run on a virtual screen of this size; (the PNG, the run's exit status)."""
    png = out / f"first-run-{width}x{height}@{scale}x.png"
    with tempfile.TemporaryDirectory(prefix="kvscope-first-run-") as home:
        env = dict(os.environ, KVSCOPE_CONFIG_DIR=f"{home}/config", KVSCOPE_DATA_DIR=f"{home}/data")
        env["QT_SCALE_FACTOR"] = str(scale)
        env.pop("QT_QPA_PLATFORM", None)  # the X screen, not offscreen: its size is the point
        command = [
            "xvfb-run",
            "--auto-servernum",
            f"--server-args=-screen 0 {width}x{height}x24",
            sys.executable,
            "-m",
            "app",
            "--prompt",
            PROMPT,
            "--screenshot",
            str(png),
            "--quit-after-reply",
            "--timeout",
            str(TIMEOUT_S),
        ]
        run = subprocess.run(command, env=env, timeout=TIMEOUT_S + 60, check=False)
    return png, run.returncode


def main(argv: list[str]) -> int:
    if shutil.which("xvfb-run") is None:
        print("first_run_screens: needs xvfb-run (Debian: apt-get install xvfb)", file=sys.stderr)
        return 2
    out = Path(argv[0] if argv else "first-run-screens").resolve()
    out.mkdir(parents=True, exist_ok=True)
    failed = 0
    for width, height, scale in SCREENS:
        png, status = shoot(width, height, scale, out)
        failed += status != 0
        print(f"{width}x{height} at {scale}x: {png if status == 0 else f'failed (exit {status})'}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
