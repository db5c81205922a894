"""A reply generated as n samples or by beam search: its alternatives and which one is kept.

The kept alternative is the assistant message's content (what the next turn continues from);
all of them are stored with the message as JSON metadata (`to_meta` / `from_meta`), so a
relaunch shows the same choice and the user can still change it. The engine ranks the
sequences best first; the best is kept until the user keeps another.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from engine.events import RequestFinished

META_VERSION = 1


@dataclass(frozen=True, slots=True)
class Alternative:
    branch: int  # the sample index (samples) or the rank (beams, 0 = best)
    text: str
    score: float | None  # None while a sample is still streaming
    finish_reason: str | None  # None while streaming
    num_tokens: int = 0


@dataclass(slots=True)
class GroupReply:
    kind: str  # "samples" | "beams"
    alternatives: list[Alternative]  # samples by index, beams by rank
    kept: int | None  # branch of the kept alternative (None: nothing finished yet)
    group: dict[str, Any] = field(default_factory=dict)  # GroupStats' figures once finished

    @classmethod
    def from_finished(cls, event: RequestFinished, kind: str) -> GroupReply:
        ranked = list(event.sequences)
        alternatives = [
            Alternative(s.branch, s.text, s.score, s.finish_reason, len(s.token_ids)) for s in ranked
        ]
        if kind == "samples":
            alternatives.sort(key=lambda a: a.branch)
        group = {}
        if event.group is not None:
            group = {
                "shared_blocks": event.group.shared_blocks,
                "unshared_blocks_equivalent": event.group.unshared_blocks_equivalent,
                "cow_copies": event.group.cow_copies,
                "saving": event.group.saving,
            }
            kind = event.group.kind
        return cls(kind, alternatives, ranked[0].branch if ranked else None, group)

    @classmethod
    def streaming(cls, texts: dict[int, str], size: int) -> GroupReply:
        """Samples mid-stream (what a crash would leave): each text so far, none kept yet."""
        return cls("samples", [Alternative(b, texts.get(b, ""), None, None) for b in range(size)], None)

    def alternative(self, branch: int) -> Alternative | None:
        return next((a for a in self.alternatives if a.branch == branch), None)

    @property
    def kept_text(self) -> str:
        kept = self.alternative(self.kept) if self.kept is not None else None
        return kept.text if kept is not None else ""

    @property
    def best_branch(self) -> int | None:
        scored = [a for a in self.alternatives if a.score is not None]
        return max(scored, key=lambda a: a.score or 0.0).branch if scored else None

    def to_meta(self) -> dict[str, Any]:
        return {
            "group_reply": META_VERSION,
            "kind": self.kind,
            "kept": self.kept,
            "alternatives": [asdict(a) for a in self.alternatives],
            "group": self.group,
        }

    @classmethod
    def from_meta(cls, meta: dict[str, Any] | None) -> GroupReply | None:
        """The stored reply, or None when the metadata is not a group reply this version reads."""
        if not isinstance(meta, dict) or meta.get("group_reply") != META_VERSION:
            return None
        try:
            alternatives = [Alternative(**a) for a in meta["alternatives"]]
            return cls(str(meta["kind"]), alternatives, meta.get("kept"), dict(meta.get("group") or {}))
        except (KeyError, TypeError):
            return None
