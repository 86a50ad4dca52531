"""The model-profiling run: forward, loss and backward on a batch with the profiler's
instruments attached (per block forward time and saved bytes, backward time, the transient
peak), returned as the profiler's plain ``ModelProfile``.

The model is profiled either before it is chunked, its parameters where the caller put them
(the model fits the device), or through the chunk engine (``ChunkedRun``: chunks gathered as
training gathers them, the time compute waits for them taken off the clock), which is how a
model whose state does not fit the device is profiled. Through the chunk engine the saved
activations are measured and then copied to host memory until backward needs them
(``offload_saved``), as ProTrain's profiler frees what it measured: a step whose activations
would not fit beside the chunks is still profiled; the copies' time is off the clock, and the
transient peak then also holds the activations one block brings back in backward (an over-count
of at most a block's, on the safe side). Backward time per block is the measured
backward total shared in proportion to forward time (per block backward hooks would wrap every
block's outputs). The transient peak is read with the plan check's counter at the plan check's
hooks (``runtime.hw.memory_counter``). Every rank must plan alike, so ``agree_model`` takes the
longest times and the most bytes of any rank.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from protrain.profiler.instruments import OUTSIDE, BlockTimer, PeakSampler, SavedBytes
from protrain.profiler.profile import BlockProfile, ModelProfile
from protrain.runtime.chunks.layout import ParamInfo
from protrain.runtime.hw import device_wall
from protrain.runtime.hw.device import DeviceInfo, synchronize
from protrain.runtime.hw.distributed import DistContext, all_reduce_min_
from protrain.runtime.hw.memory_counter import peak_reader, sample_at_hooks

STEADY_STEPS = 0.05
"""Profiling steps stop once one's wall time is within this fraction of the one before."""


@dataclasses.dataclass(frozen=True, slots=True)
class ChunkedRun:
    """The chunk engine's side of a profiling step run through it (see
    ``ChunkManager.profiling``): gradients are dropped there, not by the profiler."""

    pack: Callable[[torch.Tensor], Any]
    """A saved tensor's stand-in: a recipe for a view of a chunk buffer slot, else the tensor."""
    unpack: Callable[[Any], torch.Tensor]
    model_state: Callable[[], set[int]]
    """Storage addresses of chunk memory: saved there, a tensor is model state, not activation."""
    stall_s: Callable[[], float]
    """Seconds compute has waited for chunks so far: off the profiler's clock."""
    end_forward: Callable[[], None]
    """The forward (and loss) is over: chunks it pinned may be evicted in backward."""
    end_step: Callable[[], None]
    """The step is over: wait for the side stream (the main thread issues collectives next)."""


def profile_model(
    model: nn.Module,
    run_forward: Callable[[], Any],
    *,
    loss_fn: Callable[[Any], torch.Tensor],
    params: tuple[ParamInfo, ...],
    blocks: list[nn.Module],
    block_path: str,
    module_params: list[list[int]],
    batch_shape: tuple[int, ...],
    precision: str,
    element_size: int,
    device: DeviceInfo,
    warmup_steps: int,
    profile_steps: int,
    chunked: ChunkedRun | None = None,
    agree_max: Callable[[float], float] = lambda seconds: seconds,
    offload_saved: bool = False,
    clock: Callable[[], float] = time.perf_counter,
) -> ModelProfile:
    """Forward, loss and backward on the example batch, ``warmup_steps`` uninstrumented then
    up to ``profile_steps`` instrumented (the fastest kept). Measuring stops early once a step's
    wall time is within ``STEADY_STEPS`` of the step before it: the figures have settled, and
    each further step only adds to what profiling costs (a step of training, every one).
    Gradients are cleared afterwards and the random number generators restored, so training
    sees the model exactly as before (module buffers, e.g. running statistics, included).
    ``chunked``: the steps run through the chunk engine (which drops their gradients).
    ``agree_max(seconds)``: the largest of every rank's figure, so that all ranks stop after
    the same step (their steps issue collectives under the chunk engine). ``offload_saved``:
    saved activations wait in host memory (see the module docstring). ``clock``: what the
    steps' wall times are read on, to decide when they have settled (tests give a fake one)."""
    devices = [device.device.index or 0] if device.is_cuda else []
    runs: list[dict[str, Any]] = []
    buffers = [(buffer, buffer.detach().clone()) for buffer in model.buffers()]
    with torch.random.fork_rng(devices=devices):
        previous_s: float | None = None
        for _ in range(warmup_steps):
            started = clock()
            _one_step(
                model, run_forward, loss_fn, blocks, device, instruments=False, chunked=chunked, offload=offload_saved
            )
            previous_s = agree_max(clock() - started)
        for _ in range(max(1, profile_steps)):
            started = clock()
            runs.append(
                _one_step(
                    model,
                    run_forward,
                    loss_fn,
                    blocks,
                    device,
                    instruments=True,
                    chunked=chunked,
                    offload=offload_saved,
                )
            )
            wall_s = agree_max(clock() - started)
            if previous_s is not None and abs(wall_s - previous_s) <= STEADY_STEPS * wall_s:
                break
            previous_s = wall_s
    with torch.no_grad():
        for buffer, before in buffers:
            buffer.copy_(before)
    if chunked is None:
        for param in model.parameters():
            param.grad = None
    fastest = min(runs, key=lambda run: run["forward_s"] + run["backward_s"])
    timer: BlockTimer = fastest["timer"]
    saved: SavedBytes = fastest["saved"]
    forward_total = max(timer.total_s, 1e-12)
    backward_per_forward = fastest["backward_s"] / forward_total
    param_block = _param_blocks(params, block_path, len(blocks))
    return ModelProfile(
        batch_shape=batch_shape,
        precision=precision,
        element_size=element_size,
        param_sizes=tuple((p.numel, p.trainable) for p in params),
        param_block=param_block,
        module_params=tuple(tuple(m) for m in module_params if m),
        blocks=tuple(
            BlockProfile(
                forward_s=timer.forward_s[i],
                backward_s=timer.forward_s[i] * backward_per_forward,
                activation_bytes=saved.per_block[i],
                input_bytes=fastest["input_bytes"][i],
            )
            for i in range(len(blocks))
        ),
        other_forward_s=timer.outside_s,
        other_backward_s=timer.outside_s * backward_per_forward,
        other_activation_bytes=saved.outside,
        transient_bytes=max(0, *(run["transient"] for run in runs)),
    )


def agree_model(profile: ModelProfile, dist_ctx: DistContext) -> ModelProfile:
    """The longest times and the most bytes of any rank, per block."""
    if dist_ctx.world_size == 1:
        return profile
    numbers = [
        profile.other_forward_s,
        profile.other_backward_s,
        profile.other_activation_bytes,
        profile.transient_bytes,
    ]
    for block in profile.blocks:
        numbers += [block.forward_s, block.backward_s, block.activation_bytes, block.input_bytes]
    values = -torch.tensor(numbers, dtype=torch.float64)
    all_reduce_min_(values, dist_ctx)  # min of negatives: the maximum
    most = (-values).tolist()
    body = profile.to_dict()
    body.update(
        other_forward_s=most[0],
        other_backward_s=most[1],
        other_activation_bytes=int(most[2]),
        transient_bytes=int(most[3]),
        blocks=[
            {"forward_s": f, "backward_s": b, "activation_bytes": int(a), "input_bytes": int(x)}
            for f, b, a, x in zip(most[4::4], most[5::4], most[6::4], most[7::4], strict=True)
        ],
    )
    return ModelProfile.from_dict(body)


def _one_step(
    model: nn.Module,
    run_forward: Callable[[], Any],
    loss_fn: Callable[[Any], torch.Tensor],
    blocks: list[nn.Module],
    device: DeviceInfo,
    *,
    instruments: bool,
    chunked: ChunkedRun | None,
    offload: bool = False,
) -> dict[str, Any]:
    """One forward, loss and backward; measured when ``instruments``. Under the chunk engine
    its saved-tensor recipes are kept (a view of a buffer slot must be re-gathered in backward)
    and its gradients are not the profiler's to clear (they may view the fp32 shards).
    ``offload``: saved activations wait in host memory (see the module docstring)."""
    if chunked is None:
        for param in model.parameters():
            param.grad = None
    pack_inner = chunked.pack if chunked is not None else _detached
    unpack = chunked.unpack if chunked is not None else _same
    to_host: _SavedOnHost | None = None
    if offload:
        model_state = {p.untyped_storage().data_ptr() for p in model.parameters()}
        if chunked is not None:
            model_state |= chunked.model_state()
        to_host = _SavedOnHost(pack_inner, unpack, model_state)
        pack_inner, unpack = to_host.pack, to_host.unpack
    if not instruments:
        hooks = (
            torch.autograd.graph.saved_tensors_hooks(pack_inner, unpack)
            if chunked is not None or to_host is not None
            else contextlib.nullcontext()
        )
        with hooks:
            loss = loss_fn(run_forward())
        if chunked is not None:
            chunked.end_forward()
        loss.backward()
        synchronize(device)
        if chunked is not None:
            chunked.end_step()
        return {}
    stall_s = chunked.stall_s if chunked is not None else lambda: 0.0
    copies_s = (lambda: to_host.seconds) if to_host is not None else lambda: 0.0

    def clock() -> float:
        synchronize(device)
        return time.perf_counter() - stall_s() - copies_s()

    timer = BlockTimer(clock, len(blocks))
    saved = SavedBytes(len(blocks), where=lambda: timer.current)
    param_storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    if chunked is not None:
        param_storages |= chunked.model_state()
    grad_bytes = [0]
    # The plan check's counter at the plan check's hooks (runtime.hw.memory_counter): the two peaks
    # are compared through the plan, so they must not differ by how they were read.
    peak = PeakSampler(peak_reader(device))

    def pack(tensor: torch.Tensor) -> Any:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in param_storages and storage.nbytes() > 0:
            saved.record(_token(storage), storage.nbytes())
        return pack_inner(tensor)

    def on_device() -> int:
        """Saved bytes on the device now: none while they wait in host memory."""
        return 0 if to_host is not None else saved.total

    def sample_forward() -> None:
        peak.sample(on_device())

    def sample_backward(param: torch.Tensor) -> None:
        # Plain PyTorch keeps every gradient to the end; the chunk engine takes each one into
        # memory it already holds (counted in the base reading).
        if param.grad is not None and chunked is None:
            grad_bytes[0] += param.grad.numel() * param.grad.element_size()
        peak.sample(on_device() + grad_bytes[0])

    input_bytes = [0] * len(blocks)

    def enter_block(index: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        timer.enter(index)
        # What a checkpointed block keeps: the tensors it is called with (one storage once).
        storages = {
            t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
            for t in (*args, *kwargs.values())
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in param_storages
        }
        input_bytes[index] = max(input_bytes[index], sum(storages.values()))

    handles = []
    for index, block in enumerate(blocks):
        handles.append(
            block.register_forward_pre_hook(
                lambda _, args, kwargs, i=index: enter_block(i, args, kwargs), with_kwargs=True
            )
        )
        handles.append(block.register_forward_hook(lambda *_, i=index: timer.exit(i)))
    handles += sample_at_hooks(model, after_forward=sample_forward, after_gradient=sample_backward)
    try:
        timer.start()
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            # The output stays alive through backward, as in a training loop that holds it
            # (``out = engine(...); engine.backward(out.loss)``): its logits are part of the peak.
            output = run_forward()
            loss = loss_fn(output)
        timer.stop()
        if chunked is not None:
            chunked.end_forward()
        started = clock()
        loss.backward()
        backward_s = clock() - started
        del output
        if chunked is not None:
            chunked.end_step()
    finally:
        for handle in handles:
            handle.remove()
    return {
        "timer": timer,
        "saved": saved,
        "forward_s": timer.total_s,
        "backward_s": backward_s,
        "transient": peak.peak_beyond,
        "input_bytes": input_bytes,
    }


def _same(value: Any) -> Any:
    return value


def _detached(tensor: torch.Tensor) -> torch.Tensor:
    """What a pack hook keeps of a tensor it leaves in place: a detached alias, never the tensor
    (``runtime.activations.records.KeptTensor`` says why)."""
    return tensor if tensor.grad_fn is None else tensor.detach()


_tokens = itertools.count()


def _token(storage: torch.UntypedStorage) -> int:
    """A storage's identity for as long as it lives and never again: an address is reused once
    a storage is freed (saved activations copied to the host free theirs at once)."""
    token = getattr(storage, "_protrain_saved_token", None)
    if token is None:
        token = next(_tokens)
        storage._protrain_saved_token = token  # type: ignore[attr-defined]
    return int(token)


@dataclasses.dataclass(frozen=True, slots=True)
class _OnHost:
    """A saved activation waiting in host memory, and the device it goes back to."""

    host: torch.Tensor
    device: torch.device


class _SavedOnHost:
    """Saved-tensor hooks that copy each saved activation (not model state, not a chunk-memory
    recipe of the inner ``pack``) to host memory and back to the device when backward unpacks it; the
    copies' seconds add up in ``seconds`` (taken off the profiler's clock)."""

    def __init__(
        self, pack: Callable[[torch.Tensor], Any], unpack: Callable[[Any], torch.Tensor], model_state: set[int]
    ) -> None:
        self._pack, self._unpack, self._model_state = pack, unpack, model_state
        self.seconds = 0.0

    def pack(self, tensor: torch.Tensor) -> Any:
        packed = self._pack(tensor)
        if not isinstance(packed, torch.Tensor) or tensor.numel() == 0:
            return packed  # a recipe for a view of a chunk buffer, or nothing to move
        if tensor.untyped_storage().data_ptr() in self._model_state:
            return packed
        started = time.perf_counter()
        with device_wall.host_allocations():
            host = tensor.detach().to("cpu", copy=True)
        self.seconds += time.perf_counter() - started
        return _OnHost(host, tensor.device)

    def unpack(self, packed: Any) -> torch.Tensor:
        if not isinstance(packed, _OnHost):
            return self._unpack(packed)
        started = time.perf_counter()
        back = packed.host.to(packed.device, copy=True)
        self.seconds += time.perf_counter() - started
        return back


def _param_blocks(params: tuple[ParamInfo, ...], block_path: str, num_blocks: int) -> tuple[int, ...]:
    prefixes = [f"{block_path}.{i}." if block_path else f"{i}." for i in range(num_blocks)]
    owners = []
    for info in params:
        owner = OUTSIDE
        for name in (info.name, *info.aliases):
            for index, prefix in enumerate(prefixes):
                if name.startswith(prefix):
                    owner = index
                    break
            if owner != OUTSIDE:
                break
        owners.append(owner)
    return tuple(owners)
