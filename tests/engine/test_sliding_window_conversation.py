"""A sliding-window model (Mistral's attention, window 8) through a conversation many windows long:
every reply equals transformers' generate() on the whole history, each sliding layer reads only
the blocks of its window, and the page map folded from the engine's events shows the same KV
counts as the engine's own pool at every step."""

from __future__ import annotations

import pytest
import torch
from family_configs import VOCAB, WINDOW, tiny_model
from tiny_models import IdTokenizer

from engine.config import EngineConfig, SamplingParams
from engine.core.llm_engine import LLMEngine
from engine.events import BlockEvent, RequestFailed, RequestFinished, StepStats
from engine.kernels import native
from engine.model import paged_attention
from engine.model.decode_attention import DecodeGroup
from engine.model.loaded import LoadedModel
from engine.request import Request
from live.page_map import PageMap

BLOCK = 4
REPLY = 12


@pytest.fixture(scope="module")
def mistral():
    model = tiny_model("mistral", seed=3)
    loaded = LoadedModel.from_model(model, IdTokenizer(VOCAB), name="tiny-mistral", source="test")
    assert [layer.window for layer in loaded.attention] == [WINDOW, WINDOW]
    return model, loaded


def reference(model, prompt: list[int]) -> list[int]:
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=REPLY, do_sample=False, eos_token_id=None, pad_token_id=0
        )
    return out[0, len(prompt) :].tolist()


def test_a_long_conversation_past_the_window_stays_exact_and_the_page_map_agrees(mistral, monkeypatch):
    model, loaded = mistral
    reads = []  # (context length, blocks read, keys attended) of each decode's sliding layers
    if native.kernels() is not None:  # row by row on kvk: each row attends [start, stop) of its table
        real_rows = paged_attention.row_attention

        def rows(storage, layer, q, plan, how, probs=None):
            if how.window is not None:
                for start, stop in zip(plan.starts(how.window).tolist(), plan.stops.tolist()):
                    reads.append((stop, (stop - 1) // BLOCK - start // BLOCK + 1, stop - start))
            return real_rows(storage, layer, q, plan, how, probs)

        monkeypatch.setattr(paged_attention, "row_attention", rows)
    else:  # the torch decode path gathers the window's blocks
        real_build = DecodeGroup.build.__func__

        def build(cls, storage, seqs, window):
            group = real_build(cls, storage, seqs, window)
            attended = torch.isfinite(group.bias.view(len(seqs), -1, storage.num_kv_heads, BLOCK)[:, :, 0])
            for seq, keys in zip(seqs, attended.sum(dim=(1, 2)).tolist()):
                reads.append((seq.context_len, group.blocks_per_row, keys))
            return group

        monkeypatch.setattr(DecodeGroup, "build", classmethod(build))
    events = []
    page_map = PageMap(num_blocks=64, block_size=BLOCK)

    def emit(event):
        events.append(event)
        if isinstance(event, BlockEvent):
            assert page_map.apply(event) == []
        if isinstance(event, StepStats):  # the map, folded from events, equals the engine's pool
            assert (page_map.used_blocks, page_map.used_slots) == (event.kv.used_blocks, event.kv.used_slots)
            assert page_map.cached_free_blocks == event.kv.cached_free_blocks

    engine = LLMEngine(loaded, EngineConfig(block_size=BLOCK, num_blocks=64, prefill_chunk_size=7), emit)
    g = torch.Generator().manual_seed(5)
    history: list[int] = []
    for turn in range(4):
        history += torch.randint(3, VOCAB, (9,), generator=g).tolist()  # the user's next message
        expected = reference(model, history)
        reads.clear()
        rid = engine.add_request(
            Request(
                prompt_token_ids=tuple(history),
                sampling=SamplingParams(temperature=0.0, max_new_tokens=REPLY, ignore_eos=True),
            )
        )
        while engine.has_work():
            engine.step()
            seq = engine.seqs.get(rid)
            if seq is not None:  # the running sequence holds exactly the blocks its tokens need
                assert len(seq.block_table) == -(-seq.num_computed_tokens // BLOCK)
        assert not [e for e in events if isinstance(e, RequestFailed)]
        (done,) = [e for e in events if isinstance(e, RequestFinished) and e.request_id == rid]
        assert list(done.token_ids) == expected, f"turn {turn}: {len(history)} tokens of history"
        # each decode of a sliding layer read only the blocks of its window and attended to its
        # last WINDOW keys, never the whole history (short prefill chunks take the row path too:
        # only the decodes, past the prompt, are checked here)
        decodes = [r for r in reads if r[0] > len(history)]
        assert decodes and all(
            blocks == (n - 1) // BLOCK - max(0, n - WINDOW) // BLOCK + 1 and keys == min(n, WINDOW)
            for n, blocks, keys in decodes
        )
        history += list(done.token_ids)
        assert len(history) > (turn + 1) * 2 * WINDOW
    # everything released, and the page map agrees: the conversation's full blocks stay cached
    assert page_map.used_blocks == 0 == engine.kv.pool.num_used
    assert page_map.cached_free_blocks == engine.kv.pool.num_cached_free > 0
    finished = [e for e in events if isinstance(e, RequestFinished)]
    assert [f.stats.cached_prompt_tokens > 0 for f in finished] == [False, True, True, True]
