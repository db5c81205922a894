"""The loader's error type and the one-line messages a failed load shows the user."""

from __future__ import annotations

import torch

from engine.config import ConfigError


class ModelLoadError(Exception):
    """A model could not be loaded; str() is a one-paragraph message meant for the user."""


def first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    line = text[0] if text else type(exc).__name__
    return line if len(line) <= 300 else line[:297] + "..."


def describe_load_error(exc: BaseException) -> str:
    """The sentence to show the user for a failed load."""
    if isinstance(exc, (ModelLoadError, ConfigError)):
        return str(exc)
    if isinstance(exc, (MemoryError, torch.OutOfMemoryError)):
        return "Ran out of memory while loading the model. Choose a smaller model or dtype, or free memory."
    return f"The model could not be loaded because of an unexpected error: {type(exc).__name__}: {first_line(exc)}"
