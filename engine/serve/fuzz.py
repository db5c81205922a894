"""Schemathesis against the server's own OpenAPI schema: no 5xx, every response one the schema
names, with the content type and the body it gives.

    python -m engine.serve.fuzz [--duration 600] [--seed N] [--json]    (./dev fuzz)

A server is started in this process on a tiny random Llama (2 layers, hidden 64) speaking the
packaged model's real tokenizer, with a short context so every generation ends in milliseconds
and the time goes to many requests, not long ones; the request checks, the tokenizer, the
scheduler, streaming and the errors are all the real ones. Schemathesis (its CLI, in a process
of its own) then generates requests from /openapi.json until the time is spent: examples, the
coverage phase (boundary values, each parameter missing or of the wrong type) and fuzzing, valid
and invalid bodies. /v1/kvscope/events is left out: it is an endless stream by design.

The summary: operations tested, test cases, checks run, failures (0 is the goal), from
Schemathesis's own JSON report. The test suite runs the same for 60 s (tests/serve/test_fuzz.py).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.model.loaded import LoadedModel

CHECKS = (
    "not_a_server_error",
    "status_code_conformance",
    "content_type_conformance",
    "response_headers_conformance",
    "response_schema_conformance",
)
EXCLUDED_PATHS = ("/v1/kvscope/events",)
FUZZ_CONTEXT = 48  # tokens: every generation is short
DEFAULT_DURATION_S = 600


@dataclass(frozen=True, slots=True)
class FuzzSummary:
    seconds: int
    operations: int  # operations tested (of the schema's, less the events stream)
    test_cases: int  # requests generated and sent, each response run through every check
    checks: tuple[str, ...]
    failures: int  # unique failures (a check that failed, or a request that errored)
    failure_lines: tuple[str, ...]
    exit_code: int

    def line(self) -> str:
        return (
            f"fuzz: {self.operations} operations, {self.test_cases} test cases x {len(self.checks)} checks "
            f"({', '.join(self.checks)}), {self.failures} failures in {self.seconds} s"
        )


def tiny_model() -> LoadedModel:
    """A tiny random Llama with the packaged model's tokenizer (built in a second)."""
    # torch, transformers and the model's loading: only when a fuzz run builds its model
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from engine.model.default_model import load_default_tokenizer
    from engine.model.loaded import LoadedModel

    tokenizer = load_default_tokenizer()
    torch.manual_seed(0)
    fields: dict[str, Any] = dict(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
        tie_word_embeddings=True, attn_implementation="sdpa",
    )  # fmt: skip
    config = LlamaConfig(**fields)
    model = LlamaForCausalLM(config).eval()
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return LoadedModel.from_model(model, tokenizer, name="tiny-random-llama", source="fuzz")


def run_schemathesis(
    url: str, seconds: int, seed: int | None = None, headers: dict[str, str] | None = None
) -> FuzzSummary:
    """The Schemathesis CLI against `url` for `seconds`; its JSON report summarised."""
    with tempfile.TemporaryDirectory(prefix="kvscope-fuzz-") as tmp:
        report = Path(tmp) / "report.json"
        cmd = [
            sys.executable, "-m", "schemathesis.cli", "run", f"{url}/openapi.json",
            "--checks", ",".join(CHECKS), "--max-time", str(seconds), "--workers", "1",
            "--request-timeout", "30", "--report", "json", "--report-json-path", str(report),
            "--suppress-health-check", "all", "--output-truncate", "true",
        ]  # fmt: skip
        for path in EXCLUDED_PATHS:
            cmd += ["--exclude-path", path]
        for name, value in (headers or {}).items():
            cmd += ["-H", f"{name}: {value}"]
        if seed is not None:
            cmd += ["--seed", str(seed)]
        # in the temporary folder: Schemathesis keeps its cache (.schemathesis/) in its working one
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 300, cwd=tmp)
        raw = json.loads(report.read_text()) if report.exists() else {}
    return _summary(raw, seconds, done.returncode, done.stdout + done.stderr)


def _summary(raw: dict[str, Any], seconds: int, exit_code: int, output: str) -> FuzzSummary:
    """Schemathesis's JSON report (`operations.tested`, `test_cases.generated` and
    `.unique_failures`, `failures`, `errors`) as the summary; its output when it wrote none."""
    if not raw:
        return FuzzSummary(seconds, 0, 0, CHECKS, 1, (output.strip()[-2000:],), exit_code or 1)
    cases = raw.get("test_cases", {})
    problems = [*raw.get("failures", []), *raw.get("errors", [])]
    lines = tuple(json.dumps(p)[:400] for p in problems)
    failures = int(cases.get("unique_failures", 0)) + len(raw.get("errors", []))
    return FuzzSummary(
        seconds,
        int(raw.get("operations", {}).get("tested", 0)),
        int(cases.get("generated", 0)),
        CHECKS,
        failures,
        lines,
        exit_code,
    )


def fuzz(seconds: int, seed: int | None = None) -> FuzzSummary:
    # the engine and its server: only when this process serves (the suite brings its own)
    from engine.config import EngineConfig
    from engine.serve.server import BackgroundServer

    config = EngineConfig(block_size=4, num_blocks=256, max_model_len=FUZZ_CONTEXT, max_num_seqs=8)
    with BackgroundServer(config, loaded=tiny_model()) as server:
        return run_schemathesis(server.url, seconds, seed)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine.serve.fuzz", description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=int, default=DEFAULT_DURATION_S, help="seconds of fuzzing")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    summary = fuzz(args.duration, args.seed)
    print(json.dumps(asdict(summary), indent=2) if args.json else summary.line())
    for line in summary.failure_lines[:20]:
        print(f"  {line}", file=sys.stderr)
    return 0 if summary.failures == 0 and summary.exit_code == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
