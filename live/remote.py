"""What the views need to know about tokens that came from a remote engine.

A remote OpenAI-compatible server (vLLM, SGLang, llama.cpp's server) reports, per token, only
its top-K candidates' logprobs as it computed them. The app's remote adapter turns them into a
`TokenSnapshot` with a single stage of this name, and pseudo token ids (negative: the server
does not say which vocabulary id a text is), so the probability panel can draw the bars and say
plainly what they are: no per-stage view, no what-if, no entropy of the whole vocabulary.
"""

from __future__ import annotations

from engine.events import TokenSnapshot

REMOTE_TOP_K = "remote_top_k"
REMOTE_TOP_K_LABEL = "remote top-K"
REMOTE_TOP_K_MEANING = (
    "the server's top-K logprobs for the token it sampled (after its sampling): no per-stage view"
)


def is_remote_snapshot(snapshot: TokenSnapshot | None) -> bool:
    return snapshot is not None and len(snapshot.stages) == 1 and snapshot.stages[0].name == REMOTE_TOP_K
