"""Choosing and loading a model: the picker with its estimate, and the quantization rows."""
