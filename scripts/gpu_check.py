"""The GPU acceptance run: in one command, whether ProTrain works on this GPU and how fast.

    python scripts/gpu_check.py [--only SECTION ...] [--out DIR] [--list] [--rehearse]
    python scripts/gpu_check.py --first-contact --out DIR [--only STAGE ...] [--rehearse]

``--first-contact``: the first command on a new GPU machine, at most 8 minutes with the offline
install (issue 26): stages calibration, equivalence, checkpoint, overlap and capacity_peer, each in
a child process under its own timeout, into at most four files (gpu_checks/first_contact.py). The
one command line for the lent GPU machine, wheels included: docs/gpu-first-contact.md.

Each section writes ``DIR/<section>.json`` as it goes (rewritten after every check, so a run cut
short still reports what it did); ``DIR/report.md`` and ``DIR/summary.json`` are written at the
end. Exit 0 when every check passed, 1 when any failed or a section raised, 2 on bad arguments.
Without CUDA the script lists its sections and exits 0; ``--rehearse`` runs the sections'
code on the CPU at tiny sizes instead (the suite's smoke test: it proves the script, not a GPU).

Sections (``--list`` prints them with the CPU tests that check the same thing):
    equivalence   fp32 and bf16 training vs plain PyTorch under several plans and activation
                  modes, clipping that triggers, one case under TORCH_CUDA_SANITIZER=1
    two_ranks     two ranks on the one GPU over gloo (NCCL refuses that), per-rank budgets
    overlap       how much transfer and CPU-optimizer time compute hides, all chunks offloaded
    cost_model    predicted vs measured step time and peak memory on three plans
    capacity      Llama-shaped 1B and 3B in bf16 at seq 2048 under 24 and 78 GiB budgets
    checkpoint    save and exact resume on the GPU

Each section fits a 10-minute command on one H100 (80 GB, 16 cores, 128 GiB host). On the lent
GPU machine (Python 3.12 with torch, transformers, accelerate, rich, PyYAML, safetensors and
psutil, but no pydantic, and no network), bring pydantic's wheels along: ``make gpu-bundle``
fills ``.whl/`` (docs/gpu-first-contact.md). Then, on the GPU machine (carry ``.whl``), a few
commands of at most 10 minutes each:

    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
    PYTHONPATH=/tmp/site python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/site .
    export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
    python3 scripts/gpu_check.py --out $OUT --only equivalence two_ranks checkpoint
    python3 scripts/gpu_check.py --out $OUT --only overlap cost_model
    python3 scripts/gpu_check.py --out $OUT --only capacity
"""

from __future__ import annotations

import argparse
import importlib
import sys
import tempfile
import time
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from gpu_checks.common import Context, Section, SectionReport, machine_facts, short_traceback, write_json  # noqa: E402
from gpu_checks.first_contact import FAULTS, STAGE_NAMES, command_line, describe, run_first_contact  # noqa: E402
from gpu_checks.report import markdown  # noqa: E402

if TYPE_CHECKING:
    import torch

SECTION_MODULES = ("equivalence", "two_ranks", "overlap", "cost_model", "capacity", "checkpoint")
"""In the order a run takes them: correctness first, then speed. Each module's SECTION has the
module's name. torch is imported only once a mode that runs sections here needs it: the
first-contact parent runs none here and holds no CUDA context."""


def load_sections() -> dict[str, Section]:
    sections = {}
    for name in SECTION_MODULES:
        section: Section = importlib.import_module(f"gpu_checks.{name}").SECTION
        sections[section.name] = section
    return sections


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--only", nargs="+", metavar="SECTION",
        help=f"sections: {', '.join(SECTION_MODULES)}; with --first-contact, stages: {', '.join(STAGE_NAMES)}",
    )
    parser.add_argument("--out", type=Path, help="report directory (default: runs/gpu_check/<time>)")
    parser.add_argument("--list", action="store_true", help="list the sections and exit")
    parser.add_argument(
        "--rehearse", action="store_true", help="run the sections on the CPU at tiny sizes (a smoke test)"
    )
    parser.add_argument(
        "--first-contact", action="store_true",
        help="the first command on a new GPU machine: five stages under timeouts, at most 4 files in --out",
    )
    parser.add_argument(
        "--inject-fault", nargs="+", choices=sorted(FAULTS), default=[], metavar="KIND",
        help="with --first-contact --rehearse: add a stage that raises and/or one that hangs (a test)",
    )
    args = parser.parse_args(argv)
    names = STAGE_NAMES if args.first_contact else SECTION_MODULES
    unknown = [name for name in args.only or () if name not in names]
    if unknown:
        mode = "--first-contact stages" if args.first_contact else "sections"
        parser.error(f"--only: unknown {', '.join(unknown)}; {mode} are {', '.join(names)}")
    if args.inject_fault and not (args.first_contact and args.rehearse):
        parser.error("--inject-fault needs --first-contact --rehearse (it tests the run, on the CPU)")
    if args.out is not None and args.out.exists() and not args.out.is_dir():
        parser.error(f"--out {args.out}: exists and is not a directory")
    return args


def print_sections(sections: dict[str, Section]) -> None:
    for section in sections.values():
        print(f"{section.name:12s} {section.title}")
        print(f"{'':12s} CPU counterpart: {section.cpu_counterpart}")


def run_section(section: Section, device: torch.device, out: Path, rehearsal: bool) -> SectionReport:
    import torch

    report = SectionReport(name=section.name, title=section.title, device=str(device), rehearsal=rehearsal)
    print(f"== {section.name}: {section.title}", flush=True)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix=f"gpu-check-{section.name}-") as scratch:
        ctx = Context(
            device=device, scratch=Path(scratch), rehearsal=rehearsal, report=report,
            json_path=out / f"{section.name}.json", out=out,
        )
        ctx.save()
        try:
            section.run(ctx)
            report.finished = True
        except Exception as error:  # one section's failure must not hide the others' results
            report.error = short_traceback(error)
            print(f"  [ERR ] {report.error.splitlines()[-1]}", flush=True)
        finally:
            report.seconds = time.perf_counter() - start
            ctx.save()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return report


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    arguments = sys.argv[1:] if argv is None else list(argv)
    out = args.out or ROOT / "runs" / "gpu_check" / datetime.now().strftime("%Y%m%d-%H%M%S")
    if args.first_contact:
        return first_contact(args, out, command_line(arguments))
    import torch

    sections = load_sections()
    if args.list:
        print_sections(sections)
        return 0
    if not torch.cuda.is_available() and not args.rehearse:
        print("gpu_check: no CUDA device here; the sections it would run:")
        print_sections(sections)
        print("(run with --rehearse to exercise them on the CPU at tiny sizes; exit 0)")
        return 0
    device = torch.device("cpu") if args.rehearse else torch.device("cuda", 0)
    chosen = [sections[n] for n in (args.only or sections)]
    if args.rehearse:
        chosen = [s for s in chosen if not s.needs_cuda]
    out.mkdir(parents=True, exist_ok=True)
    facts = machine_facts()
    reports = [run_section(section, device, out, args.rehearse) for section in chosen]
    command = command_line(arguments)
    write_json(out / "summary.json", {
        "command": command, "machine": facts,
        "sections": {r.name: {"failed": r.failed, "finished": r.finished, "seconds": r.seconds} for r in reports},
        "failed": any(r.failed for r in reports),
    })
    (out / "report.md").write_text(markdown(reports, facts, command))
    failed = [r.name for r in reports if r.failed]
    print(f"gpu_check: {'FAILED: ' + ', '.join(failed) if failed else 'all checks passed'}; report in {out}")
    return 1 if failed else 0


def first_contact(args: argparse.Namespace, out: Path, command: str) -> int:
    if args.list:
        print(describe())
        return 0
    if not args.rehearse:
        import torch  # only to ask whether CUDA is there: no context is made

        if not torch.cuda.is_available():
            print("gpu_check --first-contact: no CUDA device here; the stages it would run:")
            print(describe())
            print("(add --rehearse to run them on the CPU at tiny sizes; exit 0)")
            return 0
    return run_first_contact(
        out=out, rehearsal=args.rehearse, only=args.only, faults=args.inject_fault, command=command
    )


if __name__ == "__main__":
    raise SystemExit(main())
