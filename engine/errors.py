"""The loader's error type and the one-line messages a failed load shows the user.

Torch-free, so that whoever names a load error (the app, the CLI's argument checks) does not
import torch for it: a torch out-of-memory error can only come from a torch already imported.
"""

from __future__ import annotations

import sys

from engine.config import ConfigError


class ModelLoadError(Exception):
    """A model could not be loaded; str() is a one-paragraph message meant for the user."""


class MeasurementError(Exception):
    """A measurement cannot be done here (memory, a model that fails to load, too little text);
    str() says why, for the user."""


def first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    line = text[0] if text else type(exc).__name__
    return line if len(line) <= 300 else line[:297] + "..."


def describe_load_error(exc: BaseException) -> str:
    """The sentence to show the user for a failed load."""
    if isinstance(exc, (ModelLoadError, ConfigError)):
        return str(exc)
    if _out_of_memory(exc):
        return "Ran out of memory while loading the model. Choose a smaller model or dtype, or free memory."
    return f"The model could not be loaded because of an unexpected error: {type(exc).__name__}: {first_line(exc)}"


def _out_of_memory(exc: BaseException) -> bool:
    torch = sys.modules.get("torch")
    return isinstance(exc, MemoryError) or (torch is not None and isinstance(exc, torch.OutOfMemoryError))


class InspectionError(Exception):
    """A view of the model's inside (logit lens, attention, experts, scoring, steering) cannot be
    computed for what was asked (a token outside the context, a family without experts, a vector
    of the wrong shape, a text too long): str() says why in one line, for the user."""
