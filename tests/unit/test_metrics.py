"""Each update's metrics (runtime/observability/) in metrics.jsonl and the trackers, from real CPU runs:
TensorBoard's event file read back with TensorBoard's own loader, W&B through a fake module
(wandb is never a dependency), the throughput figures against the FLOPs formula by hand, and what
measuring may not do (wait for the device beyond the engine's one synchronisation per update)."""

from __future__ import annotations

import ast
import importlib.util
import json
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from protrain import runtime
from protrain.runtime.config.spec_io import SpecError
from protrain.runtime.hw.device import synchronize
from protrain.runtime.observability.peak_flops import PEAK_TFLOPS_ENV
from protrain.runtime.planning.profilers import Profilers
from tests.helpers import TINY_GPT, lm_batches, tiny_gpt

PEAK = 0.25
UPDATES = 5
ACCUMULATION = 2
MICRO_BATCH = 2

NEW_KEYS = {
    "throughput(tps)",
    "tflops",
    "mfu(%)",
    "time_metrics/end_to_end(s)",
    "time_metrics/forward(s)",
    "time_metrics/backward(s)",
    "time_metrics/optimizer(s)",
    "time_metrics/other(s)",
    "time_metrics/exposed_wait_transfer(s)",
    "time_metrics/exposed_wait_reduce(s)",
    "time_metrics/exposed_wait_host(s)",
    "time_metrics/exposed_wait_activation(s)",
    "time_metrics/predicted_end_to_end(s)",
    "memory/max_active(GiB)",
    "memory/max_reserved(GiB)",
    "memory/host_in_use(GiB)",
    "memory/host_pinned(GiB)",
    "memory/host_max_rss(GiB)",
    "memory/predicted_max_active(GiB)",
    "memory/predicted_host_peak(GiB)",
    "ssd/written(GiB)",
    "ssd/read(GiB)",
}
TRAINING_KEYS = {"loss_metrics/global_avg_loss", "grad_norm", "lr"}


def job(tmp_path: Path, **logging: Any) -> dict[str, Any]:
    """Offloaded chunks through one buffer, one block's activations on SSD, one recomputed."""
    return {
        "seed": 3,
        "micro_batch_size": MICRO_BATCH,
        "gradient_accumulation_steps": ACCUMULATION,
        "gradient_clipping": 1.0,
        "optimizer": {"lr": 1e-3},
        "memory": {
            "n_persist": 0,
            "n_buffer": 1,
            "n_swap": 0,
            "n_checkpoint": 1,
            "ssd": {"path": str(tmp_path / "ssd"), "n_offload": 1},
        },
        "logging": logging,
        "output_dir": str(tmp_path / "runs"),
    }


def train(config: dict[str, Any], updates: int = UPDATES, profilers: Profilers | None = None) -> None:
    data = lm_batches(micro_batch_size=MICRO_BATCH, accumulation=ACCUMULATION, world_size=1)
    with runtime.initialize(tiny_gpt(), config=config, profilers=profilers) as engine:
        for update in range(updates):
            for micro in range(ACCUMULATION):
                out = engine(**data.batch(update, micro, 0))
                engine.backward(out.loss)
                engine.step()


def run_dir(tmp_path: Path) -> Path:
    (folder,) = (tmp_path / "runs").iterdir()
    return folder


def records(tmp_path: Path) -> list[dict[str, Any]]:
    lines = (run_dir(tmp_path) / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "step" in r]


@pytest.fixture(scope="module")
def tensorboard_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp_path = tmp_path_factory.mktemp("tensorboard_run")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(PEAK_TFLOPS_ENV, str(PEAK))
        train(job(tmp_path, tensorboard=True, every_steps=2))
    return tmp_path


def test_metrics_file_has_the_new_keys_with_sane_values(tensorboard_run: Path) -> None:
    seq = TINY_GPT.seq_len
    tokens = ACCUMULATION * MICRO_BATCH * seq
    # 6 * N (non-embedding, the tied head counted) + 12 * L * H * Q * T, by hand as in
    # test_metrics_flops.py.
    d = TINY_GPT.d_model
    block = 4 * d + (3 * d * d + 3 * d) + (d * d + d) + (4 * d * d + 4 * d) + (4 * d * d + d)
    n = TINY_GPT.vocab_size * d + TINY_GPT.n_layer * block + 2 * d
    per_token = 6 * n + 12 * TINY_GPT.n_layer * TINY_GPT.n_head * (d // TINY_GPT.n_head) * seq
    found = records(tensorboard_run)
    assert [r["step"] for r in found] == list(range(1, UPDATES + 1))
    for r in found:
        # What tests and users read before stays.
        assert {"loss", "lr", "grad_norm", "step_time_s", "tokens_per_s", "skipped", "waits"} <= set(r)
        assert NEW_KEYS <= set(r), NEW_KEYS - set(r)
        step_s = r["time_metrics/end_to_end(s)"]
        assert r["step_time_s"] == pytest.approx(step_s, abs=1e-6)
        assert r["throughput(tps)"] == pytest.approx(tokens / step_s)  # one rank
        assert r["tflops"] > 0
        assert r["tflops"] == pytest.approx(tokens * per_token / step_s / 1e12)
        assert r["mfu(%)"] == pytest.approx(100 * r["tflops"] / PEAK)
        phases = [r[f"time_metrics/{p}(s)"] for p in ("forward", "backward", "optimizer", "other")]
        assert min(phases[:3]) > 0 and phases[3] >= 0
        assert sum(phases) == pytest.approx(step_s, rel=1e-6)  # other: what the three leave
        for kind in ("transfer", "reduce", "host", "activation"):
            assert r[f"time_metrics/exposed_wait_{kind}(s)"] == r["waits"][f"{kind}_s"]
        assert r["memory/max_active(GiB)"] > 0 and r["memory/max_reserved(GiB)"] > 0
        # Every chunk is offloaded: its state lives in a host arena (not pinned on CPU).
        assert r["memory/host_in_use(GiB)"] > 0 and r["memory/host_pinned(GiB)"] == 0
        assert r["memory/host_max_rss(GiB)"] > 0
        # The ssd block's activations are written in forward and read back in backward, unless
        # backward reaches the block while its write is still in flight: then it takes the
        # original from memory (forwarding) and reads nothing, as happened under CI's load.
        # (test_ssd_store.py counts reads exactly.)
        assert r["ssd/written(GiB)"] > 0 and 0 <= r["ssd/read(GiB)"] <= r["ssd/written(GiB)"]
        assert r["time_metrics/predicted_end_to_end(s)"] > 0 and r["memory/predicted_max_active(GiB)"] > 0
    # The logger's own time is reported from the second update on (it is measured last).
    assert "time_metrics/logging(s)" not in found[0]
    assert all(0 < r["time_metrics/logging(s)"] < r["step_time_s"] for r in found[1:])


def test_tensorboard_event_file(tensorboard_run: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (events,) = (run_dir(tensorboard_run) / "tensorboard").glob("events.out.tfevents.*")
    accumulator = EventAccumulator(str(events.parent))
    accumulator.Reload()
    tags = set(accumulator.Tags()["scalars"])
    assert (NEW_KEYS | TRAINING_KEYS) <= tags, (NEW_KEYS | TRAINING_KEYS) - tags
    by_step = {r["step"]: r for r in records(tensorboard_run)}
    # every_steps: 2 -> update 1 and every second one.
    for tag, key in [("loss_metrics/global_avg_loss", "loss"), ("tflops", "tflops"), ("lr", "lr")]:
        scalars = accumulator.Scalars(tag)
        assert [s.step for s in scalars] == [1, 2, 4]
        for s in scalars:
            assert s.value == pytest.approx(by_step[s.step][key], rel=1e-6)  # float32 in the file


class FakeRun:
    def __init__(self, calls: list[tuple[str, Any]]) -> None:
        self.calls = calls

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.calls.append(("log", (step, metrics)))

    def finish(self) -> None:
        self.calls.append(("finish", None))


def fake_wandb(calls: list[tuple[str, Any]]) -> types.ModuleType:
    module = types.ModuleType("wandb")

    def init(**kwargs: Any) -> FakeRun:
        calls.append(("init", kwargs))
        return FakeRun(calls)

    module.init = init  # type: ignore[attr-defined]
    return module


def test_wandb_through_its_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, Any]] = []
    monkeypatch.setitem(sys.modules, "wandb", fake_wandb(calls))
    monkeypatch.delenv(PEAK_TFLOPS_ENV, raising=False)
    train(job(tmp_path, wandb={"project": "protrain-tests", "name": "tiny"}, every_steps=2))
    folder = run_dir(tmp_path)
    kinds = [kind for kind, _ in calls]
    assert kinds == ["init", "log", "log", "log", "finish"]
    init = calls[0][1]
    assert (init["project"], init["name"], init["dir"]) == ("protrain-tests", "tiny", str(folder))
    assert init["config"] == json.loads((folder / "spec.json").read_text())
    logged = [payload for kind, payload in calls if kind == "log"]
    assert [step for step, _ in logged] == [1, 2, 4]
    for _, metrics in logged:
        assert TRAINING_KEYS | {"throughput(tps)", "tflops", "memory/max_active(GiB)"} <= set(metrics)
        assert "mfu(%)" not in metrics  # no peak on CPU unless PROTRAIN_PEAK_TFLOPS says one
    assert not (folder / "tensorboard").exists()


def test_wandb_missing_is_said_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError
    train(job(tmp_path, wandb={"project": "p"}), updates=2)
    out = capsys.readouterr().out
    assert out.count("the wandb package is not installed") == 1
    assert len(records(tmp_path)) == 2


def test_tensorboard_missing_names_the_extra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else find_spec(name, *a)
    )
    with pytest.raises(SpecError, match=r"protrain\[logging\]"):
        runtime.initialize(tiny_gpt(), config=job(tmp_path, tensorboard=True))
    monkeypatch.undo()
    train(job(tmp_path / "after", tensorboard=True), updates=1)  # nothing was left claimed


def test_measuring_never_waits_for_the_device(tmp_path: Path) -> None:
    """The engine synchronises once per update; measuring and the trackers add none."""
    calls = []

    def counting(info: Any) -> None:
        calls.append(info)
        synchronize(info)

    train(job(tmp_path, tensorboard=True), updates=3, profilers=Profilers(synchronize=counting))
    assert len(calls) == 3
    # Nor can it: nothing under runtime/metrics names a call that waits for a device or a
    # tensor's value (readings there are of the allocator's counters and completed events).
    waiting = {"synchronize", "item", "tolist", "cpu", "wait", "query"}
    package = Path(runtime.__file__).parent / "metrics"
    for path in package.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute):
                assert node.attr not in waiting, f"{path.name}:{node.lineno} calls .{node.attr}"
