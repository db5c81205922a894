"""The chat: transcript and input, conversations in SQLite, tabs, group replies (samples, beams)."""
