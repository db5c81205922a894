"""Model loading, split by concern: sources, cache dirs, configs, checks, the packaged default,
weights and tokenizer; plus the loaded model's shapes and inspect-model."""
