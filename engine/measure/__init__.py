"""Measurement: memory probes, device limits, the roofline's cost model, sweeps, quality
comparisons and the benchmarks."""
