"""``protrain-run``: read and validate the job spec, then start the ranks.

    protrain-run [--nproc-per-node N|auto] [--nnodes N] [--node-rank R] [--master-addr A]
                 [--master-port P] [--max-restarts K] [--standalone] [--dry-run]
                 [--hostfile FILE [--include HOSTS | --exclude HOSTS] [--remote auto|ssh|pdsh]]
                 train.py [script args] --config job.yaml [--set key.path=value ...] [-- args]
    protrain-run --what-if HARDWARE.yaml (--model-config CONFIG.json | --largest) [...]
    protrain-run --report [--config job.yaml] [--ssd-path DIR] [--json]
    protrain-run --plot RUN_DIR [--rank R] [--out FILE.png]

    protrain-run --version

Launcher options also take torchrun's underscore spellings (``--nproc_per_node``, ``--node_rank``,
``--master_addr``, ``--master_port``, ``--max_restarts``). ``--config`` and ``--set`` are taken
wherever they appear before ``--``; everything after ``--``
goes to the script untouched (a script's own ``--config`` goes there). Launcher options come
before the script path; they override the spec's ``launcher`` section, which overrides defaults.
``--what-if`` (the memory estimator, ``what_if_cli``), ``--report`` (the environment report,
``report_cli``) and ``--plot`` (the memory picture of a traced run, ``plot_cli``) take no script:
one of them before the script path picks that command.

Exit codes: 0 success; 1 a rank failed; 2 bad input (found before any rank started, or by the
ranks while planning: hand-set knobs no plan can honour); 130 interrupted.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from protrain.launcher.hostfile import HostfileError, Node, forwarded_env, read_hostfile, select_nodes
from protrain.launcher.launch import launch
from protrain.launcher.multinode import DEFAULT_MASTER_PORT, REMOTE_CHOICES, node_launches, run_nodes
from protrain.launcher.preflight import check_master_addr, check_output_dir, key_source
from protrain.launcher.remote_node import STOP_ON_STDIN_EOF, node_side_argv
from protrain.launcher.request import EXIT_BAD_INPUT, EXIT_OK, LaunchRequest
from protrain.launcher.slurm import SlurmError, SlurmJob, read_slurm_job, under_srun
from protrain.runtime.config.spec import AUTO, Spec
from protrain.runtime.config.spec_io import Override, SpecError, load_spec, parse_override

SPEC_OPTIONS = ("--config", "--set")
"""Taken wherever they appear before ``--`` (not by the parser, which stops at the script)."""

# Launcher option -> key path in the spec's launcher section.
LAUNCHER_OPTIONS: dict[str, str] = {
    "--nproc-per-node": "nproc_per_node",
    "--nnodes": "nnodes",
    "--node-rank": "node_rank",
    "--master-addr": "master_addr",
    "--master-port": "master_port",
    "--max-restarts": "max_restarts",
}


STANDALONE = {"nnodes": "1", "master_addr": "127.0.0.1", "master_port": "0"}
"""What ``--standalone`` sets where the command line does not: one node, a free local port."""

COMMANDS = ("--what-if", "--report", "--plot")
"""Options that pick a command without a script, when they come before the script path."""
FLAGS = frozenset(
    {
        "-h",
        "--help",
        "--version",
        "--standalone",
        "--dry-run",
        "--largest",
        "--ssd",
        "--clipping",
        "--no-clipping",
        "--report",
        "--json",
        STOP_ON_STDIN_EOF,
    }
)
"""Options of protrain-run and its commands that take no value: every other option before the
script path is followed by its value (unless written ``--option=value``)."""


class UsageError(SpecError):
    """Bad command line."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(f"command line: {message}")


def build_parser() -> argparse.ArgumentParser:
    """protrain-run's options before the script path (``--config``/``--set`` aside); a usage
    error is a UsageError (exit 2 with our message), not argparse's own exit."""
    parser = _Parser(
        prog="protrain-run",
        description="Launch a ProTrain job: validate the spec, then start the ranks with "
        "torch.distributed's elastic launcher.",
        epilog="--config FILE and --set KEY.PATH=VALUE may appear anywhere before '--'. "
        "Exit codes: 0 ok, 1 a rank failed, 2 bad input, 130 interrupted.",
    )
    for option, key in LAUNCHER_OPTIONS.items():
        # torchrun's and deepspeed's underscore spellings too (--nproc_per_node, --master_port).
        spellings = sorted({option, "--" + key})
        parser.add_argument(*spellings, dest=key, metavar=key.upper(), help=f"overrides launcher.{key}")
    parser.add_argument(
        "--standalone",
        action="store_true",
        help="one node on this machine, rendezvous on a free local port (torchrun's --standalone)",
    )
    parser.add_argument(
        "--hostfile",
        metavar="FILE",
        help="DeepSpeed's hostfile ('HOST slots=N' per line): one protrain-run per host, this machine's "
        "directly, the others over pdsh or ssh, with the variables of .protrain_env forwarded",
    )
    parser.add_argument("--include", metavar="HOSTS", help="with --hostfile: only these, as 'host:0,1@host2'")
    parser.add_argument("--exclude", metavar="HOSTS", help="with --hostfile: all but these, as 'host:0@host2'")
    parser.add_argument(
        "--remote",
        choices=REMOTE_CHOICES,
        help="with --hostfile: how the other hosts are started (auto, the default: pdsh when on PATH, else ssh)",
    )
    parser.add_argument("--dry-run", action="store_true", help="validate, plan in one local process, print, exit")
    parser.add_argument("--version", action="store_true", help="print protrain-run's version and exit")
    # Listed for --help; main() hands either one, before the script path, to its own command.
    commands = parser.add_argument_group("commands without a script (each has its own --help)")
    commands.add_argument(
        "--what-if",
        metavar="HARDWARE.yaml",
        help="the memory estimator: device, host and SSD bytes and predicted step time of each "
        "placement of a model (--model-config CONFIG.json or a name) on a hardware file, and the "
        "plan the search picks; or --largest: the largest GPT-family model that fits",
    )
    commands.add_argument(
        "--report",
        action="store_true",
        help="the environment report for a bug report: versions, GPUs, CPU, memory limits, "
        "--ssd-path rates, profile cache (--json for a file to attach)",
    )
    commands.add_argument(
        "--plot",
        metavar="RUN_DIR",
        help="the memory picture of a run with logging.trace set: device, host and SSD bytes through "
        "one update with chunk and block events and the predicted peaks, the step time beside the "
        "predicted (a PNG; needs matplotlib, the plot extra)",
    )
    parser.add_argument("script", help="the training script each rank runs")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")
    return parser


def _extract_config_and_sets(argv: list[str]) -> tuple[list[str], str | None, list[str], list[str]]:
    """Pull ``--config``/``--set`` out of the part before ``--``; return (rest, config, sets, tail)."""
    if "--" in argv:
        cut = argv.index("--")
        head, tail = argv[:cut], argv[cut + 1 :]
    else:
        head, tail = argv, []
    rest: list[str] = []
    config: str | None = None
    sets: list[str] = []
    index = 0
    while index < len(head):
        arg = head[index]
        name, eq, inline = arg.partition("=")
        if name in SPEC_OPTIONS:
            if eq:
                value = inline
            elif index + 1 < len(head):
                index += 1
                value = head[index]
            else:
                raise UsageError(f"command line: {name} needs a value")
            if name == "--config":
                if config is not None:
                    raise UsageError(f"command line: --config given twice ({config!r} and {value!r})")
                config = value
            else:
                sets.append(value)
        else:
            rest.append(arg)
        index += 1
    return rest, config, sets, tail


def parse_command_line(argv: list[str]) -> LaunchRequest:
    rest, config, sets, tail = _extract_config_and_sets(argv)
    args = build_parser().parse_args(rest)
    launcher_overrides = []
    for option, key in LAUNCHER_OPTIONS.items():
        value = getattr(args, key)
        if value is not None:
            launcher_overrides.append(
                parse_override(f"launcher.{key}={value}", source=f"command line {option} {value}")
            )
    if args.standalone:
        given = {override.key_path[-1] for override in launcher_overrides}
        for key, value in STANDALONE.items():
            if key in given:
                if key == "nnodes" and str(getattr(args, key)) != "1":
                    raise UsageError(f"command line: --standalone runs one node, not --nnodes {args.nnodes}")
                continue
            launcher_overrides.append(parse_override(f"launcher.{key}={value}", source="command line --standalone"))
    script = Path(args.script)
    try:
        slurm = read_slurm_job(os.environ) if under_srun(os.environ) else None
    except SlurmError as err:
        raise UsageError(f"Slurm: {err}") from None
    hostfile = _hostfile_options(args, launcher_overrides, slurm)
    return LaunchRequest(
        slurm=slurm,
        hostfile=hostfile,
        include=args.include,
        exclude=args.exclude,
        node_argv=tuple(_without_hostfile_options(argv)) if hostfile else (),
        script=script,
        script_args=tuple(args.script_args) + tuple(tail),
        config=Path(config) if config is not None else None,
        overrides=tuple(parse_override(text) for text in sets),
        launcher_overrides=tuple(launcher_overrides),
        dry_run=bool(args.dry_run),
    )


HOSTFILE_OPTIONS = ("--hostfile", "--include", "--exclude", "--remote")
NODE_SHAPE = ("nnodes", "node_rank", "master_addr", "nproc_per_node")
"""Launcher keys a hostfile decides for each node."""


def _hostfile_options(
    args: argparse.Namespace, launcher_overrides: list[Override], slurm: SlurmJob | None
) -> Path | None:
    if args.hostfile is None:
        if args.include or args.exclude:
            raise UsageError("command line: --include and --exclude filter a --hostfile; give one")
        if args.remote:
            raise UsageError("command line: --remote picks how a --hostfile's hosts are started; give one")
        return None
    if slurm is not None:
        raise UsageError("command line: --hostfile under srun: Slurm already starts a task per node; drop one")
    for override in launcher_overrides:
        if override.key_path[-1] in NODE_SHAPE:
            raise UsageError(
                f"{override.source}: the hostfile decides launcher.{override.key_path[-1]} for each node; drop it"
            )
    return Path(args.hostfile)


def _without_hostfile_options(argv: list[str]) -> list[str]:
    """``argv`` less the hostfile options (before the script path; the script's own are kept)."""
    kept: list[str] = []
    index = 0
    while index < len(argv):
        arg = argv[index]
        name, eq, _ = arg.partition("=")
        if arg == "--" or not arg.startswith("-"):
            return kept + argv[index:]  # the script path, and what follows it, untouched
        takes_value = not eq and name not in FLAGS
        if name not in HOSTFILE_OPTIONS:
            kept.extend(argv[index : index + 1 + int(takes_value)])
        index += 1 + int(takes_value)
    return kept


def _agree_with_hostfile(request: LaunchRequest, spec: Spec, nodes: list[Node]) -> None:
    """The spec's own node shape (its file or ``--set``) must say what the hostfile says: the
    node count and each node's ranks; a node rank or master address is each node's, not the job's."""
    sources = {o.key_path: o.source for o in request.overrides}
    launcher = spec.launcher
    decided = {"nnodes": {len(nodes)}, "nproc_per_node": {len(node.slots) for node in nodes}}
    for key in sorted(launcher.model_fields_set & set(NODE_SHAPE)):
        value = getattr(launcher, key)
        if key in decided and (value == AUTO or decided[key] == {value}):
            continue
        hostfile_says = f"says {', '.join(map(str, sorted(decided[key])))}" if key in decided else "decides it per node"
        where = key_source(request.config, sources, ("launcher", key))
        raise UsageError(f"{where}: launcher.{key} is {value}, but the hostfile {hostfile_says}: drop one of them")


def _run_hostfile(request: LaunchRequest, spec: Spec, argv: list[str]) -> int:
    """One protrain-run per host of the hostfile (``multinode.py``)."""
    assert request.hostfile is not None
    # --remote read again: the request carries the hostfile options the nodes share, not this one.
    remote = build_parser().parse_args(_extract_config_and_sets(argv)[0]).remote or "auto"
    try:
        hosts = read_hostfile(request.hostfile)
        nodes = select_nodes(hosts, include=request.include, exclude=request.exclude)
        env = forwarded_env(dict(os.environ), Path.cwd(), Path.home())
        _agree_with_hostfile(request, spec, nodes)
        port = spec.launcher.master_port or DEFAULT_MASTER_PORT
        launches = node_launches(
            nodes, hosts=hosts, master_port=port, rest=list(request.node_argv), cwd=Path.cwd(), env=env, remote=remote
        )
    except HostfileError as err:
        raise UsageError(str(err)) from None
    return run_nodes(launches, cwd=Path.cwd())


def main(argv: list[str] | None = None) -> int:
    """Run protrain-run with ``argv`` (default: sys.argv[1:]); returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help"):
        build_parser().print_help()
        return EXIT_OK
    if argv and argv[0] == "--version":
        print(version_line())
        return EXIT_OK
    command = script_free_command(argv)
    if command is not None:
        # No script, no ranks. Imported only here: the planner and its tables cost every other
        # command line ~0.3 s before it is checked, and the report loads torch.
        if command == "--what-if":
            from protrain.launcher.what_if_cli import main as run_command
        elif command == "--plot":
            from protrain.launcher.plot_cli import main as run_command
        else:
            from protrain.launcher.report_cli import main as run_command
        try:
            return run_command(argv)
        except SpecError as err:
            print(f"protrain-run: error: {err}", file=sys.stderr)
            return EXIT_BAD_INPUT
    try:
        argv = node_side_argv(argv)  # a node of a --hostfile job started over ssh or pdsh (multinode.py)
        request = parse_command_line(argv)
        spec = resolve_spec(request)
        _check_script(request.script)
        if request.hostfile is not None:
            return _run_hostfile(request, spec, argv)  # each node checks its own machine
        _check_machine(request, spec)
    except SpecError as err:
        print(f"protrain-run: error: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    # launch imports torch only now, once the input is known to be good.
    return launch(request, spec)


def version_line() -> str:
    """``protrain-run X.Y.Z (torch A.B.C, Python D.E.F)``; torch's version read from its metadata
    (importing torch would cost a second)."""
    from importlib.metadata import PackageNotFoundError, version

    def installed(name: str) -> str:
        try:
            return version(name)
        except PackageNotFoundError:
            return "not installed"

    python = ".".join(str(part) for part in sys.version_info[:3])
    return f"protrain-run {installed('protrain')} (torch {installed('torch')}, Python {python})"


def script_free_command(argv: list[str]) -> str | None:
    """``--what-if``, ``--report`` or ``--plot`` when one comes before the script path (and before ``--``);
    None for a launch, whose script may take options of those names itself."""
    index = 0
    while index < len(argv):
        arg = argv[index]
        name, eq, _ = arg.partition("=")
        if arg == "--" or not arg.startswith("-"):
            return None  # the script path (or the script's own arguments) from here on
        if name in COMMANDS:
            return name
        if not eq and name not in FLAGS:
            index += 1  # the option's value, which may look like anything
        index += 1
    return None


def resolve_spec(request: LaunchRequest) -> Spec:
    """The spec file, then ``--set`` overrides in order, then launcher options (which win), all
    validated together; a checkpoint to resume from must exist before any rank starts."""
    spec = load_spec(request.config, [*request.overrides, *request.launcher_overrides])
    if request.slurm is not None:
        spec = _with_slurm(request, spec, request.slurm)
    resume = spec.checkpoint.resume
    if resume not in ("auto", "never") and not Path(resume).expanduser().exists():
        source = str(request.config) if request.config else "(defaults)"
        raise SpecError(
            f"{source}: checkpoint.resume: {resume} does not exist; give auto, never, or a checkpoint "
            "directory (one step-NNNNNNNN directory, or a checkpoint.dir to take its latest)"
        )
    return spec


def _with_slurm(request: LaunchRequest, spec: Spec, slurm: SlurmJob) -> Spec:
    """Slurm's node count, node rank, master and port under ``srun`` (one task per GPU: ranks
    per node 1, each task a "node"); a count or rank set otherwise elsewhere is refused, a master
    address or (nonzero) port set by hand is kept."""
    sources = {o.key_path: o.source for o in (*request.overrides, *request.launcher_overrides)}
    given = set(spec.launcher.model_fields_set)
    if spec.launcher.master_port == 0:
        given.discard("master_port")  # "any free port" cannot serve several nodes: Slurm's port
    decided = []
    for key, value in slurm.launcher_values().items():
        if key not in given:
            decided.append(parse_override(f"launcher.{key}={value}", source=slurm.source(key)))
        elif key in ("nnodes", "node_rank", "nproc_per_node") and str(getattr(spec.launcher, key)) != value:
            where = key_source(request.config, sources, ("launcher", key))
            raise UsageError(
                f"{where}: launcher.{key} is {getattr(spec.launcher, key)}, but {slurm.source(key)} says "
                f"{value}: drop one of them"
            )
    return load_spec(request.config, [*request.overrides, *decided, *request.launcher_overrides])


def _check_machine(request: LaunchRequest, spec: Spec) -> None:
    """What only this machine can tell, before a rank starts: the rendezvous address (a dry run
    has none), then the run folder's place (made last, so a refusal leaves nothing behind; a dry
    run writes nothing there, so it only checks that it could)."""
    sources = {o.key_path: o.source for o in (*request.overrides, *request.launcher_overrides)}
    if not request.dry_run:
        source = key_source(request.config, sources, ("launcher", "master_addr"))
        check_master_addr(spec.launcher, source=source)
    check_output_dir(
        Path(spec.output_dir).expanduser(),
        create=not request.dry_run,
        source=key_source(request.config, sources, ("output_dir",)),
    )


def _check_script(script: Path) -> None:
    if not script.exists():
        raise UsageError(f"{script}: no such training script")
    if not script.is_file():
        raise UsageError(f"{script}: is not a file (expected a Python training script)")


if __name__ == "__main__":
    sys.exit(main())
