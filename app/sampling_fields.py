"""What each sampling setting is called and does, in the words of the controls, and the text
form of the settings typed as strings (stop strings, DRY breakers)."""

from __future__ import annotations

# field -> (label, one-line explanation). Every SamplingParams field must appear here: a test
# compares this table with the dataclass, so a new engine setting cannot go missing in the GUI.
EXPLANATIONS: dict[str, tuple[str, str]] = {
    "grammar": (
        "Structured output",
        "Set per chat (above its transcript): replies follow a JSON Schema, a regex or a grammar.",
    ),
    "temperature": (
        "Temperature",
        "Divides the logits: < 1 sharpens, > 1 flattens; 0 always takes the top token.",
    ),
    "top_k": ("Top-k", "Keep only the k likeliest tokens (0 = off)."),
    "top_p": ("Top-p", "Keep the smallest set of tokens whose probability adds up to p (1 = off)."),
    "min_p": ("Min-p", "Drop tokens below min-p × the top token's probability (0 = off)."),
    "repetition_penalty": (
        "Repetition penalty",
        "Divides logits of tokens already in the text (> 1 avoids repeats).",
    ),
    "presence_penalty": ("Presence penalty", "Subtracted once from every token that has appeared."),
    "frequency_penalty": ("Frequency penalty", "Subtracted for each time a token has appeared."),
    "seed": ("Seed", "Fix it to make a reply reproducible; unchecked draws a new seed each time."),
    "max_new_tokens": ("Max new tokens", "The reply stops after this many tokens."),
    "stop": ("Stop strings", "The reply ends before the first of these; separate with |, \\n is a newline."),
    "ignore_eos": ("Ignore EOS", "Keep generating past the model's end-of-reply token."),
    "snapshot_top_n": (
        "Recorded candidates",
        "Candidates kept per token for the Probabilities panel (0 = none).",
    ),
    "n": (
        "Samples (n)",
        "Draw n replies to one prompt side by side; they share the prompt's KV pages (temperature > 0).",
    ),
    "num_beams": (
        "Beams",
        "Beam search: keep the k best-scoring continuations each step, return them ranked "
        "(1 = off; temperature 0).",
    ),
    "length_penalty": (
        "Length penalty",
        "Beams: a finished beam scores sum(log p) / length^penalty; above 0 favours longer replies.",
    ),
    "early_stopping": (
        "Early stopping",
        "Beams: stop once k beams finished (yes), when none running can still win (heuristic), "
        "or only when exactly none can (never).",
    ),
    "typical_p": (
        "Typical-p",
        "Keep the tokens whose surprise is nearest the average surprise, up to this mass (1 = off).",
    ),
    "dry_multiplier": (
        "DRY strength",
        "Penalty on a token that would repeat a sequence the text already has (0 = off).",
    ),
    "dry_base": ("DRY base", "How fast the DRY penalty grows with each further repeated token."),
    "dry_allowed_length": ("DRY allowed length", "Repeats up to this many tokens are free (names, code)."),
    "dry_penalty_last_n": ("DRY range", "How many tokens back DRY looks for repeats (0 = the whole text)."),
    "dry_sequence_breakers": (
        "DRY breakers",
        "A repeat never runs across a token holding one of these; separate with |, \\n is a newline.",
    ),
    "xtc_threshold": ("XTC threshold", "Tokens at least this likely are the top choices XTC may exclude."),
    "xtc_probability": (
        "XTC probability",
        "Chance per token that every top choice but the least likely is removed (0 = off).",
    ),
    "logit_bias": (
        "Logit bias",
        "TEXT=AMOUNT entries separated by |; every token of the text gets the amount (-100..100); "
        '"quote" to keep spaces, #id for a token id.',
    ),
    "banned_token_ids": (
        "Banned tokens",
        'Text never to be drawn, separated by |: each of its tokens is banned; "quote" to keep spaces, #id for an id.',
    ),
}

# The early-stopping choices in the order the combo box lists them, with transformers' values.
EARLY_STOPPING_CHOICES: tuple[tuple[str, bool | str], ...] = (
    ("heuristic (False)", False),
    ("yes (True)", True),
    ("never", "never"),
)

_ESCAPES = {"n": "\n", "t": "\t", "|": "|", "\\": "\\"}


def parse_stop_strings(text: str) -> tuple[str, ...]:
    """'###|\\n\\n|User:' -> ('###', '\\n\\n', 'User:'). Backslash escapes \\n \\t \\| \\\\."""
    parts, current, i = [], [], 0
    while i < len(text):
        ch = text[i]
        if ch == "\\" and i + 1 < len(text) and text[i + 1] in _ESCAPES:
            current.append(_ESCAPES[text[i + 1]])
            i += 2
            continue
        if ch == "|":
            parts.append("".join(current))
            current = []
        else:
            current.append(ch)
        i += 1
    parts.append("".join(current))
    return tuple(p for p in (s.strip(" ") for s in parts) if p)


def format_stop_strings(stops: tuple[str, ...]) -> str:
    def escape(s: str) -> str:
        return s.replace("\\", "\\\\").replace("|", "\\|").replace("\n", "\\n").replace("\t", "\\t")

    return " | ".join(escape(s) for s in stops)
