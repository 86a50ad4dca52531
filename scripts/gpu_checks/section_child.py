"""One section of the first-contact run in a process of its own (first_contact.py starts it).

    python scripts/gpu_checks/section_child.py JOB.json

A section that hangs or crashes must not stop the run, so each runs in a child: the job names
the section (``module:ATTRIBUTE``, a ``Section``), its report's JSON path, a scratch directory,
whether this is a CPU rehearsal, and the section's timeout. Before anything heavy is imported,
``faulthandler.dump_traceback_later`` is set to the timeout less a grace: a hang then prints
every thread's stack to stderr (the run's log) and ends this process, and the parent, which
kills the process group at the full timeout in any case (after asking for the stacks once more
with SIGUSR1), reports the section as timed out. The
section's report is rewritten after every check (``Context.check``), so what it did before a
hang or a crash is kept. The machine's facts go to ``facts_path`` once torch is imported.

Exit 0 when the section finished with no failed check, 1 otherwise.
"""

from __future__ import annotations

import faulthandler
import json
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def run_job(job: dict[str, Any]) -> int:
    import importlib

    import torch

    from gpu_checks import oom_breakdown
    from gpu_checks.common import Context, Section, SectionReport, machine_facts, short_traceback, write_json

    facts = machine_facts()
    write_json(Path(job["facts_path"]), facts)
    module_name, attribute = job["target"].split(":")
    section: Section = getattr(importlib.import_module(f"gpu_checks.{module_name}"), attribute)
    rehearsal = bool(job["rehearsal"])
    device = torch.device("cpu") if rehearsal else torch.device("cuda", 0)
    report = SectionReport(name=job["name"], title=section.title, device=str(device), rehearsal=rehearsal)
    ctx = Context(
        device=device,
        scratch=Path(job["scratch"]),
        rehearsal=rehearsal,
        report=report,
        json_path=Path(job["json_path"]),
        out=Path(job["scratch"]),
    )
    ctx.save()
    started = time.perf_counter()
    print(f"== {job['name']}: {section.title}", flush=True)
    if device.type == "cuda":
        oom_breakdown.watch(record=section.record_memory)
    try:
        section.run(ctx)
        report.finished = True
    except Exception as error:  # reported; the parent goes on with the next section
        report.error = short_traceback(error)
        print("  [ERR ] " + "".join(traceback.format_exception(error)), flush=True)  # all of it, in the log
        if isinstance(error, torch.OutOfMemoryError) and device.type == "cuda":
            print(oom_breakdown.at_first_error(), flush=True)
    finally:
        report.seconds = time.perf_counter() - started
        ctx.save()
    return 0 if report.finished and not report.failed else 1


def main(argv: list[str]) -> int:
    job = json.loads(Path(argv[0]).read_text())
    # First, before torch: a hang anywhere later (an import, a CUDA call, a lock) dumps stacks.
    faulthandler.enable(file=sys.stderr)
    faulthandler.dump_traceback_later(max(1.0, job["timeout_s"] - job["grace_s"]), exit=True, file=sys.stderr)
    # And on the parent's word, should this timer not have ended the process by its timeout.
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)
    sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]  # as gpu_check.py runs its sections
    return run_job(job)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
