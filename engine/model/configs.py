"""Reading a model's configuration without its weights (config.json or GGUF metadata), and
refusing what is not a text-generating model transformers can load."""

from __future__ import annotations

import functools
import json
import struct
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from engine.errors import ModelLoadError, first_line
from engine.model.gguf_header import (
    GGUFHeader,
    GGUFHeaderError,
    TensorInfo,
    kept,
    local_header,
    skipped_count,
)

if TYPE_CHECKING:
    from gguf import GGUFReader
    from transformers import PreTrainedConfig

    from engine.model.sources import ModelSource


# ---- reading configs without weights ---------------------------------------------------------
def causal_lm_problem(raw: dict[str, Any]) -> str | None:
    """Why a config (as a plain dict) is not a text-generating model transformers can load,
    or None when it is one. Cheap: no config class is built, no weights are read."""
    # transformers takes seconds to import: only once a model is read
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_MASKED_LM_MAPPING_NAMES,
    )

    model_type = raw.get("model_type")
    if not model_type:
        return "its config.json does not say which model type it is (no 'model_type')"
    if model_type not in CONFIG_MAPPING_NAMES:
        if raw.get("auto_map"):
            return f"its model type '{model_type}' needs custom Python code from the model repo, which kvscope never runs"
        return f"its model type '{model_type}' is not one this version of transformers ({_transformers_version()}) knows"
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return f"a '{model_type}' model does not generate text (it is not a causal language model)"
    causal_classes = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    archs = raw.get("architectures") or []
    if archs and not any(a in causal_classes or a.endswith(("ForCausalLM", "LMHeadModel")) for a in archs):
        return f"its architecture ({', '.join(archs)}) encodes or classifies text rather than generating it"
    if not archs and model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES and not raw.get("is_decoder"):
        return f"a '{model_type}' model is an encoder (masked language model), not a text generator"
    return None


def _transformers_version() -> str:
    # transformers takes seconds to import: only once a model is read
    import transformers

    return transformers.__version__


def read_folder_config(folder: Path) -> PreTrainedConfig:
    """The transformers config of an HF model folder, checked to be a loadable causal LM."""
    # transformers takes seconds to import: only once a model is read
    from transformers import AutoConfig

    config_path = folder / "config.json"
    if not config_path.is_file():
        raise ModelLoadError(
            f"{folder} is not a Hugging Face model folder: it has no config.json. Choose the folder that "
            "holds config.json and the weights (model.safetensors), or a .gguf file."
        )
    try:
        raw = json.loads(config_path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelLoadError(
            f"{config_path} is not valid JSON ({exc}). The file is corrupt or truncated; "
            "re-download or re-export the model."
        ) from None
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{config_path} does not hold a model configuration (a JSON object).")
    problem = causal_lm_problem(raw)
    if problem:
        raise ModelLoadError(f"{folder} cannot be loaded as a chat model: {problem}.")
    try:
        config: PreTrainedConfig = AutoConfig.from_pretrained(folder, local_files_only=True)
        return config
    except (ValueError, KeyError, TypeError, OSError) as exc:
        raise ModelLoadError(
            f"The configuration in {config_path} could not be read: {first_line(exc)}."
        ) from None


# GGUF architecture names that differ from transformers' model_type (as transformers renames them).
_GGUF_ARCH_RENAMES = {
    "qwen2moe": "qwen2_moe",
    "qwen3moe": "qwen3_moe",
    "gpt-oss": "gpt_oss",
    "minimax-m2": "minimax_m2",
}

# Model types whose GGUF holds only the text backbone of a multimodal model.
_GGUF_TEXT_MODEL_TYPES = {"gemma3": "gemma3_text", "gemma4": "gemma4_text"}


def open_gguf(path: Path) -> GGUFReader:
    """A gguf.GGUFReader over `path`, with header and tensor extents checked: a truncated or
    garbage file becomes a ModelLoadError, not a numpy error half-way through loading.

    Parsing the header takes seconds (the tokenizer's vocabulary and merges are tens of thousands
    of fields), and a load reads it for the config, the fit check and the tensors: the last reader
    is kept for the same file (same size and mtime)."""
    key = (str(Path(path).resolve()), *_stamp(path))
    cached = _READER_CACHE.get("reader")
    if cached is not None and cached[0] == key:
        return cached[1]
    reader = _open_gguf(path)
    _READER_CACHE["reader"] = (key, reader)
    return reader


_READER_CACHE: dict[str, tuple[tuple[str, int, int], GGUFReader]] = {}


def forget_gguf_header() -> None:
    """Drop the kept gguf-py reader (its parsed header: a vocabulary of tens of thousands of tokens
    as Python objects, ~90 MiB for a 1.7B file's), once a load has no more use for it."""
    _READER_CACHE.clear()


def _stamp(path: Path) -> tuple[int, int]:
    try:
        st = Path(path).stat()
    except OSError:
        return (-1, -1)
    return st.st_size, st.st_mtime_ns


def _open_gguf(path: Path) -> GGUFReader:
    broken = (
        f"{path} is not a readable GGUF file: it is corrupt or truncated (an interrupted download?). "
        "Re-download it, or choose another model."
    )
    try:
        reader = _fast_reader()(str(path), mode="c")
    except (ValueError, KeyError, IndexError, OSError, struct.error, UnicodeDecodeError):
        raise ModelLoadError(broken) from None
    size = path.stat().st_size
    if any(t.data_offset + t.n_bytes > size for t in reader.tensors) or not reader.tensors:
        raise ModelLoadError(broken)
    return reader


@functools.cache
def _fast_reader() -> type[GGUFReader]:
    """gguf's GGUFReader parsing through a plain ndarray view of the file's mapping: its tens of
    thousands of header slices then skip numpy.memmap's per-slice Python hooks (measured on a
    1.7B file's header: 0.59 s against 1.82 s of CPU). Opened copy-on-write ("c"), so the tensors'
    views are writable for torch while nothing ever writes the file; the views keep the mapping
    alive through their base."""
    # gguf (and numpy with it): only once a GGUF file is read
    import numpy as np
    from gguf import GGUFReader

    class FastGGUFReader(GGUFReader):
        @property  # type: ignore[override]
        def data(self) -> np.ndarray:
            return self._plain

        @data.setter
        def data(self, value: np.ndarray) -> None:
            self._plain = value.view(np.ndarray) if isinstance(value, np.memmap) else value

    return FastGGUFReader


def _gguf_value(reader: GGUFReader, key: str) -> Any:
    field = reader.fields.get(key)
    return None if field is None else field.contents()


def read_gguf_config(path: Path) -> PreTrainedConfig:
    """A transformers config built from a GGUF file's metadata only (its tensors stay on disk),
    with the key mapping transformers itself uses when it loads the file."""
    return config_from_header(gguf_header(path), path.name)


def gguf_header(path: Path) -> GGUFHeader:
    """A local GGUF file's header read lean (the token list counted, not kept), with its tensors'
    extents checked against the file: a truncated or garbage file is a ModelLoadError here, not a
    numpy error half-way through loading. The last one read is kept (same size and mtime)."""
    key = (str(Path(path).resolve()), *_stamp(path))
    cached = _HEADER_CACHE.get("header")
    if cached is not None and cached[0] == key:
        return cached[1]
    broken = (
        f"{path} is not a readable GGUF file: it is corrupt or truncated (an interrupted download?). "
        "Re-download it, or choose another model."
    )
    try:
        header = local_header(Path(path))
    except (GGUFHeaderError, OSError, struct.error, UnicodeDecodeError):
        raise ModelLoadError(broken) from None
    size = Path(path).stat().st_size
    if not header.tensors or any(
        header.data_start + t.offset + _tensor_bytes(t) > size for t in header.tensors
    ):
        raise ModelLoadError(broken)
    _HEADER_CACHE["header"] = (key, header)
    return header


_HEADER_CACHE: dict[str, tuple[tuple[str, int, int], GGUFHeader]] = {}


def _tensor_bytes(info: TensorInfo) -> int:
    """A tensor's bytes in the file (an unknown type: 0, refused later by the loader by name)."""
    # gguf's type table: only once a GGUF file is read
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType(info.ggml_type)]
    except (ValueError, KeyError):
        return 0
    count = 1
    for dim in info.dims:
        count *= dim
    return count // block * size


def config_from_header(header: GGUFHeader, name: str) -> PreTrainedConfig:
    """The transformers config of a GGUF header (a ModelLoadError when it describes none)."""
    fields = header.fields
    tokens = fields.get("tokenizer.ggml.tokens")
    vocab = skipped_count(tokens)
    if vocab is None and tokens:
        vocab = len(tokens)
    return gguf_metadata_config(lambda key: kept(fields.get(key)), set(header.tensor_names), vocab, name)


def gguf_metadata_config(
    value_of: Callable[[str], Any], tensor_names: set[str], vocab_len: int | None, name: str
) -> PreTrainedConfig:
    """The config transformers would build from GGUF metadata: `value_of(key)` reads a metadata
    value (None when absent), `tensor_names` are the file's tensors (an untied head has
    'output.weight'), `vocab_len` is the tokenizer's token count. Shared by local files and the
    Hub's remote headers (engine/hub/gguf_header.py)."""
    # transformers takes seconds to import: only once a model is read
    from transformers import CONFIG_MAPPING
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    arch = value_of("general.architecture")
    model_type = _GGUF_ARCH_RENAMES.get(arch, arch)
    if arch not in GGUF_CONFIG_MAPPING and model_type not in GGUF_CONFIG_MAPPING:
        raise ModelLoadError(
            f"{name} holds a '{arch}' model, an architecture transformers {_transformers_version()} "
            "cannot load from GGUF. Choose a GGUF of a supported family (Llama, Mistral, Qwen, Gemma, Phi-3, ...) "
            "or the model's Hugging Face folder."
        )
    # GGUF key -> config key, None or -1 for keys transformers drops (its table mixes value types)
    mapping = cast(
        "dict[str, str | int | None]", GGUF_CONFIG_MAPPING.get(model_type) or GGUF_CONFIG_MAPPING[arch]
    )
    kwargs: dict[str, Any] = {}
    for gguf_key, config_key in mapping.items():
        value = value_of(f"{arch}.{gguf_key}")
        if value is None or not isinstance(config_key, str):  # None or -1: a key transformers drops
            continue
        # Per-layer lists (hybrid models) size the cache by their largest entry.
        kwargs[config_key] = max(value) if isinstance(value, list) else value
    key_length = value_of(f"{arch}.attention.key_length")
    if key_length:  # the true head size; the rope dimension can cover only part of a head
        kwargs["head_dim"] = key_length
    if "vocab_size" not in kwargs and vocab_len is not None:
        kwargs["vocab_size"] = vocab_len
    kwargs["tie_word_embeddings"] = "output.weight" not in tensor_names
    model_type = _GGUF_TEXT_MODEL_TYPES.get(model_type, model_type)
    problem = causal_lm_problem({"model_type": model_type})
    if problem:
        raise ModelLoadError(f"{name} cannot be loaded as a chat model: {problem}.")
    try:
        config = CONFIG_MAPPING[model_type](**kwargs)
    except (ValueError, TypeError) as exc:
        raise ModelLoadError(
            f"The metadata of {name} does not describe a valid model: {first_line(exc)}."
        ) from None
    config.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]]
    return config


def read_config(src: ModelSource) -> PreTrainedConfig:
    """The config of any source, reading metadata only (never the weights)."""
    return read_gguf_config(src.path) if src.is_gguf else read_folder_config(src.path)
