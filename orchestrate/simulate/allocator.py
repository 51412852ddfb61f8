"""A model of PyTorch's CUDA caching allocator, to replay a training step's allocations and frees.

The rules follow c10/cuda/CUDACachingAllocator.cpp (read at pytorch/pytorch@001074d2, the stored
version; the constants and settings checked against the torch 2.13.0 wheel's headers
c10/core/AllocatorConfig.h and c10/cuda/CUDAAllocatorConfig.h, where `kLargeBuffer` became the
`large_segment_size` setting and the oversize rounding limit `max_non_split_rounding_mb`, both 20 MiB
by default). Function names below are the C++ ones, so each rule can be checked against its source:

- `round_size`: requests round up to 512 B (kMinBlockSize), or to a power-of-two division when
  `roundup_power2_divisions` asks for it;
- `get_pool`: requests <= 1 MiB (kSmallSize) go to the small pool, the rest to the large one; free
  blocks are reused only by requests on the stream that allocated them;
- `get_allocation_size`: a new segment is 2 MiB (kSmallBuffer) for the small pool, 20 MiB
  (kLargeBuffer) for requests under 10 MiB (kMinLargeAlloc), else the request rounded up to 2 MiB
  (kRoundLarge);
- `get_free_block`: best fit, the smallest cached block that fits (lowest address on ties); blocks of
  `max_split_size` or more serve only requests that are themselves oversize, and only within
  `max_non_split_rounding` of their size;
- `should_split`: the rest of a block is split off when it is >= 512 B (small pool, or any pool with
  expandable segments) or > 1 MiB (large pool, requests under `max_split_size` only);
- `free_block`: a freed block merges with free neighbours of its segment;
- `malloc`: when no cached block fits and the device is full, free oversize cached blocks
  (`release_available_cached_blocks`), then every unsplit cached segment (`release_cached_blocks`),
  retrying after each; then out of memory. `empty_cache` is `release_cached_blocks`;
- expandable segments (Note [Expandable Segments]): one segment per pool and stream in a large
  virtual range, mapped in pages of 2 MiB (small pool) or 20 MiB (large pool) as it grows; freeing
  keeps pages mapped until `release_cached_blocks` unmaps the free whole pages.

Not modelled: CUDA graphs' private pools, `garbage_collection_threshold` (it needs a memory fraction
set), and `record_stream`'s deferred frees (a replay has no GPU timeline: a free is immediate).
Sizes are bytes; `reserved` is what `torch.cuda.memory_reserved` reports, `allocated` what
`torch.cuda.memory_allocated` does (block sizes after rounding and unsplit remainders).
"""

from __future__ import annotations

import bisect

from orchestrate.simulate.allocator_settings import (
    K_MIN_BLOCK_SIZE,
    K_SMALL_BUFFER,
    K_SMALL_SIZE,
    AllocatorSettings,
    allocation_size,
    round_size,
)

_VIRTUAL_RANGE = 1 << 44
"""Address space of one expandable segment (the C++ reserves 1 1/8 of the GPU's memory: never the
limit here, where the device size is the `capacity` of the replay)."""


class OutOfMemory(Exception):
    """The request cannot be served even after freeing every cached block."""

    def __init__(self, size: int, reserved: int, allocated: int) -> None:
        super().__init__(f"out of memory: {size} B requested, {reserved} B reserved, {allocated} B allocated")
        self.size, self.reserved, self.allocated = size, reserved, allocated


class Segment:
    """One cudaMalloc, or one expandable segment's virtual range (mapped in `page`s)."""

    __slots__ = ("base", "page", "expandable")

    def __init__(self, base: int, expandable: bool, page: int = 0) -> None:
        self.base, self.expandable, self.page = base, expandable, page


class Block:
    __slots__ = ("ptr", "size", "pool", "segment", "allocated", "mapped", "prev", "next", "requested")

    def __init__(self, ptr: int, size: int, pool: Pool, segment: Segment, mapped: bool = True) -> None:
        self.ptr, self.size, self.pool, self.segment, self.mapped = ptr, size, pool, segment, mapped
        self.allocated = False
        self.prev: Block | None = None
        self.next: Block | None = None
        self.requested = 0

    def is_split(self) -> bool:
        return self.prev is not None or self.next is not None

    def splice(self, before: Block | None, after: Block | None) -> None:
        if before is not None:
            before.next = self
        self.prev = before
        if after is not None:
            after.prev = self
        self.next = after


class Pool:
    """The cached free blocks of one size class (small or large) on one stream, by (size, address);
    an expandable segment's unmapped ranges by address."""

    __slots__ = ("small", "stream", "keys", "blocks", "unmapped")

    def __init__(self, small: bool, stream: int) -> None:
        self.small, self.stream = small, stream
        self.keys: list[tuple[int, int]] = []
        self.blocks: dict[int, Block] = {}
        self.unmapped: list[Block] = []

    def insert(self, block: Block) -> None:
        bisect.insort(self.keys, (block.size, block.ptr))
        self.blocks[block.ptr] = block

    def remove(self, block: Block) -> None:
        del self.keys[bisect.bisect_left(self.keys, (block.size, block.ptr))]
        del self.blocks[block.ptr]

    def add_unmapped(self, block: Block) -> None:
        bisect.insort(self.unmapped, block, key=lambda b: b.ptr)

    def remove_unmapped(self, block: Block) -> None:
        self.unmapped.remove(block)


class CachingAllocator:
    """One device's caching allocator: `malloc(size, stream)` returns a block, `free(block)` caches
    it. `settings` default to torch's; `capacity`: the bytes the device can still give out (None:
    unlimited, so `peak_reserved` is the high-water mark a large GPU would report)."""

    def __init__(self, settings: AllocatorSettings | None = None, capacity: int | None = None) -> None:
        self.settings, self.capacity = settings or AllocatorSettings(), capacity
        self.pools: dict[tuple[bool, int], Pool] = {}
        self.allocated = self.reserved = self.requested = 0
        self.peak_allocated = self.peak_reserved = self.peak_requested = 0
        self.retries = 0
        """Times the cache was emptied to serve a request (the C++ `num_alloc_retries`)."""
        self._next_address = 0

    # -- the public calls ------------------------------------------------------------------------
    def malloc(self, orig_size: int, stream: int = 0) -> Block:
        size = round_size(orig_size, self.settings)
        pool = self._pool(size <= K_SMALL_SIZE, stream)
        block = self._get_free_block(pool, size)
        if block is None:
            block = self._alloc_block(pool, size)
            if block is None and self._release_available_cached_blocks(pool, size):
                block = self._alloc_block(pool, size)
            if block is None:
                self.retries += 1
                self.empty_cache()
                block = self._alloc_block(pool, size)
            if block is None:
                raise OutOfMemory(size, self.reserved, self.allocated)
        return self._alloc_found_block(block, size, orig_size)

    def free(self, block: Block) -> None:
        block.allocated = False
        self.allocated -= block.size
        self.requested -= block.requested
        pool = block.pool
        for neighbour in (block.prev, block.next):
            self._try_merge(block, neighbour)
        pool.insert(block)

    def empty_cache(self) -> None:
        """`release_cached_blocks`: cudaFree every cached segment with no block in use; unmap the
        free whole pages of expandable segments."""
        for small in (False, True):  # large pool first, as the C++
            for pool in [p for key, p in self.pools.items() if key[0] == small]:
                to_unmap = []
                for block in list(pool.blocks.values()):
                    if block.segment.expandable:
                        to_unmap.append(block)
                    elif not block.is_split():
                        self._release_block(block)
                for block in to_unmap:
                    self._unmap_block(block)
                    if not block.mapped and not block.is_split():  # the whole range is unmapped: drop it
                        pool.remove_unmapped(block)

    # -- finding and splitting -------------------------------------------------------------------
    def _pool(self, small: bool, stream: int) -> Pool:
        pool = self.pools.get((small, stream))
        if pool is None:
            pool = self.pools[(small, stream)] = Pool(small, stream)
        return pool

    def _get_free_block(self, pool: Pool, size: int) -> Block | None:
        keys = pool.keys
        i = bisect.bisect_left(keys, (size, -1))
        if i == len(keys):
            return None
        block = pool.blocks[keys[i][1]]
        if block.segment.expandable:
            # Best fit counts what a block can grow into: a free block before unmapped pages is
            # taken only when no larger block elsewhere fits.
            while i + 1 < len(keys) and _expandable_size(pool.blocks[keys[i + 1][1]]) < _expandable_size(block):
                i += 1
                block = pool.blocks[keys[i][1]]
        split_limit = self.settings.max_split_size
        if split_limit is not None:
            if size < split_limit <= block.size:
                return None  # an oversize block for a normal request
            if size >= split_limit and block.size >= size + self.settings.max_non_split_rounding:
                return None  # an oversize block too much larger than the oversize request
        pool.remove(block)
        return block

    def _should_split(self, block: Block, size: int) -> bool:
        remaining = block.size - size
        if block.pool.small or self.settings.expandable_segments:
            return remaining >= K_MIN_BLOCK_SIZE
        limit = self.settings.max_split_size
        return (limit is None or size < limit) and remaining > K_SMALL_SIZE

    def _alloc_found_block(self, block: Block, size: int, orig_size: int) -> Block:
        if self._should_split(block, size):
            remaining = block
            block = Block(remaining.ptr, size, remaining.pool, remaining.segment)
            block.splice(remaining.prev, remaining)
            remaining.ptr += size
            remaining.size -= size
            remaining.pool.insert(remaining)
        block.allocated, block.requested = True, orig_size
        self.allocated += block.size
        self.requested += orig_size
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        self.peak_requested = max(self.peak_requested, self.requested)
        return block

    def _try_merge(self, dst: Block, src: Block | None) -> None:
        if src is None or src.allocated or src.mapped != dst.mapped:
            return
        if src.mapped:
            dst.pool.remove(src)
        else:
            dst.pool.remove_unmapped(src)
        if dst.prev is src:
            dst.ptr = src.ptr
            dst.prev = src.prev
            if dst.prev is not None:
                dst.prev.next = dst
        else:
            dst.next = src.next
            if dst.next is not None:
                dst.next.prev = dst
        dst.size += src.size

    # -- getting memory from the device ----------------------------------------------------------
    def _fits(self, nbytes: int) -> bool:
        return self.capacity is None or self.reserved + nbytes <= self.capacity

    def _grow(self, nbytes: int) -> None:
        self.reserved += nbytes
        self.peak_reserved = max(self.peak_reserved, self.reserved)

    def _alloc_block(self, pool: Pool, size: int) -> Block | None:
        if self.settings.expandable_segments:
            return self._try_allocate_expandable_block(pool, size)
        nbytes = allocation_size(size, self.settings)
        if not self._fits(nbytes):
            return None
        self._grow(nbytes)
        ptr, self._next_address = self._next_address, self._next_address + nbytes
        return Block(ptr, nbytes, pool, Segment(ptr, expandable=False))

    def _release_block(self, block: Block) -> None:
        block.pool.remove(block)
        self.reserved -= block.size

    def _release_available_cached_blocks(self, pool: Pool, size: int) -> bool:
        """With `max_split_size` set: cudaFree one cached oversize block large enough, else the
        largest ones until enough is freed."""
        limit = self.settings.max_split_size
        if limit is None:
            return False
        target = max(size, limit)
        i = bisect.bisect_left(pool.keys, (target, -1))
        if i < len(pool.keys):
            self._release_block(pool.blocks[pool.keys[i][1]])
            return True
        released = 0
        while released < target and pool.keys and pool.keys[-1][0] >= limit:
            block = pool.blocks[pool.keys[-1][1]]
            released += block.size
            self._release_block(block)
        return released >= target

    # -- expandable segments ---------------------------------------------------------------------
    def _try_allocate_expandable_block(self, pool: Pool, size: int) -> Block | None:
        candidate = self._find_expandable_block(pool, size)
        if not candidate.mapped and not self._map_block(candidate, min(candidate.size, size)):
            return None
        while candidate.size < size:  # free, then unmapped pages after it: map what is missing
            following = candidate.next
            if not self._map_block(following, min(size - candidate.size, following.size)):
                return None
            candidate = following  # mapping merged the free block before it into it
        pool.remove(candidate)
        return candidate

    def _find_expandable_block(self, pool: Pool, size: int) -> Block:
        """The lowest address where free and unmapped blocks together hold `size`; else a new segment."""
        for block in pool.unmapped:
            start = block.prev if _allocatable(block.prev) else block
            total, b = 0, start
            while total < size and _allocatable(b):
                total += b.size
                b = b.next
            if total >= size:
                return start
        page = K_SMALL_BUFFER if pool.small else self.settings.large_segment_size
        base, self._next_address = self._next_address, self._next_address + _VIRTUAL_RANGE
        block = Block(base, _VIRTUAL_RANGE, pool, Segment(base, expandable=True, page=page), mapped=False)
        pool.add_unmapped(block)
        return block

    def _map_block(self, block: Block, size: int) -> bool:
        segment = block.segment
        first = (block.ptr - segment.base) // segment.page
        last = -(-(block.ptr + size - segment.base) // segment.page)
        mapped = (last - first) * segment.page
        if not self._fits(mapped):
            return False
        self._grow(mapped)
        pool = block.pool
        pool.remove_unmapped(block)
        block.mapped = True
        if mapped < block.size:
            rest = Block(block.ptr + mapped, block.size - mapped, pool, segment, mapped=False)
            rest.splice(block, block.next)
            pool.add_unmapped(rest)
            block.size = mapped
        self._try_merge(block, block.prev)
        self._try_merge(block, block.next)
        pool.insert(block)
        return True

    def _unmap_block(self, block: Block) -> None:
        """Return the whole pages inside a free block to the device; its partial pages stay mapped."""
        segment, pool = block.segment, block.pool
        first = -(-(block.ptr - segment.base) // segment.page)
        last = (block.ptr + block.size - segment.base) // segment.page
        if first >= last:
            return
        pool.remove(block)
        start, end = segment.base + first * segment.page, segment.base + last * segment.page
        if start > block.ptr:
            before = Block(block.ptr, start - block.ptr, pool, segment)
            before.splice(block.prev, block)
            pool.insert(before)
        if block.ptr + block.size > end:
            after = Block(end, block.ptr + block.size - end, pool, segment)
            after.splice(block, block.next)
            pool.insert(after)
        self.reserved -= end - start
        block.ptr, block.size, block.mapped = start, end - start, False
        self._try_merge(block, block.prev)
        self._try_merge(block, block.next)
        pool.add_unmapped(block)


def _allocatable(block: Block | None) -> bool:
    return block is not None and not block.allocated


def _expandable_size(block: Block) -> int:
    following = block.next
    return block.size + (following.size if following is not None and not following.mapped else 0)
