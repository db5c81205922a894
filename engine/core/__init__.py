"""The step loop and what it runs: the engine, its thread service, the scheduler, sequences and
groups (n samples, beams), the model runner and the streaming detokenizer."""
