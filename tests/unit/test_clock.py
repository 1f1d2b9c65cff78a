from __future__ import annotations

import time

from tokenbus.clock import SYSTEM_CLOCK, OffsetClock


def test_the_system_clock_reads_the_machine_s_clocks() -> None:
    before_wall, before_mono = time.time(), time.monotonic()
    wall, mono = SYSTEM_CLOCK.time(), SYSTEM_CLOCK.monotonic()
    assert before_wall <= wall <= time.time()
    assert before_mono <= mono <= time.monotonic()


def test_an_offset_moves_the_wall_reading_only_and_is_read_each_time() -> None:
    offsets = [3600.0]
    clock = OffsetClock(lambda: offsets[0])
    assert 3599 < clock.time() - time.time() <= 3600
    mono = clock.monotonic()
    assert mono <= time.monotonic() < mono + 60
    offsets[0] = 0.0
    assert abs(clock.time() - time.time()) < 60
