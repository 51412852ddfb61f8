"""The numbers and settings of PyTorch's CUDA caching allocator that `orchestrate.simulate.allocator`
replays: the constants of c10/core/AllocatorConfig.h (torch 2.13.0 wheel; the same values as
c10/cuda/CUDACachingAllocator.cpp at pytorch/pytorch@001074d2), the `PYTORCH_CUDA_ALLOC_CONF` keys
it honours (parsed as c10/core/AllocatorConfig.cpp does), `round_size` and `get_allocation_size`.
"""

from __future__ import annotations

from dataclasses import dataclass

MiB = 2**20
K_MIN_BLOCK_SIZE = 512
"""kMinBlockSize: "all sizes are rounded to at least 512 bytes"."""
K_SMALL_SIZE = 1 * MiB
"""kSmallSize: "largest 'small' allocation is 1 MiB"."""
K_SMALL_BUFFER = 2 * MiB
"""kSmallBuffer: "'small' allocations are packed in 2 MiB blocks"; also the small pool's page."""
K_LARGE_BUFFER = 20 * MiB
"""kLargeBuffer: "'large' allocations may be packed in 20 MiB blocks" (2.13: the default of
`large_segment_size_mb` and of `max_non_split_rounding_mb`); also the large pool's page."""
K_MIN_LARGE_ALLOC = 10 * MiB
"""kMinLargeAlloc: "allocations between 1 and 10 MiB may use kLargeBuffer"."""
K_ROUND_LARGE = 2 * MiB
"""kRoundLarge: "round up large allocations to 2 MiB"."""
_ROUNDUP_INTERVALS = 16
"""roundup_power2_divisions: one setting per power-of-two interval from 1 MiB to 64 GiB."""


@dataclass(frozen=True)
class AllocatorSettings:
    """The `PYTORCH_CUDA_ALLOC_CONF` keys the model honours (defaults: torch's)."""

    expandable_segments: bool = False
    max_split_size: int | None = None
    """Blocks this size or larger are never split (None: unlimited, torch's default)."""
    max_non_split_rounding: int = K_LARGE_BUFFER
    large_segment_size: int = K_LARGE_BUFFER
    roundup_power2_divisions: tuple[int, ...] = (0,) * _ROUNDUP_INTERVALS

    @classmethod
    def parse(cls, conf: str | None) -> AllocatorSettings:
        """Settings from a `PYTORCH_CUDA_ALLOC_CONF` value; keys the model does not use are ignored."""
        tokens = [t.strip() for t in (conf or "").replace("[", ",[,").replace("]", ",],").split(",") if t.strip()]
        values: dict = {}
        i = 0
        while i < len(tokens):
            key, _, value = tokens[i].partition(":")
            if key == "roundup_power2_divisions" and value == "" and i + 1 < len(tokens) and tokens[i + 1] == "[":
                end = tokens.index("]", i)
                values["roundup_power2_divisions"] = _divisions_list(tokens[i + 2:end])
                i = end + 1
                continue
            if key == "expandable_segments":
                values["expandable_segments"] = value.strip().lower() == "true"
            elif key == "max_split_size_mb":
                values["max_split_size"] = int(value) * MiB
            elif key == "max_non_split_rounding_mb":
                values["max_non_split_rounding"] = int(value) * MiB
            elif key == "large_segment_size_mb":
                values["large_segment_size"] = int(value) * MiB
            elif key == "roundup_power2_divisions":
                values["roundup_power2_divisions"] = (int(value),) * _ROUNDUP_INTERVALS
            i += 1
        return cls(**values)


def _divisions_list(pairs: list[str]) -> tuple[int, ...]:
    """`[64:8,256:4,>:1]`: intervals named by their size in MiB; the first value also covers the
    intervals below it, `>` every interval after the last named one (AllocatorConfig.cpp,
    parseRoundUpPower2Divisions)."""
    out = [0] * _ROUNDUP_INTERVALS
    first, last = True, 0
    for pair in pairs:
        key, _, value = pair.partition(":")
        divisions = int(value)
        if key == ">":
            out[last + 1:] = [divisions] * (_ROUNDUP_INTERVALS - last - 1)
            continue
        index = min(max(int(key).bit_length() - 1, 0), _ROUNDUP_INTERVALS - 1)
        if first:
            out[:index] = [divisions] * index
            first = False
        out[index], last = divisions, index
    return tuple(out)


def round_size(size: int, settings: AllocatorSettings = AllocatorSettings()) -> int:
    if size < K_MIN_BLOCK_SIZE:
        return K_MIN_BLOCK_SIZE
    index = min(max(size.bit_length() - 1 - 20, 0), _ROUNDUP_INTERVALS - 1)  # 2**20: intervals start at 1 MiB
    divisions = settings.roundup_power2_divisions[index]
    if divisions > 1 and size > K_MIN_BLOCK_SIZE * divisions:
        return _roundup_power2_next_division(size, divisions)
    return -(-size // K_MIN_BLOCK_SIZE) * K_MIN_BLOCK_SIZE


def _roundup_power2_next_division(size: int, divisions: int) -> int:
    """1200 with 4 divisions lies in [1024, 2048), split at 1024, 1280, 1536, 1792: 1280."""
    if size & (size - 1) == 0:
        return size
    floor = 1 << (size.bit_length() - 1)
    step = floor >> (divisions.bit_length() - 1)
    if step == 0:
        return floor << 1
    rounded = size & ~(step - 1)
    return size if rounded == size else rounded + step


def allocation_size(size: int, settings: AllocatorSettings = AllocatorSettings()) -> int:
    """`get_allocation_size`: the segment a rounded request gets when nothing cached fits."""
    if size <= K_SMALL_SIZE:
        return K_SMALL_BUFFER
    if size < K_MIN_LARGE_ALLOC:
        return settings.large_segment_size
    return -(-size // K_ROUND_LARGE) * K_ROUND_LARGE
