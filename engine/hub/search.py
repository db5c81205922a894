"""Searching the Hub for text-generation models: downloads, likes, size, licence, gated, support."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from engine.hub.online import HubError, api, hub_call
from engine.model.support import support_for

if TYPE_CHECKING:
    from huggingface_hub.hf_api import ExpandModelProperty_T, ModelInfo, ModelSort_T

# Bytes per element of the dtypes the Hub reports for safetensors weights.
SAFETENSORS_DTYPE_BYTES = {
    "F64": 8,
    "F32": 4,
    "BF16": 2,
    "F16": 2,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
}
SORTS: tuple[ModelSort_T, ...] = ("downloads", "likes", "trending_score", "last_modified")
_EXPAND: list[ExpandModelProperty_T] = [
    "downloads",
    "likes",
    "gated",
    "private",
    "safetensors",
    "gguf",
    "tags",
    "config",
    "pipeline_tag",
    "library_name",
    "usedStorage",
    "lastModified",
]


@dataclass(frozen=True, slots=True)
class ModelHit:
    repo_id: str
    downloads: int
    likes: int
    params: int | None  # from the safetensors or GGUF metadata the Hub computed
    weights_bytes: int | None  # safetensors weights as stored; else the repo's storage
    license: str | None
    gated: str | None  # None, "auto" or "manual" (the Hub's answer)
    formats: tuple[str, ...]  # "safetensors", "gguf"
    model_type: str | None
    supported: bool | None  # kvscope serves this model_type (None: the Hub gave no config)
    support_note: str  # the refusal reason, or the family name

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _license(info: ModelInfo) -> str | None:
    card = getattr(info, "card_data", None)
    if card is not None and getattr(card, "license", None):
        return str(card.license)
    for tag in info.tags or ():
        if tag.startswith("license:"):
            return str(tag.removeprefix("license:"))
    return None


def _weights(info: ModelInfo) -> tuple[int | None, int | None]:
    st = getattr(info, "safetensors", None)
    if st is not None and st.parameters:
        size = sum(n * SAFETENSORS_DTYPE_BYTES.get(dtype, 2) for dtype, n in st.parameters.items())
        return st.total, size
    gguf = getattr(info, "gguf", None) or {}
    return gguf.get("total"), getattr(info, "used_storage", None)


def _support(config: dict[str, Any] | None) -> tuple[str | None, bool | None, str]:
    if not config or not config.get("model_type"):
        return None, None, "no config on the Hub: decided when its files are listed"

    class _Cfg:  # the Hub's config excerpt (model_type, architectures...) read as attributes
        def __init__(self, raw: dict[str, Any]) -> None:
            self.__dict__.update(raw)

    support = support_for(_Cfg(config))
    return support.model_type, support.ok, support.family or support.refusal or ""


def hit_of(info: ModelInfo) -> ModelHit:
    params, size = _weights(info)
    formats = tuple(
        name
        for name, present in (
            (
                "safetensors",
                getattr(info, "safetensors", None) is not None or "safetensors" in (info.tags or ()),
            ),
            ("gguf", getattr(info, "gguf", None) is not None or "gguf" in (info.tags or ())),
        )
        if present
    )
    gated = info.gated if info.gated else None
    model_type, supported, note = _support(getattr(info, "config", None))
    return ModelHit(
        repo_id=info.id,
        downloads=int(info.downloads or 0),
        likes=int(info.likes or 0),
        params=params,
        weights_bytes=size,
        license=_license(info),
        gated=str(gated) if gated else None,
        formats=formats,
        model_type=model_type,
        supported=supported,
        support_note=note,
    )


def search_models(query: str, limit: int = 20, sort: str = "downloads") -> list[ModelHit]:
    """Text-generation models whose name matches `query`, most downloaded (or liked...) first."""

    sort_key = next((s for s in SORTS if s == sort), None)
    if sort_key is None:
        raise HubError(f"sort must be one of {', '.join(SORTS)}, got {sort!r}")
    if not 1 <= limit <= 1000:
        raise HubError(f"the result limit must be between 1 and 1000, got {limit}")
    with hub_call():
        infos = api().list_models(
            search=query or None, pipeline_tag="text-generation", sort=sort_key, limit=limit, expand=_EXPAND
        )
        return [hit_of(info) for info in infos]
