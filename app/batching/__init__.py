"""The load tool: N requests at once on the running engine, to watch continuous batching."""
