"""vLLM's KV-cache events over ZMQ: which prefix-cache blocks a vLLM server holds.

A vLLM server started with `--kv-events-config '{"enable_kv_cache_events": true, "publisher":
"zmq"}'` publishes on a ZMQ PUB socket (tcp://*:5557 unless told otherwise), after each engine
step that changed its prefix cache, one msgpack batch `[ts, events, dp_rank]` whose events are
maps tagged by "type": BlockStored (blocks that filled and were hashed: their hashes, the parent's
hash, their token ids, the block size), BlockRemoved (hashes evicted), AllBlocksCleared.

They name blocks by content hash, not by their place in the pool, so what they can show is the
set of cached prefix blocks (how many, how many tokens), not a page map. And a block is only
published when it fills: vLLM's CPU backend uses 128-token blocks, so a short chat publishes
nothing, which is why a subscriber watching short replies sees no events (the peers test showed
none for replies under a block and BlockStored for an 800-token prompt). A subscriber that
connects late misses what was published before (ZMQ PUB/SUB keeps nothing for it).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

import msgpack

DEFAULT_PORT = 5557  # vLLM's default KVEventsConfig endpoint, tcp://*:5557


def endpoint_for(url: str, port: int = DEFAULT_PORT) -> str:
    """Where a vLLM server at `url` publishes by default."""
    host = urlsplit(url).hostname or "127.0.0.1"
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


@dataclass(frozen=True, slots=True)
class PrefixCacheState:
    """What the events said so far (since this client subscribed)."""

    endpoint: str
    blocks: int  # cached blocks now (stored minus removed)
    tokens: int  # tokens in them
    block_size: int | None  # as the server reports it (None until a block was stored)
    stored: int  # blocks stored, removed, and clears, since subscribing
    removed: int
    cleared: int
    batches: int


class PrefixCacheMirror:
    """The set of cached block hashes, folded from the published batches."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.blocks: dict[object, int] = {}  # block hash -> tokens in it
        self.block_size: int | None = None
        self.stored = self.removed = self.cleared = self.batches = 0

    def fold(self, payload: bytes) -> None:
        batch = msgpack.unpackb(payload, raw=False, strict_map_key=False)
        events = batch[1] if isinstance(batch, (list, tuple)) and len(batch) > 1 else []
        self.batches += 1
        for event in events:
            kind = event.get("type") if isinstance(event, dict) else None
            if kind == "BlockStored":
                size = int(event.get("block_size") or 0) or None
                self.block_size = size or self.block_size
                hashes = event.get("block_hashes") or []
                for block in hashes:
                    self.blocks[_key(block)] = size or 0
                self.stored += len(hashes)
            elif kind == "BlockRemoved":
                for block in event.get("block_hashes") or []:
                    if self.blocks.pop(_key(block), None) is not None:
                        self.removed += 1
            elif kind == "AllBlocksCleared":
                self.blocks.clear()
                self.cleared += 1

    def state(self) -> PrefixCacheState:
        return PrefixCacheState(
            self.endpoint,
            len(self.blocks),
            sum(self.blocks.values()),
            self.block_size,
            self.stored,
            self.removed,
            self.cleared,
            self.batches,
        )


def _key(block) -> object:
    return tuple(block) if isinstance(block, list) else block


async def follow(endpoint: str, on_state: Callable[[PrefixCacheState], None]) -> None:
    """Subscribe to `endpoint` until cancelled, reporting the mirror after every batch (and once
    at the start, so the app can say it is listening)."""
    import zmq
    import zmq.asyncio

    mirror = PrefixCacheMirror(endpoint)
    context = zmq.asyncio.Context()
    socket = context.socket(zmq.SUB)
    try:
        socket.setsockopt(zmq.LINGER, 0)
        socket.connect(endpoint)
        socket.setsockopt(zmq.SUBSCRIBE, b"")  # every topic (vLLM's default topic is "")
        on_state(mirror.state())
        while True:
            parts = await socket.recv_multipart()
            try:
                mirror.fold(parts[-1])
            except (ValueError, TypeError, msgpack.UnpackException):
                continue  # not a batch this client understands: skip it, keep listening
            on_state(mirror.state())
    except asyncio.CancelledError:
        raise
    finally:
        socket.close(0)
        context.term()
