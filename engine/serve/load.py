"""A load run against `kvscope serve`: many clients at once, some hanging up mid-stream, some
cancelling, some asking for n samples, for minutes; then whether anything was lost or mixed up.

    python -m engine bench --serve-load [--duration 600] [--clients 64] [--model default] [--json]

The server runs in this process on the model asked for; the clients in a process of their own
(their JSON parsing does not take the server's GIL), as asyncio tasks over httpx. First every
prompt of a fixed pool (random lengths) is asked alone, greedy, one at a time: its reference.
Then each client, until the time is up, picks at random:
  60% a greedy request of the pool (streamed or not), whose reply must equal its reference;
  10% the same with a stop string taken from the middle of its reference (the server finds it
      and cancels the engine's request), whose reply must be the reference up to it;
  10% a stream it drops after a few chunks (the connection closed);
   5% a request it cancels after a random wait (its task cancelled, the connection closed);
  15% n = 2 or 3 samples (temperature 0.8), which must come back with n finished choices.
The table: requests by kind, lost (no answer, an error status, a stream that broke by itself),
mismatches (a greedy reply unlike its reference), the KV blocks still used once the server is
idle, the server's RSS after a warm-up against its end (and its peak) with the KV pool's resident
pages at both (the pool fills lazily, up to its size), p50/p99 TTFT and ITL as the streaming
clients saw them. It passes (exit 0) with nothing lost or mismatched, no block leaked and the RSS
outside the KV pool within 5%. Run the long one on a quiet machine; a short one checks the path works.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import random
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx
import psutil

from engine.config import EngineConfig, ModelSpec
from engine.model.runtime_memory import pool_resident
from engine.serve.server import BackgroundServer

WORDS = [
    "the",
    "a",
    "of",
    "river",
    "mountain",
    "light",
    "engine",
    "paper",
    "window",
    "garden",
    "music",
    "history",
    "market",
    "winter",
    "signal",
    "library",
    "bridge",
    "ocean",
    "theory",
    "kitchen",
    "planet",
    "story",
    "number",
    "morning",
    "question",
    "forest",
    "language",
]
POOL = 24  # distinct prompts (each with its reference)
DROP, CANCEL, SAMPLES, STOPS = 0.10, 0.05, 0.15, 0.10  # shares of the requests; the rest are greedy
WARMUP_SHARE = 0.2  # of the duration, before RSS is taken as the baseline
MAX_WARMUP_S = 60.0
RSS_TOLERANCE = 0.05  # RSS at the end within 5% of RSS after the warm-up


@dataclass
class LoadResult:
    duration_s: float
    clients: int
    requests: int = 0
    greedy: int = 0
    stopped: int = 0  # greedy with a stop string
    sampled: int = 0
    dropped: int = 0
    cancelled: int = 0
    lost: int = 0
    mismatches: int = 0
    problems: list[str] = field(default_factory=list)
    ttft_s: list[float] = field(default_factory=list)
    itl_s: list[float] = field(default_factory=list)
    tokens: int = 0
    blocks_leaked: int = -1
    rss_start_mib: float = 0.0
    rss_end_mib: float = 0.0
    rss_peak_mib: float = 0.0
    # What of the KV pool is resident at the same two moments: the pool fills lazily (its pages
    # become resident as blocks are first written, up to its size), which is not a leak
    pool_start_mib: float = 0.0
    pool_end_mib: float = 0.0

    @property
    def rss_drift(self) -> float:
        """The process's growth after the warm-up outside the KV pool's pages (those are bounded
        by the pool's size and counted apart)."""
        start = self.rss_start_mib - self.pool_start_mib
        end = self.rss_end_mib - self.pool_end_mib
        return (end - start) / start if start > 0 else 0.0

    def summary(self) -> dict[str, Any]:
        out = {k: v for k, v in asdict(self).items() if k not in ("ttft_s", "itl_s")}
        out["problems"] = self.problems[:20]
        out["rss_drift"] = self.rss_drift
        for name, values in (("ttft", self.ttft_s), ("itl", self.itl_s)):
            out[f"{name}_p50_ms"] = _pct(values, 50) * 1000
            out[f"{name}_p99_ms"] = _pct(values, 99) * 1000
        out["tokens_per_s"] = self.tokens / self.duration_s if self.duration_s else 0.0
        return out


def _pct(values: list[float], p: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))]


def prompt_pool(seed: int) -> list[tuple[str, int]]:
    """(prompt, max_tokens): lengths from a few words to several hundred."""
    rng = random.Random(seed)
    pool = []
    for i in range(POOL):
        words = rng.choice([3, 8, 20, 60, 150, 400])
        text = " ".join(rng.choice(WORDS) for _ in range(words))
        pool.append((f"Request {i}. Continue: {text}", rng.choice([8, 16, 32, 48])))
    return pool


# ---- the clients (their own process) -------------------------------------------------------------
async def _stream(
    http: Any, body: dict[str, Any], stop_after: int | None = None
) -> tuple[str, list[float], bool, int]:
    """The streamed text, the arrival times of its content chunks, whether it ended with [DONE],
    and its completion tokens (from the usage chunk; 0 when it was hung up on)."""
    text, times, tokens = "", list[float](), 0
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    async with http.stream("POST", "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread())[:200]!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                return text, times, True, tokens
            chunk = json.loads(data)
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            tokens = (chunk.get("usage") or {}).get("completion_tokens", tokens)
            for choice in chunk.get("choices", []):
                piece = (choice.get("delta") or {}).get("content") or ""
                if piece:
                    text += piece
                    times.append(time.perf_counter())
            if stop_after is not None and len(times) >= stop_after:
                return text, times, False, 0  # hang up: the context manager closes the connection
    return text, times, False, tokens


def _stop_of(reference: str) -> tuple[str | None, str]:
    """A stop string from the middle of a reference, and the reply it must leave (the reference
    up to its first occurrence); none for a reference too short to hold one."""
    middle = len(reference) // 2
    stop = reference[middle : middle + 3]
    if len(reference) < 6:
        return None, reference
    return stop, reference[: reference.index(stop)]


def _body(model: str, prompt: str, max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        **extra,
    }


async def _client(
    http: Any,
    model: str,
    pool: list[tuple[str, int]],
    refs: list[str],
    seed: int,
    deadline: float,
    out: LoadResult,
) -> None:
    rng = random.Random(seed)
    while time.perf_counter() < deadline:
        index = rng.randrange(len(pool))
        prompt, max_tokens = pool[index]
        roll = rng.random()
        out.requests += 1
        try:
            if roll < DROP:
                out.dropped += 1
                await _stream(http, _body(model, prompt, max_tokens), stop_after=rng.randint(1, 4))
            elif roll < DROP + CANCEL:
                out.cancelled += 1
                task = asyncio.ensure_future(http.post("/v1/chat/completions", json=_body(model, prompt, 64)))
                await asyncio.sleep(rng.uniform(0.05, 1.0))
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
            elif roll < DROP + CANCEL + SAMPLES:
                out.sampled += 1
                n = rng.choice([2, 3])
                body = _body(model, prompt, max_tokens, n=n, temperature=0.8, seed=rng.randrange(1 << 30))
                response = await http.post("/v1/chat/completions", json=body)
                choices = response.json().get("choices", []) if response.status_code == 200 else []
                if len(choices) != n or not all(c["finish_reason"] in ("stop", "length") for c in choices):
                    out.lost += 1
                    out.problems.append(f"n={n}: HTTP {response.status_code}, {len(choices)} choices")
                else:
                    out.tokens += response.json()["usage"]["completion_tokens"]
            else:
                stop, expected = (
                    _stop_of(refs[index]) if roll < DROP + CANCEL + SAMPLES + STOPS else (None, refs[index])
                )
                extra = {"stop": [stop]} if stop else {}
                if stop:
                    out.stopped += 1
                else:
                    out.greedy += 1
                start = time.perf_counter()
                if rng.random() < 0.7:
                    text, times, done, tokens = await _stream(http, _body(model, prompt, max_tokens, **extra))
                    if not done:
                        out.lost += 1
                        out.problems.append(f"prompt {index}: the stream ended without [DONE]")
                        continue
                    if times:
                        out.ttft_s.append(times[0] - start)
                        out.itl_s.extend(b - a for a, b in zip(times, times[1:]))
                else:
                    response = await http.post(
                        "/v1/chat/completions", json=_body(model, prompt, max_tokens, **extra)
                    )
                    if response.status_code != 200:
                        out.lost += 1
                        out.problems.append(f"prompt {index}: HTTP {response.status_code}")
                        continue
                    text = response.json()["choices"][0]["message"]["content"]
                    tokens = response.json()["usage"]["completion_tokens"]
                out.tokens += tokens
                if text != expected:
                    out.mismatches += 1
                    out.problems.append(f"prompt {index} (stop {stop!r}): {text[:60]!r} != {expected[:60]!r}")
        except Exception as exc:  # noqa: BLE001 - a broken request is counted, the client goes on
            out.lost += 1
            out.problems.append(f"prompt {index}: {type(exc).__name__}: {exc}"[:300])


async def _run_clients(
    url: str, model: str, clients: int, duration_s: float, seed: int, started: Any
) -> dict[str, Any]:
    pool = prompt_pool(seed)
    limits = httpx.Limits(max_connections=clients + 8, max_keepalive_connections=clients + 8)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(600.0), limits=limits) as http:
        refs = []
        for prompt, max_tokens in pool:  # each alone: the references
            response = await http.post("/v1/chat/completions", json=_body(model, prompt, max_tokens))
            response.raise_for_status()
            refs.append(response.json()["choices"][0]["message"]["content"])
        started.set()
        out = LoadResult(duration_s, clients)
        t0 = time.perf_counter()
        deadline = t0 + duration_s
        await asyncio.gather(
            *(_client(http, model, pool, refs, seed * 1000 + i, deadline, out) for i in range(clients))
        )
        out.duration_s = time.perf_counter() - t0
    return asdict(out)


def _client_process(
    url: str, model: str, clients: int, duration_s: float, seed: int, started: Any, conn: Any
) -> None:
    try:
        conn.send(asyncio.run(_run_clients(url, model, clients, duration_s, seed, started)))
    except Exception as exc:  # noqa: BLE001 - reported to the parent
        conn.send({"error": f"{type(exc).__name__}: {exc}"})


# ---- the server side -------------------------------------------------------------------------------
def run_load(config: Any, clients: int, duration_s: float, seed: int = 0, loaded: Any = None) -> LoadResult:
    with BackgroundServer(config, loaded=loaded, max_waiting=max(256, 4 * clients)) as server:
        model = server.bridge.model_name
        ctx = multiprocessing.get_context("spawn")
        started = ctx.Event()
        parent, child = ctx.Pipe(duplex=False)
        proc = ctx.Process(
            target=_client_process,
            args=(server.url, model, clients, duration_s, seed, started, child),
            daemon=True,
        )
        proc.start()
        me = psutil.Process()
        while not started.wait(1.0):
            if not proc.is_alive():
                break
        warmup = min(MAX_WARMUP_S, WARMUP_SHARE * duration_s)
        time.sleep(warmup)

        def pool_resident_now() -> int:
            return int(server.bridge.engine._call(lambda core: pool_resident(core.storage)).result(30))

        pool_start = pool_resident_now()
        rss_start = me.memory_info().rss
        rss_peak = [rss_start]
        done = threading.Event()

        def sample() -> None:
            while not done.wait(1.0):
                rss_peak.append(me.memory_info().rss)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        raw = parent.recv() if parent.poll(duration_s + 900) else {"error": "the clients did not finish"}
        proc.join(30)
        done.set()
        rss_end = me.memory_info().rss
        pool_end = pool_resident_now()
        if "error" in raw:
            raise RuntimeError(f"the load run failed: {raw['error']}")
        result = LoadResult(**raw)
        deadline = time.monotonic() + 60
        used = -1
        while time.monotonic() < deadline:
            idle, used = server.bridge.engine._call(
                lambda core: (not core.has_work(), core.kv.pool.num_used)
            ).result(30)
            if idle and used == 0:
                break
            time.sleep(0.5)
        result.blocks_leaked = used
        result.rss_start_mib, result.rss_end_mib = rss_start / 2**20, rss_end / 2**20
        result.pool_start_mib, result.pool_end_mib = pool_start / 2**20, pool_end / 2**20
        result.rss_peak_mib = max(*rss_peak, rss_end) / 2**20
    return result


def table(result: LoadResult, model: str) -> str:
    s = result.summary()
    rows = [
        ("model", model),
        ("clients", f"{result.clients} for {result.duration_s:.0f} s"),
        (
            "requests",
            f"{result.requests} ({result.greedy} greedy, {result.stopped} greedy with a stop string, "
            f"{result.sampled} n>1, {result.dropped} dropped "
            f"mid-stream, {result.cancelled} cancelled)",
        ),
        ("lost", str(result.lost)),
        ("mismatches", f"{result.mismatches} (greedy replies unlike their reference computed alone)"),
        ("blocks leaked", f"{result.blocks_leaked} (KV blocks used once idle)"),
        (
            "RSS",
            f"{result.rss_start_mib:.0f} MiB after warm-up -> {result.rss_end_mib:.0f} MiB, peak "
            f"{result.rss_peak_mib:.0f} MiB; of it the KV pool's resident pages {result.pool_start_mib:.0f} -> "
            f"{result.pool_end_mib:.0f} MiB; the rest {result.rss_drift:+.1%}",
        ),
        ("TTFT p50 / p99", f"{s['ttft_p50_ms']:.0f} / {s['ttft_p99_ms']:.0f} ms (streaming clients)"),
        ("ITL p50 / p99", f"{s['itl_p50_ms']:.1f} / {s['itl_p99_ms']:.1f} ms"),
        ("tokens/s", f"{s['tokens_per_s']:.1f} (completion tokens of the replies read to their end)"),
    ]
    width = max(len(k) for k, _ in rows)
    lines = [f"{k.ljust(width)}  {v}" for k, v in rows]
    lines += [f"  ! {p}" for p in result.problems[:10]]
    return "\n".join(lines)


def run_serve_load(args: argparse.Namespace) -> int:
    spec = ModelSpec(args.model, dtype=args.dtype, device=args.device)
    config = EngineConfig(model=spec, block_size=args.block_size, max_num_seqs=args.max_num_seqs)
    print(f"serve load: {args.clients} clients for {args.duration} s on {args.model} ...", file=sys.stderr)
    result = run_load(config, args.clients, float(args.duration), seed=args.seed)
    if args.json:
        print(json.dumps(result.summary(), indent=2))
    else:
        print(table(result, args.model))
    return 0 if passed(result) else 1


def passed(result: LoadResult) -> bool:
    """Nothing lost or mixed up, every block back once idle, RSS within 5% after the warm-up."""
    return (
        result.lost == 0
        and result.mismatches == 0
        and result.blocks_leaked == 0
        and abs(result.rss_drift) <= RSS_TOLERANCE
    )
