"""Proposers of draft tokens: n-gram prompt lookup, a draft model, or the target's first layers.
Their guesses are checked by engine.speculative.verify."""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Protocol

import torch
from transformers import DynamicCache

from engine.config import ConfigError, EngineConfig, ModelSpec, SamplingParams
from engine.model.loaded import LoadedModel
from engine.model.loading import load_model
from engine.sampling.sampler import Sampler

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase


class Sequence(Protocol):
    """What a proposer reads of a sequence (engine.core.sequence.Sequence): its committed tokens,
    where its prompt ends, and its sampling settings."""

    @property
    def seq_id(self) -> int: ...

    @property
    def token_ids(self) -> list[int]: ...

    @property
    def num_prompt_tokens(self) -> int: ...

    @property
    def output_ids(self) -> list[int]: ...

    @property
    def params(self) -> SamplingParams: ...


class Proposer(Protocol):
    """What the engine asks of a proposer (n-gram lookup or a draft model)."""

    name: str

    def propose(self, seq: Sequence, k: int) -> tuple[list[int], list[torch.Tensor | None]]:
        """Up to k draft tokens and, per draft, its distribution q (None: one-hot)."""
        ...

    def on_verified(self, seq: Sequence, valid_tokens: int) -> None:
        """Only the sequence's first `valid_tokens` tokens are still true."""
        ...

    def release(self, seq: Sequence) -> None: ...

    def memory_bytes(self) -> tuple[int, int]:
        """(own weights, own caches) in bytes."""
        ...


class NgramProposer:
    """Prompt lookup: find the latest earlier occurrence of the sequence's last n tokens (n from
    `max_n` down to `min_n`) and propose the tokens that followed it. No model; q is one-hot."""

    name = "ngram"

    def __init__(self, max_n: int = 3, min_n: int = 1):
        self.max_n, self.min_n = max_n, min_n

    def propose(self, seq: Sequence, k: int) -> tuple[list[int], list[torch.Tensor | None]]:
        tokens = seq.token_ids
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            tail = tokens[-n:]
            for start in range(len(tokens) - n - 1, -1, -1):
                if tokens[start : start + n] == tail:
                    follow = tokens[start + n : start + n + k]
                    if follow:
                        return list(follow), [None] * len(follow)
        return [], []

    def on_verified(self, seq: Sequence, valid_tokens: int) -> None:
        pass

    def release(self, seq: Sequence) -> None:
        pass

    def memory_bytes(self) -> tuple[int, int]:
        """(own weights, own caches): a lookup in the sequence's tokens holds neither."""
        return 0, 0


class DraftModelProposer:
    """A smaller causal LM sharing the target's tokenizer proposes k tokens autoregressively,
    sampled under the request's own sampling settings (its q). Each sequence keeps a draft-side
    DynamicCache, cropped back to the verified prefix after every round."""

    def __init__(self, model: PreTrainedModel, name: str = "draft", weights_bytes: int = 0):
        self.model = model
        self.name = name
        # the draft's own weights (0 for a self-draft, which shares the target's)
        self.weights_bytes = weights_bytes
        self._state: dict[int, tuple[DynamicCache, int, Sampler]] = {}

    def memory_bytes(self) -> tuple[int, int]:
        """(own weights, the K/V its per-sequence caches hold now)."""
        cache_bytes = 0
        for cache, _, _ in self._state.values():
            for layer in getattr(cache, "layers", []):
                for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
                    if isinstance(t, torch.Tensor):
                        cache_bytes += t.numel() * t.element_size()
        return self.weights_bytes, cache_bytes

    @torch.inference_mode()
    def propose(self, seq: Sequence, k: int) -> tuple[list[int], list[torch.Tensor | None]]:
        cache, cached, sampler = self._state.get(seq.seq_id) or (
            DynamicCache(config=self.model.config),
            0,
            Sampler(seq.params),
        )
        device = next(self.model.parameters()).device
        new = seq.token_ids[cached:]
        prompt, output = seq.token_ids[: seq.num_prompt_tokens], list(seq.output_ids)
        logits = self._forward(new, cached, cache, device)
        drafts: list[int] = []
        qs: list[torch.Tensor | None] = []
        for i in range(k):
            q = sampler.distribution(logits, prompt, output + drafts)
            x = int(q.argmax()) if seq.params.greedy else sampler.draw(q)
            drafts.append(x)
            qs.append(q)
            if i < k - 1:
                logits = self._forward([x], len(seq.token_ids) + i, cache, device)
        self._state[seq.seq_id] = (cache, len(seq.token_ids) + k - 1, sampler)
        return drafts, qs

    def _forward(self, ids: list[int], start: int, cache: DynamicCache, device: torch.device) -> torch.Tensor:
        input_ids = torch.tensor([ids], device=device)
        positions = torch.arange(start, start + len(ids), device=device)[None]
        out = self.model(
            input_ids=input_ids, position_ids=positions, cache=cache, use_cache=True, logits_to_keep=1
        )
        logits: torch.Tensor = out.logits
        return logits[0, -1].float()

    def on_verified(self, seq: Sequence, valid_tokens: int) -> None:
        """Only the first `valid_tokens` of the sequence are still true; drop the rest."""
        state = self._state.get(seq.seq_id)
        if state is None:
            return
        cache, cached, sampler = state
        keep = min(cached, valid_tokens)
        if cached > keep:
            cache.crop(-(cached - keep))  # transformers 5.x: a negative count removes tokens
        self._state[seq.seq_id] = (cache, keep, sampler)

    def release(self, seq: Sequence) -> None:
        self._state.pop(seq.seq_id, None)


def first_layers(model: PreTrainedModel, num_layers: int) -> PreTrainedModel:
    """A self-draft: the target truncated to its first `num_layers` decoder layers (then its
    final norm and LM head), sharing the target's weights: no extra weight memory."""
    inner = model.model
    if not 1 <= num_layers < inner.config.num_hidden_layers:
        raise ValueError(
            f"a self-draft needs 1..{inner.config.num_hidden_layers - 1} layers, got {num_layers}"
        )
    draft_inner = copy.copy(inner)
    draft_inner._modules = dict(inner._modules)
    draft_inner.config = copy.deepcopy(inner.config)
    draft_inner.config.num_hidden_layers = num_layers
    draft = copy.copy(model)
    draft._modules = dict(model._modules)
    draft._modules["model"] = draft_inner
    draft.config = draft_inner.config
    return draft


def make_proposer(config: EngineConfig, loaded: LoadedModel) -> Proposer:
    """The proposer named by `config.speculative` for the target `loaded`."""
    spec = config.speculative
    assert spec is not None, "the engine makes a proposer only for a speculative config"
    if spec.method == "ngram":
        return NgramProposer()
    if spec.method == "self":
        layers = spec.self_draft_layers or max(1, loaded.info.num_layers // 4)
        return DraftModelProposer(first_layers(loaded.model, layers), name=f"self ({layers} layers)")
    assert spec.draft_model, "SpeculativeConfig requires a draft model for 'draft'"
    draft = load_model(ModelSpec(spec.draft_model, dtype=loaded.info.dtype, device=str(loaded.device.type)))
    check_same_tokenizer(loaded.tokenizer, draft.tokenizer)
    return DraftModelProposer(
        draft.model, name=f"draft ({draft.info.name})", weights_bytes=draft.info.weight_bytes
    )


PROBE_TEXT = "Speculative decoding checks drafts: 42 tokens, naïve café, 你好, 🙂."


def check_same_tokenizer(
    target_tokenizer: PreTrainedTokenizerBase, draft_tokenizer: PreTrainedTokenizerBase
) -> None:
    """Draft tokens are target tokens: the two vocabularies must agree."""
    same = len(target_tokenizer) == len(draft_tokenizer) and target_tokenizer.encode(
        PROBE_TEXT
    ) == draft_tokenizer.encode(PROBE_TEXT)
    if not same:
        raise ConfigError(
            "The draft model's tokenizer differs from the target's, so its tokens cannot be verified; "
            "choose a draft model of the same family (same vocabulary)."
        )
