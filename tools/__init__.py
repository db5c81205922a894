"""Developer tools, not shipped (the wheel and the frozen bundle leave this folder out): the
attach path against real vLLM and llama.cpp servers (`./dev peers-test`), what the HTTP layer
costs against in-process requests, the app's responsiveness and throughput while it generates,
and a first run's screenshots on common screen sizes (`first_run_screens`). Each runs as
`python -m tools.NAME`."""
