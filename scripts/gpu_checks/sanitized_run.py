"""One training run in a process of its own, for the equivalence section's sanitizer case.

    python scripts/gpu_checks/sanitized_run.py JOB.json

``TORCH_CUDA_SANITIZER=1`` must be in the environment before torch is imported (torch enables
its CUDA sanitizer at import), hence a process of its own; the parent sets it on CUDA only. The
job (``run_in_child`` writes it) names the GPT's config, the batch size, the number of updates
and the engine's spec. The child trains, then writes ``state.pt`` (the final fp32 state, on the
host) and ``verdict.json`` (ok, whether the sanitizer was on, the losses, the plan, or the
error) into the job's ``out``; the parent judges the state. Exit 0 when the run finished, 1 when
it raised (a sanitizer report raises ``CUDASanitizerErrors``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]


def sanitizer_enabled() -> bool:
    """Whether torch turned its CUDA sanitizer on at import."""
    if not torch.cuda.is_available():
        return False
    from torch.cuda import _sanitizer

    return bool(_sanitizer.cuda_sanitizer is not None and _sanitizer.cuda_sanitizer.enabled)


def run_job(job: dict[str, Any]) -> dict[str, Any]:
    from gpu_checks.training import Sizes, lm_data, to_cpu, train
    from protrain import runtime
    from protrain_demo.gpt import GPT, GPTConfig

    size = Sizes(model=GPTConfig(**job["model"]), micro_batch=job["micro_batch"], steps=job["steps"])
    torch.manual_seed(0)
    model = GPT(size.model)
    started = time.perf_counter()
    with runtime.initialize(model, config=job["spec"]) as engine:
        losses = train(engine, lm_data(size), size.steps)
        state = to_cpu(engine.state_dict())
        plan = engine.plan
    torch.save(state, Path(job["out"]) / "state.pt")
    return {
        "losses": losses,
        "steps": size.steps,
        "seconds": round(time.perf_counter() - started, 2),
        "plan": {
            "chunk_size": plan.chunk_size,
            "num_chunks": plan.num_chunks,
            "n_persist": plan.n_persist,
            "n_buffer": plan.n_buffer,
            "block_modes": [mode.value for mode in plan.block_modes],
        },
    }


def run_in_child(job: dict[str, Any], *, sanitize: bool, timeout_s: float, log: Path) -> dict[str, Any]:
    """Write ``job`` into its ``out``, run this file on it in a child process (with
    ``TORCH_CUDA_SANITIZER=1`` when ``sanitize``); the child's verdict (empty if it wrote none)
    with its exit code. Its whole output goes to ``log`` (a sanitizer report is printed there,
    with the stacks of both accesses), and the error, if any, after it."""
    out = Path(job["out"])
    out.mkdir(parents=True, exist_ok=True)
    (out / "job.json").write_text(json.dumps(job))
    env = {key: value for key, value in os.environ.items() if key != "TORCH_CUDA_SANITIZER"}
    if sanitize:
        env["TORCH_CUDA_SANITIZER"] = "1"
    try:
        child = subprocess.run(
            [sys.executable, str(Path(__file__)), str(out / "job.json")],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
        output, code = child.stdout + child.stderr, child.returncode
    except subprocess.TimeoutExpired as expired:  # subprocess.run killed it
        # What it printed so far (bytes here, whatever ``text`` says).
        output = "".join(
            part.decode(errors="replace") if isinstance(part, bytes) else part or ""
            for part in (expired.stdout, expired.stderr)
        )
        code = None
    verdict_path = out / "verdict.json"
    verdict = json.loads(verdict_path.read_text()) if verdict_path.exists() else {}
    verdict["exit_code"] = code
    log.write_text(
        output + "\n" + verdict.get("error", "" if code is not None else f"killed after {timeout_s} s")
    )
    return verdict


def main(argv: list[str]) -> int:
    sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]  # as gpu_check.py runs its sections
    job = json.loads(Path(argv[0]).read_text())
    verdict: dict[str, Any] = {"sanitizer": sanitizer_enabled()}
    try:
        verdict |= run_job(job) | {"ok": True}
    except Exception as error:  # the parent reports it
        verdict |= {"ok": False, "error": "".join(traceback.format_exception(error))[-3000:]}
    (Path(job["out"]) / "verdict.json").write_text(json.dumps(verdict))
    return 0 if verdict["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
