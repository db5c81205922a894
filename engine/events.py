"""Typed events: the only things that cross from the engine thread into the app.

Every event is a small frozen dataclass carrying plain Python values (no tensors), so a
consumer on another thread can keep them without touching torch or the engine's state.
`t` is `time.perf_counter()` on the engine thread when the event was made.

One module past 400 lines on purpose: it is the whole vocabulary that crosses from the engine to
the GUI and over the wire (engine/serve/codec.py serialises every dataclass found here), and a
reader should find all of it in one place.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.shapes import ModelShapes


@dataclass(frozen=True, slots=True)
class ModelLoading:
    stage: str  # human-readable step, e.g. "converting GGUF to HF folder (first run only)"
    fraction: float  # 0..1, best effort
    t: float = 0.0


@dataclass(frozen=True, slots=True)
class ModelInfo:
    name: str
    source: str
    architecture: str
    dtype: str
    device: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    max_position_embeddings: int
    params: int
    weight_bytes: int
    kv_bytes_per_token: int  # of a pool whose config says "auto" (stored as kv_dtype)
    load_seconds: float
    # The weight scheme applied at load (engine.quant.schemes) and what the same weights took in
    # the load dtype before it: the "before" of the app's weights before/after. None: not known.
    quantization: str = "none"
    weight_bytes_before: int | None = None
    # The shapes every cost formula reads (KV bytes per token, FLOPs and bytes per step).
    shapes: ModelShapes | None = None
    # Lines the app shows about how the model runs: what native loading kept, the forward used,
    # which kernel runs which rows (measured), the engine's thread count.
    notes: tuple[str, ...] = ()
    # Bytes per weight element as stored (fractional for packed formats: 4-bit codes with their
    # group scales are ~0.56); what a step that reads the weights in their own format moves.
    weight_bytes_per_param: float = 0.0
    # What kvscope does to this model's conversations, for the user (engine/text/chat_template.py):
    # a system prompt merged into the first user turn, or plain text for a model without a
    # template. "" when the template takes the conversation as it is.
    chat_note: str = ""
    # What a KV pool whose config says "auto" stores (engine.shapes.auto_kv_dtype: float16 for a
    # GGUF at its own bits); "" for the model's dtype (a remote engine's, or a hand-made info).
    kv_dtype: str = ""

    def kv_stored_as(self, kv_dtype: str) -> str:
        """What a pool configured with `kv_dtype` (engine.config.KV_DTYPES) stores: "int8", or a
        dtype."""
        return kv_dtype if kv_dtype != "auto" else self.kv_dtype or self.dtype


@dataclass(frozen=True, slots=True)
class ModelLoaded:
    info: ModelInfo
    kv_num_blocks: int
    kv_block_size: int
    kv_pool_bytes: int
    t: float = 0.0


@dataclass(frozen=True, slots=True)
class ModelLoadFailed:
    message: str
    t: float = 0.0


@dataclass(frozen=True, slots=True)
class RequestStarted:
    request_id: int
    prompt_tokens: int
    t: float = 0.0


@dataclass(frozen=True, slots=True)
class StageSnapshot:
    """The top candidates' probabilities after one sampling stage.

    `probs[i]` belongs to `TokenSnapshot.candidate_ids[i]`; 0.0 where the stage removed it.
    """

    name: str  # "raw", "repetition_penalty", "temperature", "top_k", "top_p", "min_p", ...
    probs: tuple[float, ...]
    removed: tuple[bool, ...]  # removed by THIS stage (not by an earlier one)
    kept_count: int  # tokens of the whole vocabulary still allowed after this stage
    kept_mass: float  # probability mass (under the previous stage) that this stage kept


@dataclass(frozen=True, slots=True)
class GrammarSnapshot:
    """What the grammar's token mask (the sampler's first stage, "grammar") did at one token."""

    allowed: int  # tokens of the vocabulary the grammar permitted here
    vocab_size: int
    removed_mass: float  # raw probability mass of the tokens it did not permit
    forced: bool  # exactly one token was permitted
    accepting: bool  # the text so far was complete (ending here was allowed)
    # What the grammar forces from here on (llguidance's fast-forward tokens), when any.
    forced_ids: tuple[int, ...] = ()
    forced_texts: tuple[str, ...] = ()
    # The likeliest tokens (by raw probability) the mask removed, with that probability.
    cut_ids: tuple[int, ...] = ()
    cut_texts: tuple[str, ...] = ()
    cut_probs: tuple[float, ...] = ()


@dataclass(frozen=True, slots=True)
class TokenSnapshot:
    candidate_ids: tuple[int, ...]
    candidate_texts: tuple[str, ...]
    stages: tuple[StageSnapshot, ...]
    drawn_id: int
    drawn_prob: float  # probability of the drawn token under the final distribution
    entropy: float  # nats, final distribution
    raw_entropy: float  # nats, raw softmax(logits)
    # The raw logits of the top candidates (sorted descending) and the log-sum-exp of the whole
    # vocabulary, so a what-if under other settings can be recomputed without the model.
    raw_top_ids: tuple[int, ...] = ()
    raw_top_logits: tuple[float, ...] = ()
    raw_logsumexp: float = 0.0
    penalized_top_logits: tuple[float, ...] = ()  # the same ids after penalties (before temperature)
    # Constrained decoding: the grammar stage's own record (its StageSnapshot is stages[1]).
    grammar: GrammarSnapshot | None = None


@dataclass(frozen=True, slots=True)
class TokenGenerated:
    request_id: int
    index: int  # 0-based position in the reply
    token_id: int
    text: str  # the token's own text, for display
    text_delta: str  # what this token adds to the streamed reply (may be "" mid multi-byte char)
    logprob: float  # log p(token) under the final sampling distribution
    snapshot: TokenSnapshot | None = None
    # Speculative decoding: "accepted" (a draft token kept), "resampled" (drawn from the
    # residual after a rejection), "bonus" (drawn after all drafts were kept), "" otherwise.
    spec: str = ""
    spec_round: int = -1
    t: float = 0.0
    # Which sample of an n-sample request this token extends (0..n-1; 0 for a plain request).
    # Beam search streams no tokens: its beams change every step (see BeamStep).
    branch: int = 0


@dataclass(frozen=True, slots=True)
class RequestStats:
    prompt_tokens: int
    generated_tokens: int
    cached_prompt_tokens: int
    ttft_s: float
    itl_s: tuple[float, ...]
    tokens_per_s: float
    preemptions: int
    peak_blocks: int
    target_forwards: int = 0
    spec_rounds: int = 0
    spec_drafted: int = 0
    spec_accepted: int = 0
    spec_accepted_by_position: tuple[int, ...] = ()  # rounds whose i-th draft was kept
    spec_drafted_by_position: tuple[int, ...] = ()  # rounds that had an i-th draft
    # Measured saving of its speculative rounds against plain decoding, seconds (negative: a loss)
    spec_saved_s: float = 0.0
    # vLLM's request phases: arrival -> first scheduled (queued), first scheduled -> first token
    # (prefill: the prompt's processing, chunks and any wait between them). ttft_s is their sum.
    queued_s: float = 0.0
    prefill_s: float = 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.spec_accepted / self.spec_drafted if self.spec_drafted else 0.0

    @property
    def mean_accepted_length(self) -> float:
        return self.spec_accepted / self.spec_rounds if self.spec_rounds else 0.0


@dataclass(frozen=True, slots=True)
class SequenceResult:
    """One finished sequence of an n-sample or beam-search request."""

    branch: int  # the sample's index (n samples) or its rank (beams, 0 = best)
    text: str
    token_ids: tuple[int, ...]
    # Samples: the sum of their tokens' log-probs under the sampling distribution. Beams:
    # transformers' beam score, sum(log-probs) / len(token_ids) ** length_penalty.
    score: float
    finish_reason: str  # "stop" (EOS or stop string), "length", "cancelled"


@dataclass(frozen=True, slots=True)
class GroupStats:
    """KV memory of a request's sequences with block sharing, against what they would need alone.

    Both are peaks over the request's steps: `shared_blocks` the distinct blocks its sequences
    held at once, `unshared_blocks_equivalent` the blocks they would have held with a private
    copy of every shared block (the sum of their block-table lengths)."""

    kind: str  # "samples" or "beams"
    num_sequences: int  # n, or num_beams
    shared_blocks: int
    unshared_blocks_equivalent: int
    cow_copies: int  # shared, partly filled blocks copied before a sequence wrote into them
    forks: int = 0  # sequences started by sharing another's blocks
    pruned: int = 0  # beams dropped by the search (their blocks freed)

    @property
    def saving(self) -> float:
        """Fraction of the unshared blocks that sharing saved (0.25 = a quarter fewer)."""
        if not self.unshared_blocks_equivalent:
            return 0.0
        return 1.0 - self.shared_blocks / self.unshared_blocks_equivalent


@dataclass(frozen=True, slots=True)
class RequestFinished:
    request_id: int
    # "stop" (EOS, a stop string, or the grammar's end), "length", "cancelled", "grammar" (the
    # grammar permitted no next token: `note` says so)
    finish_reason: str
    text: str  # for n samples / beams: of the first entry of `sequences`
    token_ids: tuple[int, ...]
    stats: RequestStats
    t: float = 0.0
    # n samples (n > 1) or beam search (num_beams > 1): every sequence, best score first, and
    # the group's memory figures. Empty / None for a plain request.
    sequences: tuple[SequenceResult, ...] = ()
    group: GroupStats | None = None
    note: str = ""  # why it ended, when the reason needs words (finish_reason "grammar")


@dataclass(frozen=True, slots=True)
class SequenceForked:
    """A sequence of a group started as a copy of `parent_seq_id`: it shares all the parent's KV
    blocks (a "share" BlockEvent under `seq_id` follows). `seq_id` names its blocks in BlockEvents."""

    request_id: int
    parent_seq_id: int
    seq_id: int
    branch: int  # sample index (n samples) or beam slot (beam search) it takes
    num_tokens: int  # prompt + generated tokens it shares with the parent
    t: float = 0.0


@dataclass(frozen=True, slots=True)
class SequenceFinished:
    """One sequence of a group ended before its request: a sample finished ("stop", "length"),
    or a beam was dropped by the search ("pruned"). Its blocks are released ("free" follows)."""

    request_id: int
    seq_id: int
    branch: int
    finish_reason: str  # "stop", "length", "pruned"
    t: float = 0.0


@dataclass(frozen=True, slots=True)
class FinishedBeam:
    """A hypothesis that ended at a beam step and entered the kept (best num_beams) set."""

    parent: int  # the beam slot (of the previous step) it extends
    token_id: int  # its last token (EOS, or any token at max_new_tokens)
    score: float  # sum(log-probs) / generated_len ** length_penalty


@dataclass(frozen=True, slots=True)
class BeamStep:
    """One step of a beam search, for drawing the beam tree. After step s, beam slot j holds
    the beam that extends slot `parents[j]` of step s - 1 (step 0: every parent is 0, the
    prompt) by `token_ids[j]`; its running score is the sum of its tokens' log-probs."""

    request_id: int
    step: int  # 0-based: the index of the token just chosen
    parents: tuple[int, ...]
    token_ids: tuple[int, ...]
    token_texts: tuple[str, ...]
    scores: tuple[float, ...]
    seq_ids: tuple[int, ...]  # the engine sequence holding each beam (its blocks' owner)
    finished: tuple[FinishedBeam, ...] = ()
    done: bool = False  # the search ended at this step (RequestFinished follows)
    t: float = 0.0


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One function call: the tool's name and its arguments as JSON text (OpenAI's shape)."""

    name: str
    arguments: str = "{}"
    id: str = ""


@dataclass(frozen=True, slots=True)
class ToolCallsParsed:
    """The reply of a request that offered tools, read in the model family's tool-call format
    (engine.tools.formats), just before its RequestFinished. `calls` empty and `error` empty:
    the model answered in words. `error`: the model wrote a call that does not parse; `raw`
    keeps what it wrote, and no call is made from it."""

    request_id: int
    format: str  # "hermes", "llama3_json", "mistral"
    content: str  # the reply's text outside its calls
    calls: tuple[ToolCall, ...] = ()
    raw: str = ""  # the calls' text as the model wrote it (markers included)
    # The reply tokens that hold the calls: output_ids[token_start:token_end]
    token_start: int = 0
    token_end: int = 0
    error: str = ""
    branch: int = 0  # the sample (n > 1) or beam rank whose reply this is
    t: float = 0.0


@dataclass(frozen=True, slots=True)
class RequestFailed:
    request_id: int
    message: str
    t: float = 0.0


@dataclass(frozen=True, slots=True)
class SpecRound:
    """One speculative round of one request: the drafts, both distributions at each, and the
    verdict. `emitted` are the tokens this round added (kept drafts, then one more)."""

    request_id: int
    round: int
    proposer: str
    draft_ids: tuple[int, ...]
    q_probs: tuple[float, ...]  # draft probability of each draft token (1.0 for n-gram)
    p_probs: tuple[float, ...]  # target probability of each examined draft token
    accept_probs: tuple[float, ...]  # min(1, p/q)
    accepted: int
    emitted: tuple[int, ...]
    bonus: bool
    t: float = 0.0
    # What the round cost and bought, measured by the engine (engine/speculative/adaptive.py):
    # the draft length it was given (its drafts may be fewer: a lookup without a match, a draft
    # below its confidence), its share of the drafting time, and the time it saved against
    # plain decoding (the tokens beyond the first at a plain token's time, less the step's time
    # beyond a plain step of its other rows, less the drafting; negative: a loss).
    draft_length: int = 0
    draft_s: float = 0.0
    saved_s: float = 0.0


@dataclass(frozen=True, slots=True)
class DraftLength:
    """A request's draft length changed (adaptive speculative decoding): the drafts it will be
    given per round from now on (0: it decodes plainly, probing or scoring shadow drafts now and
    then), chosen on its recent acceptance and the engine's measured step costs."""

    request_id: int
    draft_length: int
    acceptance: float  # the recent acceptance it was chosen on (decayed over the last rounds)
    t: float = 0.0


BLOCK_OPS = ("allocate", "append", "rollback", "share", "free", "cache", "evict", "cow")


@dataclass(frozen=True, slots=True)
class BlockEvent:
    """One mutation of the KV block pool.

    op:
      allocate  blocks taken from the free queue for `seq_id`
      append    `token_start..token_end` of `seq_id` were written into `block_ids`
      rollback  speculative slots `token_start..token_end` were discarded; `fills` are the
                blocks' new fill levels (blocks left empty are then freed)
      share     blocks reused by `seq_id`, ref count + 1: a prefix-cache hit, or a fork taking
                its parent's blocks (n samples, beams; see SequenceForked)
      free      `seq_id` released its reference; blocks may stay cached
      cache     full blocks got a prefix hash (reusable after free)
      evict     a cached-free block lost its hash because it was reused for new data
      cow       copy-on-write: `seq_id` was about to write into `src_block_ids[i]`, a partly
                filled block it shares; the source's `fills[i]` slots were copied into
                `block_ids[i]` (allocated to `seq_id` by the "allocate" just before), which
                takes the source's place in its block table, from position `token_start`. A
                "free" of the source by `seq_id` follows (its other holders keep it).
    """

    op: str
    block_ids: tuple[int, ...]
    seq_id: int | None
    token_start: int = 0
    token_end: int = 0
    # For "append" and "share": slots written in each of `block_ids` after the op (a block's
    # fill level, 1..block_size). Empty for the other ops.
    fills: tuple[int, ...] = ()
    t: float = 0.0
    src_block_ids: tuple[int, ...] = ()  # "cow": the shared block each of `block_ids` copies

    def block_start(self, i: int, block_size: int) -> int:
        """Position of the first slot of the event's i-th block in its sequence. Blocks are
        position-aligned: the i-th block of an event covering tokens from `token_start` holds
        logical block token_start // block_size + i. (The pool keeps it on its blocks, the page
        map folds it from the events: one rule for both.)"""
        return (self.token_start // block_size + i) * block_size


@dataclass(frozen=True, slots=True)
class KVStats:
    num_blocks: int
    block_size: int
    used_blocks: int  # ref count > 0
    cached_free_blocks: int  # ref count 0 but holding a reusable prefix hash
    free_blocks: int  # ref count 0 (includes cached_free_blocks)
    used_slots: int  # token slots written across used blocks
    bytes_per_block: int
    pool_bytes: int

    @property
    def allocated_slots(self) -> int:
        return self.used_blocks * self.block_size

    @property
    def utilisation(self) -> float:
        """Written slots over allocated slots: internal fragmentation shows as < 1."""
        return self.used_slots / self.allocated_slots if self.used_blocks else 1.0


@dataclass(frozen=True, slots=True)
class StepCost:
    """FLOPs and bytes of one engine step (engine.measure.roofline.step_cost computes it from
    what the step actually ran: its sequences, its LM-head rows, the kernels' weight bytes)."""

    flops: int | float
    weight_bytes: int | float  # layer weights, gathered embedding rows, the LM head when it runs
    kv_read_bytes: int | float
    kv_write_bytes: int | float
    # Every term above by name, for the roofline's tooltip.
    breakdown: dict[str, int | float] = field(default_factory=dict, compare=False)

    @property
    def bytes_total(self) -> int | float:
        return self.weight_bytes + self.kv_read_bytes + self.kv_write_bytes

    @property
    def intensity(self) -> float:
        """Arithmetic intensity, FLOPs per byte moved: where the step sits on the roofline."""
        return self.flops / self.bytes_total


@dataclass(frozen=True, slots=True)
class StepStats:
    step: int
    prefill_tokens: int
    decode_tokens: int
    num_seqs: int
    running: int
    waiting: int
    duration_s: float
    forward_s: float
    sample_s: float
    kv: KVStats
    # Cumulative since the engine started: prefix-cache lookups, prompt tokens looked up and
    # tokens served from cache, and preemptions.
    prefix_queries: int = 0
    prefix_query_tokens: int = 0
    prefix_hit_tokens: int = 0
    preemptions: int = 0
    # This step's (query tokens, context tokens) per scheduled sequence: the shapes the
    # roofline's FLOP and byte counts are computed from.
    seq_shapes: tuple[tuple[int, int], ...] = ()
    t: float = 0.0
    # Rows the LM head computed (one per sequence that samples; 1 + drafts for a speculative
    # round; one per beam), as the runner ran them: never inferred from the tokens emitted.
    logit_rows: int = 0
    # Phase times: drafting (speculative proposers, before the target forward), the target
    # forward, then postprocess (commit, sampling, verification, events) in `sample_s`.
    # `forward_s` never includes drafting; duration_s also holds the (small) scheduling time.
    draft_s: float = 0.0
    # The matmul kernel the step's linears ran ("fp32", "int4-packed/bf16", ...), as chosen by
    # rows; and the step's FLOPs and bytes computed by the engine from what it ran.
    kernel: str = ""
    cost: StepCost | None = None


@dataclass(frozen=True, slots=True)
class MemorySample:
    """Memory by what holds it; every figure names where it came from."""

    weights_bytes: int
    kv_pool_bytes: int
    kv_used_bytes: int
    process_bytes: int  # RSS on CPU; torch.cuda.memory_allocated on CUDA
    process_reserved_bytes: int  # RSS again on CPU; torch.cuda.memory_reserved on CUDA
    device_total_bytes: int  # system RAM / GPU memory
    source: str  # e.g. "psutil RSS" or "torch.cuda counters" or "NVML"
    t: float = 0.0
    # A speculative draft model's own weights and its KV cache (0 without one; a self-draft
    # shares the target's weights and counts only its cache).
    draft_weights_bytes: int = 0
    draft_cache_bytes: int = 0


@dataclass(frozen=True, slots=True)
class EngineError:
    """A failure outside any request (the engine keeps serving where it can)."""

    message: str
    t: float = 0.0


Event = (
    ModelLoading
    | ModelLoaded
    | ModelLoadFailed
    | RequestStarted
    | TokenGenerated
    | RequestFinished
    | RequestFailed
    | ToolCallsParsed
    | SequenceForked
    | SequenceFinished
    | BeamStep
    | BlockEvent
    | SpecRound
    | DraftLength
    | StepStats
    | MemorySample
    | EngineError
)

# How a request ends: finished (stopped, at its length or cancelled) or failed with a message.
RequestEnd = RequestFinished | RequestFailed
