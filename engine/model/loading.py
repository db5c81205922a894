"""Loading a model: checks first (path, config, device, dtype, memory), then weights, tokenizer
and quantization, into a LoadedModel."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from engine.config import AUTO, ModelSpec
from engine.errors import ModelLoadError, first_line
from engine.kernels.policy import KernelPolicy
from engine.measure.device import TORCH_DTYPES, check_dtype_on_device, resolve_device
from engine.model.checks import check_fits
from engine.model.configs import forget_gguf_header, read_config, read_gguf_config
from engine.model.default_model import default_model_dir, load_default_tokenizer
from engine.model.gguf_native import NATIVE, load_native
from engine.model.gguf_tokenizer import load_gguf_tokenizer
from engine.model.layer_attention import AttentionProbeError
from engine.model.loaded import LoadedModel
from engine.model.runtime_memory import give_back_freed_memory
from engine.model.sources import ModelSource, resolve_source
from engine.model.support import check_support
from engine.quant.schemes import QuantizationError, check_scheme, get_scheme, quantize_model

if TYPE_CHECKING:
    from pathlib import Path

    from transformers import PreTrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

Progress = Callable[[str, float], None]

# ---- loading ---------------------------------------------------------------------------------
WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.pt", "*.pth")


def _load_weights(src: ModelSource, torch_dtype: torch.dtype) -> PreTrainedModel:
    # transformers takes seconds to import: only once a model is read
    from transformers import AutoModelForCausalLM

    kwargs: dict[str, Any] = dict(dtype=torch_dtype, local_files_only=True)
    where: Path
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
    model: PreTrainedModel
    try:
        try:
            model = AutoModelForCausalLM.from_pretrained(where, attn_implementation="sdpa", **kwargs)
        except ValueError as exc:
            if "scaled_dot_product_attention" not in str(exc) and "sdpa" not in str(exc):
                raise
            # An architecture without an SDPA kernel still works with the reference attention.
            model = AutoModelForCausalLM.from_pretrained(where, attn_implementation="eager", **kwargs)
        return model
    except (torch.OutOfMemoryError, MemoryError):
        raise ModelLoadError(
            f"Ran out of memory while loading {src.name}. Choose a smaller model or dtype, or free memory."
        ) from None
    except ModelLoadError:
        raise
    except Exception as exc:  # noqa: BLE001 - safetensors, numpy, struct, OSError... all mean unreadable
        raise ModelLoadError(
            f"The weights of {src.name} could not be read from {src.path} ({type(exc).__name__}: "
            f"{first_line(exc)}). The files may be corrupt or truncated; re-download or re-export them."
        ) from None


def _load_tokenizer(src: ModelSource) -> PreTrainedTokenizerBase:
    # transformers takes seconds to import: only once a model is read
    from transformers import AutoTokenizer

    tokenizer: PreTrainedTokenizerBase
    try:
        if src.is_gguf:
            tokenizer = load_gguf_tokenizer(src.path)
        else:
            tokenizer = AutoTokenizer.from_pretrained(src.path, local_files_only=True)
        return tokenizer
    except Exception as exc:  # noqa: BLE001 - any tokenizer failure means the model cannot chat
        raise ModelLoadError(
            f"The tokenizer of {src.name} could not be loaded from {src.path} ({first_line(exc)}). "
            "A model folder needs its tokenizer files (tokenizer.json or tokenizer.model)."
        ) from None


CPU = torch.device("cpu")


def resolve_scheme(quantization: str, src: ModelSource, device: torch.device = CPU) -> str:
    """'auto' is 'native' for a GGUF source (its own blocks kept) and 'none' otherwise (and on
    a GPU, where native's CPU kernels do not run)."""
    if quantization == AUTO:
        return NATIVE if src.gguf is not None and device.type == "cpu" else "none"
    if quantization == NATIVE and src.gguf is None:
        raise ModelLoadError(
            f"'native' keeps a GGUF file's own quantized blocks, but {src.name} is not a GGUF file. "
            "Choose 'none' or another quantization scheme."
        )
    return quantization


def load_transformers_model(source: str, dtype: str = "float32") -> PreTrainedModel:
    """The source's weights in a plain transformers model, as transformers alone would serve them
    (no kernel layers, no fused projections): the baseline `engine bench` runs generate() on."""
    src = resolve_source(source)
    if src.kind == "default" and src.is_gguf:
        src = ModelSource("default", default_model_dir(), src.name, src.gguf)
    model = _load_weights(src, TORCH_DTYPES[dtype])
    model.eval()
    return model


def load_model(
    spec: ModelSpec,
    progress: Progress | None = None,
    *,
    available_bytes: int | None = None,
) -> LoadedModel:
    """Load `spec` into a LoadedModel in eval mode. Everything that can be checked without the
    weights (path, config, architecture, device, dtype, memory) is checked first, so a refusal is
    quick. `available_bytes` overrides the free-memory figure (see engine.measure.memory)."""
    report = progress or (lambda stage, fraction: None)
    start = time.perf_counter()
    report("checking the model", 0.0)
    device = resolve_device(spec.device)
    check_dtype_on_device(spec.dtype, device)
    if spec.quantization != AUTO:
        get_scheme(spec.quantization)  # an unknown name is refused before anything is read
    src = resolve_source(spec.source)
    scheme = resolve_scheme(spec.quantization, src, device)
    check_scheme(scheme, device)
    if scheme == NATIVE:
        assert src.gguf is not None, "resolve_scheme gives 'native' to GGUF sources only"
        config = read_gguf_config(src.gguf)
        check_support(config, src.name)
        return _load_native(spec, src, config, report, start, available_bytes)
    config = read_config(src)
    check_support(config, src.name)  # every family either has parity tests or is refused here
    check_fits(config, spec.dtype, device, src.name, available_bytes)
    if src.kind == "default" and src.is_gguf:
        src = ModelSource("default", default_model_dir(report), src.name, src.gguf)
    report(f"loading weights ({spec.dtype})", 0.4)
    model = _load_weights(src, TORCH_DTYPES[spec.dtype])
    if device.type != "cpu":
        report(f"moving weights to {device}", 0.75)
        try:
            # transformers wraps .to with functools.wraps, whose type keeps Module.to's unbound
            # signature (self first), so a bound call looks wrong to mypy
            model = model.to(device)  # type: ignore[arg-type]
        except torch.OutOfMemoryError:
            raise ModelLoadError(f"{src.name} does not fit in the memory of {device}.") from None
    report("loading tokenizer", 0.8)
    tokenizer = _load_tokenizer(src)
    if scheme != "none":
        report(f"quantizing weights ({scheme})", 0.85)
        model = _quantize(model.eval(), scheme, tokenizer, src.name)
    loaded = _served(
        lambda: LoadedModel.from_model(
            model.eval(),
            tokenizer,
            name=src.name,
            source=spec.source,
            load_seconds=time.perf_counter() - start,
        ),
        src.name,
    )
    give_back_freed_memory()  # the load's short-lived copies, for every caller (CLI, bench, app)
    report("ready", 1.0)
    return loaded


def _load_native(
    spec: ModelSpec,
    original: ModelSource,
    config: PreTrainedConfig,
    report: Progress,
    start: float,
    available_bytes: int | None,
) -> LoadedModel:
    """The GGUF's own blocks, read straight from the file (engine/model/gguf_native.py)."""

    gguf = original.gguf
    assert gguf is not None
    # the packed weights take about their file's size; the dense tensors are small
    check_fits(
        config, "int8", torch.device("cpu"), original.name, available_bytes, nbytes=gguf.stat().st_size
    )
    # The tokenizer first, its temporaries given back before the weights' pages come in: after
    # them, a first load's tokenizer conversion (nothing cached yet) rode on top of the mapped
    # weights and set the process's peak (1.7B Q4_K_M, engine bench, cold caches: 1535 -> 1489
    # MiB, against the file's 1007 MiB x 1.1 + 400).
    report("loading tokenizer", 0.05)
    tokenizer = load_default_tokenizer() if original.kind == "default" else _load_tokenizer(original)
    give_back_freed_memory()
    try:
        model, kept = load_native(gguf, TORCH_DTYPES[spec.dtype], KernelPolicy(), report)
    except ModelLoadError:
        raise
    except (torch.OutOfMemoryError, MemoryError):
        raise ModelLoadError(f"Ran out of memory while loading {original.name}.") from None
    except Exception as exc:  # noqa: BLE001 - a malformed tensor: say so, not a traceback
        raise ModelLoadError(
            f"{gguf.name} could not be read at its own bits ({type(exc).__name__}: {first_line(exc)}). "
            "It may be corrupt; or load it with --quantization none."
        ) from None
    loaded = _served(
        lambda: LoadedModel.from_model(
            model,
            tokenizer,
            name=original.name,
            source=spec.source,
            load_seconds=time.perf_counter() - start,
            scheme=NATIVE,
        ),
        original.name,
    )
    shapes = loaded.info.shapes
    before = shapes.params * 4 if shapes is not None else loaded.info.weight_bytes  # the float32 twin
    loaded.info = dataclasses.replace(
        loaded.info, weight_bytes_before=before, notes=(kept.summary(), *kept.notes, *loaded.info.notes)
    )
    forget_gguf_header()  # the config, tokenizer and tensors have read it
    give_back_freed_memory()  # the metadata's temporaries
    report("ready", 1.0)
    return loaded


def _served(make: Callable[[], LoadedModel], name: str) -> LoadedModel:
    """The LoadedModel `make` builds, or the one-line refusal of its attention probe."""
    try:
        return make()
    except AttentionProbeError as exc:  # the real model's attention, seen from its calls
        raise ModelLoadError(f"{name} cannot be served: {exc}.") from None


def _quantize(
    model: PreTrainedModel, scheme: str, tokenizer: PreTrainedTokenizerBase, name: str
) -> PreTrainedModel:
    try:
        return quantize_model(model, scheme, tokenizer)
    except QuantizationError:
        raise
    except (torch.OutOfMemoryError, MemoryError):
        raise ModelLoadError(f"Ran out of memory while quantizing {name} with '{scheme}'.") from None
    except Exception as exc:  # noqa: BLE001 - a kernel or package failure: say which scheme, not a traceback
        raise ModelLoadError(
            f"Quantizing {name} with '{scheme}' failed ({type(exc).__name__}: {first_line(exc)}). "
            "Choose another quantization scheme, or 'none'."
        ) from None
