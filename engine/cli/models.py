"""`python -m engine models search|files|download|list|delete`: the Hugging Face Hub and the models
already on this machine, from the terminal. Every command takes --json; failures print one line
to stderr (offline, no network, gated, not found, disk full) and exit 2."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from engine.hub.cache import delete_cached, list_cached
from engine.hub.download import download_files
from engine.hub.online import HubError
from engine.hub.search import search_models
from engine.model.local_models import gpt4all_models, lmstudio_models, ollama_models

if TYPE_CHECKING:
    from engine.hub.download import DownloadProgress
    from engine.hub.files import RepoFiles, WeightChoice

EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130


def add_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    m = sub.add_parser("models", help="search, list, download and delete models (the Hugging Face Hub)")
    msub = m.add_subparsers(dest="models_command", required=True)

    s = msub.add_parser("search", help="text-generation models on the Hub matching a name")
    s.add_argument("query")
    s.add_argument("--limit", type=int, default=20)
    s.add_argument(
        "--sort", default="downloads", choices=["downloads", "likes", "trending_score", "last_modified"]
    )
    s.add_argument("--json", action="store_true")

    f = msub.add_parser("files", help="a repo's weight files with sizes and whether they fit here")
    f.add_argument("repo")
    f.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    f.add_argument("--context", type=int, default=4096, help="tokens of KV the fit estimate reserves")
    f.add_argument("--budget-gib", type=float, default=None, help="memory to fit in (default: free now)")
    f.add_argument("--json", action="store_true")

    d = msub.add_parser("download", help="download a repo's weights into the Hugging Face cache")
    d.add_argument("repo")
    which = d.add_mutually_exclusive_group()
    which.add_argument(
        "--gguf", metavar="QUANT", help="a GGUF quantization (e.g. Q4_K_M; see `models files`)"
    )
    which.add_argument("--safetensors", action="store_true", help="the safetensors weights (the default)")
    d.add_argument("--json", action="store_true")

    ls = msub.add_parser("list", help="models on this machine: HF cache, LM Studio, GPT4All, Ollama")
    ls.add_argument("--json", action="store_true")

    rm = msub.add_parser("delete", help="remove a repo (all revisions) from the Hugging Face cache")
    rm.add_argument("repo")
    rm.add_argument("--json", action="store_true")


def run(args: argparse.Namespace) -> int:
    try:
        return COMMANDS[args.models_command](args)
    except HubError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT


def _gib(n: int | None) -> str:
    if n is None:
        return "?"
    return f"{n / 2**30:.2f} GiB" if n >= 2**28 else f"{n / 2**20:.1f} MiB"


def _count(n: int) -> str:
    return f"{n / 1e6:.1f}M" if n >= 1e6 else (f"{n / 1e3:.1f}k" if n >= 1e3 else str(n))


def _print_json(value: object) -> None:
    print(json.dumps(value, indent=2, default=str))


# ---- search ---------------------------------------------------------------------------------
def _search(args: argparse.Namespace) -> int:
    hits = search_models(args.query, limit=args.limit, sort=args.sort)
    if args.json:
        _print_json([h.as_dict() for h in hits])
        return 0
    if not hits:
        print(f"No text-generation models match {args.query!r}.")
        return 0
    for h in hits:
        params = f"{h.params / 1e9:.2f}B params" if h.params else "params ?"
        gated = f" · gated ({h.gated})" if h.gated else ""
        served = "" if h.supported is None else (" · kvscope: yes" if h.supported else " · kvscope: refused")
        print(
            f"{h.repo_id}  ↓{_count(h.downloads)} ♥{_count(h.likes)} · {params} · {_gib(h.weights_bytes)} · "
            f"{h.license or 'licence ?'}{gated} · {', '.join(h.formats) or 'no weights listed'}{served}"
        )
    return 0


# ---- files ----------------------------------------------------------------------------------
def _files(args: argparse.Namespace) -> int:
    # torch and the model code: imported by the command that runs, not by `--help`
    from engine.hub.files import repo_files

    files = repo_files(args.repo, dtype=args.dtype, context=args.context, budget_gib=args.budget_gib)
    if args.json:
        _print_json(files.as_dict())
        return 0
    print(f"{files.repo_id} @ {files.revision[:12]}{' · gated' if files.gated else ''}")
    print(
        f"kvscope: {'serves' if files.supported else 'refuses' if files.supported is False else '?'} — {files.support}"
    )
    for c in files.choices:
        est = c.estimate
        if est is None:
            fit = c.estimate_error
        else:
            need = est["weight_bytes"] + est["kv_bytes_for_context"]
            verdict = "fits" if est["fits_with_context"] else "does NOT fit"
            fit = (
                f"{_gib(est['weight_bytes'])} weights ({est['weights_as']}) + {_gib(est['kv_bytes_for_context'])} KV "
                f"for {est['context']:,} tokens = {_gib(need)}: {verdict} in {_gib(est['budget_bytes'])} "
                f"({est['budget_source']})"
            )
        note = f" · {c.note}" if c.note else ""
        print(f"  {c.label:<28} {_gib(c.weights_bytes):>10} on disk · {fit}{note}")
    return 0


# ---- download -------------------------------------------------------------------------------
def _pick(files: RepoFiles, args: argparse.Namespace) -> WeightChoice:
    loadable = [c for c in files.choices if c.loadable]
    if args.gguf:
        wanted = args.gguf.upper()
        match = [c for c in loadable if c.kind == "gguf" and c.label.split(" ")[0] == wanted]
        if not match:
            quants = ", ".join(c.label for c in loadable if c.kind == "gguf") or "none"
            raise HubError(f"{files.repo_id} has no single-file GGUF {wanted}; it has: {quants}.")
        return match[0]
    st = [c for c in loadable if c.kind == "safetensors"]
    if st:
        return st[0]
    quants = ", ".join(c.label for c in loadable if c.kind == "gguf")
    if args.safetensors or not quants:
        raise HubError(f"{files.repo_id} has no safetensors weights{'; GGUF: ' + quants if quants else ''}.")
    raise HubError(f"{files.repo_id} has GGUF files only: choose one with --gguf ({quants}).")


class _Bar:
    """A byte-level bar on stderr, redrawn at most every 1% (or each file)."""

    def __init__(self) -> None:
        self.last = (-1, "")
        self.drawn = False

    def __call__(self, p: DownloadProgress) -> None:
        pct = int(100 * p.done_bytes / p.total_bytes) if p.total_bytes else 100
        if (pct, p.file) == self.last:
            return
        self.last, self.drawn = (pct, p.file), True
        filled = pct * 30 // 100
        rate = f"{p.bytes_per_s / 2**20:.1f} MiB/s" if p.bytes_per_s else ""
        print(
            f"\r[{'#' * filled}{'.' * (30 - filled)}] {pct:3d}% {_gib(p.done_bytes)}/{_gib(p.total_bytes)} "
            f"{rate} {p.file[-40:]:<40}",
            end="",
            file=sys.stderr,
            flush=True,
        )


def _download(args: argparse.Namespace) -> int:
    # torch and the model code: imported by the command that runs, not by `--help`
    from engine.hub.files import repo_files

    choice = _pick(repo_files(args.repo), args)
    bar = _Bar()
    try:
        result = download_files(args.repo, choice.files, progress=bar)
    except KeyboardInterrupt:
        print(
            "\ninterrupted: what arrived is kept in the Hugging Face cache; run the same command to resume",
            file=sys.stderr,
        )
        return EXIT_INTERRUPTED
    finally:
        if bar.drawn:
            print(file=sys.stderr)  # end the bar's line
    report: dict[str, Any] = {
        "repo_id": result.repo_id,
        "revision": result.revision,
        "choice": choice.label,
        "files": list(result.files),
        "folder": str(result.folder),
        "total_bytes": result.total_bytes,
        "downloaded_bytes": result.downloaded_bytes,
        "resumed_bytes": result.resumed_bytes,
        "source": result.source,
    }
    if args.json:
        _print_json(report)
    else:
        resumed = f", {_gib(result.resumed_bytes)} resumed" if result.resumed_bytes else ""
        print(f"{result.repo_id} ({choice.label}): {_gib(result.downloaded_bytes)} downloaded{resumed}.")
        print(f"load it with: kvscope --model {result.source}")
    return 0


# ---- list / delete --------------------------------------------------------------------------
def _list(args: argparse.Namespace) -> int:
    cached = list_cached()
    others = lmstudio_models() + gpt4all_models() + ollama_models()
    if args.json:
        _print_json(
            {
                "hf_cache": [c.as_dict() for c in cached],
                "other": [
                    {"source": m.source, "name": m.name, "where": m.where, "size_bytes": m.size_bytes}
                    for m in others
                ],
            }
        )
        return 0
    if not cached and not others:
        print("No models on this machine yet: `models search NAME`, then `models download REPO`.")
    for c in cached:
        partial = f" + {_gib(c.partial_bytes)} partial (resumable)" if c.partial_bytes else ""
        print(
            f"HF cache   {c.repo_id:<48} {_gib(c.size_bytes):>10}{partial} · {', '.join(c.weights) or 'no weights'}"
        )
    for m in others:
        print(f"{m.where:<10} {m.name:<48} {_gib(m.size_bytes):>10} · {m.source}")
    return 0


def _delete(args: argparse.Namespace) -> int:
    freed = delete_cached(args.repo)
    if args.json:
        _print_json({"repo_id": args.repo, "freed_bytes": freed})
    else:
        print(f"Deleted {args.repo} from the Hugging Face cache: {_gib(freed)} freed.")
    return 0


COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "search": _search,
    "files": _files,
    "download": _download,
    "list": _list,
    "delete": _delete,
}
