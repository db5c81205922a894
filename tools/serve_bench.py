"""What the HTTP layer costs: 4 concurrent HTTP clients against the same 4 requests in-process.

    python -m tools.serve_bench [--model default] [--new-tokens 64] [--rounds 3] [--json]

Both sides run the same engine on its own thread (`engine.core.service.Engine`, one loaded model
shared between them, never running at the same time) with the same config (prefix caching off,
so every round does the same work). In-process: the 4 requests are submitted at once and the
clock stops at the last RequestFinished. HTTP: 4 threads each stream one chat completion from a
real uvicorn on loopback (SSE parsed, usage read) and the clock stops at the last [DONE]; the
clients run in a process of their own, as clients do, so their JSON parsing does not take the
server's GIL (they still share the CPUs). Rounds alternate; the ratio is HTTP tokens/s over
in-process tokens/s (1.0 = free). Run it on a quiet machine: anything else on the CPUs lands in
one side or the other.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import sys
import threading
import time
from typing import TYPE_CHECKING, Any

from engine.units import tokens_per_s

if TYPE_CHECKING:
    from engine.config import SamplingParams
    from engine.core.service import Engine

PROMPTS = (
    "Explain how a bicycle gear works.",
    "Why do leaves change colour in autumn?",
    "What does a compiler do?",
    "How do tides work?",
)
CLIENTS = len(PROMPTS)


def run_in_process(engine: Engine, params: SamplingParams) -> tuple[float, int]:
    from engine.events import RequestFailed, RequestFinished
    from engine.request import Request

    start = time.perf_counter()
    try:
        ended = engine.run([Request.chat(prompt, sampling=params) for prompt in PROMPTS]).result(600)
    except TimeoutError:
        raise RuntimeError("the in-process round did not finish") from None
    wall = time.perf_counter() - start
    failed = [e for e in ended if isinstance(e, RequestFailed)]
    if failed:
        raise RuntimeError(failed[0].message)
    return wall, sum(e.stats.generated_tokens for e in ended if isinstance(e, RequestFinished))


def run_http(url: str, model: str, new_tokens: int) -> tuple[float, int]:
    import httpx

    barrier = threading.Barrier(CLIENTS + 1)
    tokens: list[int] = []
    errors: list[str] = []

    def client(prompt: str) -> None:
        body = {
            "model": model,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": new_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        with httpx.Client(base_url=url, timeout=600) as http:
            barrier.wait()
            with http.stream("POST", "/v1/chat/completions", json=body) as r:
                for line in r.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if chunk.get("usage"):
                        tokens.append(chunk["usage"]["completion_tokens"])
                    elif "error" in chunk:
                        errors.append(chunk["error"]["message"])

    threads = [threading.Thread(target=client, args=(p,)) for p in PROMPTS]
    for t in threads:
        t.start()
    barrier.wait()
    start = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    if errors or len(tokens) != CLIENTS:
        raise RuntimeError(errors[0] if errors else "an HTTP client got no usage")
    return wall, sum(tokens)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.serve_bench", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)

    from engine.config import EngineConfig, ModelSpec, SamplingParams
    from engine.core.service import Engine
    from engine.model.loading import load_model
    from engine.serve.server import BackgroundServer

    config = EngineConfig(
        model=ModelSpec(args.model, dtype=args.dtype, device="cpu"),
        max_num_seqs=CLIENTS,
        enable_prefix_caching=False,
    )
    params = SamplingParams(temperature=0.0, max_new_tokens=args.new_tokens, ignore_eos=True)
    print(f"loading {args.model} ...", file=sys.stderr)
    loaded = load_model(config.model)
    local = Engine(config, sink=lambda event: None, loaded=loaded)  # the rounds read their ends from run()
    local.start()
    local.wait_until_loaded()
    rows: list[dict[str, Any]] = []
    clients = multiprocessing.get_context("spawn").Pool(1)  # started once, reused every round
    with clients, BackgroundServer(config, loaded=loaded) as server:
        model = server.bridge.model_name
        run_in_process(local, params)  # warm-up both paths (first forwards, allocator, sockets)
        clients.apply(run_http, (server.url, model, 4))
        for i in range(args.rounds):
            in_s, in_tokens = run_in_process(local, params)
            http_s, http_tokens = clients.apply(run_http, (server.url, model, args.new_tokens))
            row: dict[str, Any] = {
                "round": i + 1,
                "in_process_tokens_per_s": tokens_per_s(in_tokens, in_s),
                "http_tokens_per_s": tokens_per_s(http_tokens, http_s),
                "tokens": http_tokens,
            }
            row["ratio"] = row["http_tokens_per_s"] / row["in_process_tokens_per_s"]
            rows.append(row)
            print(
                f"round {i + 1}: in-process {row['in_process_tokens_per_s']:.1f} tok/s, "
                f"HTTP {row['http_tokens_per_s']:.1f} tok/s, ratio {row['ratio']:.3f}",
                file=sys.stderr,
            )
    local.shutdown()
    ratio = statistics.median(r["ratio"] for r in rows)
    result = {
        "model": loaded.info.name,
        "clients": CLIENTS,
        "new_tokens": args.new_tokens,
        "rounds": rows,
        "median_ratio": ratio,
        "http_cost": 1.0 - ratio,
    }
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(
            f"HTTP / in-process tokens/s (median of {args.rounds}): {ratio:.3f} (HTTP path costs {1 - ratio:.1%})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
