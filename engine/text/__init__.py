"""The tokenizer's side of the engine: a conversation into prompt ids (the chat template), and
tokens back into text (a token's own text, stop tokens, streaming detokenization)."""
