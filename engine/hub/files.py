"""A Hub repo's weight files, grouped the way kvscope loads them, with the fit estimate before any
weight downloads.

Choices: the safetensors weights (all shards together; the repo's config.json and tokenizer come
with them) and each GGUF quantization (Q4_K_M, Q8_0, ... read from the file name; a GGUF split
into parts is listed, but kvscope loads single files only). The estimate is inspect-model's
(engine.model.inspect.memory_estimate): the weights as a load holds them (a GGUF's per tensor
type from its header: engine.model.gguf_plan, kept at its bits on the CPU or dequantized to the
chosen dtype) plus KV for the chosen context against the memory free now, and the process beside
the measured runtime. The shapes come from config.json (fetched alone, a few KB) or, for a GGUF,
from the file's header read over range requests.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any

from engine.config import AUTO, DTYPES
from engine.errors import ModelLoadError
from engine.hub.cache import cached_source
from engine.hub.gguf_header import config_from_header, header_plan, read_header, remote_fetcher
from engine.hub.online import HubError, api, describe, endpoint, hub_call, token
from engine.measure.device import resolve_device
from engine.model.configs import read_folder_config
from engine.model.inspect import budget_bytes_for, keeps_own_bits, memory_estimate
from engine.model.runtime_memory import runtime_estimate
from engine.model.sources import ModelSource
from engine.model.support import support_for
from engine.shapes import ModelShapes

if TYPE_CHECKING:
    from huggingface_hub.hf_api import ModelInfo
    from transformers import PreTrainedConfig

    from engine.hub.gguf_header import GGUFHeader
    from engine.model.gguf_plan import GGUFPlan

SAFETENSORS = "safetensors"
GGUF = "gguf"
# Files a safetensors download brings besides the weights: config, tokenizer, chat template.
COMPANION_SUFFIXES = (".json", ".model", ".txt", ".jinja", ".tiktoken", ".py")
_QUANT = re.compile(r"(?i)(?<![A-Za-z0-9])(I?Q\d(?:_[A-Z0-9]+)*|BF16|FP16|F16|FP32|F32|MXFP4)(?![A-Za-z0-9])")
_SPLIT = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$", re.IGNORECASE)


@dataclass(frozen=True, slots=True)
class WeightChoice:
    kind: str  # SAFETENSORS or GGUF
    label: str  # "safetensors (3 shards)", "Q4_K_M"
    files: tuple[str, ...]  # what to download (weights and companions)
    weights_bytes: int  # the weight files on disk
    download_bytes: int  # everything `files` takes
    loadable: bool  # kvscope can load it once downloaded
    note: str = ""  # why not, or what to know
    estimate: dict[str, Any] | None = None  # inspect-model's figures, None when the shapes are unknown
    estimate_error: str = ""
    # What to load when every file of the choice is already in the local cache at this revision
    # (a repo id, or a GGUF's path): it can be used at once, without downloading it again.
    cached_source: str | None = None


@dataclass(frozen=True, slots=True)
class RepoFiles:
    repo_id: str
    revision: str
    gated: str | None
    choices: tuple[WeightChoice, ...]
    support: str  # the family served, or why not
    supported: bool | None
    other_files: tuple[str, ...] = field(default=())

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def quant_of(filename: str) -> str:
    """The quantization a GGUF file name announces ('Q4_K_M', 'IQ2_XS', 'F16', ...), else 'GGUF'."""
    stem = PurePosixPath(filename).name
    found = _QUANT.findall(_SPLIT.sub(".gguf", stem))
    return found[-1].upper() if found else "GGUF"


def _sizes(info: ModelInfo) -> dict[str, int]:
    return {s.rfilename: int(s.size or (s.lfs.size if s.lfs else 0) or 0) for s in info.siblings or ()}


def group_weights(sizes: dict[str, int]) -> list[tuple[str, str, tuple[str, ...], int, bool, str]]:
    """(kind, label, weight files, weight bytes, loadable, note) for each way to load the repo."""
    out = []
    shards = sorted(f for f in sizes if f.endswith(".safetensors") and "/" not in f)
    if shards:
        label = SAFETENSORS if len(shards) == 1 else f"{SAFETENSORS} ({len(shards)} shards)"
        out.append((SAFETENSORS, label, tuple(shards), sum(sizes[f] for f in shards), True, ""))
    quants: dict[str, list[str]] = {}
    for f in sorted(f for f in sizes if f.lower().endswith(".gguf")):
        quants.setdefault(quant_of(f) + ("" if "/" not in f else f" ({PurePosixPath(f).parent})"), []).append(
            f
        )
    for quant, files in quants.items():
        split = len(files) > 1 or bool(_SPLIT.search(files[0]))
        if len(files) > 1 and not split:  # several single files of one quantization: one each
            for f in files:
                out.append((GGUF, f"{quant} · {PurePosixPath(f).name}", (f,), sizes[f], True, ""))
            continue
        note = f"split into {len(files)} parts: kvscope loads single-file GGUFs" if split else ""
        out.append((GGUF, quant, tuple(files), sum(sizes[f] for f in files), not split, note))
    return out


def _config_shapes(repo_id: str, revision: str) -> PreTrainedConfig:
    """The repo's config.json (downloaded alone into the HF cache) as a transformers config."""
    # huggingface_hub reads its HF_* settings when first imported: after hub.online set them
    from huggingface_hub import hf_hub_download

    from engine.hub.download import private_repo_dir

    private_repo_dir(repo_id)  # before huggingface_hub creates it with the default permissions
    path = hf_hub_download(repo_id, "config.json", revision=revision, endpoint=endpoint(), token=token())

    return read_folder_config(Path(path).parent)


def _gguf_config(repo_id: str, revision: str, filename: str) -> tuple[PreTrainedConfig, GGUFHeader]:
    """The config a GGUF's header describes, and the header (its tensors' types and shapes)."""

    header = read_header(remote_fetcher(repo_id, filename, revision))
    return config_from_header(header, PurePosixPath(filename).name), header


def _estimate(
    config: PreTrainedConfig,
    dtype: str,
    context: int | None,
    budget: tuple[int, str],
    plan: GGUFPlan | None,
) -> dict[str, Any]:

    estimate = memory_estimate(ModelShapes.from_config(config), dtype, context, budget, plan)
    runtime = runtime_estimate(resolve_device("auto").type)
    estimate.update(runtime.as_dict(estimate["weight_bytes"], estimate["kv_bytes_for_context"]))
    return estimate


def repo_files(
    repo_id: str, dtype: str = "bfloat16", context: int | None = 4096, budget_gib: float | None = None
) -> RepoFiles:
    """The repo's ways to load, each with its download size and the fit for this machine."""

    if dtype not in DTYPES:
        raise HubError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if context is not None and context < 1:
        raise HubError(f"context must be at least 1 token, got {context}")
    budget = budget_bytes_for(budget_gib)
    with hub_call(repo_id):
        info = api().model_info(repo_id, files_metadata=True)
        revision = info.sha
        if revision is None:
            raise HubError(f"The Hub did not say which commit of {repo_id} it listed; try again.")
        sizes = _sizes(info)
        groups = group_weights(sizes)
        companions = tuple(
            f
            for f in sorted(sizes)
            if "/" not in f and f.endswith(COMPANION_SUFFIXES) and f != ".gitattributes"
        )
        config: PreTrainedConfig | None = None
        config_error = ""
        if "config.json" in sizes:
            try:
                config = _config_shapes(repo_id, revision)
            except ModelLoadError as exc:
                config_error = str(exc)
            except Exception as exc:  # noqa: BLE001 - a gated repo lists its files but not their contents
                config_error = describe(exc, repo_id)
        choices: list[WeightChoice] = []
        configs = [config] if config is not None else []
        for kind, label, files, weight_bytes, loadable, note in groups:
            cfg, error = config, config_error
            header: GGUFHeader | None = None
            if kind == GGUF and loadable:
                try:
                    (cfg, header), error = _gguf_config(repo_id, revision, files[0]), ""
                    configs.append(cfg)
                except (ModelLoadError, ValueError) as exc:
                    cfg, error = None, str(exc)
            estimate: dict[str, Any] | None = None
            if cfg is not None:
                try:
                    # loaded as a GGUF file is: each tensor as the loader holds it (gguf_plan)
                    local = PurePosixPath(files[0])
                    gguf = ModelSource("gguf", Path(local.name), local.name, Path(local.name))
                    plan = header_plan(header, dtype, keeps_own_bits(AUTO, gguf)) if header else None
                    estimate = _estimate(cfg, dtype, context, budget, plan)
                except Exception as exc:  # noqa: BLE001 - per-layer shapes: no single figure
                    error = f"no estimate: {type(exc).__name__}"
            elif not error:
                error = "no config.json in the repo: the shapes (and so the fit) are unknown"
            download = files + (companions if kind == SAFETENSORS else ())
            on_disk = cached_source(repo_id, revision, download) if loadable else None
            choices.append(
                WeightChoice(
                    kind,
                    label,
                    download,
                    weight_bytes,
                    sum(sizes.get(f, 0) for f in download),
                    loadable,
                    note,
                    estimate,
                    error,
                    on_disk,
                )
            )
    if not choices:
        raise HubError(
            f"{repo_id} has no weights kvscope can load (no *.safetensors or *.gguf files"
            f"{'; it has only ' + _formats(sizes) if sizes else ''})."
        )
    support = support_for(configs[0]) if configs else None
    return RepoFiles(
        repo_id=repo_id,
        revision=revision,
        gated=str(info.gated) if info.gated else None,
        choices=tuple(choices),
        support=(support.family or support.refusal or "") if support else config_error or "unknown",
        supported=support.ok if support else None,
        other_files=tuple(f for f in sorted(sizes) if not any(f in c.files for c in choices)),
    )


def _formats(sizes: dict[str, int]) -> str:
    suffixes = sorted({PurePosixPath(f).suffix for f in sizes if PurePosixPath(f).suffix} - {".json", ".md"})
    return ", ".join(suffixes) if suffixes else "no weight files"


def dump(files: RepoFiles) -> str:
    return json.dumps(files.as_dict(), indent=2)
