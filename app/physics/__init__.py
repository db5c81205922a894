"""The physics-of-inference views' controllers: what the roofline, the KV memory calculator and
the sweep view ask for (device limits, model configs, memory, sweeps), run by the shell off the
GUI thread, and handed back to the views to draw."""
