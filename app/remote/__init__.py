"""The app as a client of a remote engine: an OpenAI-compatible server (vLLM, SGLang, llama.cpp's
server, or `kvscope serve`) whose replies, metrics and (for kvscope) engine events become the
same events a local engine emits, so the chat and the panels do not care where they come from."""
