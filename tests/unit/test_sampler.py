"""The resumable sharded sampler: every rank gets whole micro-batches of one shared permutation,
and a run resumed from ``state_dict`` (on the same or a different number of ranks) sees exactly
the batches the uninterrupted run would have seen."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from protrain.runtime.data.sampler import ShardedSampler, epoch_order

pytestmark = pytest.mark.timeout(30)

MicroStep = tuple[list[int], ...]  # one micro-batch of indices per rank


def build_samplers(
    num_samples: int, *, world_size: int, micro_batch_size: int, seed: int = 7
) -> list[ShardedSampler]:
    return [
        ShardedSampler(
            num_samples, world_size=world_size, rank=rank, micro_batch_size=micro_batch_size, seed=seed
        )
        for rank in range(world_size)
    ]


def micro_batches(sampler: ShardedSampler) -> Iterator[list[int]]:
    """One rank's micro-batches over as many epochs as asked for, as a training loop reads them."""
    while True:
        batch: list[int] = []
        for index in sampler:
            batch.append(index)
            if len(batch) == sampler.micro_batch_size:
                yield batch
                batch = []
        assert not batch, "the sampler yields whole micro-batches only"


def run_job(samplers: list[ShardedSampler], *, num_windows: int, window_micro_steps: int) -> list[MicroStep]:
    """Train ``num_windows`` update windows on every rank, calling consume() after each."""
    streams = [micro_batches(sampler) for sampler in samplers]
    steps: list[MicroStep] = []
    for _ in range(num_windows):
        for _ in range(window_micro_steps):
            steps.append(tuple(next(stream) for stream in streams))
        for sampler in samplers:
            sampler.consume(window_micro_steps * sampler.step)
    return steps


def global_stream(steps: list[MicroStep]) -> list[int]:
    """The job's samples in global position order: rank r holds positions r, r + W, r + 2W, ..."""
    return [index for step in steps for batch_k in zip(*step, strict=True) for index in batch_k]


def reference_stream(
    num_samples: int, *, step: int, num_micro_steps: int, epoch: int = 0, offset: int = 0, seed: int = 7
) -> list[int]:
    """The global stream written straight from the rule: micro-steps of ``step`` positions, an
    epoch ending when fewer than ``step`` positions remain."""
    stream: list[int] = []
    for _ in range(num_micro_steps):
        if num_samples - offset < step:
            epoch, offset = epoch + 1, 0
        order = epoch_order(num_samples, seed=seed, epoch=epoch, shuffle=True)
        stream += order[offset : offset + step].tolist()
        offset += step
    return stream


def resume(
    state: dict[str, int | bool], num_samples: int, *, world_size: int, micro_batch_size: int
) -> list[ShardedSampler]:
    samplers = build_samplers(num_samples, world_size=world_size, micro_batch_size=micro_batch_size)
    for sampler in samplers:
        sampler.load_state_dict(json.loads(json.dumps(state)))  # as a checkpoint would carry it
    return samplers


def test_ranks_split_one_epoch_into_disjoint_whole_micro_batches() -> None:
    samplers = build_samplers(50, world_size=3, micro_batch_size=4)  # 4 micro-steps of 12, 2 dropped
    per_rank = [list(sampler) for sampler in samplers]
    assert [len(indices) for indices in per_rank] == [16, 16, 16]
    assert all(len(sampler) == 16 for sampler in build_samplers(50, world_size=3, micro_batch_size=4))
    union = [index for indices in per_rank for index in indices]
    assert len(set(union)) == len(union) == 48
    order = epoch_order(50, seed=7, epoch=0, shuffle=True)
    assert sorted(union) == sorted(order[:48].tolist())
    for rank, indices in enumerate(per_rank):
        assert indices == order[rank:48:3].tolist()  # strided, like DistributedSampler


def test_shuffle_differs_per_epoch_and_is_reproducible_from_the_seed() -> None:
    sampler = ShardedSampler(64, world_size=1, rank=0, micro_batch_size=8, seed=3)
    first, second = list(sampler), list(sampler)
    assert sorted(first) == sorted(second) == list(range(64))
    assert first != second
    again = ShardedSampler(64, world_size=1, rank=0, micro_batch_size=8, seed=3)
    assert [list(again), list(again)] == [first, second]
    other_seed = ShardedSampler(64, world_size=1, rank=0, micro_batch_size=8, seed=4)
    assert list(other_seed) != first


def test_without_shuffle_every_epoch_is_arange_order() -> None:
    sampler = ShardedSampler(10, world_size=2, rank=1, micro_batch_size=2, seed=0, shuffle=False)
    assert list(sampler) == [1, 3, 5, 7]
    assert list(sampler) == [1, 3, 5, 7]


@pytest.mark.parametrize("stop_after_windows", [1, 2, 3, 5])
def test_resumed_run_sees_exactly_the_uninterrupted_batches(stop_after_windows: int) -> None:
    # 50 samples, 2 ranks x 3: 8 micro-steps per epoch (2 dropped); windows of 3 micro-steps cross
    # epoch boundaries; 7 windows = 21 micro-steps, about 2.6 epochs.
    uninterrupted = run_job(
        build_samplers(50, world_size=2, micro_batch_size=3), num_windows=7, window_micro_steps=3
    )
    assert global_stream(uninterrupted) == reference_stream(50, step=6, num_micro_steps=21)

    samplers = build_samplers(50, world_size=2, micro_batch_size=3)
    before = run_job(samplers, num_windows=stop_after_windows, window_micro_steps=3)
    states = [sampler.state_dict() for sampler in samplers]
    assert all(state == states[0] for state in states)
    resumed = resume(states[0], 50, world_size=2, micro_batch_size=3)
    after = run_job(resumed, num_windows=7 - stop_after_windows, window_micro_steps=3)
    assert before + after == uninterrupted


def test_state_dict_holds_the_consumed_position_as_plain_values() -> None:
    samplers = build_samplers(50, world_size=2, micro_batch_size=3)
    run_job(samplers, num_windows=3, window_micro_steps=3)  # 9 micro-steps: one past epoch 0's 8
    assert samplers[0].state_dict() == {
        "num_samples": 50,
        "seed": 7,
        "shuffle": True,
        "epoch": 1,
        "offset": 6,
    }
    assert json.loads(json.dumps(samplers[0].state_dict())) == samplers[0].state_dict()


@pytest.mark.parametrize(("saved_world", "resumed_world"), [(2, 1), (1, 2)])
def test_resharded_resume_continues_the_same_global_positions(saved_world: int, resumed_world: int) -> None:
    # 40 samples, micro-batch 3: 2 ranks drop 4 samples per epoch, 1 rank drops 1.
    saved = build_samplers(40, world_size=saved_world, micro_batch_size=3)
    run_job(saved, num_windows=2, window_micro_steps=2 // saved_world)  # 12 samples consumed
    state = saved[0].state_dict()
    assert (state["epoch"], state["offset"]) == (0, 12)

    resumed = resume(state, 40, world_size=resumed_world, micro_batch_size=3)
    num_micro_steps = 20 // resumed_world
    steps = run_job(resumed, num_windows=num_micro_steps, window_micro_steps=1)
    expected = reference_stream(40, step=3 * resumed_world, num_micro_steps=num_micro_steps, offset=12)
    assert global_stream(steps) == expected
    # The drop rule follows the resumed job's micro-step: 1 rank reads epoch 0 up to 39, 2 ranks up to 36.
    order_0 = epoch_order(40, seed=7, epoch=0, shuffle=True).tolist()
    end = 39 if resumed_world == 1 else 36
    assert global_stream(steps)[: end - 12] == order_0[12:end]


def test_resuming_on_more_ranks_starts_the_next_epoch_when_the_rest_is_too_short() -> None:
    single = ShardedSampler(20, world_size=1, rank=0, micro_batch_size=2, seed=7)
    single.consume(16)  # 4 left: one micro-step for 1 rank, less than one for 4 ranks
    wide = ShardedSampler(20, world_size=4, rank=2, micro_batch_size=2, seed=7)
    wide.load_state_dict(single.state_dict())
    assert (wide.state_dict()["epoch"], wide.state_dict()["offset"]) == (1, 0)
    assert list(wide) == epoch_order(20, seed=7, epoch=1, shuffle=True)[2:16:4].tolist()


def test_iterating_ahead_of_consume_does_not_change_the_state() -> None:
    sampler = ShardedSampler(50, world_size=2, rank=0, micro_batch_size=3, seed=7)
    sampler.consume(12)
    saved = sampler.state_dict()
    list(sampler), iter(sampler)  # a prefetching loader already into the next epoch
    assert sampler.state_dict() == saved
    sampler.consume(6)
    assert sampler.state_dict()["offset"] == 18


def test_consume_rolls_over_epochs_and_rejects_partial_micro_steps() -> None:
    sampler = ShardedSampler(50, world_size=2, rank=1, micro_batch_size=3, seed=7)
    sampler.consume(6 * 8 * 3 + 6)  # three whole epochs of 8 micro-steps, then one more
    assert (sampler.state_dict()["epoch"], sampler.state_dict()["offset"]) == (3, 6)
    with pytest.raises(ValueError, match="multiple of world_size \\* micro_batch_size = 6"):
        sampler.consume(9)
    with pytest.raises(ValueError, match="must be >= 0"):
        sampler.consume(-6)


def test_len_counts_the_epoch_the_next_iter_yields() -> None:
    sampler = ShardedSampler(50, world_size=2, rank=0, micro_batch_size=3, seed=7)
    sampler.load_state_dict({"num_samples": 50, "seed": 7, "shuffle": True, "epoch": 2, "offset": 30})
    assert len(sampler) == 9 == len(list(sampler))  # 20 left: 3 micro-steps of 6, 3 per rank
    assert len(sampler) == 24 == len(list(sampler))


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("num_samples", 51, "'num_samples' does not match: the checkpoint has 51, this sampler has 50"),
        ("seed", 8, "'seed' does not match: the checkpoint has 8, this sampler has 7"),
        ("shuffle", False, "'shuffle' does not match: the checkpoint has False, this sampler has True"),
    ],
)
def test_load_state_dict_names_the_mismatched_key(key: str, value: int | bool, message: str) -> None:
    sampler = ShardedSampler(50, world_size=2, rank=0, micro_batch_size=3, seed=7)
    state = sampler.state_dict() | {key: value}
    with pytest.raises(ValueError, match=message):
        sampler.load_state_dict(state)


def test_load_state_dict_rejects_missing_extra_and_bad_position() -> None:
    sampler = ShardedSampler(50, world_size=2, rank=0, micro_batch_size=3, seed=7)
    state = sampler.state_dict()
    del state["offset"]
    with pytest.raises(ValueError, match=r"missing keys \['offset'\] and unexpected keys \['world_size'\]"):
        sampler.load_state_dict(state | {"world_size": 2})
    with pytest.raises(ValueError, match="'offset'=51 is past num_samples=50"):
        sampler.load_state_dict(state | {"offset": 51})
    with pytest.raises(ValueError, match="'epoch' must be >= 0"):
        sampler.load_state_dict(state | {"epoch": -1, "offset": 0})


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"rank": 2}, r"rank must be in \[0, world_size=2\), got 2"),
        ({"world_size": 0}, "world_size must be >= 1"),
        ({"micro_batch_size": True}, "micro_batch_size must be an int"),
        ({"num_samples": 5}, "num_samples=5 is smaller than one micro-step of the job"),
        ({"seed": -1}, "seed must be >= 0"),
    ],
)
def test_constructor_rejects_bad_arguments(kwargs: dict[str, int], message: str) -> None:
    arguments = {"num_samples": 50, "world_size": 2, "rank": 0, "micro_batch_size": 3, "seed": 7} | kwargs
    with pytest.raises(ValueError, match=message):
        ShardedSampler(arguments.pop("num_samples"), **arguments)


def test_dataloader_gets_full_batches_in_sampler_order() -> None:
    dataset = TensorDataset(torch.arange(50) * 10)
    sampler = ShardedSampler(50, world_size=2, rank=1, micro_batch_size=4, seed=7)
    loader = DataLoader(dataset, batch_size=4, sampler=sampler)
    assert len(loader) == 6  # 50 // 8 = 6 micro-steps
    expected = epoch_order(50, seed=7, epoch=0, shuffle=True)[1:48:2] * 10
    batches = [values for (values,) in loader]
    assert all(batch.shape == (4,) for batch in batches)
    assert torch.equal(torch.cat(batches), expected)
    second_epoch = torch.cat([values for (values,) in loader])
    assert torch.equal(second_epoch, epoch_order(50, seed=7, epoch=1, shuffle=True)[1:48:2] * 10)


def test_dataloader_with_workers_resumes_mid_epoch_from_the_consumed_position() -> None:
    dataset = TensorDataset(torch.arange(50))
    uninterrupted = ShardedSampler(50, world_size=2, rank=0, micro_batch_size=3, seed=7)
    expected = [
        batch.tolist() for _ in range(2) for (batch,) in DataLoader(dataset, 3, sampler=uninterrupted)
    ]

    sampler = ShardedSampler(50, world_size=2, rank=0, micro_batch_size=3, seed=7)
    loader = DataLoader(dataset, batch_size=3, sampler=sampler, num_workers=2, prefetch_factor=4)
    seen = []
    for (batch,) in loader:  # workers have prefetched the whole epoch; training stops after 5
        seen.append(batch.tolist())
        sampler.consume(6)
        if len(seen) == 5:
            break
    resumed = ShardedSampler(50, world_size=2, rank=0, micro_batch_size=3, seed=7)
    resumed.load_state_dict(sampler.state_dict())
    for _ in range(2):  # the rest of epoch 0, then epoch 1
        seen += [batch.tolist() for (batch,) in DataLoader(dataset, batch_size=3, sampler=resumed)]
    assert seen == expected
