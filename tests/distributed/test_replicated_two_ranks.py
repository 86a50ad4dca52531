"""Replicated persistent chunks on two real gloo ranks (issue 29): the first ``n_replicate``
persistent chunks hold the whole chunk's state on every rank and all-reduce their gradients, as
DDP does, instead of being sharded (ZeRO-3). Training stays plain PyTorch's; a mixed plan
(replicated, sharded and offloaded chunks) equals the all-sharded plan bit for bit where the
reductions match; an all-replicated plan issues DDP's all-reduces and no all-gather; checkpoints
are the same whatever the plan replicates, in both directions."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from tests.checkpointing import checkpoint_job, train_until
from tests.distributed.pool import RankPool
from tests.distributed.test_checkpoint_two_ranks import assert_same_checkpoint
from tests.distributed.test_collectives_two_ranks import update_collectives
from tests.helpers import (
    assert_matches_reference,
    assert_state_close,
    assert_state_equal,
    gpt_reference,
    lm_batches,
    tiny_gpt,
)

pytestmark = pytest.mark.timeout(300)

STEPS = 6
MIXED = {"chunk_size": "64KiB", "n_persist": 8, "n_replicate": 4, "n_buffer": 2}
SHARDED = {**MIXED, "n_replicate": 0}


def train(*, rank: int, output_dir: str, memory: dict[str, Any], accumulation: int, clip: float) -> dict[str, Any]:
    from protrain import runtime

    data = lm_batches(micro_batch_size=2, accumulation=accumulation, world_size=2)
    config = {
        "seed": 3,
        "micro_batch_size": 2,
        "gradient_accumulation_steps": accumulation,
        "gradient_clipping": clip,
        "optimizer": {"lr": 1e-3, "weight_decay": 0.1},
        "memory": {"block_modes": ["keep", "keep"], **memory},
        "output_dir": output_dir,
    }
    losses, norms = [], []
    with runtime.initialize(tiny_gpt(0), config=config) as engine:
        for update in range(STEPS):
            window = 0.0
            for micro in range(accumulation):
                out = engine(**data.batch(update, micro, rank))
                engine.backward(out.loss)
                window += out.loss.item()
                engine.step()
            losses.append(window / accumulation)
            norms.append(engine.get_global_grad_norm())
        replicated = sum(1 for chunk in engine.chunks.chunks if chunk.is_replicated)
        state = engine.state_dict()
        return {"state": state, "losses": losses, "norms": norms, "replicated": replicated, "plan": engine.plan}


@pytest.mark.parametrize(
    ("accumulation", "clip"), [(1, 0.0), (4, 0.05)], ids=["accumulation-1", "accumulation-4-clipped"]
)
def test_a_mixed_plan_trains_as_plain_pytorch(
    rank_pool: RankPool, tmp_path: Path, accumulation: int, clip: float
) -> None:
    """Replicated, sharded and offloaded chunks in one plan; with clipping the global norm counts
    each replicated gradient once (every rank holds all of it)."""
    results = rank_pool.run(train, output_dir=str(tmp_path), memory=MIXED, accumulation=accumulation, clip=clip)
    assert results[0]["replicated"] == results[1]["replicated"] == 4
    plan = results[0]["plan"]
    assert (plan.n_replicate, plan.n_persist) == (4, 8) and plan.num_chunks > plan.n_persist
    assert_state_equal(results[1]["state"], results[0]["state"])
    reference = gpt_reference(
        accumulation=accumulation, world_size=2, steps=STEPS, lr=1e-3, weight_decay=0.1, clip=clip
    )
    assert_matches_reference(results[0]["state"], reference.fp32, reference.fp64)
    mean_losses = [(a + b) / 2 for a, b in zip(results[0]["losses"], results[1]["losses"], strict=True)]
    assert mean_losses == pytest.approx(reference.losses, rel=1e-5)


def test_replicating_changes_no_bit_of_the_training(rank_pool: RankPool, tmp_path: Path) -> None:
    """Two ranks' all-reduce and reduce-scatter add the same two numbers, and the update is
    elementwise: the mixed plan and the all-sharded one end bit-identical. The logged gradient
    norm too: each rank takes the squares of its shard's slice of a replicated gradient."""
    mixed = rank_pool.run(train, output_dir=str(tmp_path / "mixed"), memory=MIXED, accumulation=1, clip=0.0)
    sharded = rank_pool.run(train, output_dir=str(tmp_path / "sharded"), memory=SHARDED, accumulation=1, clip=0.0)
    assert sharded[0]["replicated"] == 0
    assert_state_equal(mixed[0]["state"], sharded[0]["state"])
    assert mixed[0]["losses"] == sharded[0]["losses"]
    assert mixed[0]["norms"] == mixed[1]["norms"] == sharded[0]["norms"]


def ddp_and_protrain_collectives(*, rank: int, output_dir: str) -> dict[str, Any]:
    """One chunk holding the whole model, replicated, beside DDP with one bucket: each update's
    gradient all-reduces (calls, bytes) of both, and ProTrain's other collectives."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from protrain import runtime
    from tests.helpers import train_updates

    data = lm_batches(micro_batch_size=2, accumulation=1, world_size=2)
    numel = sum(p.numel() for p in {id(p): p for p in tiny_gpt(0).parameters()}.values())
    chunk_bytes = -(-numel * 4 * 101 // 100 // 64) * 64  # the model and 1% for alignment
    config = {
        "seed": 3,
        "micro_batch_size": 2,
        "optimizer": {"lr": 1e-3, "weight_decay": 0.1},
        "memory": {"chunk_size": chunk_bytes, "n_persist": 1, "n_replicate": 1, "block_modes": ["keep", "keep"]},
        "output_dir": output_dir,
    }
    with runtime.initialize(tiny_gpt(0), config=config) as engine:
        train_updates(engine, data, range(3), rank=rank)
        plan = engine.plan
        table = "\n".join(" ".join(row) for row in plan.rows())
    ours = update_collectives(output_dir)
    calls: list[int] = []

    def counting(bucket: Any) -> Any:
        calls.append(bucket.buffer().numel() * bucket.buffer().element_size())
        buffer = bucket.buffer().div_(dist.get_world_size())
        return dist.all_reduce(buffer, async_op=True).get_future().then(lambda fut: fut.value()[0])

    model = tiny_gpt(0)
    ddp = DistributedDataParallel(model, bucket_cap_mb=64)
    # Unannotated: DDP checks a hook's annotations, which postponed annotations make strings.
    ddp.register_comm_hook(None, lambda state, bucket: counting(bucket))
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-3, weight_decay=0.1)
    for update in range(3):
        ddp(**data.batch(update, 0, rank)).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return {"ours": ours, "ddp_bytes": calls, "num_chunks": plan.num_chunks, "table": table}


def test_an_all_replicated_plan_communicates_as_ddp(rank_pool: RankPool, tmp_path: Path) -> None:
    """Per update: DDP's one bucket all-reduce, ProTrain's one chunk all-reduce of the same
    gradients (the chunk's padding aside), no all-gather, no reduce-scatter; the plan table says
    "as DDP"."""
    found = rank_pool.run(ddp_and_protrain_collectives, output_dir=str(tmp_path))[0]
    assert found["num_chunks"] == 1 and "(all: as DDP)" in found["table"]
    ddp_bytes = found["ddp_bytes"]
    assert len(ddp_bytes) == 3, "DDP all-reduced one bucket per update"
    for update in found["ours"][1:]:
        assert update["all_gather"] == 0 and update["reduce_scatter"] == 0 and update["broadcast"] == 0
        # The gradient's all-reduce, and two of a few bytes: the window's header (gradient flags,
        # loss, tokens) and the gradient norm's squares.
        assert update["all_reduce"] == 3
        gradient_mib = ddp_bytes[0] / (1 << 20)
        assert gradient_mib <= update["all_reduce(MiB)"] <= gradient_mib * 1.02


def test_checkpoints_move_between_replicated_and_sharded_plans(rank_pool: RankPool, tmp_path: Path) -> None:
    """A replicated plan saves what a sharded one would; each loads the other's, bit for bit."""
    replicated = str(tmp_path / "replicated")
    rank_pool.run(
        train_until,
        config=checkpoint_job(replicated, memory=MIXED, checkpoint={"interval_steps": 3}),
        until=3,
    )
    saved = f"{replicated}/ckpt/step-00000003"
    into_sharded = str(tmp_path / "into-sharded")
    rank_pool.run(
        train_until,
        config=checkpoint_job(str(tmp_path / "sharded"), memory=SHARDED, checkpoint={"resume": saved}),
        until=3,
        resave_to=into_sharded,
    )
    assert_same_checkpoint(f"{into_sharded}/step-00000003", saved)
    back = str(tmp_path / "back")
    rank_pool.run(
        train_until,
        config=checkpoint_job(
            str(tmp_path / "again"), memory=MIXED, checkpoint={"resume": f"{into_sharded}/step-00000003"}
        ),
        until=3,
        resave_to=back,
    )
    assert_same_checkpoint(f"{back}/step-00000003", saved)


def test_a_replicated_run_resumed_ends_bit_identical(rank_pool: RankPool, tmp_path: Path) -> None:
    """Every rank needs the whole of a replicated chunk's state after a resume, though each read
    only its shard's part: the resumed run ends where the uninterrupted one does."""
    full = rank_pool.run(train_until, config=checkpoint_job(str(tmp_path / "full"), memory=MIXED), until=6)
    interrupted = str(tmp_path / "interrupted")
    rank_pool.run(
        train_until, config=checkpoint_job(interrupted, memory=MIXED, checkpoint={"interval_steps": 3}), until=3
    )
    resumed = rank_pool.run(train_until, config=checkpoint_job(interrupted, memory=MIXED), until=6)
    for rank in (0, 1):
        assert resumed[rank]["started_at"] == 3
        assert resumed[rank]["losses"] == full[rank]["losses"][3:]
        assert_state_equal(resumed[rank]["state"], full[rank]["state"])


def train_switching(*, rank: int, output_dir: str, first: int, then: int) -> dict[str, Any]:
    """Three updates replicating ``first`` chunks, a switch to replicating ``then``, three more."""
    import dataclasses

    from protrain import runtime
    from tests.helpers import train_updates

    data = lm_batches(micro_batch_size=2, accumulation=1, world_size=2)
    config = {
        "seed": 3,
        "micro_batch_size": 2,
        "optimizer": {"lr": 1e-3, "weight_decay": 0.1},
        "memory": {"block_modes": ["keep", "keep"], **MIXED, "n_replicate": first},
        "output_dir": output_dir,
    }
    with runtime.initialize(tiny_gpt(0), config=config) as engine:
        train_updates(engine, data, range(3), rank=rank)
        engine.switch_plan(dataclasses.replace(engine.plan, n_replicate=then))
        replicated = sum(1 for chunk in engine.chunks.chunks if chunk.is_replicated)
        train_updates(engine, data, range(3, 6), rank=rank)
        return {"state": engine.state_dict(), "replicated": replicated}


def test_a_plan_switch_moves_replicated_state_both_ways(rank_pool: RankPool, tmp_path: Path) -> None:
    """Into and out of replication between updates: every master, moment and step count lands
    in its new place; the runs end as the plan that never switched (bit for bit: the reductions
    match)."""
    steady = rank_pool.run(train, output_dir=str(tmp_path / "steady"), memory=SHARDED, accumulation=1, clip=0.0)
    into = rank_pool.run(train_switching, output_dir=str(tmp_path / "into"), first=0, then=4)
    out_of = rank_pool.run(train_switching, output_dir=str(tmp_path / "out-of"), first=4, then=0)
    assert (into[0]["replicated"], out_of[0]["replicated"]) == (4, 0)
    assert_state_equal(into[0]["state"], steady[0]["state"])
    assert_state_equal(out_of[0]["state"], steady[0]["state"])


def train_in_place(*, rank: int, output_dir: str, accumulation: int, backwards: int) -> dict[str, Any]:
    """Every chunk replicated, fp32: ``backwards`` forward and backward calls per micro-batch (each
    of the loss over ``backwards``), counting the gradient buffers backward takes."""
    from protrain import runtime

    data = lm_batches(micro_batch_size=2, accumulation=accumulation, world_size=2)
    config = {
        "seed": 3,
        "micro_batch_size": 2,
        "gradient_accumulation_steps": accumulation,
        "gradient_clipping": 0.05,  # gradients kept: a backward may leave the window open
        "optimizer": {"lr": 1e-3, "weight_decay": 0.1},
        "memory": {"chunk_size": "64KiB", "n_persist": 12, "n_replicate": 12, "block_modes": ["keep", "keep"]},
        "output_dir": output_dir,
    }
    with runtime.initialize(tiny_gpt(0), config=config) as engine:
        pool = engine.chunks.reducer.grad_pool
        for update in range(STEPS):
            for micro in range(accumulation):
                for _ in range(backwards):  # the same batch each time: the window's gradient is unchanged
                    engine.backward(engine(**data.batch(update, micro, rank)).loss / backwards)
                engine.step()
        assert engine.plan.n_replicate == engine.plan.num_chunks
        return {"state": engine.state_dict(), "buffers": pool.most_allocated}


@pytest.mark.parametrize(
    ("accumulation", "backwards"), [(3, 1), (2, 2)], ids=["accumulation-3", "two-backwards-per-micro-batch"]
)
def test_replicated_gradients_accumulate_in_place_and_are_all_reduced_once_per_window(
    rank_pool: RankPool, tmp_path: Path, accumulation: int, backwards: int
) -> None:
    """As DDP with gradient_as_bucket_view and no_sync: autograd accumulates each rank's
    micro-batches into the replicated shards, which are all-reduced in the window's last
    backward; no gradient buffer is taken. A second backward in that micro-batch (after the
    shards' all-reduce) goes through the buffers, and the window's gradient is the same."""
    results = rank_pool.run(train_in_place, output_dir=str(tmp_path), accumulation=accumulation, backwards=backwards)
    assert_state_equal(results[1]["state"], results[0]["state"])
    if backwards == 1:
        assert results[0]["buffers"] == 0, "backward copied gradients into buffers"
    else:
        assert results[0]["buffers"] > 0, "the second backward of the last micro-batch uses the buffers"
    reference = gpt_reference(
        accumulation=accumulation, world_size=2, steps=STEPS, lr=1e-3, weight_decay=0.1, clip=0.05
    )
    assert_matches_reference(results[0]["state"], reference.fp32, reference.fp64)


class SharedUnderReentrant(nn.Module):
    """An input layer, then one layer applied twice, each time under reentrant checkpointing:
    the shared layer's gradient arrives twice in one backward (DDP refuses this unless told the
    graph is static), both times before the input layer's."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 32)
        self.shared = nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = checkpoint(self.shared, torch.tanh(self.embed(x)), use_reentrant=True)
        h = checkpoint(self.shared, torch.tanh(h), use_reentrant=True)
        return (h**2).mean()


def shared_inputs() -> list[list[torch.Tensor]]:
    """Per update, each rank's batch."""
    generator = torch.Generator().manual_seed(0)
    return [[torch.randn(4, 8, generator=generator) for _rank in range(2)] for _update in range(STEPS)]


def train_shared(*, rank: int, output_dir: str, memory: dict[str, Any]) -> dict[str, Any]:
    from protrain import runtime

    torch.manual_seed(1)
    config = {"seed": 3, "micro_batch_size": 4, "optimizer": {"lr": 1e-2, "weight_decay": 0.1}}
    try:
        with runtime.initialize(
            SharedUnderReentrant(), config={**config, "memory": memory, "output_dir": output_dir}
        ) as engine:
            for batches in shared_inputs():
                engine.backward(engine(batches[rank]))
                engine.step()
            return {"state": engine.state_dict(), "chunks": engine.plan.num_chunks}
    except RuntimeError as error:
        return {"error": str(error)}


def shared_reference() -> dict[str, torch.Tensor]:
    """Plain PyTorch: both ranks' losses averaged, fused AdamW (biases without decay)."""
    torch.manual_seed(1)
    model = SharedUnderReentrant()
    decay = [model.embed.weight, model.shared.weight]
    optimizer = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": 0.1},
            {"params": [model.embed.bias, model.shared.bias], "weight_decay": 0.0},
        ],
        lr=1e-2,
        betas=(0.9, 0.95),
        fused=True,
    )
    for batches in shared_inputs():
        ((model(batches[0]) + model(batches[1])) / 2).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return model.state_dict()


@pytest.mark.parametrize("n_replicate", [1, 0], ids=["replicated", "sharded"])
def test_a_gradient_arriving_twice_in_one_backward_is_summed_once_averaged(
    rank_pool: RankPool, tmp_path: Path, n_replicate: int
) -> None:
    """Gradients take the ranks' 1/2 as they enter the shard or buffer (rank_average.py): the
    second arrival of the shared layer's gradient must take it too, before the chunk (the whole
    model here) is reduced."""
    memory = {"chunk_size": "64KiB", "n_persist": 1, "n_replicate": n_replicate, "n_buffer": 0}
    results = rank_pool.run(train_shared, output_dir=str(tmp_path), memory=memory)
    assert results[0]["chunks"] == 1
    assert_state_equal(results[1]["state"], results[0]["state"])
    assert_state_close(results[0]["state"], shared_reference())


def test_a_gradient_arriving_after_its_chunk_was_reduced_is_refused(rank_pool: RankPool, tmp_path: Path) -> None:
    """The shared layer alone in a chunk: its first gradient completes the chunk, whose reduction
    begins; the second would be lost or race it, so backward fails and says why."""
    memory = {"chunk_size": "4608B", "n_persist": 2, "n_replicate": 2, "n_buffer": 0}
    results = rank_pool.run(train_shared, output_dir=str(tmp_path), memory=memory)
    for result in results:
        assert result["error"].startswith("shared.")  # its weight or bias, whichever came first
        assert "got a second gradient in one backward" in result["error"]
        assert "use_reentrant=False" in result["error"]
