"""The distributed sampler: a global order independent of the world size, exact resume from its
state (JSON, as checkpoints carry it), also on a different number of ranks."""

from __future__ import annotations

import json

import pytest

from orchestrate.data.sampler import DistributedBlockSampler
from orchestrate.errors import UserError


def _samplers(n: int, world: int, seed: int = 7) -> list[DistributedBlockSampler]:
    return [DistributedBlockSampler(n, r, world, seed) for r in range(world)]


def _global_step(samplers: list[DistributedBlockSampler], micro: int, accumulation: int) -> list[int]:
    """One optimizer step: `accumulation` micro-batches on every rank, in lockstep; returns the
    step's samples in (micro-batch, rank) order, which is the global stream order."""
    out = []
    for _ in range(accumulation):
        for s in samplers:
            out += s.take(micro)
    return out


@pytest.mark.parametrize("world", [1, 2, 3])
def test_ranks_share_one_global_order_disjointly(world: int):
    n = 30
    reference = DistributedBlockSampler(n, 0, 1, seed=7).take(n)  # epoch 0's permutation
    shards = [s.take(n // world) for s in _samplers(n, world)]
    assert [i for shard in shards for i in shard] == reference[: (n // world) * world]
    assert sorted(reference) == list(range(n))


def test_epochs_differ_and_a_take_straddles_them_without_dropping():
    s = DistributedBlockSampler(10, 0, 1, seed=0)
    first, second = s.take(10), s.take(10)
    assert sorted(first) == sorted(second) == list(range(10)) and first != second
    assert s.state_dict() == {"epoch": 2, "position": 0, "seed": 0, "num_blocks": 10}
    crossing = DistributedBlockSampler(10, 0, 1, seed=0)
    assert crossing.take(15) == first + second[:5]
    a, b = _samplers(7, 2, seed=0)
    # 2 ranks x 2 per call over 7 blocks: nothing is skipped at the epoch boundary.
    stream = [i for _ in range(7) for i in a.take(2) + b.take(2)]
    single = DistributedBlockSampler(7, 0, 1, seed=0).take(28)
    assert stream == single


@pytest.mark.parametrize("steps", [3, 7, 20])
def test_blocks_read_are_the_blocks_a_run_of_that_many_samples_takes(steps: int):
    """What a precomputed teacher caches (methods/distill/cache.py): the run's own samples, known
    before step 1, on any world size; from one epoch on, every block."""
    n, micro, accumulation, world = 50, 2, 2, 2
    samplers = _samplers(n, world)
    taken = {i for _ in range(steps) for i in _global_step(samplers, micro, accumulation)}
    read = DistributedBlockSampler(n, 1, 1, seed=7).blocks_read(steps * micro * accumulation * world)
    assert read.tolist() == sorted(taken)
    assert (len(read) < n) == (steps * 8 < n)


def test_state_round_trip_continues_the_same_order():
    a = DistributedBlockSampler(17, 1, 2, seed=5)
    a.take(11)  # into the second epoch
    b = DistributedBlockSampler(17, 1, 2, seed=0)
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))  # checkpoints carry it as JSON
    assert a.take(20) == b.take(20)


@pytest.mark.parametrize(("new_world", "new_micro"), [(2, 2), (4, 2), (1, 4), (8, 1)])
def test_resume_sees_the_batches_of_an_uninterrupted_run_also_on_another_world_size(new_world, new_micro):
    n, global_batch, steps, stop = 37, 16, 12, 5  # 16 x 12 > 37: several epochs
    uninterrupted = _samplers(n, 2)
    expected = [_global_step(uninterrupted, micro=2, accumulation=global_batch // (2 * 2)) for _ in range(steps)]

    before = _samplers(n, 2)
    seen = [_global_step(before, micro=2, accumulation=4) for _ in range(stop)]
    state = json.loads(json.dumps(before[0].state_dict()))
    assert all(s.state_dict() == state for s in before)  # every rank holds the same state
    resumed = _samplers(n, new_world, seed=0)
    for s in resumed:
        s.load_state_dict(state)
    accumulation = global_batch // (new_micro * new_world)
    seen += [_global_step(resumed, micro=new_micro, accumulation=accumulation) for _ in range(steps - stop)]
    assert seen == expected  # the same samples, in the same global order, in every step


def test_resume_on_changed_data_is_refused():
    state = DistributedBlockSampler(10, 0, 1, seed=0).state_dict()
    with pytest.raises(UserError, match="changed since the checkpoint"):
        DistributedBlockSampler(11, 0, 1, seed=0).load_state_dict(state)
    legacy = {"epoch": 1, "position": 3, "seed": 0}  # a state without num_blocks still loads
    s = DistributedBlockSampler(10, 0, 1, seed=0)
    s.load_state_dict(legacy)
    assert s.state_dict()["epoch"] == 1
