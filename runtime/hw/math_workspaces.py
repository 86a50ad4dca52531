"""Device memory the math libraries keep beside the model: cuBLAS's workspace, one per thread
that runs matrix products on a stream (the caller's thread in forward, autograd's device thread
in backward), held by torch's caching allocator until the process ends. On an H100 with torch
2.11 that is 32 MiB each, 64 MiB in all: a first GPU run under a 122 MiB wall ran out of memory
on them, since no plan counted them.

Part of the device layer (runtime/hw/device.py). ``library_workspace_bytes`` measures them on
CUDA and leaves them allocated, so a profiling step after it does not see them appear as the
model's memory; on CPU the BLAS keeps nothing on the device and the answer is 0.
"""

from __future__ import annotations

import torch

from protrain.runtime.hw.device import DeviceInfo

PROBE_SIDE = 64
"""Of the square matrices multiplied: any product takes the whole workspace."""


def library_workspace_bytes(device: DeviceInfo) -> int:
    """Bytes of the math libraries' workspaces a training step holds on ``device``: those of
    a forward and a backward in fp32 and in bf16 with a bias (cuBLASLt), measured from none (the
    workspaces already made are freed first, where torch can) and left allocated."""
    if not device.is_cuda:
        return 0
    where = device.device
    torch.cuda.synchronize(where)
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()
    before = torch.cuda.memory_allocated(where)
    for dtype in (torch.float32, torch.bfloat16):
        weight = torch.ones(PROBE_SIDE, PROBE_SIDE, device=where, dtype=dtype, requires_grad=True)
        bias = torch.ones(PROBE_SIDE, device=where, dtype=dtype, requires_grad=True)
        inputs = torch.ones(PROBE_SIDE, PROBE_SIDE, device=where, dtype=dtype, requires_grad=True)
        torch.nn.functional.linear(inputs, weight, bias).sum().backward()  # backward: autograd's thread
        del weight, bias, inputs
    torch.cuda.synchronize(where)
    return max(0, torch.cuda.memory_allocated(where) - before)
