"""`python -m engine serve` (and `kvscope serve`): the engine behind an OpenAI-compatible HTTP API.

Checks the bind address and takes the port before loading the model, so a mistake costs
nothing; then loads, prints where it listens, and serves until Ctrl-C.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

from engine.cli.args import add_engine_args, engine_config_from
from engine.serve.bridge import DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_WAITING
from engine.serve.server import DEFAULT_HOST, DEFAULT_PORT

API_KEY_ENV = "KVSCOPE_API_KEY"


def add_command(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    s = sub.add_parser(
        "serve",
        help="serve the model over an OpenAI-compatible HTTP API (chat, completions, logprobs, metrics)",
    )
    add_engine_args(s)
    s.add_argument("--host", default=DEFAULT_HOST, help="address to listen on (default: loopback only)")
    s.add_argument("--port", type=int, default=DEFAULT_PORT)
    s.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_ENV),
        help=f"require 'Authorization: Bearer KEY' on every route but /health (default: ${API_KEY_ENV}); "
        "needed off loopback",
    )
    s.add_argument("--served-model-name", default=None, help="the model id clients send (default: its name)")
    s.add_argument("--max-num-seqs", type=int, default=8, help="sequences batched in one step at most")
    s.add_argument(
        "--max-model-len", type=int, default=None, help="context length (default: the model's, at most 8192)"
    )
    s.add_argument(
        "--max-body-bytes",
        type=int,
        default=DEFAULT_MAX_BODY_BYTES,
        help=f"refuse larger request bodies with 413 (default {DEFAULT_MAX_BODY_BYTES})",
    )
    s.add_argument(
        "--max-waiting",
        type=int,
        default=DEFAULT_MAX_WAITING,
        help="requests waiting (tokenizing or queued) before new ones get 429 with Retry-After "
        f"(default {DEFAULT_MAX_WAITING})",
    )
    s.add_argument(
        "--allow-origin",
        action="append",
        default=[],
        metavar="ORIGIN",
        help="let browser pages from ORIGIN call the API (CORS; repeatable; default: none)",
    )
    s.add_argument(
        "--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"]
    )


def run(args: argparse.Namespace) -> int:
    import uvicorn  # noqa: F401 - fail here, before loading, if the server's packages are missing

    from engine.serve.bridge import EngineBridge
    from engine.serve.server import bind, check_bind, make_uvicorn, url_of

    if not 0 <= args.port <= 65535:
        print(f"error: --port must be in [0, 65535], got {args.port}", file=sys.stderr)
        return 2
    for flag, value in (("--max-body-bytes", args.max_body_bytes), ("--max-waiting", args.max_waiting)):
        if value < 1:
            print(f"error: {flag} must be >= 1, got {value}", file=sys.stderr)
            return 2
    check_bind(args.host, args.api_key)
    config = dataclasses.replace(
        engine_config_from(args), max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len
    )
    sock = bind(args.host, args.port)
    bridge = EngineBridge(config, model_name=args.served_model_name, max_waiting=args.max_waiting)
    print(f"loading {config.model.source} ...", file=sys.stderr)
    try:
        bridge.start()
    except RuntimeError as exc:
        sock.close()
        print(f"error: {exc}", file=sys.stderr)
        bridge.shutdown()
        return 1
    url = url_of(sock)
    print(
        f"kvscope serving {bridge.model_name} at {url}/v1 (OpenAI-compatible; /metrics, /health, "
        f"/v1/kvscope/events){'; API key required' if args.api_key else ''}. Ctrl-C stops.",
        file=sys.stderr,
    )
    try:
        make_uvicorn(bridge, args.api_key, args.log_level, args.max_body_bytes, tuple(args.allow_origin)).run(
            sockets=[sock]
        )
    finally:
        bridge.shutdown()
    return 0
