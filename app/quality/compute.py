"""What the running quantization costs against full precision: one run, on the calling thread (the
QualityController calls it from a worker). The engine measures (engine.api.measure_quality: both
copies of the model, their distributions over the same tokens, their greedy speed); this module
turns the job into its question and the answer into what the quality panel and the probability
panel's reference overlay draw.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from app.quality.jobs import EVAL_TEXT, QualityJob, QualityUnavailable
from engine.api import MeasurementError, QualityReport, SpeedFigures, measure_quality
from engine.config import ModelSpec
from widgets.reference import ReferenceDistribution

__all__ = ["QualityResult", "SpeedFigures", "compute_quality", "reference_label"]


@dataclass(frozen=True, slots=True)
class QualityResult:
    job: QualityJob
    report: QualityReport  # over `token_ids`
    token_ids: tuple[int, ...]
    token_texts: tuple[str, ...]
    reply_start: int | None  # position of the reply's first token in token_ids (None: no reply)
    truncated: int  # tokens dropped from the start to stay within the engine's MAX_TOKENS
    reference: dict[int, ReferenceDistribution]  # reply token index -> reference there
    quantized_speed: SpeedFigures | None
    reference_speed: SpeedFigures | None
    seconds: float

    @property
    def scheme(self) -> str:
        return self.job.spec.quantization

    @property
    def reference_label(self) -> str:
        return reference_label(self.job.spec)


def reference_label(spec: ModelSpec) -> str:
    return f"full precision ({spec.dtype})"


def compute_quality(
    job: QualityJob, progress: Callable[[str], None] = lambda text: None, cancelled=lambda: False
) -> QualityResult | None:
    """The whole run, on the calling thread; None when `cancelled()` turned true on the way."""
    reply = job.reply
    try:
        run = measure_quality(
            job.spec,
            job.kv_dtype,
            None if job.source == EVAL_TEXT else job.messages,
            reply.token_ids if reply is not None else (),
            reply.prompt_tokens if reply is not None else None,
            job.speed_tokens,
            progress,
            cancelled,
            reply.candidate_ids if reply is not None else (),
        )
    except MeasurementError as exc:
        raise QualityUnavailable(str(exc)) from None
    if run is None:
        return None
    label = reference_label(job.spec)
    overlay = {
        index: ReferenceDistribution(label, at.probs, at.top_id, at.top_text, at.top_prob, at.kl)
        for index, at in run.references.items()
    }
    return QualityResult(
        job,
        run.report,
        run.token_ids,
        run.token_texts,
        run.reply_start,
        run.truncated,
        overlay,
        run.quantized_speed,
        run.reference_speed,
        run.seconds,
    )
