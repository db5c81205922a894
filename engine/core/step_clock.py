"""How long a step's forward took on its device.

On the CPU the forward returns when its work is done: the wall clock around it is its time. On
CUDA it returns once its kernels are queued; the wall clock would time the launches, and the
work would land in whatever synchronizes next (the sampler reading the logits). So on CUDA the
forward is bracketed by two CUDA events, the second one synchronized before the step goes on,
and the forward's time is the device's elapsed time between them (`Event.elapsed_time`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(slots=True)
class Mark:
    wall: float
    event: Any = None  # a torch.cuda.Event recorded at the start (CUDA only)


class DeviceClock:
    def __init__(self, device: torch.device, cuda: Any = None) -> None:
        """`cuda`: the module with Event (torch.cuda by default; a test passes a fake)."""
        self.cuda = (cuda if cuda is not None else torch.cuda) if device.type == "cuda" else None

    @property
    def synchronizes(self) -> bool:
        return self.cuda is not None

    def start(self) -> Mark:
        if self.cuda is None:
            return Mark(time.perf_counter())
        event = self.cuda.Event(enable_timing=True)
        event.record()
        return Mark(time.perf_counter(), event)

    def stop(self, mark: Mark) -> float:
        """Seconds the device spent since `mark`; on CUDA it waits for the work to finish."""
        if self.cuda is None or mark.event is None:
            return time.perf_counter() - mark.wall
        end = self.cuda.Event(enable_timing=True)
        end.record()
        end.synchronize()
        return float(mark.event.elapsed_time(end)) / 1000.0  # elapsed_time is in milliseconds
