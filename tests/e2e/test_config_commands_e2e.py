"""A shipped spec's multi-rank header command, launched for real at a tiny preset: the ranks
build the model on the meta device, fill their shards of each chunk from the same seeded
initialisation, offload chunks on a small device budget, and train. (One rank of every header
runs in-process in tests/unit/test_config_commands.py; the demo's 2-rank header is launched by
tests/e2e/test_planning_e2e.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.config_commands import assert_trained_through_chunks, tiny_command
from tests.e2e.conftest import ROOT, Job

MULTI_RANK = [ROOT / "configs" / "gpt2-124m-4gpu.yaml"]


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("path", MULTI_RANK, ids=[p.name for p in MULTI_RANK])
def test_multi_rank_header_command_trains_at_a_tiny_preset(job: Job, path: Path) -> None:
    argv = tiny_command(path, job.workdir, "launcher.master_port=0", "launcher.shutdown_grace_s=5")
    assert int(argv[argv.index("--nproc-per-node") + 1]) > 1
    for index in (argv.index("scripts/train_lm.py"), argv.index("--config") + 1):
        argv[index] = str(ROOT / argv[index])  # the header's paths are from the repository root
    result = job.run(*argv, timeout=200)
    assert result.returncode == 0, result.stderr
    (metrics,) = (job.workdir / "runs").glob("*/metrics.jsonl")
    assert_trained_through_chunks(result.stdout, metrics)
