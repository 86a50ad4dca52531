"""The first-contact run (issue 26, item 7): ``scripts/gpu_check.py --first-contact --out DIR``.

What a first GPU machine, with minutes of GPU time in all, should say first: whether the GPU path
works and how fast, in one command of at most 8 minutes from a bare machine (docs/gpu-first-contact.md
gives the command line, the offline install included). Stages, most information per minute first:

    calibration    copy rates (registered vs pinned), host downcast and add rates alone and beside CPU
                   Adam, CPU Adam at 4M and 256M parameters, a memory-counter reading, a labelled copy
                   in a parsed trace, the planner's hardware probe
    equivalence    the equivalence section, a mid-size GPU-bound case, bf16 offloaded vs resident
    checkpoint     save, resume and export under the strict device wall, the model larger than it
    overlap        one fixed batch, every chunk offloaded vs all persistent: busy share, exposed time
    capacity_peer  a 1B Llama at a 24 GiB cap: ProTrain's plan beside FSDP2 with CPU offload

Each stage runs in a child process (section_child.py) under its own timeout: a hang dumps every
thread's stack into the log (``faulthandler``) and the stage is abandoned (its process group
killed), a failure or a crash is reported, and the run goes on. DIR holds at most four files,
none in a folder: ``report.md``, ``summary.json`` (both rewritten through a temporary file and a
rename at every change, so they are complete whenever the run is killed), ``trace.json.gz`` (one
traced update of the overlap stage, kept under 50 MB) and ``first-contact.log`` (every child's
output). The parent imports no torch: it holds no CUDA context while the stages measure memory.

``--rehearse`` runs the same stages on the CPU at tiny sizes (about 40 s on 2 cores, at most three
minutes: the rehearsal timeouts add up to 165 s); ``--inject-fault raise hang`` adds two stages after
the first, one that raises and one that hangs, to show both are reported while the run goes on.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from gpu_checks.common import write_json
from gpu_checks.first_contact_report import LOG_FILE, REPORT_FILE, SUMMARY_FILE, TRACE_FILE, render

CHILD = Path(__file__).resolve().with_name("section_child.py")
POLL_S = 1.0
"""How often the parent folds a running stage's checks into the report."""
GRACE_S = 3.0
"""The child dumps its stacks and exits this long before the parent would kill it."""
INSTALL_ALLOWANCE_S = 25
"""The offline install before the run (docs/gpu-first-contact.md), counted in the 7 minutes."""
EXIT_GRACE_S = 15.0
"""A child whose section is done gets this long to exit (a hang in shutdown: threads, NCCL)."""
MAX_TRACE_BYTES = 50 * 10**6


@dataclass(frozen=True, slots=True, kw_only=True)
class Stage:
    name: str
    title: str
    """Until its child reports its section's own title."""
    target: str
    """``module:ATTRIBUTE`` of a ``Section`` under gpu_checks."""
    gpu_timeout_s: float
    rehearsal_timeout_s: float
    strict_device: str | None = None
    """PROTRAIN_STRICT_DEVICE for the child; None: as in the parent's environment."""


STAGES = (
    Stage(name="calibration", title="copy, host and CPU Adam rates, counter cost, trace attribution",
          target="calibration:SECTION", gpu_timeout_s=35, rehearsal_timeout_s=20, strict_device="0"),
    Stage(name="equivalence", title="training equals plain PyTorch on the device",
          target="fc_equivalence:SECTION", gpu_timeout_s=85, rehearsal_timeout_s=45),
    Stage(name="checkpoint", title="save, resume and export under the strict device wall",
          target="fc_checkpoint:SECTION", gpu_timeout_s=40, rehearsal_timeout_s=35, strict_device="1"),
    Stage(name="overlap", title="one fixed batch: busy share, exposed time, offloaded vs persistent",
          target="fc_overlap:SECTION", gpu_timeout_s=100, rehearsal_timeout_s=30, strict_device="0"),
    Stage(name="capacity_peer", title="a 1B Llama at a 24 GiB cap, ProTrain beside FSDP2",
          target="fc_capacity:SECTION", gpu_timeout_s=135, rehearsal_timeout_s=35, strict_device="0"),
)
STAGE_NAMES = tuple(stage.name for stage in STAGES)
FAULTS = {
    "raise": Stage(name="fault_raise", title="injected: raises", target="faults:RAISES",
                   gpu_timeout_s=10, rehearsal_timeout_s=10),
    "hang": Stage(name="fault_hang", title="injected: hangs", target="faults:HANGS",
                  gpu_timeout_s=8, rehearsal_timeout_s=8),
}
assert sum(s.gpu_timeout_s for s in STAGES) + INSTALL_ALLOWANCE_S <= 7 * 60, "issue 26: at most 7 minutes"
assert sum(s.rehearsal_timeout_s for s in STAGES) <= 170, "the CPU rehearsal ends within 3 minutes"


@dataclass(slots=True)
class Outcome:
    """What the parent knows of one stage: its state and the child's report (its JSON)."""

    stage: Stage
    timeout_s: float
    state: str = "pending"
    """pending, running, passed, failed (a check failed), error (raised), timed out, died."""
    seconds: float = 0.0
    exit_code: int | None = None
    report: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "state": self.state,
            "seconds": round(self.seconds, 1),
            "timeout_s": self.timeout_s,
            "exit_code": self.exit_code,
            "title": self.report.get("title") or self.stage.title,
            "error": self.report.get("error"),
            "checks": self.report.get("checks", []),
        }


@dataclass(slots=True)
class Run:
    out: Path
    scratch: Path
    command: str
    rehearsal: bool
    outcomes: list[Outcome]
    facts: dict[str, Any] = field(default_factory=dict)
    started: float = field(default_factory=time.monotonic)
    started_at: str = field(default_factory=lambda: datetime.now(timezone.utc).isoformat(timespec="seconds"))
    notes: list[str] = field(default_factory=list)
    trace: str | None = None
    interrupted: str | None = None
    facts_read: bool = False

    def save(self) -> None:
        """Both report files, each through a temporary file and a rename."""
        summary = {
            "command": self.command,
            "mode": "first-contact" + (" rehearsal (CPU)" if self.rehearsal else ""),
            "started_at": self.started_at,
            "elapsed_s": round(time.monotonic() - self.started, 1),
            "complete": all(o.state not in ("pending", "running") for o in self.outcomes),
            "interrupted": self.interrupted,
            "failed": any(o.state not in ("passed", "pending", "running") for o in self.outcomes),
            "machine": self.facts,
            "trace": self.trace,
            "notes": self.notes,
            "sections": {o.stage.name: o.to_json() for o in self.outcomes},
        }
        write_json(self.out / SUMMARY_FILE, summary)
        tmp = self.out / (REPORT_FILE + ".tmp")
        tmp.write_text(render(summary))
        os.replace(tmp, self.out / REPORT_FILE)

    def log(self, line: str) -> None:
        print(line, flush=True)
        with open(self.out / LOG_FILE, "a") as log:
            log.write(f"[first-contact {time.monotonic() - self.started:7.1f} s] {line}\n")


def chosen_stages(only: Sequence[str] | None, faults: Sequence[str]) -> list[Stage]:
    stages = [s for s in STAGES if not only or s.name in only]
    injected = [FAULTS[kind] for kind in dict.fromkeys(faults)]
    return stages[:1] + injected + stages[1:]


def software_versions() -> dict[str, str]:
    """Installed versions, read without importing the packages."""
    from importlib import metadata

    found = {}
    for name in ("torch", "transformers", "accelerate", "safetensors", "pydantic", "psutil"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            found[name] = metadata.version(name)
    return found


def run_first_contact(
    *, out: Path, rehearsal: bool, only: Sequence[str] | None, faults: Sequence[str], command: str
) -> int:
    """Every stage in order; exit 0 when all passed, 1 otherwise."""
    out.mkdir(parents=True, exist_ok=True)
    for name in (REPORT_FILE, SUMMARY_FILE, TRACE_FILE, LOG_FILE):  # a run into a used DIR starts afresh
        (out / name).unlink(missing_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="protrain-first-contact-"))
    outcomes = [
        Outcome(stage=s, timeout_s=s.rehearsal_timeout_s if rehearsal else s.gpu_timeout_s)
        for s in chosen_stages(only, faults)
    ]
    run = Run(out=out, scratch=scratch, command=command, rehearsal=rehearsal, outcomes=outcomes)
    run.facts = {"python": sys.version.split()[0], "host_cores": os.cpu_count(), **software_versions()}
    if rehearsal:
        run.notes.append("CPU rehearsal: the stages' code at tiny sizes; figures are CPU figures, not a GPU's")

    def stop(signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt(signal.Signals(signum).name)

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        run.save()
        for outcome in outcomes:
            run_stage(run, outcome)
    except KeyboardInterrupt as interrupt:
        run.interrupted = str(interrupt) or "SIGINT"
        for outcome in outcomes:
            if outcome.state == "running":
                outcome.state = "interrupted"
        run.log(f"interrupted ({run.interrupted}): the report holds what ran")
    finally:
        signal.signal(signal.SIGTERM, previous)
        run.save()
        shutil.rmtree(scratch, ignore_errors=True)
    states = {o.stage.name: o.state for o in outcomes}
    run.log(f"done in {time.monotonic() - run.started:.0f} s: {states}; report in {out / REPORT_FILE}")
    return 0 if all(state == "passed" for state in states.values()) and not run.interrupted else 1


def run_stage(run: Run, outcome: Outcome) -> None:
    stage = outcome.stage
    folder = run.scratch / stage.name
    folder.mkdir()
    json_path = folder / "report.json"
    job = {
        "target": stage.target,
        "name": stage.name,
        "json_path": str(json_path),
        "scratch": str(folder / "work"),
        "facts_path": str(run.scratch / "facts.json"),
        "rehearsal": run.rehearsal,
        "timeout_s": outcome.timeout_s,
        "grace_s": GRACE_S,
    }
    (folder / "work").mkdir()
    (folder / "job.json").write_text(json.dumps(job))
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if run.rehearsal:
        # One intra-op thread, as the suite's parallel workers have: on a few shared cores, OpenMP
        # threads spinning for each other made the stages 3-5 times slower.
        env.setdefault("OMP_NUM_THREADS", "1")
    if stage.strict_device is not None:
        env["PROTRAIN_STRICT_DEVICE"] = stage.strict_device
    outcome.state = "running"
    run.log(f"{stage.name}: started (timeout {outcome.timeout_s:.0f} s)")
    run.save()
    started = time.monotonic()
    with open(run.out / LOG_FILE, "a") as log:
        # A process group of its own (same session), so the stage and anything it started go
        # together; kept in the session, so whatever ends this run's session ends them too.
        group: dict[str, Any] = (
            {"process_group": 0} if sys.version_info >= (3, 11) else {"preexec_fn": os.setpgrp}  # 3.10: no threads here
        )
        child = subprocess.Popen(
            [sys.executable, str(CHILD), str(folder / "job.json")],
            stdout=log, stderr=subprocess.STDOUT, env=env, **group,
        )
        try:
            outcome.exit_code = watch(run, outcome, child, json_path, started)
        finally:
            kill_group(child)
    outcome.seconds = time.monotonic() - started
    outcome.report = read_report(json_path) or outcome.report
    read_facts(run)
    outcome.state = judge(outcome, timed_out=outcome.seconds >= outcome.timeout_s - GRACE_S - 0.5)
    keep_files(run, stage, folder / "work")
    run.log(f"{stage.name}: {outcome.state} after {outcome.seconds:.1f} s (exit {outcome.exit_code})")
    run.save()


def watch(
    run: Run, outcome: Outcome, child: subprocess.Popen[bytes], json_path: Path, started: float
) -> int | None:
    """Wait for the child, folding its checks into the report as they come; kill it at the
    timeout, or once its section is done and it has not exited within ``EXIT_GRACE_S`` (a hang
    at shutdown must not eat the time of the stages after it). Its exit code (None when killed)."""
    seen = 0.0
    done_at: float | None = None
    while True:
        try:
            return child.wait(timeout=POLL_S)
        except subprocess.TimeoutExpired:
            pass
        now = time.monotonic()
        if now - started >= outcome.timeout_s or (done_at is not None and now - done_at >= EXIT_GRACE_S):
            why = (
                f"at its timeout of {outcome.timeout_s:.0f} s" if done_at is None
                else f"{EXIT_GRACE_S:.0f} s after its section ended without exiting"
            )
            run.log(f"{outcome.stage.name}: killed {why}")
            with contextlib.suppress(ProcessLookupError):
                child.send_signal(signal.SIGUSR1)  # its faulthandler prints every thread's stack
                with contextlib.suppress(subprocess.TimeoutExpired):
                    child.wait(timeout=1.0)
            return None
        with contextlib.suppress(OSError):
            changed = json_path.stat().st_mtime
            if changed != seen:
                seen = changed
                outcome.report = read_report(json_path) or outcome.report
                outcome.seconds = now - started
                if done_at is None and (outcome.report.get("finished") or outcome.report.get("error")):
                    done_at = now
                read_facts(run)
                run.save()


def read_facts(run: Run) -> None:
    """The machine as the first child saw it through torch (the parent imports none)."""
    if not run.facts_read and (facts := read_report(run.scratch / "facts.json")):
        run.facts |= facts
        run.facts_read = True


def kill_group(child: subprocess.Popen[bytes]) -> None:
    """The child's process group: the stage and whatever it started (our own processes only)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(child.pid, signal.SIGKILL)
    child.wait()


def read_report(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):  # not written yet
        return None


def judge(outcome: Outcome, *, timed_out: bool) -> str:
    report = outcome.report
    if report.get("finished"):
        return "failed" if report.get("failed") else "passed"
    if report.get("error"):
        return "error"
    if outcome.exit_code is None or timed_out:
        return "timed out"
    return f"died (exit {outcome.exit_code})"


def keep_files(run: Run, stage: Stage, work: Path) -> None:
    """The one trace (under 50 MB) into DIR; any log a stage wrote into the one log."""
    trace = work / TRACE_FILE
    if trace.exists():
        size = trace.stat().st_size
        if run.trace is None and size <= MAX_TRACE_BYTES and gzip_complete(trace):
            tmp = run.out / (TRACE_FILE + ".tmp")  # the scratch may be another filesystem: copy, rename
            shutil.copyfile(trace, tmp)
            os.replace(tmp, run.out / TRACE_FILE)
            run.trace = f"{TRACE_FILE} ({stage.name}, {size / 1e6:.1f} MB)"
        else:
            run.notes.append(f"{stage.name}: its trace ({size / 1e6:.1f} MB) not kept: over 50 MB or incomplete")
    for path in sorted(work.rglob("*.log")):
        with open(run.out / LOG_FILE, "a") as log:
            log.write(f"\n----- {stage.name}: {path.relative_to(work)}\n")
            log.write(path.read_text(errors="replace"))


def gzip_complete(path: Path) -> bool:
    try:
        with gzip.open(path, "rb") as stream:
            while stream.read(1 << 24):
                pass
        return True
    except (OSError, EOFError):
        return False


def describe() -> str:
    return "\n".join(
        f"{s.name:14s} timeout {s.gpu_timeout_s:.0f} s ({s.rehearsal_timeout_s:.0f} s rehearsed)" for s in STAGES
    )


def command_line(argv: Sequence[str]) -> str:
    return shlex.join(["scripts/gpu_check.py", *argv])
