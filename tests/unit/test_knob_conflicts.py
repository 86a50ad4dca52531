"""Hand-set chunk knobs that no plan can honour: the message names the smallest value of each
hand-set knob that works, and each value it names does work (and one less does not)."""

from __future__ import annotations

import re

import pytest

from protrain.profiler.feasibility import chunk_knob_conflict, spec_size
from protrain.profiler.profile import BlockProfile, ModelProfile
from protrain.profiler.search import NoPlanFitsError, search
from tests.unit.test_cost_model import hardware

KIB = 1 << 10
# Six fp32 parameters of 16 KiB each; module "attn" owns the first two, "mlp" the next two, then
# one each: at 32 KiB chunks (two parameters a chunk) every module fits one chunk, at 16 KiB
# "attn" and "mlp" each span two.
SIZES = [(4 * KIB, True)] * 6
MODULES = [[0, 1], [2, 3], [4], [5]]
NAMES = ["attn", "mlp", "head", "norm"]
PLENTY = 1 << 40


def conflict(*, chunk_size: int | None, n_persist: int | None, n_buffer: int | None) -> str | None:
    sizes = [chunk_size] if chunk_size is not None else [16 * KIB, 32 * KIB, 64 * KIB]
    return chunk_knob_conflict(
        SIZES,
        MODULES,
        element_size=4,
        world_size=1,
        chunk_sizes=sizes,
        chunk_size_hand_set=chunk_size is not None,
        n_persist=n_persist,
        n_buffer=n_buffer,
        module_names=NAMES,
    )


def test_too_few_buffers_names_the_module_and_the_smallest_of_each_knob_that_works() -> None:
    message = conflict(chunk_size=16 * KIB, n_persist=0, n_buffer=1)
    assert message is not None
    assert message.startswith(
        "memory.n_buffer=1 is too few: module 'attn' uses 2 non-persistent chunks at once"
    )
    assert "with n_persist=0 and chunks of 16KiB" in message
    assert "the smallest n_buffer that works is 2: set memory.n_buffer >= 2;" in message
    # attn spans chunks 0-1 and mlp chunks 2-3: one buffer works once both are persistent.
    assert "keeping n_buffer=1, the smallest n_persist that works is 3;" in message
    assert "keeping n_persist=0 and n_buffer=1, the smallest chunk_size that works is 32KiB" in message
    # Each value named works with the others as set; one less does not.
    assert conflict(chunk_size=16 * KIB, n_persist=0, n_buffer=2) is None
    assert conflict(chunk_size=16 * KIB, n_persist=3, n_buffer=1) is None
    assert conflict(chunk_size=16 * KIB, n_persist=2, n_buffer=1) is not None
    assert conflict(chunk_size=32 * KIB, n_persist=0, n_buffer=1) is None
    assert conflict(chunk_size=28 * KIB, n_persist=0, n_buffer=1) is not None


def test_no_buffer_with_offloaded_chunks_names_every_way_out() -> None:
    message = conflict(chunk_size=16 * KIB, n_persist=0, n_buffer=0)
    assert message is not None
    assert "the smallest n_buffer that works is 2" in message
    assert "keeping n_buffer=0, the smallest n_persist that works is 6 (every chunk on the device)" in message
    assert "no chunk_size works with n_persist=0 and n_buffer=0" in message
    assert message.endswith("or leave these knobs auto")


def test_n_persist_beyond_the_chunks_names_the_largest_that_works() -> None:
    assert conflict(chunk_size=16 * KIB, n_persist=7, n_buffer=None) == (
        "memory.n_persist=7 exceeds the model's 6 chunks of 16KiB: the largest n_persist that works "
        "is 6 (every chunk on the device); set at most that, or auto"
    )
    assert conflict(chunk_size=16 * KIB, n_persist=6, n_buffer=0) is None


def test_with_auto_chunk_size_any_size_the_search_tries_may_work() -> None:
    # At 32 KiB one buffer serves every module: the search has a plan, so nothing is refused.
    assert conflict(chunk_size=None, n_persist=0, n_buffer=1) is None
    message = conflict(chunk_size=None, n_persist=0, n_buffer=0)
    assert message is not None
    assert "an offloaded chunk is used from a device buffer" in message
    assert "the smallest n_buffer that works is 1" in message and "chunk_size" not in message


@pytest.mark.parametrize(
    ("n_persist", "n_buffer"), [(None, 0), (None, None), (0, None), (2, 2)], ids=str
)
def test_knobs_left_auto_or_enough_are_never_refused(n_persist: int | None, n_buffer: int | None) -> None:
    assert conflict(chunk_size=16 * KIB, n_persist=n_persist, n_buffer=n_buffer) is None


def test_the_search_refuses_impossible_knobs_with_the_same_message() -> None:
    model = ModelProfile(
        batch_shape=(1, 8),
        precision="fp32",
        element_size=4,
        param_sizes=tuple(SIZES),
        param_block=(0, 0, 1, 1, 2, 3),
        module_params=tuple(tuple(m) for m in MODULES),
        blocks=(BlockProfile(forward_s=1e-3, backward_s=2e-3, activation_bytes=KIB),) * 4,
        other_forward_s=0.0,
        other_backward_s=0.0,
        other_activation_bytes=0,
        transient_bytes=0,
    )
    with pytest.raises(NoPlanFitsError) as refused:
        search(
            model,
            hardware(),
            device_budget=PLENTY,
            host_budget=PLENTY,
            chunk_size=16 * KIB,
            n_persist=0,
            n_buffer=1,
        )
    # The profile has no module names; the rest is the same message.
    expected = conflict(chunk_size=16 * KIB, n_persist=0, n_buffer=1)
    assert expected is not None
    assert str(refused.value) == expected.replace("module 'attn'", "one module")
    with pytest.raises(NoPlanFitsError, match=re.escape("memory.n_persist=7 exceeds the model's 6 chunks")):
        search(model, hardware(), device_budget=PLENTY, host_budget=PLENTY, chunk_size=16 * KIB, n_persist=7)


def test_sizes_are_written_as_the_spec_reads_them() -> None:
    assert [spec_size(n) for n in (64 * KIB, 80 * KIB, 3 << 30, 1000, 1536)] == [
        "64KiB",
        "80KiB",
        "3GiB",
        "1000",
        "1536",
    ]
