"""Chunk packing, the chunk-size search and the model's chunk layout."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from protrain.profiler.chunking import candidate_chunk_bytes, pack, search_chunk_bytes, search_chunk_size
from protrain.runtime.chunks.layout import ChunkLayout, first_use_order, layout_from_params, model_params
from tests.helpers import tiny_gpt


def test_pack_keeps_order_never_splits_and_separates_frozen() -> None:
    packing = pack([(6, True), (3, True), (4, False), (2, True), (5, True)], chunk_numel=10, world_size=2)
    assert packing.chunk_numel == 10
    assert packing.placement == ((0, 0), (0, 6), (1, 0), (2, 0), (2, 2))
    assert [c.trainable for c in packing.chunks] == [True, False, True]
    assert [c.used for c in packing.chunks] == [9, 4, 7]
    assert packing.wasted_numel == 1 + 6 + 3


def test_pack_rounds_capacity_to_world_size_and_rejects_big_params() -> None:
    assert pack([(5, True)], chunk_numel=7, world_size=4).chunk_numel == 8
    with pytest.raises(ValueError, match="does not fit"):
        pack([(9, True)], chunk_numel=8, world_size=1)


def test_search_minimises_waste_over_a_grid_scaled_to_the_model() -> None:
    sizes = [(1 << 18, True)] * 24  # 24 MiB of fp32 parameters of 1 MiB each
    grid = candidate_chunk_bytes(24 << 20, 1 << 20)
    assert grid[0] == 1 << 20 and grid[-1] == 24 << 20  # total/64 or the largest parameter, up to the whole model
    best = search_chunk_size(sizes, element_size=4, world_size=1)
    waste = pack(sizes, best // 4, 1).wasted_numel
    assert waste == min(pack(sizes, size // 4, 1).wasted_numel for size in grid) == 0
    assert best == 24 << 20  # ties go to the largest size


def gpt_sizes(layers: int, width: int, vocab: int = 256, seq: int = 256) -> list[tuple[int, bool]]:
    """A GPT's parameters in first-use order: embeddings, then per block its norms, attention
    (qkv, out) and MLP (4x width) with biases, then the final norm."""
    sizes = [(vocab * width, True), (seq * width, True)]
    for _ in range(layers):
        sizes += [(width, True)] * 2 + [(width * 3 * width, True), (3 * width, True)]
        sizes += [(width * width, True), (width, True)] + [(width, True)] * 2
        sizes += [(width * 4 * width, True), (4 * width, True), (4 * width * width, True), (width, True)]
    return sizes + [(width, True)] * 2


def test_shrink_wrapped_sizes_pack_alike_with_less_padding() -> None:
    """Whole parameters of a few sizes pack badly into the power-of-two grid; each grid size cut
    to its fullest chunk packs the same parameters into the same places with less padding, and
    the search tries both."""
    sizes = gpt_sizes(6, 512)
    total = sum(numel for numel, _ in sizes) * 4
    grid = candidate_chunk_bytes(total, max(numel for numel, _ in sizes) * 4)
    tried = search_chunk_bytes(sizes, element_size=4, world_size=2)
    assert set(grid) < set(tried)
    for size in grid:
        packing = pack(sizes, size // 4, 2)
        wrapped = min(t for t in tried if t <= size and pack(sizes, t // 4, 2).placement == packing.placement)
        fullest = max(chunk.used for chunk in packing.chunks) * 4
        assert wrapped == size or (wrapped % (64 << 10) == 0 and fullest <= wrapped < fullest + (64 << 10))
    padding = {size: pack(sizes, size // 4, 2).num_chunks * size / total for size in tried}
    assert padding[8 << 20] > 1.4 and min(padding[t] for t in tried if t < 8 << 20 and t > 4 << 20) < 1.07


def test_big_models_use_the_papers_range() -> None:
    grid = candidate_chunk_bytes(20 << 30, 100 << 20)
    assert grid[0] == 100 << 20 and grid[-1] == 256 << 20
    assert candidate_chunk_bytes(20 << 30, 1 << 20)[0] == 32 << 20
    # A parameter above half the cap (a large vocabulary's embedding) widens the range to twice
    # its size, so the other parameters can pack densely.
    grid = candidate_chunk_bytes(20 << 30, 200 << 20)
    assert grid[0] == 200 << 20 and grid[-1] == 400 << 20


def test_model_layout_ties_first_use_and_round_trip() -> None:
    model = tiny_gpt()
    model.blocks[1].mlp.fc.requires_grad_(False)
    batch = torch.randint(0, 256, (2, 8))
    order = first_use_order(model, lambda: model(batch))
    assert order[:2] == ["wte.weight", "wpe.weight"] and order[-2:] == ["ln_f.weight", "ln_f.bias"]
    params = model_params(model, order)
    assert len(params) == len({id(p) for p in model.parameters()})
    wte = params[0]
    assert wte.name == "wte.weight" and wte.aliases == ("lm_head.weight",)
    layout = layout_from_params(params, chunk_numel=40_000, world_size=2)
    assert layout.index_of("lm_head.weight") == 0
    frozen = layout.slots[layout.index_of("blocks.1.mlp.fc.weight")].chunk
    assert not layout.chunks[frozen].trainable
    assert all(
        layout.params[i].trainable == layout.chunks[c.index].trainable
        for c in layout.chunks
        for i in c.params
    )
    again = ChunkLayout.from_dict(json.loads(json.dumps(layout.to_dict())))
    assert again == layout


def test_first_use_order_on_meta_device_and_unused_params_last() -> None:
    with torch.device("meta"):
        model = nn.ModuleDict({"b": nn.Linear(4, 4), "a": nn.Linear(4, 4), "unused": nn.Linear(4, 4)})
    order = first_use_order(model, lambda: model["a"](model["b"](torch.empty(2, 4, device="meta"))))
    assert order == ["b.weight", "b.bias", "a.weight", "a.bias"]
    names = [p.name for p in model_params(model, order)]
    assert names[-2:] == ["unused.weight", "unused.bias"]


def test_too_small_chunk_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="memory.chunk_size is too small: parameter wte.weight"):
        layout_from_params(model_params(tiny_gpt()), chunk_numel=1000, world_size=1)
