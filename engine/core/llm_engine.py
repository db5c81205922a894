"""The synchronous engine: requests in, one `step()` at a time, events out.

`engine.core.service.Engine` runs this on a thread; the CLI, the benchmark and the tests drive it
directly. A step has three parts, as in nano-vllm and vLLM:
  schedule     drafts proposed (speculative decoding), then which sequences run how many tokens;
  forward      one packed forward over the paged cache (engine/core/runner.py), logits only for
               the rows that sample or verify;
  postprocess  the new K/V committed, then each sequence's rows handed to its handler
               (engine/core/postprocess.py: plain tokens, speculative rounds, samples, beams),
               tokens streamed, requests finished; then the step's stats, with the facts the
               runner knows (rows computed, kernels, bytes, FLOPs) and its phase times.

A request that breaks a step fails alone. A forward that raises is run again one sequence at a
time to find which sequence raises; those fail, and the others are scheduled again by the next
step, from the state the failed step found them in (nothing was committed). A failure while one
sequence's rows are postprocessed fails that sequence (its group) and the others' go on.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import replace

from engine.config import (
    DEFAULT_KV_BUDGET_BYTES,
    DEFAULT_MAX_MODEL_LEN,
    ConfigError,
    EngineConfig,
    SamplingParams,
)
from engine.core.drafter import make_proposer
from engine.core.group_driver import GroupDriver, GroupError
from engine.core.kept_logits import KeptLogits
from engine.core.postprocess import Postprocessor, RoundContext
from engine.core.runner import ForwardResult, ModelRunner
from engine.core.scheduler import ScheduledBatch, Scheduler
from engine.core.sequence import Sequence
from engine.core.stats import request_stats
from engine.core.step_clock import DeviceClock
from engine.events import (
    DraftLength,
    EngineError,
    Event,
    KVStats,
    MemorySample,
    ModelLoading,
    RequestEnd,
    RequestFailed,
    RequestFinished,
    RequestStarted,
    StepStats,
)
from engine.grammar.compile import GrammarError
from engine.grammar.grammars import Grammars
from engine.grammar.state import GrammarDeadEnd, GrammarState
from engine.kernels.linear import kv_formats
from engine.kernels.policy import KernelPolicy
from engine.kv.block_pool import BlockPool
from engine.kv.manager import KVCacheManager
from engine.limits import Limits
from engine.measure.memory import probe_memory
from engine.measure.roofline import step_cost
from engine.model.kv_storage import PagedKVStorage
from engine.model.loaded import LoadedModel
from engine.request import Request
from engine.sampling.sampler import Sampler
from engine.speculative.adaptive import DraftTuner
from engine.speculative.proposers import Proposer
from engine.speculative.self_draft import Calibration
from engine.text import chat_template
from engine.text.token_text import TokenText, eos_ids_of
from engine.tools.use import ToolUse, parsed, tool_use


class RequestError(ValueError):
    """A request the engine cannot serve; the message is for the user."""


class LLMEngine:
    def __init__(
        self, loaded: LoadedModel, config: EngineConfig, emit: Callable[[Event], None] | None = None
    ):
        self.loaded = loaded
        self.config = config
        # Where events go. Everything inside emits through `self.emit`, which hands each event
        # here: replace it to time or filter every event of the engine (engine bench does).
        self.sink: Callable[[Event], None] = emit or (lambda event: None)
        self._ends: dict[int, RequestEnd] | None = None  # while `run` waits for its requests
        info = loaded.info
        self.tokenizer = loaded.tokenizer
        bs = config.block_size
        kv_dtype = loaded.kv_dtype_for(config.kv_dtype)  # "auto": float16 for a GGUF at its own bits
        block_bytes = PagedKVStorage.block_bytes(
            info.num_layers, bs, info.num_kv_heads, info.head_dim, loaded.dtype, kv_dtype
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
        self.storage = PagedKVStorage(
            info.num_layers,
            num_blocks,
            bs,
            info.num_kv_heads,
            info.head_dim,
            loaded.dtype,
            loaded.device,
            kv_dtype=kv_dtype,
            layers=loaded.attention or None,
        )
        policy = loaded.policy if loaded.policy is not None else KernelPolicy()
        kv_kinds = kv_formats(loaded.model)  # the prefix cache keys blocks by these formats' kernels
        self.kv = KVCacheManager(
            pool,
            config.enable_prefix_caching,
            copy_block=self.storage.copy_block,
            kernels_at=lambda rows: policy.kernels_at(rows, kv_kinds),
        )
        self.max_model_len = min(
            config.max_model_len or min(info.max_position_embeddings, DEFAULT_MAX_MODEL_LEN),
            info.max_position_embeddings,
        )
        self.runner = ModelRunner(loaded.model, self.storage, self.kv, loaded.device, policy)
        spec = config.speculative
        self._proposer: Proposer | None = (
            make_proposer(config, loaded, num_blocks, self._greedy_replies, self.storage) if spec else None
        )
        # the draft length of each sequence, from the engine's measured costs and acceptance
        self.tuner: DraftTuner | None = (
            DraftTuner(spec.num_draft, spec.adaptive, self._proposer.free)
            if spec is not None and self._proposer is not None
            else None
        )
        self._drafting: tuple[float, int] = (0.0, 0)  # this step's drafting: seconds, draft forwards
        self.scheduler = Scheduler(
            self.kv,
            config.max_num_batched_tokens,
            config.max_num_seqs,
            config.prefill_chunk_size,
            decode_tokens=1 + (config.speculative.num_draft if config.speculative else 0),
        )
        self.seqs: dict[int, Sequence] = {}  # every live sequence by seq_id (forks included)
        self.text = TokenText(self.tokenizer, eos_ids_of(loaded.model, self.tokenizer))
        self.eos_ids = self.text.eos_ids
        self.grammars = Grammars(self.tokenizer, info.vocab_size, self.eos_ids)
        self.limits = Limits(
            self.max_model_len,
            num_blocks,
            bs,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            config.speculative is not None,
        )
        self.groups = GroupDriver(self.emit, self.kv, self.scheduler, self.seqs, self.text, self.limits)
        self.groups.tool_reply = self.tool_reply
        # the logits recorded tokens were drawn from: a what-if under their own settings is exact
        self.kept_logits = KeptLogits()
        self.post = Postprocessor(
            self.kv,
            self.groups,
            self.text,
            self.emit,
            self.finish,
            self.max_model_len,
            self._proposer,
            self.tuner,
            self.fail_request,
            self.kept_logits,
        )
        self.post.live = lambda seq: seq.seq_id in self.seqs
        self.clock = DeviceClock(loaded.device)  # the forward's time on its device (CUDA events)
        self.step_count = 0
        self.peak_blocks_used = 0
        self._next_id = 1_000_000  # ids for direct callers; the thread service passes its own

    @property
    def proposer(self) -> Proposer | None:
        """Who drafts tokens (None: speculation is off); tests and benchmarks may swap it."""
        return self._proposer

    @proposer.setter
    def proposer(self, proposer: Proposer | None) -> None:
        self._proposer = self.post.proposer = proposer
        if proposer is not None and self.tuner is not None:
            self.tuner.free = proposer.free

    def _keep_middle(self, batch: ScheduledBatch) -> None:
        """The own forward keeps the residual at the layer a hidden-state drafter reads, this step,
        where a sequence of the batch may draft from it next step (DraftTuner.may_draft_next)."""
        own, proposer, tuner = self.runner.own_forward, self.proposer, self.tuner
        if own is None:
            return
        wanted = (
            proposer is not None
            and proposer.reads_hidden
            and (tuner is None or any(tuner.may_draft_next(seq.seq_id) for seq in batch.seqs))
        )
        own.keep_middle = proposer.middle_layer if wanted and proposer is not None else 0

    def emit(self, event: Event) -> None:
        if self._ends is not None and isinstance(event, (RequestFinished, RequestFailed)):
            self._ends[event.request_id] = event
        self.sink(event)

    # ---- requests --------------------------------------------------------------------------
    def run(self, requests: Iterable[Request], *, interruptible: bool = False) -> list[RequestEnd]:
        """Add `requests` and step until the engine has no work left: each request's end
        (RequestFinished or RequestFailed), in the order given. The one way to run an engine to
        the end (the CLI, the benchmarks, the measurements). `interruptible`: Ctrl-C cancels the
        requests instead of unwinding, and each keeps what it generated (the CLI's replies)."""
        ends: dict[int, RequestEnd] = {}
        self._ends = ends
        try:
            ids = [self.add_request(request) for request in requests]
            try:
                while self.has_work():
                    self.step()
            except KeyboardInterrupt:
                if not interruptible:
                    raise
                for request_id in ids:
                    self.abort(request_id)
        finally:
            self._ends = None
        return [ends[request_id] for request_id in ids]

    def add_request(self, request: Request, request_id: int | None = None) -> int:
        if request_id is None:
            request_id, self._next_id = self._next_id, self._next_id + 1
        try:
            seq = self._make_sequence(request, request_id)
        except Exception as exc:  # noqa: BLE001 - any bad request becomes an event, not a crash
            message = (
                str(exc)
                if isinstance(
                    exc,
                    (RequestError, GroupError, ConfigError, GrammarError, chat_template.ChatTemplateError),
                )
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
        refusal = self.limits.refusal(len(ids))
        if refusal is not None:
            raise RequestError(refusal.message)
        params = request.sampling
        vocab = self.loaded.info.vocab_size
        for what, given in (
            ("Token id", ids),
            ("The logit bias's token id", [t for t, _ in params.logit_bias]),
            ("The banned token id", params.banned_token_ids),
        ):
            bad = next((i for i in given if not 0 <= i < vocab), None)
            if bad is not None:
                raise RequestError(f"{what} {bad} is not in the vocabulary (ids 0 to {vocab - 1}).")
        if params.group_size > 1:
            self.groups.check(params)
        use, grammar = tool_use(self.tokenizer, request, params.grammar)
        if grammar is not params.grammar:
            params = replace(params, grammar=grammar)  # the calls' grammar
        seq = Sequence(request_id, ids, len(ids), params, makes_text=request.detokenize)
        seq.tool_use = use
        if params.grammar is not None:
            seq.grammar = self.start_grammar(params, request.reply_prefix_ids)
        seq.sampler = Sampler(params, decode_token=self.text.text)
        seq.detokenizer = self.text.detokenizer(ids, params.stop, request.detokenize)
        return seq

    def start_grammar(self, params: SamplingParams, reply_prefix: tuple[int, ...] = ()) -> GrammarState:
        """A matcher for `params.grammar` replayed over a branch's reply prefix (the tokens the
        reply already has), checked to permit a first token (RequestError: why not)."""
        assert params.grammar is not None
        state = self.grammars.start(params.grammar)
        taken = state.replay(reply_prefix)
        if taken < len(reply_prefix):
            token = reply_prefix[taken]
            raise RequestError(
                f"The reply cannot continue under its {params.grammar.label}: its token {taken} "
                f"({self.text.text(token)!r}) does not follow the grammar."
            )
        if state.finished:
            raise RequestError(f"The reply is already complete under its {params.grammar.label}.")
        try:
            state.mask()
        except GrammarDeadEnd as exc:
            raise RequestError(f"The {params.grammar.label} permits no text here: {exc}.") from None
        return state

    def abort(self, request_id: int) -> None:
        if request_id in self.groups.active:
            self.groups.cancel(request_id)
            return
        seq = self.seqs.get(request_id)
        if seq is not None:
            self.finish(seq, "cancelled")

    def abort_all(self) -> None:
        for request_id in list(self.groups.active):
            self.abort(request_id)
        for request_id in list(self.seqs):
            self.abort(request_id)

    def fail_request(self, seq: Sequence, message: str) -> None:
        """Fail the request `seq` belongs to (its whole group), alone."""
        if seq.group is not None:
            if seq.group.request_id in self.groups.active:
                self.groups.fail(seq.group, message)
            return
        if seq.seq_id in self.seqs:
            self.release(seq)
            self.emit(RequestFailed(seq.seq_id, message, time.perf_counter()))

    def fail_running(self, message: str) -> None:
        """A step raised: every request in flight fails with the message; the engine goes on."""
        for group in list(self.groups.active.values()):
            self.groups.fail(group, message)
        for seq in list(self.seqs.values()):
            self.release(seq)
            self.emit(RequestFailed(seq.seq_id, message, time.perf_counter()))

    def release(self, seq: Sequence) -> None:
        """Out of the queues, blocks freed, draft state dropped."""
        seq.drop_drafts(0)
        self.scheduler.remove(seq)
        self.seqs.pop(seq.seq_id, None)
        if self.proposer is not None:
            self.proposer.release(seq)
        if self.tuner is not None:
            self.tuner.release(seq.seq_id)

    def tool_reply(self, use: ToolUse, request_id: int, token_ids: tuple[int, ...], branch: int = 0) -> None:
        """A reply of a request that offered tools, read for calls (ToolCallsParsed)."""
        self.emit(parsed(use, self.tokenizer, request_id, token_ids, self.eos_ids, branch))

    def finish(self, seq: Sequence, reason: str, note: str = "") -> None:
        self.release(seq)
        seq.finish_reason = reason
        seq.detokenizer.flush()
        if seq.tool_use is not None and reason != "cancelled":
            self.tool_reply(seq.tool_use, seq.seq_id, tuple(seq.output_ids))
        stats = request_stats(seq, seq.token_times, seq.num_output_tokens)
        self.emit(
            RequestFinished(
                seq.seq_id,
                reason,
                seq.detokenizer.text,
                tuple(seq.output_ids),
                stats,
                time.perf_counter(),
                note=note,
            )
        )

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
        # (query tokens, context tokens after the step) per sequence, before the commit moves them
        shapes = tuple((n, seq.num_computed_tokens + n) for seq, n in zip(batch.seqs, batch.num_tokens))
        mark = self.clock.start()
        try:
            result = self._forward(batch)
        except Exception as exc:  # noqa: BLE001 - find the request that broke it; the rest go on
            self._isolate_failed_forward(batch, exc)
            self._drafting = (0.0, 0)
            return
        forward_s = self.clock.stop(mark)  # on CUDA: synchronized, the device's own time
        t_post = time.perf_counter()
        drafting_s, forwards = self._drafting
        rounds = RoundContext(t_post - t_drafted, batch.decode_tokens, self._decoding(batch))
        self.post.run(batch, result, self.step_count, rounds)
        self.peak_blocks_used = max(self.peak_blocks_used, self.kv.pool.num_used)
        t_end = time.perf_counter()
        self.step_count += 1
        if self.tuner is not None and not batch.prefill_tokens:
            # a decode step's cost by its rows: scheduling, forward and postprocessing all grow with them
            self.tuner.observe_step(
                batch.decode_tokens, t_end - t_drafted, t_end - t_post, drafting_s, forwards
            )
        self._drafting = (0.0, 0)
        phases = (t_drafted - t0, forward_s, t_end - t_post)
        self._emit_step(batch, result, shapes, t0, phases, t_end)

    @staticmethod
    def _decoding(batch: ScheduledBatch) -> int:
        """Sequences decoding this step (a token each, or a speculative round)."""
        return sum(1 for seq in batch.seqs if not seq.is_prefill)

    def _logit_counts(self, seqs: list[Sequence], num_tokens: list[int]) -> dict[int, int]:
        return {
            seq.seq_id: 1 + seq.num_draft_tokens
            for seq, n in zip(seqs, num_tokens)
            if seq.num_computed_tokens + n == seq.num_tokens_with_spec
        }

    def _isolate_failed_forward(self, batch: ScheduledBatch, exc: Exception) -> None:
        """The step's forward raised `exc`: run each sequence's part alone; a sequence whose
        own forward raises fails with its error. When none does, the failure needs the whole
        batch (memory, say): the request that joined it last fails, so the batch shrinks. The
        others keep their scheduled blocks and run again next step; drafts are proposed anew."""
        culprits: list[tuple[Sequence, Exception]] = []
        for seq, n in zip(batch.seqs, batch.num_tokens):
            try:
                self.runner.forward([seq], [n], self._logit_counts([seq], [n]))
            except Exception as lone:  # noqa: BLE001 - this sequence's own failure
                culprits.append((seq, lone))
        if not culprits:
            culprits = [(max(batch.seqs, key=lambda s: (s.arrival_time, s.seq_id)), exc)]
        for seq, error in culprits:
            self.fail_request(
                seq, f"the request failed in the model's forward: {type(error).__name__}: {error}"
            )
        for seq in list(self.seqs.values()):
            if seq.num_draft_tokens:
                seq.drop_drafts(0)
                if self.proposer is not None:
                    self.proposer.on_verified(seq, seq.num_tokens_with_spec)
        failed = ", ".join(str(s.group.request_id if s.group else s.seq_id) for s, _ in culprits)
        self.emit(
            EngineError(
                f"a step's forward failed ({type(exc).__name__}: {exc}); request {failed} failed alone, "
                f"the step runs again without it",
                time.perf_counter(),
            )
        )

    def _forward(self, batch: ScheduledBatch) -> ForwardResult:
        """Logit rows: the last packed position of each sequence whose tokens are all in the cache
        after this step, or every verified position of a speculative round."""
        for seq in batch.seqs:
            seq.target_forwards += 1
        counts = self._logit_counts(batch.seqs, batch.num_tokens)
        for group in {id(s.group): s.group for s in batch.seqs if s.group is not None}.values():
            group.measure_blocks()
        self._keep_middle(batch)
        return self.runner.forward(batch.seqs, batch.num_tokens, counts)

    def _emit_step(
        self,
        batch: ScheduledBatch,
        result: ForwardResult,
        shapes: tuple[tuple[int, int], ...],
        t0: float,
        phases: tuple[float, float, float],
        t_end: float,
    ) -> None:
        draft_s, forward_s, post_s = phases
        info = self.loaded.info
        cost = None
        if info.shapes is not None:
            cost = step_cost(
                info.shapes,
                shapes,
                info.weight_bytes_per_param,
                self.storage.bytes_per_block / (self.storage.block_size * info.shapes.kv_elements_per_token),
                logit_rows=result.logits.shape[0],
                linear_weight_bytes=result.record.weight_bytes,
            )
        self.emit(
            StepStats(
                step=self.step_count,
                prefill_tokens=batch.prefill_tokens,
                decode_tokens=batch.decode_tokens,
                num_seqs=len(batch.seqs),
                running=len(self.scheduler.running),
                waiting=len(self.scheduler.waiting),
                duration_s=t_end - t0,
                forward_s=forward_s,
                sample_s=post_s,
                kv=self.kv_stats(),
                prefix_queries=self.kv.queries,
                prefix_query_tokens=self.kv.query_tokens,
                prefix_hit_tokens=self.kv.hit_tokens,
                preemptions=self.scheduler.preemptions,
                seq_shapes=shapes,
                t=t_end,
                logit_rows=result.logits.shape[0],
                draft_s=draft_s,
                kernel=result.record.summary(),
                cost=cost,
            )
        )

    # ---- speculative decoding: drafts before the schedule ----------------------------------
    def _propose_drafts(self) -> None:
        """Give each decoding sequence its round of draft tokens (as many as its draft length,
        engine.speculative.adaptive), kept apart from its tokens (spec_token_ids) until verified;
        the scheduler and the runner compute them after it. A free proposer also proposes for
        sequences at length 0: shadow drafts, scored against what they then decode; its length
        is chosen knowing what the proposal rests on (Proposer.evidence), and a sequence it has
        nothing for decodes plainly."""
        spec, proposer, tuner = self.config.speculative, self.proposer, self.tuner
        assert spec is not None and proposer is not None and tuner is not None
        decoding = [
            seq
            for seq in self.scheduler.running
            if seq.num_tokens - seq.num_computed_tokens == 1 and seq.num_output_tokens > 0
        ]
        asked: list[Sequence] = []
        lengths: list[int] = []
        shadows: list[Sequence] = []
        for seq in decoding:
            tuner.score_shadow(seq.seq_id, seq.token_ids)
            cap = min(
                seq.params.max_new_tokens - seq.num_output_tokens - 1,
                self.max_model_len - seq.num_tokens - 1,
            )
            evidence = proposer.evidence(seq) if proposer.free else 0
            if proposer.free and evidence == 0:
                seq.draft_length = 0  # nothing to propose: nothing to decide or learn
                continue
            before = tuner.tuning(seq.seq_id).draft_length
            k = tuner.choose(seq.seq_id, len(decoding), cap, evidence)
            after = tuner.tuning(seq.seq_id).draft_length
            if after != before:
                self.emit(DraftLength(seq.seq_id, after, tuner.acceptance(seq.seq_id), time.perf_counter()))
            seq.draft_length = k
            if k > 0:
                asked.append(seq)
                lengths.append(k)
            elif cap > 0 and tuner.wants_shadow(seq.seq_id):
                shadows.append(seq)
        if not asked and not shadows:
            return
        start = time.perf_counter()
        proposals = proposer.propose([*asked, *shadows], [*lengths, *[spec.num_draft] * len(shadows)])
        seconds = time.perf_counter() - start
        for seq, (drafts, qs) in zip(asked, proposals):
            if not drafts:
                tuner.nothing_drafted(seq.seq_id, seq.draft_length)
            seq.spec_token_ids = list(drafts)
            seq.draft_q = list(qs)
            seq.draft_s = seconds / (len(asked) + len(shadows))
        for seq, (drafts, _) in zip(shadows, proposals[len(asked) :]):
            tuner.start_shadow(seq.seq_id, seq.num_tokens, drafts, tuner.tuning(seq.seq_id).evidence)
        if asked:
            self._drafting = (seconds, max(1, proposer.forwards))

    def _greedy_replies(self, prompts: tuple[str, ...], new_tokens: int) -> Calibration:
        """The target's greedy replies to `prompts` on a plain engine of its own (the
        self-draft's calibration): each full token sequence and where its reply starts."""
        # a pool of this engine's own size (the memory its user allowed: the replies run in as
        # many waves as it takes; the packaged model's 116 take ~30 s at 2 cores, in two)
        plain = replace(self.config, speculative=None, num_blocks=self.kv.pool.num_blocks)
        self.emit(
            ModelLoading(
                f"self-draft: fitting its head on the model's own replies to {len(prompts)} prompts "
                f"(once per model, then cached)",
                0.99,
                time.perf_counter(),
            )
        )
        engine = LLMEngine(self.loaded, plain)
        params = SamplingParams(temperature=0.0, max_new_tokens=new_tokens)
        requests = [Request.chat(prompt, sampling=params) for prompt in prompts]
        sequences, starts = [], []
        for request, end in zip(requests, engine.run(requests)):
            if isinstance(end, RequestFinished) and end.token_ids:
                prompt = engine.prompt_ids(request)
                sequences.append([*prompt, *end.token_ids])
                starts.append(len(prompt))
        return Calibration(sequences, starts)

    def _trim_drafts(self, batch: ScheduledBatch) -> None:
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
                    seq.draft_length = min(seq.draft_length, keep)  # what the tuner asked, as verified
                    self.proposer.on_verified(seq, seq.num_tokens_with_spec)

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
        self.release(seq)
        self.emit(RequestFailed(seq.seq_id, message, time.perf_counter()))

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
        draft_weights, draft_cache = self.proposer.memory_bytes() if self.proposer is not None else (0, 0)
        sample = MemorySample(
            weights_bytes=self.loaded.info.weight_bytes,
            kv_pool_bytes=self.storage.total_bytes,
            kv_used_bytes=self.kv.pool.num_used * self.storage.bytes_per_block,
            process_bytes=process,
            process_reserved_bytes=reserved,
            device_total_bytes=total,
            source=source,
            t=time.perf_counter(),
            draft_weights_bytes=draft_weights,
            draft_cache_bytes=draft_cache,
        )
        self.emit(sample)
        return sample
