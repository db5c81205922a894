"""Speculative decoding: proposers of draft tokens and the exact rejection-sampling verifier."""
