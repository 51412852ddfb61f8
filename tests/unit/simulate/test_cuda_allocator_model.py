"""The CUDA caching-allocator model (orchestrate/simulate/allocator.py) keeps each rule of
c10/cuda/CUDACachingAllocator.cpp, with sizes taken from the allocator's own comments: 512-byte
rounding, the 2 MiB small pool, 20 MiB segments for 1-10 MiB requests, 2 MiB rounding above,
best fit per stream, the split thresholds, max_split_size, roundup_power2_divisions, expandable
segments' pages, and the empty-the-cache retry before running out of memory."""

from __future__ import annotations

import pytest

from orchestrate.simulate.allocator import CachingAllocator, OutOfMemory
from orchestrate.simulate.allocator_settings import AllocatorSettings, allocation_size, round_size
from orchestrate.simulate.counter import Life
from orchestrate.simulate.replay import Trace, replay, smallest_capacity, trace_from_lives

KiB, MiB = 2**10, 2**20
EXPANDABLE = AllocatorSettings(expandable_segments=True)


def test_sizes_round_up_to_512_bytes():
    # kMinBlockSize: "all sizes are rounded to at least 512 bytes"
    assert [round_size(n) for n in (1, 512, 513, 1000, 1024)] == [512, 512, 1024, 1024, 1024]
    a = CachingAllocator()
    assert a.malloc(1).size == 512 and a.allocated == 512 and a.requested == 1


def test_roundup_power2_divisions_rounds_to_the_next_division():
    # roundup_power2_next_division's comment: 1200 with 4 divisions lies in [1024, 2048), divided at
    # 1024, 1280, 1536, 1792: 1280. Intervals are counted from 1 MiB, so the same split one power up.
    four = AllocatorSettings.parse("roundup_power2_divisions:4")
    assert round_size(1200 * KiB, four) == 1280 * KiB
    assert round_size(2 * MiB, four) == 2 * MiB  # a power of two stays
    assert round_size(1200, four) == 1536  # not above 512 x divisions: plain 512-byte rounding
    per_interval = AllocatorSettings.parse("roundup_power2_divisions:[1:4,>:2]")
    assert round_size(1200 * KiB, per_interval) == 1280 * KiB  # the 1 MiB interval: 4 divisions
    assert round_size(2400 * KiB, per_interval) == 3 * MiB  # [2, 4) MiB: 2 divisions


def test_small_requests_share_a_2_mib_segment():
    # kSmallSize "largest 'small' allocation is 1 MiB", kSmallBuffer "packed in 2 MiB blocks"
    a = CachingAllocator()
    first = a.malloc(1 * MiB)
    second = a.malloc(512 * KiB)
    assert a.reserved == 2 * MiB and second.ptr == first.ptr + 1 * MiB
    a.malloc(1 * MiB + 512)  # one byte-block over kSmallSize: the large pool, its own segment
    assert a.reserved == 2 * MiB + 20 * MiB


def test_requests_between_1_and_10_mib_pack_into_20_mib_segments():
    # kLargeBuffer: "'large' allocations may be packed in 20 MiB blocks"; kMinLargeAlloc: "allocations
    # between 1 and 10 MiB may use kLargeBuffer"
    assert allocation_size(5 * MiB) == allocation_size(10 * MiB - 512) == 20 * MiB
    a = CachingAllocator()
    blocks = [a.malloc(5 * MiB) for _ in range(4)]
    assert a.reserved == 20 * MiB and [b.ptr - blocks[0].ptr for b in blocks] == [0, 5 * MiB, 10 * MiB, 15 * MiB]
    a.malloc(5 * MiB)
    assert a.reserved == 40 * MiB


def test_larger_requests_round_up_to_2_mib_and_small_remainders_stay_unsplit():
    # kRoundLarge: "round up large allocations to 2 MiB"; a large-pool remainder is split off only
    # when it is more than kSmallSize
    assert allocation_size(10 * MiB) == 10 * MiB and allocation_size(11 * MiB) == 12 * MiB
    a = CachingAllocator()
    whole = a.malloc(11 * MiB)  # 12 MiB segment, 1 MiB left: not > 1 MiB, not split
    assert a.reserved == 12 * MiB and whole.size == 12 * MiB and a.allocated == 12 * MiB
    split = a.malloc(12 * MiB + 512 * KiB)  # 14 MiB segment, 1.5 MiB left: split
    assert split.size == 12 * MiB + 512 * KiB and a.allocated == 24 * MiB + 512 * KiB


def test_small_pool_splits_any_remainder_of_512_bytes():
    a = CachingAllocator()
    a.malloc(2 * MiB - 512 - 1 * MiB)  # leaves 1 MiB + 512: split
    last = a.malloc(1 * MiB)  # leaves 512 B: still split (>= kMinBlockSize)
    assert last.size == 1 * MiB and a.reserved == 2 * MiB
    assert a.malloc(512).size == 512 and a.reserved == 2 * MiB


def test_best_fit_takes_the_smallest_cached_block_that_fits():
    a = CachingAllocator()
    sizes = (30 * MiB, 24 * MiB, 40 * MiB)
    blocks = [a.malloc(s) for s in sizes]
    for b in blocks:
        a.free(b)
    reused = a.malloc(23 * MiB)
    assert reused.ptr == blocks[1].ptr and a.reserved == sum(sizes)


def test_a_freed_block_serves_only_its_own_stream():
    # "Once freed, blocks can be re-allocated on the same stream, but not on any other stream."
    a = CachingAllocator()
    a.free(a.malloc(30 * MiB, stream=1))
    a.malloc(30 * MiB, stream=0)
    assert a.reserved == 60 * MiB
    a.malloc(30 * MiB, stream=1)
    assert a.reserved == 60 * MiB


def test_freed_neighbours_merge_and_empty_cache_frees_whole_segments_only():
    a = CachingAllocator()
    first, second = a.malloc(5 * MiB), a.malloc(5 * MiB)
    a.free(first)
    a.empty_cache()
    assert a.reserved == 20 * MiB  # the segment still holds `second`
    a.free(second)
    a.empty_cache()
    assert a.reserved == 0 and a.allocated == 0


def test_max_split_size_keeps_oversize_blocks_whole_and_for_oversize_requests():
    # "blocks >= max_split_size are not allowed to be split. These oversize cached blocks will
    # still satisfy requests within 1MB of the oversize cached block size" (2.13: within
    # max_non_split_rounding_mb, 20 MiB by default)
    a = CachingAllocator(AllocatorSettings.parse("max_split_size_mb:32"))
    a.free(a.malloc(40 * MiB))
    a.malloc(5 * MiB)  # a normal request never takes an oversize block
    assert a.reserved == 60 * MiB
    big = a.malloc(36 * MiB)  # oversize request: the cached 40 MiB block, not split
    assert big.size == 40 * MiB and a.reserved == 60 * MiB
    a.free(big)
    a.malloc(20 * MiB)  # below max_split_size: only a block smaller than 32 MiB may serve it
    assert a.reserved == 80 * MiB
    a.free(a.malloc(100 * MiB))
    a.malloc(60 * MiB)  # 100 MiB >= 60 + 20 MiB: too much larger, a new segment
    assert a.reserved == 80 * MiB + 160 * MiB


def test_a_full_device_empties_the_cache_and_retries_before_running_out():
    # "If the cudaMalloc fails, the allocator will attempt to free ... all cached blocks that are
    # not split and retry the allocation."
    a = CachingAllocator(capacity=50 * MiB)
    a.free(a.malloc(30 * MiB))
    b = a.malloc(40 * MiB)
    assert a.retries == 1 and a.reserved == 40 * MiB and b.size == 40 * MiB
    with pytest.raises(OutOfMemory):
        a.malloc(30 * MiB)


def test_oversize_cached_blocks_are_freed_first_when_max_split_size_is_set():
    # release_available_cached_blocks: the largest oversize blocks until the request is covered
    a = CachingAllocator(AllocatorSettings.parse("max_split_size_mb:32"), capacity=100 * MiB)
    oversize = [a.malloc(40 * MiB), a.malloc(34 * MiB)]
    a.free(a.malloc(6 * MiB))  # a cached 20 MiB segment, not oversize
    for b in oversize:
        a.free(b)
    a.malloc(60 * MiB)  # 94 + 60 > 100: freeing the 40 and 34 MiB blocks is enough, no retry
    assert a.retries == 0 and a.reserved == 20 * MiB + 60 * MiB


def test_expandable_segments_map_20_mib_pages_into_one_segment_per_stream():
    # Note [Expandable Segments]: "we use 2MiB pages for our small pool and 20MiB pages for our
    # large pool"; "one segment (per stream) that grows as necessary"
    a = CachingAllocator(EXPANDABLE)
    first = a.malloc(5 * MiB)
    assert a.reserved == 20 * MiB
    second = a.malloc(30 * MiB)  # 15 MiB free at the end of the page, plus one more page mapped
    assert second.ptr == first.ptr + 5 * MiB and a.reserved == 40 * MiB
    a.malloc(100 * KiB)
    assert a.reserved == 42 * MiB  # the small pool: its own segment, one 2 MiB page
    a.malloc(5 * MiB, stream=1)
    assert a.reserved == 62 * MiB


def test_expandable_segments_split_any_remainder_and_unmap_free_pages_on_empty_cache():
    a = CachingAllocator(EXPANDABLE)
    kept = a.malloc(19 * MiB + 512 * KiB)  # 512 KiB left in the page: split (>= 512 B)
    assert kept.size == 19 * MiB + 512 * KiB
    spill = a.malloc(21 * MiB)  # maps two more pages, spanning the page boundary
    assert spill.ptr == kept.ptr + kept.size and a.reserved == 60 * MiB
    a.free(spill)
    a.empty_cache()  # pages wholly free are unmapped; the one holding `kept` stays
    assert a.reserved == 20 * MiB
    a.free(kept)
    a.empty_cache()
    assert a.reserved == 0


def test_expandable_best_fit_prefers_a_free_block_to_the_growing_end():
    # get_free_block: the block before unmapped pages counts as the size it can grow to
    a = CachingAllocator(EXPANDABLE)
    a.malloc(10 * MiB)
    hole = a.malloc(12 * MiB)
    a.malloc(10 * MiB)  # the mapped pages end 8 MiB after this block
    hole_ptr = hole.ptr
    a.free(hole)
    assert a.malloc(6 * MiB).ptr == hole_ptr


def test_expandable_segments_fill_a_full_device_after_unmapping():
    a = CachingAllocator(EXPANDABLE, capacity=60 * MiB)
    a.free(a.malloc(40 * MiB, stream=1))  # two pages cached on stream 1
    a.malloc(30 * MiB, stream=0)  # needs two pages: stream 1's are unmapped first
    assert a.retries == 1 and a.reserved == 40 * MiB


def test_settings_parse_the_alloc_conf_string():
    s = AllocatorSettings.parse("expandable_segments:True, max_split_size_mb:128,garbage_collection_threshold:0.6")
    assert s.expandable_segments and s.max_split_size == 128 * MiB
    assert AllocatorSettings.parse(None) == AllocatorSettings()
    assert not AllocatorSettings.parse("expandable_segments:False").expandable_segments


def _life(nbytes: int, birth: int, death: int | None, stream: int = 0) -> Life:
    return Life(nbytes, birth, "forward", death=death, stream=stream)


def test_a_replay_starts_from_what_lives_at_the_start_and_follows_the_event_clock():
    lives = [_life(1 * MiB, 1, None), _life(3 * MiB, 2, 4),  # setup: one stays, one dies before the start
             _life(6 * MiB, 5, 8), _life(6 * MiB, 9, 10, stream=1), _life(0, 6, 7)]
    trace = trace_from_lives(lives, start=4)
    assert trace.initial == 1 and trace.sizes == [1 * MiB, 6 * MiB, 6 * MiB] and trace.streams == [0, 0, 1]
    assert trace.events == [1, 2, -2, 3, -3]
    peaks = replay(trace, AllocatorSettings())
    # stream 1 cannot reuse stream 0's cached 20 MiB segment on an unlimited device ...
    assert (peaks.allocated, peaks.requested, peaks.reserved) == (7 * MiB, 7 * MiB, 42 * MiB)
    # ... but a device with 22 MiB frees it and retries
    assert smallest_capacity(trace, AllocatorSettings()) == 22 * MiB
    with pytest.raises(OutOfMemory):
        replay(Trace(sizes=[30 * MiB], streams=[0], events=[1], initial=0), AllocatorSettings(), capacity=20 * MiB)
