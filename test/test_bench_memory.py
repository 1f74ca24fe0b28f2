"""The benchmarks' CPU peak memory: frees the profiler cannot see do not inflate the peak.

The profiler records the allocator's events of the profiled thread only; a buffer a gloo
thread frees has no free event (seen on 2x2 and 3x3 Boltz-2 predictions).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import segment_peaks  # noqa: E402


def test_an_address_handed_out_again_counts_its_earlier_block_as_freed():
    allocations = [(1, 100, 0xA), (2, 50, 0xB), (4, 100, 0xA), (5, -50, 0xB), (6, 30, 0xC)]
    peak, segments = segment_peaks(allocations, [(3, "second")], first="first")
    assert peak == 150  # 0xA was freed out of sight before it came back
    assert segments == {"first": 150, "second": 150}


def test_frees_and_marks_at_one_time_come_before_its_allocations():
    allocations = [(1, 100, 0xA), (2, 100, 0xB), (2, -100, 0xA)]
    peak, segments = segment_peaks(allocations, [(2, "later")], first="start")
    assert peak == 100
    assert segments == {"start": 100, "later": 100}
