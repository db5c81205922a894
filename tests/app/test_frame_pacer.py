"""The render pacer keeps the GUI thread's CPU share within its budget while generating."""

from __future__ import annotations

from app.frame_pacer import CPU_BUDGET, MAX_INTERVAL_MS, MIN_INTERVAL_MS, FramePacer


class Clocks:
    """Wall and thread-CPU clocks advanced by hand: each frame takes `frame_s` of wall time,
    of which the GUI thread spent `share` on the CPU."""

    def __init__(self):
        self.wall = self.cpu = 0.0

    def frame(self, frame_s: float, share: float) -> None:
        self.wall += frame_s
        self.cpu += frame_s * share


def run(pacer: FramePacer, clocks: Clocks, share: float, busy: bool, frames: int = 200) -> int:
    interval = MIN_INTERVAL_MS
    for _ in range(frames):
        clocks.frame(interval / 1000, share)
        interval = pacer.next_interval_ms(busy)
    return interval


def make() -> tuple[FramePacer, Clocks]:
    clocks = Clocks()
    return FramePacer(clock=lambda: clocks.wall, cpu_clock=lambda: clocks.cpu), clocks


def test_an_expensive_gui_slows_the_frames_while_generating():
    pacer, clocks = make()
    assert run(pacer, clocks, share=4 * CPU_BUDGET, busy=True) == MAX_INTERVAL_MS
    assert pacer.cpu_share > CPU_BUDGET


def test_a_cheap_gui_keeps_the_fastest_rate():
    pacer, clocks = make()
    assert run(pacer, clocks, share=CPU_BUDGET / 4, busy=True) == MIN_INTERVAL_MS


def test_the_rate_recovers_when_the_gui_gets_cheap_again_and_when_idle():
    pacer, clocks = make()
    run(pacer, clocks, share=4 * CPU_BUDGET, busy=True)
    assert run(pacer, clocks, share=CPU_BUDGET / 4, busy=True) == MIN_INTERVAL_MS
    run(pacer, clocks, share=4 * CPU_BUDGET, busy=True)
    assert pacer.next_interval_ms(busy=False) == MIN_INTERVAL_MS  # idle: nothing competes


def test_the_next_reply_starts_at_the_rate_the_last_one_settled_at():
    pacer, clocks = make()
    settled = run(pacer, clocks, share=4 * CPU_BUDGET, busy=True)
    assert settled == MAX_INTERVAL_MS
    run(pacer, clocks, share=0.0, busy=False)  # idle between replies: fast frames, no CPU
    clocks.frame(MIN_INTERVAL_MS / 1000, 0.0)
    assert pacer.next_interval_ms(busy=True) == MAX_INTERVAL_MS  # not the fastest rate again


def test_idle_frames_do_not_make_generating_look_cheap():
    pacer, clocks = make()
    run(pacer, clocks, share=4 * CPU_BUDGET, busy=True)
    share = pacer.cpu_share
    run(pacer, clocks, share=0.0, busy=False)
    assert pacer.cpu_share == share


def test_frames_stay_fast_until_a_replys_first_token_is_shown():
    pacer, clocks = make()
    run(pacer, clocks, share=4 * CPU_BUDGET, busy=True)
    clocks.frame(MIN_INTERVAL_MS / 1000, 0.0)
    assert pacer.next_interval_ms(busy=True, first_token_due=True) == MIN_INTERVAL_MS
    clocks.frame(MIN_INTERVAL_MS / 1000, 0.0)
    assert pacer.next_interval_ms(busy=True) == MAX_INTERVAL_MS
