"""The forward of one step: the batch's metadata built once, one packed forward over the paged
cache, logits for the rows that need them, and what ran (kernels, weight bytes).

The packed rows are ordered decode first (one row per decoding sequence), then prefill chunks, so
each kind of row reaches its kernel in one segment (engine.kernels.policy: every sequence's rows
take the kernel for its own row count). Two executors: kvscope's own forward for the Llama-shaped
families (engine/model/llama_forward.py) where it applies, transformers' modeling code otherwise;
both read and write the same pool through the same attention.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from engine.core.sequence import Sequence
from engine.kernels.policy import KernelPolicy, StepRecord
from engine.kv.manager import KVCacheManager, kernel_runs
from engine.limits import blocks_for_tokens
from engine.model.attention_probs import AttentionRecorder
from engine.model.kv_storage import PagedKVStorage, SeqSlice, block_index
from engine.model.layer_hooks import layer_hooks
from engine.model.llama_forward import (
    EXECUTOR,
    LlamaForward,
    ResidualEdit,
    ResidualObserver,
    unsupported_reason,
)
from engine.model.paged_attention import PagedBatch, PagedCache, paged_attention
from engine.model.routers import RouteRecorder, record_routes

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def _kernel_segments(seq: Any, n: int) -> list[tuple[int, int]]:
    """[(rows, the row count their kernels are chosen for)] of a sequence's `n` rows this step
    (see forward): a prompt's rows its whole length, the rows after it one row each, split where
    a chunk (a recompute after preemption) crosses the prompt's end."""
    prompt = getattr(seq, "num_prompt_tokens", None)
    if prompt is None:  # a drafter's sequence (engine/core/drafter.py): catch-up rows as a prefill
        return [(n, int(seq.num_tokens) if seq.is_prefill else 1)]
    return kernel_runs(int(prompt), seq.num_computed_tokens, n)


@dataclass(slots=True)
class ForwardProbe:
    """What a forward that inspects the model shows or changes beside its logits (engine/core/
    replay.py builds one; a step of generation never does, and then none of it runs)."""

    residual: ResidualObserver | None = None  # (stage, residual of the logit rows)
    edit: ResidualEdit | None = None  # (stage, residual of every row) -> the residual to go on with
    attention: AttentionRecorder | None = None  # every head's probabilities of the short rows
    routes: RouteRecorder | None = None  # each MoE router's choices for every row


@dataclass(slots=True)
class ForwardResult:
    logits: torch.Tensor  # float32 [rows, vocab]
    rows: dict[int, tuple[int, int]]  # seq_id -> (first row, count) in `logits`
    record: StepRecord  # kernels run and weight bytes read
    # the final norm's output of the same rows (what the head read), float32 [rows, hidden];
    # kvscope's own forward only (None on transformers')
    hidden: torch.Tensor | None = None
    # the residual entering the forward's keep_middle layer at the same rows, where one is kept
    middle: torch.Tensor | None = None


class ModelRunner:
    def __init__(
        self,
        model: PreTrainedModel,
        storage: PagedKVStorage,
        kv: KVCacheManager,
        device: torch.device,
        policy: KernelPolicy,
    ):
        self.model = model
        self.storage = storage
        self.kv = kv
        self.device = device
        self.policy = policy
        self._cache = PagedCache()
        reason = unsupported_reason(model, storage.layers)
        if reason is None and storage.layers is None:
            reason = "no attention probe for its layers"  # a hand-built storage: the generic path
        self.own_forward = LlamaForward(model, storage.layers) if reason is None else None
        # which forward runs, and why the fast one does not (ModelInfo.notes says the same)
        self.executor = EXECUTOR if reason is None else f"transformers' ({reason})"

    def forward(
        self,
        seqs: list[Sequence],
        num_tokens: list[int],
        logit_counts: dict[int, int],
        observer: ResidualObserver | None = None,
        probe: ForwardProbe | None = None,
    ) -> ForwardResult:
        """Run the batch. `logit_counts[seq_id]` = how many of that sequence's last rows need
        logits (1 to sample, 1 + drafts to verify a speculative round; absent: none).
        `observer(stage, hidden)`: the residual stream of those same rows (in ForwardResult.rows'
        order) after the embedding (stage 0) and after each layer (engine/model/llama_forward.py);
        kvscope's own forward only. `probe`: what an inspecting forward records or changes
        (the residual observed and edited on either executor, attention probabilities, routes)."""
        if observer is not None and self.own_forward is None:
            raise ValueError(
                f"observing the residual stream needs kvscope's own forward; this model runs {self.executor}"
            )
        if probe is not None and probe.residual is not None:
            observer = probe.residual
        edit = probe.edit if probe is not None else None
        order = sorted(range(len(seqs)), key=lambda i: num_tokens[i] != 1)  # decode rows first
        seqs = [seqs[i] for i in order]
        num_tokens = [num_tokens[i] for i in order]
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        slices: list[SeqSlice] = []
        keep: list[int] = []
        rows: dict[int, tuple[int, int]] = {}
        # the row count each sequence's kernels are chosen for (engine.kernels.policy): a
        # prompt's rows its whole length, so they meet the same kernels however it is chunked,
        # cached or batched; every row after the prompt one row, as it was decoded (a decode, a
        # speculative round, a recompute after preemption or a replay of a reply)
        segments = [segment for seq, n in zip(seqs, num_tokens) for segment in _kernel_segments(seq, n)]
        bs = self.storage.block_size
        for seq, n in zip(seqs, num_tokens):
            start = seq.num_computed_tokens
            q_start = len(ids)
            ids.extend(seq.tokens_with_spec(start, start + n))
            positions.extend(range(start, start + n))
            slots.extend(self.kv.slot_ids(seq.block_table, start, n))
            context = start + n
            table = [b.block_id for b in seq.block_table[: blocks_for_tokens(context, bs)]]
            slices.append(SeqSlice(q_start, n, context, block_index(table, self.device)))
            count = logit_counts.get(seq.seq_id, 0)
            if count:
                rows[seq.seq_id] = (len(keep), count)
                keep.extend(range(q_start + n - count, q_start + n))

        def long_tensor(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long, device=self.device)

        batch = PagedBatch(self.storage, long_tensor(slots), slices)
        input_ids, position_ids = long_tensor(ids), long_tensor(positions)
        keep_rows = long_tensor(keep)
        if probe is not None:
            batch.recorder = probe.attention
        with (
            torch.inference_mode(),
            self.policy.step([m for m, _ in segments], [k for _, k in segments]) as record,
        ):
            hidden = middle = None
            if self.own_forward is not None:
                own = self.own_forward
                logits = own(input_ids, position_ids, batch, keep_rows, observer, edit)
                hidden, middle = own.last_normed, own.last_middle
                own.last_normed = own.last_middle = None  # the result keeps them, and no longer
            else:
                with contextlib.ExitStack() as hooks:
                    if observer is not None or edit is not None:
                        hooks.enter_context(layer_hooks(self.model, keep_rows, observer, edit))
                    if probe is not None and probe.routes is not None:
                        hooks.enter_context(record_routes(self.model, probe.routes))
                    logits = self._transformers_forward(input_ids, position_ids, batch, keep_rows)
        return ForwardResult(
            logits.float(),
            rows,
            record,
            None if hidden is None else hidden.float(),
            None if middle is None else middle.float(),
        )

    def _transformers_forward(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, batch: PagedBatch, keep_rows: torch.Tensor
    ) -> torch.Tensor:
        with paged_attention(self.model, batch):
            out = self.model(
                input_ids=input_ids[None],
                position_ids=position_ids[None],
                cache=self._cache,
                use_cache=True,
                logits_to_keep=keep_rows,
                paged_batch=batch,
            )
        logits: torch.Tensor = out.logits
        return logits[0]
