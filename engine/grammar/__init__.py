"""Constrained decoding: grammar specs compiled with llguidance, one matcher per sequence."""
