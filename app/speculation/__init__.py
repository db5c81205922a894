"""Speculative decoding in the window: its controls, the restart that applies them, and the
measured speedup."""
