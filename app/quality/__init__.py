"""The quantization-quality runs: what a run compares, its computation off the GUI thread, and
the controller that connects it to the panel."""
