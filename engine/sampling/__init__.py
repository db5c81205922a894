"""Choosing the next token: the stages, the sampler that runs them, per-token snapshots and
what-if."""
