"""A GGUF file's tokenizer, converted by transformers once and kept in the cache dir.

transformers builds a fast tokenizer from a GGUF's tokenizer fields (tens of thousands of tokens
and merges) on every load, after parsing the whole header again with its own gguf reader: on a
1.7B file ~9 s of a 16 s load on this machine. Here the conversion reads the header kvscope
already parsed (engine.model.configs.open_gguf) and its result is saved as a tokenizer folder
keyed by the file's identity (path, size, mtime), which later loads read in a fraction of a
second. A cache that cannot be written only costs the conversion next time.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from engine.cache_dirs import cache_root, is_converted, publish_atomically, source_fingerprint
from engine.errors import ModelLoadError
from engine.model.configs import open_gguf

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def load_gguf_tokenizer(path: Path) -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer  # transformers takes seconds to import: only once a model is read

    fingerprint = source_fingerprint(path)
    folder = cache_root() / "tokenizers" / hashlib.sha256(fingerprint.encode()).hexdigest()[:16]
    if is_converted(folder, fingerprint):
        cached: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(folder, local_files_only=True)
        return cached
    with _parsed_header(path):
        tokenizer: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(
            path.parent, gguf_file=path.name, local_files_only=True
        )
    with contextlib.suppress(ModelLoadError, OSError):  # unwritable: converted again next time
        publish_atomically(folder, fingerprint, tokenizer.save_pretrained)
    return tokenizer


@contextlib.contextmanager
def _parsed_header(path: Path) -> Iterator[None]:
    """While transformers loads this file's tokenizer, its `gguf.GGUFReader(path)` is the reader
    kvscope already parsed (transformers imports the class from gguf inside the call); other
    files still get a reader of their own."""
    import gguf  # gguf: only once a GGUF file is read

    reader = open_gguf(path)
    original = gguf.GGUFReader
    resolved = path.resolve()

    def reuse(target: Any, mode: Literal["r", "r+", "c"] = "r") -> Any:
        return reader if Path(target).resolve() == resolved else original(target, mode)

    gguf.GGUFReader = reuse  # type: ignore[misc,assignment]
    try:
        yield
    finally:
        gguf.GGUFReader = original  # type: ignore[misc]
