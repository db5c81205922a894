"""engine bench times the engine as the app and the server run it: the heap its loads leave is
frozen out of Python's full collections while it measures (engine/core/gc_heap.py), and
collectable again when the bench returns."""

from __future__ import annotations

import gc

import pytest

from engine.bench import bench
from engine.cli.main import build_parser


class Measured(Exception):
    """Stops the bench once its first timed reply has begun."""


def test_the_bench_measures_with_the_load_s_heap_frozen_and_thaws_it_after(monkeypatch):
    args = build_parser().parse_args(
        ["bench", "--model", "default", "--paths", "native", "--prompt-tokens", "8", "--new-tokens", "2"]
    )
    frozen_while_timing = []

    def timed_reply(*_args, **_kwargs):
        frozen_while_timing.append(gc.get_freeze_count())
        raise Measured

    monkeypatch.setattr(bench, "run_engine", timed_reply)
    assert gc.get_freeze_count() == 0
    with pytest.raises(Measured):
        bench.run_bench(args)
    assert frozen_while_timing and frozen_while_timing[0] > 10_000, "the imports' and the model's objects"
    assert gc.get_freeze_count() == 0
