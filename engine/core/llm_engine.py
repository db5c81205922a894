"""The synchronous engine: requests in, one `step()` at a time, events out.

`engine.core.service.Engine` runs this on a thread; the CLI, the benchmark and the tests drive it
directly. A step is: schedule -> one packed forward over the paged cache -> commit the new K/V
-> sample the sequences whose prompt is fully in the cache -> emit events.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from engine.config import ConfigError, EngineConfig
from engine.core.detokenize import IncrementalDetokenizer
from engine.core.group_driver import GroupDriver, GroupError
from engine.core.runner import ModelRunner
from engine.core.scheduler import Scheduler
from engine.core.sequence import Sequence
from engine.events import (
    Event,
    KVStats,
    MemorySample,
    RequestFailed,
    RequestFinished,
    RequestStarted,
    RequestStats,
    SpecRound,
    StepStats,
    TokenGenerated,
)
from engine.kv.block_pool import BlockPool
from engine.kv.manager import KVCacheManager
from engine.kv.paged_cache import PagedKVStorage
from engine.measure.memory import probe_memory
from engine.model import chat_template
from engine.request import Request
from engine.sampling.sampler import Sampler
from engine.speculative.proposers import make_proposer
from engine.speculative.verify import Verdict, verify

# Without an explicit size the KV pool gets this much memory: room for several thousand tokens
# of a small model, and few enough blocks that every one is visible in the page map.
DEFAULT_KV_BUDGET_BYTES = 256 * 2**20
# Context cap when the model's own is larger and nothing else is configured.
DEFAULT_MAX_MODEL_LEN = 8192


class RequestError(ValueError):
    """A request the engine cannot serve; the message is for the user."""


class LLMEngine:
    def __init__(self, loaded, config: EngineConfig, emit: Callable[[Event], None] | None = None):
        self.loaded = loaded
        self.config = config
        self.emit = emit or (lambda event: None)
        info = loaded.info
        self.tokenizer = loaded.tokenizer
        bs = config.block_size
        # the storage's own formula: int8 KV counts its scales
        block_bytes = PagedKVStorage.block_bytes(
            info.num_layers, bs, info.num_kv_heads, info.head_dim, loaded.dtype, config.kv_dtype
        )
        if config.num_blocks is not None:
            num_blocks = config.num_blocks
        else:
            budget = config.kv_budget_bytes or DEFAULT_KV_BUDGET_BYTES
            num_blocks = budget // block_bytes
            if num_blocks < 1:
                raise ConfigError(
                    f"A KV budget of {budget} bytes holds no block of {bs} tokens "
                    f"({block_bytes} bytes each); raise the budget or lower the block size."
                )
        pool = BlockPool(num_blocks, bs, self.emit)
        self.kv = KVCacheManager(pool, config.enable_prefix_caching)
        self.storage = PagedKVStorage(
            info.num_layers,
            num_blocks,
            bs,
            info.num_kv_heads,
            info.head_dim,
            loaded.dtype,
            loaded.device,
            kv_dtype=config.kv_dtype,
            layers=loaded.attention or None,
        )
        self.kv.copy_block = self.storage.copy_block  # copy-on-write of shared blocks
        self.max_model_len = min(
            config.max_model_len or min(info.max_position_embeddings, DEFAULT_MAX_MODEL_LEN),
            info.max_position_embeddings,
        )
        self.runner = ModelRunner(loaded.model, self.storage, self.kv, loaded.device)
        self.proposer = make_proposer(config, loaded) if config.speculative else None
        self.scheduler = Scheduler(
            self.kv, config.max_num_batched_tokens, config.max_num_seqs, config.prefill_chunk_size
        )
        self.seqs: dict[int, Sequence] = {}  # every live sequence by seq_id (forks included)
        self.groups = GroupDriver(self)  # n-sample and beam-search requests
        self.eos_ids = _eos_ids(loaded.model, self.tokenizer)
        self.step_count = 0
        self.peak_blocks_used = 0
        self._next_id = 1_000_000  # ids for direct callers; the thread service passes its own

    # ---- requests --------------------------------------------------------------------------
    def add_request(self, request: Request, request_id: int | None = None) -> int:
        if request_id is None:
            request_id, self._next_id = self._next_id, self._next_id + 1
        try:
            seq = self._make_sequence(request, request_id)
        except Exception as exc:  # noqa: BLE001 - any bad request becomes an event, not a crash
            message = (
                str(exc)
                if isinstance(exc, (RequestError, GroupError, chat_template.ChatTemplateError))
                else f"{type(exc).__name__}: {exc}"
            )
            self.emit(RequestFailed(request_id, message, time.perf_counter()))
            return request_id
        self.seqs[request_id] = seq
        if seq.params.group_size > 1:
            self.groups.start(seq)
        self.emit(RequestStarted(request_id, seq.num_prompt_tokens, seq.arrival_time))
        self.scheduler.add(seq)
        return request_id

    def prompt_ids(self, request: Request) -> list[int]:
        return chat_template.prompt_ids(self.tokenizer, request)

    def _make_sequence(self, request: Request, request_id: int) -> Sequence:
        ids = self.prompt_ids(request)
        if not ids:
            raise RequestError("The prompt is empty.")
        if len(ids) >= self.max_model_len:
            raise RequestError(
                f"The prompt is {len(ids)} tokens but the context holds {self.max_model_len}: "
                "shorten the message or start a new conversation."
            )
        pool_tokens = self.kv.pool.num_blocks * self.kv.block_size
        if len(ids) + 1 > pool_tokens:
            raise RequestError(
                f"The prompt needs {len(ids) + 1} KV slots but the whole KV pool holds {pool_tokens} "
                f"({self.kv.pool.num_blocks} blocks of {self.kv.block_size}): raise the KV budget."
            )
        params = request.sampling
        if params.group_size > 1:
            self.groups.check(params)
        seq = Sequence(request_id, ids, len(ids), params)
        seq.sampler = Sampler(params, decode_token=self._token_text)
        seq.detokenizer = IncrementalDetokenizer(self.tokenizer, ids, params.stop)
        return seq

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def abort(self, request_id: int) -> None:
        if request_id in self.groups.active:
            self.groups.cancel(request_id)
            return
        seq = self.seqs.get(request_id)
        if seq is not None:
            self._finish(seq, "cancelled")

    def abort_all(self) -> None:
        for request_id in list(self.groups.active):
            self.abort(request_id)
        for request_id in list(self.seqs):
            self.abort(request_id)

    def fail_running(self, message: str) -> None:
        """A step raised: every request in flight fails with the message; the engine goes on."""
        for group in list(self.groups.active.values()):
            self.groups.fail(group, message)
        for seq in list(self.seqs.values()):
            self._release(seq)
            self.emit(RequestFailed(seq.seq_id, message, time.perf_counter()))

    def _release(self, seq: Sequence) -> None:
        """Out of the queues, blocks freed, draft state dropped."""
        seq.drop_drafts(0)
        self.scheduler.remove(seq)
        self.seqs.pop(seq.seq_id, None)
        if self.proposer is not None:
            self.proposer.release(seq)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    # ---- the step --------------------------------------------------------------------------
    def step(self) -> None:
        t0 = time.perf_counter()
        if self.proposer is not None:
            self._propose_drafts()
        t_drafted = time.perf_counter()
        batch = self.scheduler.schedule()
        self._trim_drafts(batch)
        if not batch.seqs:
            self._fail_unschedulable()
            return
        for group in {id(s.group): s.group for s in batch.seqs if s.group is not None}.values():
            group.measure_blocks()
        # Logit rows: the last packed position of each sequence whose tokens are all in the
        # cache after this step, or every verified position of a speculative round.
        rows, sampling, offset = [], [], 0
        shapes = tuple((n, seq.num_computed_tokens + n) for seq, n in zip(batch.seqs, batch.num_tokens))
        for seq, n in zip(batch.seqs, batch.num_tokens):
            offset += n
            seq.target_forwards += 1
            if seq.num_computed_tokens + n == seq.num_tokens:
                count = 1 + seq.num_draft_tokens
                sampling.append((seq, len(rows), count))
                rows.extend(range(offset - count, offset))
        t_forward = time.perf_counter()
        logits = self.runner.forward(batch.seqs, batch.num_tokens, rows)
        t1 = time.perf_counter()
        verdicts = {seq.seq_id: self._verify(seq, logits[r : r + c]) for seq, r, c in sampling if c > 1}
        for seq, n in zip(batch.seqs, batch.num_tokens):
            verdict = verdicts.get(seq.seq_id)
            self.kv.commit(seq, n, None if verdict is None else 1 + verdict.accepted)
        self.peak_blocks_used = max(self.peak_blocks_used, self.kv.pool.num_used)
        beam_rows: dict[int, dict[int, int]] = {}
        for seq, r, c in sampling:
            verdict = verdicts.get(seq.seq_id)
            if verdict is not None:
                self._emit_round(seq, verdict, logits[r : r + c])
            elif seq.group is None:
                self._sample_token(seq, logits[r])
            elif seq.group.kind == "beams":
                beam_rows.setdefault(seq.group.request_id, {})[seq.seq_id] = r
            elif not seq.group.forked:  # the prompt is in: every sample draws from its logits
                for member in self.groups.fork_samples(seq.group):
                    self._sample_token(member, logits[r])
            else:
                self._sample_token(seq, logits[r])
        for request_id, seq_rows in beam_rows.items():
            self.groups.beam_step(self.groups.active[request_id], seq_rows, logits)
        t2 = time.perf_counter()
        self.step_count += 1
        self.emit(
            StepStats(
                step=self.step_count,
                prefill_tokens=batch.prefill_tokens,
                decode_tokens=batch.decode_tokens,
                num_seqs=len(batch.seqs),
                running=len(self.scheduler.running),
                waiting=len(self.scheduler.waiting),
                duration_s=t2 - t0,
                forward_s=t1 - t_forward,
                sample_s=t2 - t1,
                kv=self.kv_stats(),
                prefix_queries=self.kv.queries,
                prefix_query_tokens=self.kv.query_tokens,
                prefix_hit_tokens=self.kv.hit_tokens,
                preemptions=self.scheduler.preemptions,
                seq_shapes=shapes,
                t=t2,
                logit_rows=len(rows),
                draft_s=t_drafted - t0,
            )
        )

    # ---- speculative decoding --------------------------------------------------------------
    def _propose_drafts(self) -> None:
        """Give each decoding sequence a round of draft tokens, appended (unverified) to its
        tokens so the scheduler and runner treat them as ordinary tokens to compute."""
        spec = self.config.speculative
        for seq in self.scheduler.running:
            if seq.num_tokens - seq.num_computed_tokens != 1 or seq.num_output_tokens == 0:
                continue  # still prefilling
            k = min(
                seq.draft_k or spec.num_draft,
                seq.params.max_new_tokens - seq.num_output_tokens - 1,
                self.max_model_len - seq.num_tokens - 1,
            )
            if k <= 0:
                continue
            drafts, qs = self.proposer.propose(seq, k)
            seq.token_ids.extend(drafts)
            seq.draft_q = list(qs)
            seq.num_draft_tokens = len(drafts)

    def _trim_drafts(self, batch) -> None:
        """Drafts of sequences the scheduler did not run (preempted) or ran only in part (the
        token budget) are dropped before anything sees them."""
        if self.proposer is None:
            return
        scheduled = {seq.seq_id: n for seq, n in zip(batch.seqs, batch.num_tokens)}
        for seq in self.seqs.values():
            if seq.num_draft_tokens:
                keep = max(0, scheduled.get(seq.seq_id, 0) - 1)
                if keep < seq.num_draft_tokens:
                    seq.drop_drafts(keep)
                    self.proposer.on_verified(seq, seq.num_tokens)

    def _verify(self, seq: Sequence, logits: torch.Tensor) -> Verdict:
        d = seq.num_draft_tokens
        drafts = seq.token_ids[-d:]
        prompt = seq.token_ids[: seq.num_prompt_tokens]
        history = seq.output_ids[:-d]
        p = torch.stack(
            [seq.sampler.distribution(logits[i], prompt, history + drafts[:i]) for i in range(d + 1)]
        )
        return verify(p, drafts, seq.draft_q, seq.sampler.draw, seq.sampler.uniform)

    def _emit_round(self, seq: Sequence, verdict: Verdict, logits: torch.Tensor) -> None:
        drafts = seq.token_ids[-seq.num_draft_tokens :]
        seq.drop_drafts(0)
        emitted = drafts[: verdict.accepted] + [verdict.token]
        self.proposer.on_verified(seq, seq.num_tokens + verdict.accepted)
        seq.spec_rounds += 1
        seq.spec_drafted += len(drafts)
        seq.spec_accepted += verdict.accepted
        for counts, n in (
            (seq.spec_drafted_by_position, len(drafts)),
            (seq.spec_accepted_by_position, verdict.accepted),
        ):
            counts.extend([0] * (len(drafts) - len(counts)))
            for j in range(n):
                counts[j] += 1
        if self.config.speculative.adaptive:
            seq.draft_k = min(self.config.speculative.num_draft, verdict.accepted + 1)
        self.emit(
            SpecRound(
                seq.seq_id,
                seq.spec_rounds,
                self.proposer.name,
                tuple(drafts),
                verdict.q_of_draft,
                verdict.p_of_draft,
                verdict.accept_probs,
                verdict.accepted,
                tuple(emitted),
                verdict.bonus,
                time.perf_counter(),
            )
        )
        prompt = seq.token_ids[: seq.num_prompt_tokens]
        for i, token in enumerate(emitted):
            kind = "accepted" if i < verdict.accepted else ("bonus" if verdict.bonus else "resampled")
            result = seq.sampler.result_for(logits[i], prompt, seq.output_ids, token)
            if self._emit_token(seq, result, kind, seq.spec_rounds):
                return  # finished: the rest of the round is dropped

    def _fail_unschedulable(self) -> None:
        """Nothing could run. With nothing running, the head of the queue cannot fit even in an
        empty pool (its recomputed context outgrew it): fail it rather than spin."""
        if self.scheduler.running or not self.scheduler.waiting:
            return
        seq = self.scheduler.waiting[0]
        members = seq.group.members if seq.group is not None else [seq]
        what = f"{seq.num_tokens} tokens" if len(members) == 1 else f"{len(members)} sequences"
        message = (
            f"The KV pool ({self.kv.pool.num_blocks} blocks of {self.kv.block_size} tokens) is too "
            f"small for this conversation's {what}: raise the KV budget."
        )
        if seq.group is not None:
            self.groups.fail(seq.group, message)
            return
        self._release(seq)
        self.emit(RequestFailed(seq.seq_id, message, time.perf_counter()))

    def _sample_token(self, seq: Sequence, logits: torch.Tensor) -> None:
        result = seq.sampler.sample(logits, seq.token_ids[: seq.num_prompt_tokens], seq.output_ids)
        self._emit_token(seq, result)

    def _emit_token(self, seq: Sequence, result, spec: str = "", spec_round: int = -1) -> bool:
        """Append a chosen token, stream it, and finish the request if it ends here."""
        now = time.perf_counter()
        token = result.token_id
        seq.token_ids.append(token)
        seq.token_times.append(now)
        seq.cumulative_logprob += result.logprob
        if seq.group is not None:
            seq.group.mark_token_step(self.step_count, now)
        is_eos = token in self.eos_ids and not seq.params.ignore_eos
        delta = "" if is_eos else seq.detokenizer.push(token)
        if is_eos or seq.detokenizer.stopped:
            reason = "stop"
        elif seq.num_output_tokens >= seq.params.max_new_tokens or seq.num_tokens >= self.max_model_len:
            reason = "length"
        else:
            reason = None
        if reason is not None:
            delta += seq.detokenizer.flush()  # text held back for a possible stop string
        self.emit(
            TokenGenerated(
                seq.group.request_id if seq.group is not None else seq.seq_id,
                seq.num_output_tokens - 1,
                token,
                self._token_text(token),
                delta,
                result.logprob,
                result.snapshot,
                spec,
                spec_round,
                now,
                seq.branch,
            )
        )
        if reason is not None:
            if seq.group is not None:
                self.groups.end_sample(seq, reason)
            else:
                self._finish(seq, reason)
        return reason is not None

    def _finish(self, seq: Sequence, reason: str) -> None:
        self._release(seq)
        seq.finish_reason = reason
        seq.detokenizer.flush()
        times = seq.token_times
        ttft = times[0] - seq.arrival_time if times else 0.0
        itl = tuple(b - a for a, b in zip(times, times[1:]))
        decode_time = times[-1] - times[0] if len(times) > 1 else 0.0
        stats = RequestStats(
            prompt_tokens=seq.num_prompt_tokens,
            generated_tokens=seq.num_output_tokens,
            cached_prompt_tokens=seq.num_cached_tokens,
            ttft_s=ttft,
            itl_s=itl,
            tokens_per_s=(len(times) - 1) / decode_time if decode_time > 0 else 0.0,
            preemptions=seq.preemptions,
            peak_blocks=seq.peak_blocks,
            target_forwards=seq.target_forwards,
            spec_rounds=seq.spec_rounds,
            spec_drafted=seq.spec_drafted,
            spec_accepted=seq.spec_accepted,
            spec_accepted_by_position=tuple(seq.spec_accepted_by_position),
            spec_drafted_by_position=tuple(seq.spec_drafted_by_position),
        )
        self.emit(
            RequestFinished(
                seq.seq_id, reason, seq.detokenizer.text, tuple(seq.output_ids), stats, time.perf_counter()
            )
        )

    # ---- telemetry -------------------------------------------------------------------------
    def kv_stats(self) -> KVStats:
        pool = self.kv.pool
        used_slots = sum(b.num_tokens for b in pool.blocks if b.ref_cnt > 0)
        return KVStats(
            num_blocks=pool.num_blocks,
            block_size=pool.block_size,
            used_blocks=pool.num_used,
            cached_free_blocks=pool.num_cached_free,
            free_blocks=pool.num_free,
            used_slots=used_slots,
            bytes_per_block=self.storage.bytes_per_block,
            pool_bytes=self.storage.total_bytes,
        )

    def sample_memory(self) -> MemorySample:
        process, reserved, total, source = probe_memory(self.loaded.device)
        sample = MemorySample(
            weights_bytes=self.loaded.info.weight_bytes,
            kv_pool_bytes=self.storage.total_bytes,
            kv_used_bytes=self.kv.pool.num_used * self.storage.bytes_per_block,
            process_bytes=process,
            process_reserved_bytes=reserved,
            device_total_bytes=total,
            source=source,
            t=time.perf_counter(),
        )
        self.emit(sample)
        return sample


def _eos_ids(model, tokenizer) -> set[int]:
    ids: set[int] = set()
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for value in (eos, getattr(tokenizer, "eos_token_id", None)):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(v for v in value if isinstance(v, int))
    return ids
