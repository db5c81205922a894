"""`./dev peers-test`: the attach path against real engines, outside the CI suite.

    ./dev peers-test [--only vllm|llamacpp] [--out DIR]

For each peer that is installed it starts the server on the packaged SmolLM2 (vLLM: the HF
folder kvscope converts it to, bf16; llama.cpp: the GGUF itself), attaches kvscope's remote
client to it as the app does, and checks what the app relies on: a streamed greedy reply with
its top-K, a client-timed TTFT and ITL, cached tokens on a repeated long system prompt, n
samples, a cancel mid-stream, the server's /metrics read under its own names; for vLLM also
whether its ZMQ KV-cache events reach a subscriber; and finally the real app, attached under
Xvfb, answering a prompt into a screenshot. A peer that is not installed is reported with the
command that installs it. Results are printed and written to DIR/peers.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

PEERS = Path.home() / ".cache" / "kvscope-peers"
VLLM_PYTHON = Path(os.environ.get("KVSCOPE_VLLM_PYTHON", PEERS / "vllm-cpu" / "bin" / "python"))
LLAMA_BIN = Path(os.environ.get("KVSCOPE_LLAMA_BIN", PEERS / "llama.cpp" / "bin"))
ROOT = Path(__file__).resolve().parents[2]
ZMQ_PORT = 5557
LONG_SYSTEM = " ".join(
    f"Rule {i}: answer clearly, cite the principle behind it, and keep a friendly tone." for i in range(40)
)
# vLLM's own subscriber types decode its messages; run with vLLM's python (it has zmq and msgspec).
ZMQ_SUBSCRIBER = r"""
import json, signal, sys, time, zmq, msgspec
from vllm.distributed.kv_events import KVEventBatch
stop = []
signal.signal(signal.SIGTERM, lambda *_: stop.append(True))  # the runner is done: report
ctx = zmq.Context(); sock = ctx.socket(zmq.SUB)
sock.connect(sys.argv[1]); sock.setsockopt(zmq.SUBSCRIBE, b"")
decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
received, deadline = [], time.time() + float(sys.argv[2])
print("ready", flush=True)
while time.time() < deadline and not stop:
    if not sock.poll(200):
        continue
    parts = sock.recv_multipart()
    for event in decoder.decode(parts[-1]).events:
        item = {"t": time.time(), "topic": parts[0].decode(errors="replace"), "type": type(event).__name__}
        if hasattr(event, "block_hashes"):
            item["blocks"] = len(event.block_hashes)
        if hasattr(event, "token_ids"):
            item.update(tokens=len(event.token_ids), block_size=event.block_size, first_tokens=event.token_ids[:12])
        received.append(item)
print(json.dumps(received), flush=True)
"""


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_healthy(url: str, process: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode} before it was ready")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        time.sleep(2)
    raise RuntimeError(f"not healthy after {timeout:.0f} s")


class Client:
    """kvscope's remote client (app.remote.engine), with its events collected."""

    def __init__(self, url: str) -> None:
        from app.remote.engine import RemoteEngine
        from app.remote.target import RemoteTarget

        self.events: list = []
        self.records: list = []
        self.engine = RemoteEngine(RemoteTarget.parse(url), self.events.append, self.records.append)
        self.engine.start()
        if not self.engine.wait_until_loaded(60):
            raise RuntimeError(self.engine.load_error or "did not attach")

    def ask(self, text: str, system: str | None = None, timeout: float = 300, **sampling):
        from engine.config import SamplingParams
        from engine.request import Request

        request = Request.chat(text, system=system, sampling=SamplingParams(**sampling))
        try:
            (end,) = self.engine.run([request]).result(timeout)
        except TimeoutError:
            raise RuntimeError("no reply in time") from None
        return end.request_id, end

    def tokens(self, rid: int) -> list:
        from engine.events import TokenGenerated

        return [e for e in list(self.events) if isinstance(e, TokenGenerated) and e.request_id == rid]

    def close(self) -> None:
        self.engine.shutdown(20)


def check(results: dict, name: str, fn) -> None:
    start = time.time()  # wall clock: the ZMQ subscriber (another process) stamps with it too
    try:
        value = fn()
        results[name] = {"ok": True, **(value if isinstance(value, dict) else {"value": value})}
    except Exception as exc:  # noqa: BLE001 - every check reports, none stops the others
        results[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    results[name]["wall"] = [start, time.time()]
    print(
        f"  {'ok  ' if results[name]['ok'] else 'FAIL'} {name}: {json.dumps(results[name])[:300]}",
        file=sys.stderr,
    )


def attach_checks(url: str, expect_family: str) -> dict:
    from engine.events import RequestFinished
    from live.remote import is_remote_snapshot

    results: dict = {}
    client = Client(url)
    try:
        source = client.engine.source
        results["attached"] = {
            "ok": source.family == expect_family,
            "family": source.family,
            "model": source.model,
        }

        def greedy():
            rid, end = client.ask(
                "Why is the sky blue?", temperature=0.0, max_new_tokens=24, snapshot_top_n=5
            )
            assert isinstance(end, RequestFinished), getattr(end, "message", end)
            tokens = client.tokens(rid)
            snaps = [t.snapshot for t in tokens if is_remote_snapshot(t.snapshot)]
            assert tokens and len(snaps) == len(tokens), "every token has the server's top-K"
            assert all(s.drawn_id == s.candidate_ids[0] for s in snaps), "greedy draws the likeliest"
            return {
                "tokens": len(tokens),
                "top_k": len(snaps[0].candidate_ids),
                "client_ttft_ms": round(end.stats.ttft_s * 1000, 1),
                "client_median_itl_ms": round(sorted(end.stats.itl_s)[len(end.stats.itl_s) // 2] * 1000, 1),
                "text": end.text[:80],
            }

        def cached():
            client.ask("First question?", system=LONG_SYSTEM, max_new_tokens=4, temperature=0.0)
            _, end = client.ask("Second question?", system=LONG_SYSTEM, max_new_tokens=4, temperature=0.0)
            assert isinstance(end, RequestFinished), getattr(end, "message", end)
            return {"prompt_tokens": end.stats.prompt_tokens, "cached_tokens": end.stats.cached_prompt_tokens}

        def samples():
            _, end = client.ask("Name a colour.", temperature=0.9, n=2, max_new_tokens=8, seed=1)
            assert isinstance(end, RequestFinished), getattr(end, "message", end)
            return {"sequences": [s.text for s in end.sequences]}

        def cancel():
            from engine.config import SamplingParams
            from engine.request import Request

            sampling = SamplingParams(temperature=0.0, max_new_tokens=400, ignore_eos=True)
            rid = client.engine.submit(Request.chat("Count slowly to one thousand.", sampling=sampling))
            deadline = time.monotonic() + 120
            while len(client.tokens(rid)) < 3 and time.monotonic() < deadline:
                time.sleep(0.05)
            client.engine.cancel(rid)
            time.sleep(1.0)
            ends = [e for e in client.events if isinstance(e, RequestFinished) and e.request_id == rid]
            assert ends and ends[0].finish_reason == "cancelled"
            return {"tokens_before_cancel": len(client.tokens(rid))}

        def metrics():
            from app.remote.records import RemoteMetrics

            polls = [r for r in client.records if isinstance(r, RemoteMetrics)]
            assert polls, "no /metrics poll read"
            points = [r.point for r in polls if r.point is not None]
            return {
                "family": polls[-1].sample.family,
                "figures": sorted(polls[-1].sample.values),
                "max_tokens_per_s": max((p.tokens_per_s or 0.0) for p in points),
                "kv_usage_seen": max((p.kv_usage or 0.0) for p in points),
                "prefix_hit_rate": points[-1].prefix_hit_rate if points else None,
            }

        for name, fn in (("greedy_stream", greedy), ("cached_tokens", cached), ("n_samples", samples),
                         ("cancel", cancel), ("metrics", metrics)):  # fmt: skip
            check(results, name, fn)
    finally:
        client.close()
    return results


def app_screenshot(url: str, out: Path, name: str) -> dict:
    """The real app attached under Xvfb: a prompt answered into a screenshot, stored with the server named."""
    if shutil.which("xvfb-run") is None:
        raise RuntimeError("xvfb-run is not installed (apt-get install -y xvfb)")
    data = Path(tempfile.mkdtemp(prefix="kvscope-peers-"))
    env = {**os.environ, "KVSCOPE_DATA_DIR": str(data / "data"), "KVSCOPE_CONFIG_DIR": str(data / "config")}
    shot = out / f"peers-{name}.png"
    run = subprocess.run(
        ["xvfb-run", "-a", "-s", "-screen 0 1600x1000x24", sys.executable, "-m", "app", "--attach", url,
         "--prompt", "Why is the sky blue? Answer in two sentences.", "--screenshot", str(shot),
         "--quit-after-reply", "--timeout", "600"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-500:]
    from app.chat.conversations import ConversationStore

    store = ConversationStore(data / "data" / "conversations.sqlite3")
    try:
        (first,) = store.summaries()[:1]
        conv = store.load(first.id)
        model = conv.messages[-1].model
    finally:
        store.close()
    return {"screenshot": str(shot), "stored_model": model}


def run_vllm(out: Path) -> dict:
    if not VLLM_PYTHON.exists():
        return {
            "status": "missing",
            "how": "../shared/tools/setup-vllm-cpu (~3.5 GB; the server starts in ~3.5 min)",
        }
    from engine.model.default_model import default_model_dir

    folder, port = default_model_dir(), free_port()
    url = f"http://127.0.0.1:{port}"
    kv_events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{ZMQ_PORT}"}
    cmd = ["nice", "-n", "10", str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder),
           "--served-model-name", "smollm2", "--dtype", "bfloat16", "--max-model-len", "2048", "--host", "127.0.0.1",
           "--port", str(port), "--enable-prefix-caching", "--enable-prompt-tokens-details",
           "--kv-events-config", json.dumps(kv_events)]  # fmt: skip
    log = open(out / "vllm.log", "w")  # noqa: SIM115 - closed after the server ends
    server = subprocess.Popen(
        cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    )
    result: dict = {"command": " ".join(cmd)}
    subscriber = None
    try:
        started = time.monotonic()
        wait_healthy(url, server, 900)
        result["start_s"] = round(time.monotonic() - started)
        subscriber = subprocess.Popen(
            [str(VLLM_PYTHON), "-c", ZMQ_SUBSCRIBER, f"tcp://127.0.0.1:{ZMQ_PORT}", "1800"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        subscriber.stdout.readline()  # "ready": connected before the first request
        time.sleep(1.0)  # ZMQ's slow joiner: let the subscription reach the publisher
        result["checks"] = attach_checks(url, "vllm")
        check(result["checks"], "app_attached", lambda: app_screenshot(url, out, "vllm"))
        subscriber.terminate()  # it reports what it received, then exits
        zmq_out, zmq_err = subscriber.communicate(timeout=60)
        if zmq_out.strip():
            received = json.loads(zmq_out.strip().splitlines()[-1])
            result["zmq_kv_events"] = zmq_summary(received, result["checks"], folder)
        else:
            result["zmq_kv_events"] = {"error": zmq_err[-800:]}
    except Exception as exc:  # noqa: BLE001
        result["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        if subscriber is not None and subscriber.poll() is None:
            subscriber.kill()
        _stop(server, log, grace_s=60)  # vLLM takes its time to wind down
    result["status"] = _status(result)
    return result


def _stop(server: subprocess.Popen, log, grace_s: float) -> None:
    """Ask a peer server to stop, kill it if it has not after `grace_s`, close its log."""
    server.terminate()
    with contextlib.suppress(subprocess.TimeoutExpired):
        server.wait(grace_s)
    if server.poll() is None:
        server.kill()
    log.close()


def zmq_summary(received: list[dict], checks: dict, folder: Path) -> dict:
    """What the subscriber got, by the check that was running, and the blocks it was told of
    (vLLM publishes a block when it fills and is hashed for the prefix cache)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    by_check = {}
    for name, c in checks.items():
        start, end = c.get("wall", (0, 0))
        during = [e for e in received if start <= e["t"] <= end + 0.5]
        by_check[name] = {k: sum(1 for e in during if e["type"] == k) for k in {e["type"] for e in during}}
    stored = [e for e in received if e["type"] == "BlockStored"]
    return {
        "events": len(received),
        "by_check": by_check,
        "block_size": stored[0]["block_size"] if stored else None,
        "stored_blocks": [
            {"blocks": e["blocks"], "tokens": e["tokens"], "starts": tokenizer.decode(e["first_tokens"])}
            for e in stored[:8]
        ],
    }


def run_llamacpp(out: Path) -> dict:
    binary = LLAMA_BIN / "llama-server"
    if not binary.exists():
        return {"status": "missing", "how": "../shared/tools/build-llama-bench (~10 min on 2 cores)"}
    from engine.model.sources import default_gguf_path

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = ["nice", "-n", "10", str(binary), "-m", str(default_gguf_path()), "--host", "127.0.0.1", "--port", str(port),
           "--metrics", "-c", "4096", "-t", "2", "-np", "2"]  # fmt: skip
    log = open(out / "llamacpp.log", "w")  # noqa: SIM115 - closed after the server ends
    env = {**os.environ, "LD_LIBRARY_PATH": f"{LLAMA_BIN}:{os.environ.get('LD_LIBRARY_PATH', '')}"}
    server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    result: dict = {"command": " ".join(cmd)}
    try:
        wait_healthy(url, server, 300)
        result["checks"] = attach_checks(url, "llamacpp")
        check(result["checks"], "app_attached", lambda: app_screenshot(url, out, "llamacpp"))
    except Exception as exc:  # noqa: BLE001
        result["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        _stop(server, log, grace_s=30)
    result["status"] = _status(result)
    return result


def _status(result: dict) -> str:
    if "error" in result:
        return "failed"
    return "passed" if all(c.get("ok") for c in result.get("checks", {}).values()) else "partial"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="./dev peers-test", description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=["vllm", "llamacpp"])
    parser.add_argument("--out", type=Path, default=ROOT / "out" / "peers")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    results = {}
    for name, run in (("vllm", run_vllm), ("llamacpp", run_llamacpp)):
        if args.only in (None, name):
            print(f"== {name}", file=sys.stderr)
            results[name] = run(args.out)
            if results[name]["status"] == "missing":
                print(f"  not installed: run {results[name]['how']}", file=sys.stderr)
    (args.out / "peers.json").write_text(json.dumps(results, indent=2))
    print(json.dumps({k: v["status"] for k, v in results.items()}))
    return 0 if all(r["status"] in ("passed", "missing") for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
