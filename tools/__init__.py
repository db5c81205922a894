"""Developer tools, not shipped (the wheel and the frozen bundle leave this folder out): the
attach path against real vLLM and llama.cpp servers (`./dev peers-test`), what the HTTP layer
costs against in-process requests, and the app's responsiveness and throughput while it
generates. Each runs as `python -m tools.NAME`."""
