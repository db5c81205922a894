"""The headless CLI (`python -m engine ...`): one module per group of commands."""
