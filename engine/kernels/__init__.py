"""Weights as a kernel choice: a linear layer holds its weights in their own format (dense,
int8 rows, int4 groups, GGUF Q8_0 blocks) and runs each step's rows through the kernel measured
fastest for that many rows on this machine; fused projections; the GGUF block mappings."""
