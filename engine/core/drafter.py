"""A model that drafts: a smaller model of the target's family, or the target's own layers (a
self-draft, engine/speculative/self_draft.py), run on the engine's own runner over a paged KV
pool of its own.

Every decoding sequence's drafts come from the same forwards: a round of k drafts is k forwards
of the draft for the whole batch (the first one also catches the draft's cache up on the tokens
the target committed since the last round: 1 + the drafts it accepted), each through kvscope's
own forward and the kernel table's kernels, like the target's decode steps. A draft's cache keeps
the positions the target verified and drops the rest (`on_verified`), block by block.

A layer self-draft's layers are the target's first layers (the hidden-state self-draft runs no
layer: engine/speculative/hidden_draft.py): the K/V of the tokens the target has
computed are copied from the target's pool (its first layers) instead of run through the draft,
so a round after plain steps (the tuner's probe) or on a new sequence costs its draft forwards
and a copy, not a catch-up forward over every token since the last round (the whole prompt at
the first: most of what self-drafting lost on free chat).

Drafts are drawn under the request's own sampling settings (their distribution is the q the
verifier needs); a greedy request's drafts are the draft's argmax (one-hot q). A draft whose
head covers only the first ids of the vocabulary (a self-draft's trimmed head) gives the other
ids probability 0, which the exact verifier allows for any proposal.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from engine.config import ConfigError, EngineConfig, ModelSpec
from engine.core.runner import ModelRunner
from engine.kernels.policy import KernelPolicy
from engine.kv.block_pool import Block, BlockPool
from engine.kv.manager import KVCacheManager
from engine.model.kv_storage import PagedKVStorage
from engine.model.loaded import LoadedModel
from engine.model.loading import load_model
from engine.sampling.sampler import Sampler
from engine.speculative import self_draft
from engine.speculative.hidden_draft import HiddenStateDrafter
from engine.speculative.proposers import (
    Drafts,
    NgramProposer,
    Proposer,
    Sequence,
    check_same_tokenizer,
    draw_draft,
)
from engine.speculative.self_draft import Calibration, DraftModel, FittedDraft


@dataclass(eq=False)
class _DraftSeq:
    """One sequence's side of the draft: the tokens whose K/V the draft has (the target's
    committed tokens, then its own drafts of the round), its blocks. Shaped like the engine's
    Sequence where the runner and the KV manager read it."""

    seq_id: int
    sampler: Sampler
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_table: list[Block] = field(default_factory=list)
    spec_token_ids: list[int] = field(default_factory=list)  # always empty: a draft has no drafts
    peak_blocks: int = 0
    block_keys: list[tuple[tuple[int, ...], bytes]] = field(default_factory=list)  # the manager's memo
    cow_copies: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def is_prefill(self) -> bool:
        return self.num_tokens - self.num_computed_tokens > 1

    def tokens_with_spec(self, start: int, end: int) -> list[int]:
        return self.token_ids[start:end]


class ModelDrafter:
    """A draft model as a proposer (engine.speculative.proposers.Proposer): batched drafts."""

    free = False  # proposing runs a model
    reads_hidden = False
    middle_layer = 0

    def __init__(
        self,
        draft: DraftModel,
        config: EngineConfig,
        num_blocks: int,
        vocab_size: int,
        target_kv: PagedKVStorage | None = None,
    ):
        self.draft = draft
        self.name = draft.name
        self.vocab_size = vocab_size  # the target's: a draft's q spans it
        info = draft.shapes
        self.storage = PagedKVStorage(
            info.num_layers,
            num_blocks,
            config.block_size,
            info.num_kv_heads,
            info.head_dim,
            draft.dtype,
            draft.device,
            kv_dtype=draft.kv_dtype_for(config.kv_dtype),
            layers=draft.attention or None,
        )
        self.kv = KVCacheManager(BlockPool(num_blocks, config.block_size), enable_prefix_caching=False)
        policy = draft.policy if draft.policy is not None else KernelPolicy()
        self.runner = ModelRunner(draft.model, self.storage, self.kv, draft.device, policy)
        # the target's pool, where the draft's first layers' K/V can be copied from
        self._source = target_kv if _copies_from(self.storage, target_kv, draft.target_layers) else None
        self.copied_tokens = 0  # tokens whose K/V the last `propose` copied from the target
        self._seqs: dict[int, _DraftSeq] = {}
        self.forwards = 0  # draft forwards the last `propose` ran

    # ---- Proposer ----------------------------------------------------------------------------
    def memory_bytes(self) -> tuple[int, int]:
        """(own weights: a self-draft's fitted head, a draft model's weights; the K/V its pool
        holds now)."""
        return self.draft.weight_bytes, self.kv.pool.num_used * self.storage.bytes_per_block

    def evidence(self, seq: Sequence) -> int:
        """One class: a model's drafts (its confidence threshold filters them)."""
        return 0

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Drafts]:
        by_id = {seq.seq_id: seq for seq in seqs}
        drafts: dict[int, Drafts] = {seq.seq_id: ([], []) for seq in seqs}
        stopped: set[int] = set()  # below the confidence threshold: the round ends there
        self.forwards = self.copied_tokens = 0
        active: list[tuple[_DraftSeq, int]] = []
        for seq, k in zip(seqs, ks):
            own = self._catch_up(seq) if k > 0 else None
            if own is not None:
                active.append((own, k))
        for i in range(max((k for _, k in active), default=0)):
            running = [(own, k) for own, k in active if k > i and own.seq_id not in stopped]
            if i > 0:  # feed each sequence its previous draft
                fed = []
                for own, k in running:
                    if not self._room(own, 1):
                        continue  # the pool is full: this sequence's round ends here
                    own.token_ids.append(drafts[own.seq_id][0][-1])
                    fed.append((own, k))
                running = fed
            if not running:
                break
            owns = [own for own, _ in running]
            counts = [own.num_tokens - own.num_computed_tokens for own in owns]
            result = self.runner.forward(owns, counts, {own.seq_id: 1 for own in owns})  # type: ignore[arg-type]
            self.forwards += 1
            for own, n in zip(owns, counts):
                self.kv.commit(own, n)
                row = result.logits[result.rows[own.seq_id][0]]
                if self.draft.confidence > 0 and float(torch.softmax(row, -1).max()) < self.draft.confidence:
                    stopped.add(own.seq_id)
                    continue
                token, q = draw_draft(
                    own.sampler, row, by_id[own.seq_id], drafts[own.seq_id][0], self.vocab_size
                )
                drafts[own.seq_id][0].append(token)
                drafts[own.seq_id][1].append(q)
        return [drafts[seq.seq_id] for seq in seqs]

    def on_verified(self, seq: Sequence, valid_tokens: int) -> None:
        """Keep the draft's K/V of the first `valid_tokens` tokens only."""
        own = self._seqs.get(seq.seq_id)
        if own is None:
            return
        keep = min(own.num_computed_tokens, valid_tokens)
        del own.token_ids[keep:]
        own.num_computed_tokens = keep
        needed = self.kv.blocks_needed(keep)
        if len(own.block_table) > needed:
            emptied = own.block_table[needed:]
            del own.block_table[needed:]
            self.kv.pool.free(list(reversed(emptied)), own.seq_id)

    def observe_hidden(
        self, seq: Sequence, hidden: torch.Tensor, middle: torch.Tensor | None, length: int
    ) -> None:
        pass

    def release(self, seq: Sequence) -> None:
        own = self._seqs.pop(seq.seq_id, None)
        if own is not None:
            self.kv.free(own)

    # ---- inside ------------------------------------------------------------------------------
    def _catch_up(self, seq: Sequence) -> _DraftSeq | None:
        """The sequence's draft side with the target's committed tokens it lacks queued (and
        room for them in the pool), or None when the pool cannot hold them."""
        own = self._seqs.get(seq.seq_id)
        if own is None:
            own = self._seqs[seq.seq_id] = _DraftSeq(seq.seq_id, Sampler(seq.params))
        committed = seq.token_ids
        del own.token_ids[own.num_computed_tokens :]
        own.token_ids.extend(committed[own.num_computed_tokens :])
        if own.num_computed_tokens >= len(committed) or not self._room(
            own, own.num_tokens - own.num_computed_tokens
        ):
            self.release(seq)
            return None
        if self._source is not None:  # the target's K/V of its computed tokens, but the last
            start = own.num_computed_tokens
            count = min(seq.num_computed_tokens, own.num_tokens - 1) - start
            if count > 0:
                src = torch.tensor(self.kv.slot_ids(seq.block_table, start, count))  # the same block size
                dst = torch.tensor(self.kv.slot_ids(own.block_table, start, count))
                self.storage.copy_positions(self._source, self.draft.target_layers, src, dst)
                self.kv.commit(own, count)
                self.copied_tokens += count
        return own

    def _room(self, own: _DraftSeq, n: int) -> bool:
        """Blocks for `n` more tokens, taken now; False when the pool has none left."""
        if not own.block_table:
            if not self.kv.can_allocate(own, [], n):
                return False
            self.kv.allocate(own, [], 0)
        if not self.kv.can_append(own, n):
            return False
        self.kv.append(own, n)
        return True


def _copies_from(storage: PagedKVStorage, source: PagedKVStorage | None, layers: int) -> bool:
    """Whether the draft's pool can take its first `layers` layers' K/V from `source` as they
    lie: the same block size, heads, head size and formats."""
    if source is None or layers < 1 or layers > min(storage.num_layers, source.num_layers):
        return False
    mine = (storage.block_size, storage.num_kv_heads, storage.head_dim, storage.dtype, storage.kv_dtype)
    theirs = (source.block_size, source.num_kv_heads, source.head_dim, source.dtype, source.kv_dtype)
    return mine == theirs and storage.device == source.device


# ---- which proposer --------------------------------------------------------------------------
# Replies the self-draft is calibrated on (engine.speculative.self_draft.calibrate): free chat of
# several kinds on many subjects, greedy, the target's own words; as many as its hidden size asks
# for (self_draft.calibration_replies), generated as one batch.
_CALIBRATION_SUBJECTS = (
    "sleep", "bicycles", "autumn", "camping", "detective stories", "tomato sauce", "cats",
    "birthday parties", "the moon", "volcanoes", "saving money", "learning a language",
    "photosynthesis", "the Roman empire", "chess", "coffee", "running a marathon", "rainbows",
    "electric cars", "bees", "the internet", "gardening", "pizza", "the ocean", "time management",
    "dinosaurs", "music theory", "recycling", "the stock market", "airplanes", "friendship",
    "winter", "Python programming", "the human heart", "earthquakes", "baking bread",
    "job interviews", "the solar system", "yoga", "trees",
)  # fmt: skip
_CALIBRATION_FORMS = (
    "Tell me about {}.",
    "Explain {} to a child.",
    "Write a short poem about {}.",
    "What are three facts about {}?",
    "Give me advice about {}.",
    "Why do people like {}?",
)
# every form of every subject, in an order that varies both from the start (a small model's
# calibration takes only the first ones)
CALIBRATION_PROMPTS = tuple(
    _CALIBRATION_FORMS[(i + j) % len(_CALIBRATION_FORMS)].format(subject)
    for j in range(len(_CALIBRATION_FORMS))
    for i, subject in enumerate(_CALIBRATION_SUBJECTS)
)
CALIBRATION_TOKENS = 128

# greedy replies to prompts: (full token sequences, where each reply starts)
ReplyMaker = Callable[[tuple[str, ...], int], Calibration]


def make_proposer(
    config: EngineConfig,
    loaded: LoadedModel,
    num_blocks: int,
    replies: ReplyMaker,
    target_kv: PagedKVStorage | None = None,
) -> Proposer:
    """The proposer named by `config.speculative` for the target `loaded`; a model drafter gets
    a KV pool of `num_blocks` blocks. `replies` generates the target's own greedy replies (the
    self-draft's calibration, when no plan is cached for this model); a self-draft copies its
    layers' K/V from `target_kv`, the target's pool."""
    spec = config.speculative
    assert spec is not None, "the engine makes a proposer only for a speculative config"
    vocab = loaded.info.vocab_size
    if spec.method == "ngram":
        return NgramProposer()
    if spec.method == "self":
        fitted = self_draft_for(loaded, spec.self_draft_layers, replies)
        if fitted is None:  # no replies to fit on: the first layers as they are
            if spec.self_draft_layers == self_draft.HIDDEN:
                raise ConfigError(
                    "The hidden-state self-draft is fitted on the model's own chat replies, and this "
                    "model has no chat template; choose a number of layers to draft with instead."
                )
            layers = spec.self_draft_layers or max(1, loaded.info.num_layers // 4)
            layer_draft = self_draft.first_layers_draft(loaded, layers)
        elif fitted.map is not None:
            return HiddenStateDrafter(fitted, loaded.model.get_input_embeddings(), vocab)
        else:
            layer_draft = self_draft.fitted_self_draft(loaded, fitted)
        return ModelDrafter(layer_draft, config, num_blocks, vocab, target_kv)
    assert spec.draft_model, "SpeculativeConfig requires a draft model for 'draft'"
    draft = load_model(ModelSpec(spec.draft_model, dtype=loaded.info.dtype, device=str(loaded.device.type)))
    check_same_tokenizer(loaded.tokenizer, draft.tokenizer)
    if draft.info.vocab_size > vocab:
        raise ConfigError(
            f"The draft model's head has {draft.info.vocab_size} tokens, more than the target's {vocab}."
        )
    return ModelDrafter(
        self_draft.draft_model(draft, f"draft ({draft.info.name})"), config, num_blocks, vocab
    )


def self_draft_for(loaded: LoadedModel, layers: int | None, replies: ReplyMaker) -> FittedDraft | None:
    """The fitted self-draft (`layers` None: the calibration's choice; HIDDEN: the hidden-state
    draft; n: the first n layers): its plan from the cache, or calibrated now on the target's
    replies (and cached). None without replies to fit on (no chat template)."""
    cached = self_draft.load_plan(loaded)
    if cached is not None and (layers is None or cached.plan.layers == layers):
        return cached
    count = self_draft.calibration_replies(loaded.info.hidden_size, len(CALIBRATION_PROMPTS), layers)
    calibration = replies(CALIBRATION_PROMPTS[:count], CALIBRATION_TOKENS)
    if len(calibration.sequences) < 2:
        return None
    fitted = self_draft.calibrate(loaded, calibration, layers)
    if layers is None:
        self_draft.save_plan(loaded, fitted)
    return fitted
