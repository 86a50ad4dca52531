"""Model and optimizer state in parameter space, as ``torch.distributed.checkpoint`` sees it.

The engine keeps state in chunk layout: each chunk one flat buffer, evenly sharded over ranks,
a parameter possibly split between two ranks' shards. A checkpoint must not depend on that
layout (a new plan or world size has to load it), so every parameter is presented to DCP as a
global tensor of its own shape under its own name, each rank contributing the part in its shard:

    model.<name>              fp32 master (frozen parameters: their stored dtype)
    optim.<state>.<name>      each state tensor of the optimizer rule (runtime/optim/), by its
                              name: AdamW's optim.exp_avg.<name> and optim.exp_avg_sq.<name>
    optim.step.<name>         updates this parameter has had (torch's per-parameter state['step'])

A rank's part of a parameter is a contiguous range of its flattened elements; DCP describes
shards as boxes, so the range is cut into at most a few boxes (``row_major_boxes``) and the
parameter becomes a ``ShardedTensor`` made of those boxes. DCP then writes each rank's boxes from
that rank and, on load, reads whatever boxes the loading layout asks for: resharding comes from
DCP. With one rank there is nothing to split: plain tensors.

ShardedTensor is the DCP type that carries arbitrary per-rank boxes (DTensor placements only
express even splits along dimensions, not a flat range cut across rows); torch marks it
deprecated in favour of DTensor, so its FutureWarning is silenced here, on purpose.

Host tensors (the offloaded chunks' state) are handed to DCP as ``exact_alias``es, so a
synchronous save copies nothing of them. A plain view would not do: DCP's file writer clones a
tensor whose storage is larger than its bytes, and (torch 2.13) keeps every clone of a rank's file
until the file is written, a second copy of the whole optimizer state
(docs/decisions/0010-checkpoint-host-state-without-a-copy.md). The compute device's tensors (the
persistent chunks' state; on CPU, what is not in the host arena) pass through one reused host
buffer a piece at a time (``staging``). An asynchronous save copies everything to the host first
(the plan counts that staging).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from protrain.runtime.checkpoint.staging import DeviceStaging, exact_alias
from protrain.runtime.chunks.layout import ChunkLayout
from protrain.runtime.chunks.manager import ChunkManager
from protrain.runtime.chunks.store import Chunk, shard_segments
from protrain.runtime.hw.distributed import all_gather_flat

MODEL = "model."
STEP = "optim.step."

Box = tuple[list[int], list[int]]
"""(offsets, sizes) of a box inside a tensor."""


def row_major_boxes(shape: Sequence[int], start: int, end: int) -> list[Box]:
    """Cut the flat element range [start, end) of a row-major tensor of ``shape`` into boxes whose
    row-major concatenation is exactly that range, in order (at most 2 per dimension + 1)."""
    if start >= end:
        return []
    if len(shape) <= 1:
        return [([start], [end - start])]
    row = math.prod(shape[1:])
    first, last = start // row, end // row
    inner = list(shape[1:])
    if first == last:
        return [([first, *o], [1, *s]) for o, s in row_major_boxes(inner, start - first * row, end - first * row)]
    boxes: list[Box] = []
    if start % row:
        boxes += [([first, *o], [1, *s]) for o, s in row_major_boxes(inner, start % row, row)]
        first += 1
    if last > first:
        boxes.append(([first] + [0] * len(inner), [last - first, *inner]))
    if end % row:
        boxes += [([last, *o], [1, *s]) for o, s in row_major_boxes(inner, 0, end % row)]
    return boxes


@dataclass(frozen=True, slots=True)
class Piece:
    """The part of parameter ``param`` held by ``rank``: its flat range from ``param_offset``."""

    rank: int
    param_offset: int
    numel: int


def pieces_by_param(layout: ChunkLayout, world_size: int) -> dict[int, list[Piece]]:
    """Every rank's part of every parameter (the same answer on every rank)."""
    result: dict[int, list[Piece]] = {}
    for chunk in layout.chunks:
        for rank in range(world_size):
            for segment in shard_segments(layout, chunk, rank):
                result.setdefault(segment.param, []).append(
                    Piece(rank=rank, param_offset=segment.param_offset, numel=segment.numel)
                )
    return result


@dataclass
class ParameterSpaceState:
    """The DCP state dict of a chunk manager, the staging of its device pieces (the planners
    need it) and what to do after DCP filled it (load)."""

    state_dict: dict[str, Any]
    staging: DeviceStaging | None = None
    after_load: list[Callable[[], None]] = field(default_factory=list)

    def finish_load(self) -> None:
        for action in self.after_load:
            action()


class ParameterSpace:
    """Builds ``ParameterSpaceState`` for one chunk manager (see the module docstring)."""

    def __init__(self, chunks: ChunkManager, group: dist.ProcessGroup | None) -> None:
        self.chunks = chunks
        self.layout = chunks.layout
        self.rank = chunks.dist_ctx.rank
        self.world_size = chunks.dist_ctx.world_size
        self.group = group
        self._pieces = pieces_by_param(self.layout, self.world_size)

    # ------------------------------------------------------------------ the state dict

    def for_save(self, *, copy: bool) -> ParameterSpaceState:
        """``copy``: host copies of everything (an asynchronous save writes while training goes
        on); otherwise host tensors are handed over as they are and device tensors staged."""
        if copy:
            state = ParameterSpaceState(state_dict={})
            for chunk, sources in self._sources():
                copies = [source.detach().to("cpu", copy=True) for source in sources]
                self._add_chunk(state.state_dict, chunk, copies, None)
        else:
            state = self._staged()
        state.state_dict.update(self._step_counts())
        return state

    def for_load(self) -> ParameterSpaceState:
        """Tensors DCP loads into: the live host state, and placeholders for device state."""
        state = self._staged()
        steps = {STEP + self.layout.params[i].name: torch.zeros((), dtype=torch.float32) for i in self._trainable()}
        state.state_dict.update(steps)
        state.after_load.append(lambda: self._set_step_counts(steps))
        state.after_load.append(self._share_replicated)
        state.after_load.append(self._refresh_copies)
        return state

    @torch.no_grad()
    def _refresh_copies(self) -> None:
        """Chunks whose fp32 master the load wrote into its NVMe file: their compute copies."""
        for chunk in self.chunks.chunks:
            chunk.refresh_copy()

    @torch.no_grad()
    def _share_replicated(self) -> None:
        """After a load each rank has read its shard's part of a replicated chunk: every rank
        gets the whole, by one all-gather per state tensor (padded to the collectives' size)."""
        if self.world_size == 1:
            return
        shard = self.layout.shard_numel
        start = self.rank * shard
        for chunk in self.chunks.chunks:
            if not chunk.is_replicated:
                continue
            for flat in chunk.state_tensors():
                whole = torch.zeros(self.layout.chunk_numel, dtype=flat.dtype, device=flat.device)
                mine = max(0, min(shard, flat.numel() - start))
                whole[start : start + mine].copy_(flat[start : start + mine])
                all_gather_flat(whole, whole[start : start + shard], self.chunks.dist_ctx.group)
                flat.copy_(whole[: flat.numel()])

    def _staged(self) -> ParameterSpaceState:
        """The live state: host tensors as they are, device tensors as staging placeholders."""
        state = ParameterSpaceState(state_dict={}, staging=DeviceStaging(self._largest_device_piece()))
        for chunk, sources in self._sources():
            self._add_chunk(state.state_dict, chunk, sources, state.staging)
        return state

    def _largest_device_piece(self) -> int:
        """Bytes of the largest part of one parameter in this rank's device state."""
        largest = 0
        for chunk, sources in self._sources():
            for source in sources:
                if not self.chunks.store.on_host(source):
                    most = max((segment.numel for segment in chunk.segments), default=0)
                    largest = max(largest, most * source.element_size())
        return largest

    # ------------------------------------------------------------------ pieces

    def _sources(self) -> Iterator[tuple[Chunk, list[torch.Tensor]]]:
        """Per chunk: its master shard, then (trainable) the optimizer rule's state tensors."""
        for chunk in self.chunks.chunks:
            yield chunk, [tensor.detach() for tensor in chunk.state_tensors()]

    def _add_chunk(
        self, state_dict: dict[str, Any], chunk: Chunk, flats: list[torch.Tensor], staging: DeviceStaging | None
    ) -> None:
        """``staging``: device tensors among ``flats`` become its placeholders."""
        states = tuple(f"optim.{name}." for name in self.chunks.optimizer_rule.state_names)
        prefixes = (MODEL, *states)[: len(flats)]
        # A replicated chunk is saved as if sharded (each rank writes its shard's part of the whole
        # it holds), so the checkpoint is the same whatever the plan replicates.
        segments, base = chunk.segments, 0
        if chunk.is_replicated and self.world_size > 1:
            segments = shard_segments(self.layout, chunk.info, self.rank)
            base = self.rank * self.layout.shard_numel
        for prefix, flat in zip(prefixes, flats, strict=True):
            stage = staging if staging is not None and not self.chunks.store.on_host(flat) else None
            for segment in segments:
                info = self.layout.params[segment.param]
                if info.numel == 0:
                    continue
                local = flat.narrow(0, base + segment.shard_offset, segment.numel)
                name = prefix + info.name
                state_dict[name] = self._global_tensor(name, segment.param, local, flat.dtype, stage)
        # A parameter with no element in this rank's shard still needs its key on every rank
        # (the ShardedTensor is a collective description), with no local boxes.
        if self.world_size > 1:
            for index in chunk.info.params:
                info = self.layout.params[index]
                if info.numel == 0:
                    continue  # nothing to save; the manifest still records its shape
                for prefix, flat in zip(prefixes, flats, strict=True):
                    if prefix + info.name not in state_dict:
                        state_dict[prefix + info.name] = self._global_tensor(
                            prefix + info.name, index, None, flat.dtype, None
                        )

    def _global_tensor(
        self, name: str, param: int, local: torch.Tensor | None, dtype: torch.dtype, staging: DeviceStaging | None
    ) -> Any:
        """One parameter as DCP's global tensor under ``name``, ``local`` being this rank's flat
        part (``staging``: a device tensor, standing in the state dict as a placeholder)."""
        info = self.layout.params[param]
        # A 0-d parameter (a learnable scale) is stored as shape [1]: DCP's boxes have a rank.
        shape = list(info.shape) or [1]

        def host_box(box: torch.Tensor, offsets: Sequence[int]) -> torch.Tensor:
            return exact_alias(box) if staging is None else staging.placeholder(name, offsets, box)

        if self.world_size == 1:
            assert local is not None
            return host_box(local.view(shape), [0] * len(shape))
        from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardMetadata
        from torch.distributed._shard.sharded_tensor.metadata import (
            ShardedTensorMetadata,
            TensorProperties,
        )

        metadata: list[ShardMetadata] = []
        local_shards: list[Shard] = []
        for piece in self._pieces[param]:
            position = 0
            for offsets, sizes in row_major_boxes(shape, piece.param_offset, piece.param_offset + piece.numel):
                box = ShardMetadata(shard_offsets=offsets, shard_sizes=sizes, placement=f"rank:{piece.rank}/cpu")
                metadata.append(box)
                count = math.prod(sizes)
                if piece.rank == self.rank:
                    assert local is not None
                    local_shards.append(Shard(host_box(local.narrow(0, position, count).view(sizes), offsets), box))
                position += count
        global_metadata = ShardedTensorMetadata(
            shards_metadata=metadata,
            size=torch.Size(shape),
            # Host state on CUDA lives in page-locked memory; the properties must say so.
            tensor_properties=TensorProperties(
                dtype=dtype, pin_memory=bool(local_shards and local_shards[0].tensor.is_pinned())
            ),
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            return ShardedTensor._init_from_local_shards_and_global_metadata(
                local_shards, global_metadata, process_group=self.group
            )

    # ------------------------------------------------------------------ step counts

    def _trainable(self) -> list[int]:
        return [i for i, info in enumerate(self.layout.params) if info.trainable]

    def _step_counts(self) -> dict[str, torch.Tensor]:
        """Per trainable parameter its update count, the same value on every rank (a rank that
        holds none of a parameter learns it from the others: a max over ranks)."""
        counts = torch.zeros(len(self.layout.params), dtype=torch.float64)
        for chunk in self.chunks.trainable_chunks():
            assert chunk.optimizer is not None
            for index, segment in enumerate(chunk.segments):
                counts[segment.param] = max(float(counts[segment.param]), float(chunk.optimizer.steps[index]))
        if self.world_size > 1:
            dist.all_reduce(counts, op=dist.ReduceOp.MAX, group=self.group)
        return {STEP + self.layout.params[i].name: counts[i].to(torch.float32).clone() for i in self._trainable()}

    def _set_step_counts(self, steps: dict[str, torch.Tensor]) -> None:
        for chunk in self.chunks.trainable_chunks():
            assert chunk.optimizer is not None
            for index, segment in enumerate(chunk.segments):
                chunk.optimizer.steps[index] = steps[STEP + self.layout.params[segment.param].name]


def expected_entries(layout: ChunkLayout) -> dict[str, tuple[tuple[int, ...], bool]]:
    """Parameter name -> (shape, trainable): what a checkpoint must hold for this model."""
    return {info.name: (tuple(info.shape), info.trainable) for info in layout.params}
