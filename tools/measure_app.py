"""Responsiveness and throughput of the app while it generates: `python -m tools.measure_app --json`.

Two figures, each against its target:
- GUI responsiveness: a 10 ms probe QTimer runs on the GUI thread during generation in the
  full window (all panels live, chat streaming); its worst lateness is how long the event loop
  was ever blocked. Target: under 50 ms.
- Throughput: the engine's decode tokens/s inside the app over a headless run of the same
  request on the same loaded model (same engine, events into a plain list), both at the torch
  thread count the app chooses (one core left to the GUI; OMP_NUM_THREADS overrides), so the
  ratio is what the GUI costs and nothing else. Target: >= 95%. --headless-threads N runs the
  headless side at N instead (e.g. at the CLI's own count, to see what leaving a core costs).
Runs alternate in pairs whose order alternates too (headless then app, app then headless, ...):
the speed drifts within a measurement (measured on the 2-core machine: headless 165 -> 149
tokens/s over four pairs), and with the app always second it paid half a pair's drift (~2%) that
the GUI did not cost. Medians reported, and each pair's ratio.
Run it on an otherwise idle machine: other processes on the same cores distort both figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

PROBE_INTERVAL_MS = 10
TARGET_WORST_DELAY_MS = 50.0
TARGET_THROUGHPUT_RATIO = 0.95
DEFAULT_PROMPT = "Explain in a few paragraphs how a paged KV cache lets an inference server batch many chats."
# A run that has not finished after this long has hung; the measurement reports it and stops.
RUN_TIMEOUT_S = 600.0


class MeasureError(RuntimeError):
    """A measurement run could not complete; str() says which and why."""


def measured_params(max_new_tokens: int):
    """Greedy, EOS ignored: both runs generate exactly the same tokens, as many as asked.
    Snapshots on, as in the app, so the engine does the same work in both runs."""
    from app.settings import DEFAULT_SNAPSHOT_TOP_N
    from engine.config import SamplingParams

    return SamplingParams(
        temperature=0.0, max_new_tokens=max_new_tokens, ignore_eos=True, snapshot_top_n=DEFAULT_SNAPSHOT_TOP_N
    )


def headless_run(loaded, config, request) -> float:
    """tokens/s of `request` on an Engine whose events go into a list (no GUI at all)."""
    from engine.api import local_engine
    from engine.events import RequestFailed

    engine = local_engine(config, lambda event: None, loaded)  # its end comes from run()
    engine.start()
    try:
        if not engine.wait_until_loaded(RUN_TIMEOUT_S):
            raise MeasureError(f"headless engine did not start: {engine.load_error}")
        try:
            (end,) = engine.run([request]).result(RUN_TIMEOUT_S)
        except TimeoutError:
            raise MeasureError("headless run did not finish") from None
    finally:
        engine.shutdown()
    if isinstance(end, RequestFailed):
        raise MeasureError(f"headless run failed: {end.message}")
    return end.stats.tokens_per_s


class _Probe:
    """Records how late each 10 ms tick of a GUI-thread timer fires (and, each tick, the value
    of `watch`: the render interval the pacer chose)."""

    def __init__(self, watch=lambda: 0.0):
        from PySide6.QtCore import QTimer

        self.watch = watch
        self.watched: list[float] = []
        self.delays_ms: list[float] = []
        self._last: float | None = None
        self._timer = QTimer()
        self._timer.setInterval(PROBE_INTERVAL_MS)
        self._timer.timeout.connect(self._tick)

    def start(self) -> None:
        self._last = time.perf_counter()
        self._timer.start()

    def stop(self) -> None:
        self._timer.stop()

    def _tick(self) -> None:
        now = time.perf_counter()
        self.delays_ms.append(max(0.0, (now - self._last) * 1000.0 - PROBE_INTERVAL_MS))
        self.watched.append(self.watch())
        self._last = now


def _run_until(signals, done, timeout_s: float) -> bool:
    """Run a real Qt event loop until `done()` holds after one of `signals`; False on timeout.
    A nested QEventLoop, not a processEvents() poll: timers fire exactly as under app.exec()."""
    from PySide6.QtCore import QEventLoop, QObject, QTimer, Slot

    class _Waiter(QObject):
        def __init__(self, loop: QEventLoop):
            super().__init__()
            self.loop = loop

        @Slot()
        def check(self) -> None:
            if done():
                self.loop.quit()

    if done():
        return True
    loop = QEventLoop()
    waiter = _Waiter(loop)
    for signal in signals:
        signal.connect(waiter.check)
    deadline = QTimer()
    deadline.setSingleShot(True)
    deadline.timeout.connect(loop.quit)
    deadline.start(round(timeout_s * 1000))
    loop.exec()
    deadline.stop()
    for signal in signals:
        signal.disconnect(waiter.check)
    return done()


@dataclass(frozen=True, slots=True)
class AppRun:
    """One reply through the window."""

    tokens_per_s: float
    probe_delays_ms: list[float]
    gui_cpu_s_per_token: float  # the GUI thread's own CPU time (whatever else loads the machine)
    render_intervals_ms: list[float]  # the pacer's interval at each probe tick


def app_run(window, prompt: str, params) -> AppRun:
    """Send `prompt` through the chat of a live window and measure it (AppRun)."""
    window.controls.sampling.set_params(params)
    window.controller.new_conversation()
    probe = _Probe(lambda: window.host.pacer.interval_ms)
    gui_cpu_start = time.thread_time()
    probe.start()
    controller = window.controller
    # The chat measures the prompt against the context on the engine thread before it starts.
    if controller.send(prompt):
        _run_until(
            (controller.reply_started, controller.reply_refused),
            lambda: controller.preparing is None,
            RUN_TIMEOUT_S,
        )
    active = controller.active
    if active is None:
        probe.stop()
        raise MeasureError("the app did not accept the prompt (no model ready, or over the context?)")
    record = active.record
    host = window.host
    finished = _run_until(
        (host.request_finished, host.request_failed), lambda: window.controller.active is None, RUN_TIMEOUT_S
    )
    probe.stop()
    gui_cpu_s = time.thread_time() - gui_cpu_start
    if not finished:
        raise MeasureError("the app's reply did not finish")
    if record.stats is None:
        raise MeasureError("the app's reply failed")
    per_token = gui_cpu_s / max(1, record.stats.generated_tokens)
    return AppRun(record.stats.tokens_per_s, probe.delays_ms, per_token, probe.watched)


def _wait_ready(window) -> None:
    host = window.host
    ready = _run_until(
        (host.model_loaded, host.model_load_failed),
        lambda: host.status().ready or bool(window.load_failures),
        RUN_TIMEOUT_S,
    )
    if window.load_failures:
        raise MeasureError(f"the app's engine did not start: {window.load_failures[-1]}")
    if not ready:
        raise MeasureError("the app's engine did not start in time")


def run_measurement(
    loaded,
    prompt: str = DEFAULT_PROMPT,
    max_new_tokens: int = 128,
    repeats: int = 3,
    config=None,
    headless_threads: int | None = None,
    app_threads: int | None = None,
):
    """Both figures for `loaded`; builds (and closes) a full window in the current QApplication.

    Each side runs with its own torch thread count (None: as the process has it): headless as
    the engine's CLI runs, the app as kvscope sets itself up (one core left to the GUI)."""
    import torch

    from app.chat.conversations import ConversationStore
    from app.paths import conversations_db_path
    from app.settings import AppSettings
    from app.window import MainWindow
    from engine.config import EngineConfig
    from engine.request import ChatMessage, Request

    config = config or EngineConfig()
    headless_threads = headless_threads or torch.get_num_threads()
    app_threads = app_threads or torch.get_num_threads()
    params = measured_params(max_new_tokens)
    request = Request(messages=(ChatMessage("user", prompt),), sampling=params)
    headless_run(loaded, config, Request.chat(prompt, max_new_tokens=4))  # warm-up, not measured

    conversations = ConversationStore(conversations_db_path())
    window = MainWindow(AppSettings(), conversations, interactive=False)
    window.show()
    headless, in_app, delays, gui_cpu, intervals = [], [], [], [], []

    def measure_headless() -> None:
        torch.set_num_threads(headless_threads)
        headless.append(headless_run(loaded, config, request))

    try:
        for i in range(repeats):
            if i % 2 == 0:
                measure_headless()
            torch.set_num_threads(app_threads)
            window.start_engine(config, loaded=loaded)
            _wait_ready(window)
            run = app_run(window, prompt, params)
            in_app.append(run.tokens_per_s)
            gui_cpu.append(run.gui_cpu_s_per_token)
            intervals.extend(run.render_intervals_ms)
            delays.extend(run.probe_delays_ms)
            window.host.stop()  # idle engines off while the other run measures
            if i % 2 == 1:
                measure_headless()
    finally:
        window.close()
        conversations.close()
    headless_tps, app_tps = statistics.median(headless), statistics.median(in_app)
    worst = max(delays, default=0.0)
    ratio = app_tps / headless_tps if headless_tps > 0 else 0.0
    return {
        "model": loaded.info.name,
        "dtype": loaded.info.dtype,
        "device": loaded.info.device,
        "generated_tokens": max_new_tokens,
        "repeats": repeats,
        "headless_torch_threads": headless_threads,
        "app_torch_threads": app_threads,
        "headless_tokens_per_s": headless_tps,
        "app_tokens_per_s": app_tps,
        "throughput_ratio": ratio,
        "headless_runs": headless,
        "app_runs": in_app,
        "pair_ratios": [a / h if h > 0 else 0.0 for h, a in zip(headless, in_app)],
        "gui_cpu_ms_per_token": statistics.median(gui_cpu) * 1000,
        "render_interval_ms_median": _percentile(intervals, 50),
        "probe_interval_ms": PROBE_INTERVAL_MS,
        "probe_samples": len(delays),
        "probe_worst_delay_ms": worst,
        "probe_p99_delay_ms": _percentile(delays, 99),
        "probe_median_delay_ms": _percentile(delays, 50),
        "targets": {
            "probe_worst_delay_ms": TARGET_WORST_DELAY_MS,
            "throughput_ratio": TARGET_THROUGHPUT_RATIO,
        },
        "meets_targets": worst < TARGET_WORST_DELAY_MS and ratio >= TARGET_THROUGHPUT_RATIO,
    }


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.measure_app", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="default", help="model source (default: the packaged SmolLM2)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompt", default=DEFAULT_PROMPT)
    parser.add_argument(
        "--headless-threads",
        type=int,
        default=None,
        help="the headless side's torch threads (default: the app's)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    if args.max_new_tokens < 2 or args.repeats < 1:
        parser.error("--max-new-tokens must be >= 2 and --repeats >= 1")
    # The measuring window must not touch the user's conversations or layout.
    scratch = tempfile.TemporaryDirectory(prefix="kvscope-measure-")
    os.environ.setdefault("KVSCOPE_DATA_DIR", scratch.name)
    os.environ.setdefault("KVSCOPE_CONFIG_DIR", scratch.name)

    from PySide6.QtWidgets import QApplication

    from app.paths import asset_path
    from app.runtime import gui_torch_threads, paint_on_the_gui_thread_only, share_gil_finely
    from engine.config import ConfigError, ModelSpec
    from engine.errors import ModelLoadError, describe_load_error
    from engine.model.loading import load_model
    from widgets.theme import apply_theme

    share_gil_finely()  # as the app does (process-wide, so for both runs)
    paint_on_the_gui_thread_only()
    app = QApplication.instance() or QApplication(sys.argv[:1])
    apply_theme(app, asset_path("style.qss"))
    try:
        loaded = load_model(ModelSpec(args.model, args.dtype, args.device))
        import torch

        # Like for like: both sides at the app's own thread count (as kvscope configures itself).
        app_threads = (
            torch.get_num_threads()
            if os.environ.get("OMP_NUM_THREADS")
            else gui_torch_threads(os.cpu_count())
        )
        headless_threads = args.headless_threads or app_threads
        result = run_measurement(
            loaded,
            args.prompt,
            args.max_new_tokens,
            args.repeats,
            headless_threads=headless_threads,
            app_threads=app_threads,
        )
    except (ModelLoadError, ConfigError) as exc:
        print(f"measure: {describe_load_error(exc)}", file=sys.stderr)
        return 1
    except MeasureError as exc:
        print(f"measure: {exc}", file=sys.stderr)
        return 1
    finally:
        scratch.cleanup()
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(
            f"{result['model']} ({result['dtype']}, {result['device']}), {args.max_new_tokens} tokens × "
            f"{args.repeats}; torch threads: headless {result['headless_torch_threads']}, "
            f"app {result['app_torch_threads']}"
        )
        print(
            f"GUI probe: worst delay {result['probe_worst_delay_ms']:.1f} ms, p99 {result['probe_p99_delay_ms']:.1f} ms "
            f"(target < {TARGET_WORST_DELAY_MS:.0f} ms)"
        )
        print(
            f"Throughput: app {result['app_tokens_per_s']:.1f} tok/s vs headless {result['headless_tokens_per_s']:.1f} "
            f"tok/s = {result['throughput_ratio'] * 100:.1f}% (target >= {TARGET_THROUGHPUT_RATIO * 100:.0f}%)"
        )
    return 0 if result["meets_targets"] else 3


if __name__ == "__main__":
    sys.exit(main())
