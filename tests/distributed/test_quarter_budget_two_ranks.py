"""Two gloo ranks under the device wall, each with a quarter of the model's fp32 size as its device
budget: train, evaluate, checkpoint, resume, state dict, exports (safetensors shards, a PEFT
adapter). Every save streams: the device rises by at most one chunk and one shard buffer, only
rank 0 writes files, and what it writes loads back to the trained weights; training equals
plain PyTorch's data-parallel run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.distributed.pool import RankPool
from tests.helpers import assert_matches_reference, assert_state_equal, gpt_reference, lm_batches
from tests.unit.test_streamed_export import DEEP, UPDATES, deep_gpt, deep_lora, fp32_bytes, job

pytestmark = pytest.mark.timeout(300)


def train_and_save(*, rank: int, root: str) -> dict[str, Any]:
    import torch

    from protrain import runtime
    from protrain.runtime.model_io.safetensors_stream import ShardedWriter

    writers: list[int] = []
    init = ShardedWriter.__init__

    def counted(self: ShardedWriter, *args: Any, **kwargs: Any) -> None:
        writers.append(rank)
        init(self, *args, **kwargs)

    ShardedWriter.__init__ = counted  # type: ignore[method-assign]
    try:
        model = deep_gpt()
        budget = fp32_bytes(model) // 4
        data = lm_batches(micro_batch_size=2, accumulation=1, world_size=2)
        config = job(Path(root), budget, checkpoint={"dir": str(Path(root) / "ckpt")})
        with runtime.initialize(model, config=config, example_batch=data.batch(0, 0, rank)) as engine:
            for update in range(UPDATES):
                out = engine(**data.batch(update, 0, rank))
                engine.backward(out.loss)
                engine.step()
            engine.eval()
            with torch.no_grad():
                loss = float(engine(**data.batch(3, 0, rank)).loss)
            engine.train()
            engine.load_checkpoint(engine.save_checkpoint())
            wall = engine._wall
            assert wall is not None
            held = wall.live_bytes
            wall.take_highest()
            state = engine.state_dict()
            engine.export(Path(root) / "model.safetensors", max_shard_size="1MB")
            rise = wall.take_highest() - held
            layout = engine.chunks.layout
            bound = (layout.chunk_numel + layout.shard_numel) * 4 + 1024  # and a few scalars
        return {"state": state, "loss": loss, "rise": rise, "bound": bound, "writers": writers}
    finally:
        ShardedWriter.__init__ = init  # type: ignore[method-assign]


def test_two_ranks_train_and_stream_every_save_within_a_quarter_of_the_model(
    rank_pool: RankPool, tmp_path: Path
) -> None:
    from protrain.runtime.model_io import load_safetensors_export

    results = rank_pool.run(train_and_save, root=str(tmp_path))
    for result in results:
        assert result["rise"] <= result["bound"], f"a save raised the device {result['rise']} bytes"
    assert [r["writers"] for r in results] == [[0], []], "rank 0 alone writes"
    assert_state_equal(results[1]["state"], results[0]["state"])
    reference = gpt_reference(DEEP, world_size=2, steps=UPDATES, lr=1e-3, weight_decay=0.1)
    state = results[0]["state"]
    assert_matches_reference({k: v for k, v in state.items() if k in reference.fp32}, reference.fp32, reference.fp64)
    assert_state_equal(load_safetensors_export(tmp_path / "model.safetensors"), state)
    assert len(list(tmp_path.glob("model-*-of-*.safetensors"))) > 4


def export_adapter(*, rank: int, root: str) -> list[str]:
    from protrain import runtime

    model = deep_lora()
    budget = fp32_bytes(model) // 4
    data = lm_batches(micro_batch_size=2, accumulation=1, world_size=2)
    with runtime.initialize(model, config=job(Path(root), budget), example_batch=data.batch(0, 0, rank)) as engine:
        out = engine(**data.batch(0, 0, rank))
        engine.backward(out.loss)
        engine.step()
        engine.export(Path(root) / "adapter", adapter_only=True)
        return sorted(p.name for p in (Path(root) / "adapter").iterdir())


def test_two_ranks_export_a_lora_adapter_within_a_quarter_of_the_model(rank_pool: RankPool, tmp_path: Path) -> None:
    files = rank_pool.run(export_adapter, root=str(tmp_path))
    assert files[0] == files[1] and "adapter_model.safetensors" in files[0]
