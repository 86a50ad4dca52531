"""The math libraries' device workspaces are part of every plan's peak.

cuBLAS keeps a workspace per thread that multiplies matrices (the caller's in forward, autograd's
in backward), allocated by torch beside the model: 64 MiB on an H100. A first GPU run under a
122 MiB wall ran out of memory on them because no plan counted them. The device layer measures
them (0 on CPU, whose BLAS keeps nothing on the device); here a profiler that reports some shows
what a GPU run would see: the prediction grows by them, and a search under a budget leaves them
room.
"""

from __future__ import annotations

from pathlib import Path

import torch

from protrain import runtime
from protrain.runtime.hw.device import DeviceInfo
from protrain.runtime.hw.math_workspaces import library_workspace_bytes
from protrain.runtime.planning.profilers import Profilers
from tests.helpers import tiny_gpt
from tests.unit.test_planning import example, job



def planned(tmp_path: Path, workspaces: int, **memory: object) -> runtime.Plan:
    measuring = Profilers(library_workspaces=lambda device: workspaces)
    spec = job(tmp_path, **memory)
    with runtime.initialize(tiny_gpt(), config=spec, example_batch=example(), profilers=measuring) as engine:
        return engine.plan


def test_the_cpu_keeps_no_math_workspace_on_the_device() -> None:
    assert library_workspace_bytes(DeviceInfo(torch.device("cpu"), "gloo")) == 0


def test_the_workspaces_add_to_the_predicted_peak_and_the_search_leaves_them_room(tmp_path: Path) -> None:
    without = planned(tmp_path, 0)
    assert without.all_resident and without.predicted_peak_device_bytes is not None
    workspaces = without.predicted_peak_device_bytes // 4
    with_them = planned(tmp_path, workspaces)
    assert (with_them.n_persist, with_them.block_modes) == (without.n_persist, without.block_modes)
    assert with_them.predicted_peak_device_bytes == without.predicted_peak_device_bytes + workspaces
    # A budget the resident plan fits only without them: the search must give up some memory.
    budget = without.predicted_peak_device_bytes + workspaces // 2
    tight = planned(tmp_path, workspaces, device_budget=budget)
    assert tight.predicted_peak_device_bytes is not None and tight.predicted_peak_device_bytes <= budget
    assert not tight.all_resident or tight.block_modes != without.block_modes
