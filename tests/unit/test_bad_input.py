"""Bad input through the launcher's main(argv): exit code 2, one message naming the file (or
the --set / option), the key path and what is allowed; no traceback, no rank started."""

from __future__ import annotations

from pathlib import Path

import pytest

from protrain.launcher.cli import main
from protrain.launcher.preflight import check_master_addr, check_output_dir
from protrain.launcher.request import EXIT_BAD_INPUT
from protrain.runtime.config.spec import LauncherSpec

SCRIPT_TEXT = "raise SystemExit('the script must not run on bad input')\n"


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "train.py"
    path.write_text(SCRIPT_TEXT)
    return path


# (spec text, file suffix, words the message must contain)
BAD_SPECS: list[tuple[str, str, str, list[str]]] = [
    ("bool for int", "seed: true\n", ".yaml", ["seed", "true", "an integer >= 0"]),
    ("float for int", "micro_batch_size: 2.0\n", ".yaml", ["micro_batch_size", "2.0", "an integer >= 1"]),
    ("string for int", 'gradient_accumulation_steps: "4"\n', ".yaml", ["gradient_accumulation_steps", "'4'"]),
    ("zero batch", "micro_batch_size: 0\n", ".yaml", ["micro_batch_size", "an integer >= 1"]),
    ("negative seed", "seed: -1\n", ".yaml", ["seed", "-1"]),
    ("bad enum", "precision: fp8\n", ".yaml", ["precision", "fp8", "one of fp32, bf16, fp16"]),
    ("unknown top key", "sed: 1\n", ".yaml", ["sed", "unknown key", "seed"]),
    (
        "unknown optimizer key",
        "optimizer: {learning_rate: 0.1}\n",
        ".yaml",
        ["optimizer.learning_rate", "lr"],
    ),
    ("unknown memory key", "memory: {n_persistent: 1}\n", ".yaml", ["memory.n_persistent", "n_persist"]),
    ("unknown ssd key", "memory: {ssd: {dir: /tmp}}\n", ".yaml", ["memory.ssd.dir", "path"]),
    ("unknown launcher key", "launcher: {nproc: 2}\n", ".yaml", ["launcher.nproc", "nproc_per_node"]),
    ("unknown checkpoint key", "checkpoint: {every: 5}\n", ".yaml", ["checkpoint.every", "interval_steps"]),
    (
        "unknown loss scaling key",
        "precision: fp16\nloss_scaling: {init: 2}\n",
        ".yaml",
        ["loss_scaling.init", "initial"],
    ),
    (
        "bad size unit",
        "memory: {device_budget: 22GB2}\n",
        ".yaml",
        ["memory.device_budget", "22GB2", '"22GiB"'],
    ),
    ("negative size", "memory: {host_budget: -5}\n", ".yaml", ["memory.host_budget", "-5"]),
    ("fractional bytes", "memory: {chunk_size: 1.5B}\n", ".yaml", ["memory.chunk_size", "1.5B"]),
    # "auto" only where the planner, the launcher or the Trainer integration fills it.
    ("auto not allowed", "scheduler: {warmup_steps: auto}\n", ".yaml", ["scheduler.warmup_steps", "'auto'"]),
    ("auto not allowed keep_last", "checkpoint: {keep_last: auto}\n", ".yaml", ["checkpoint.keep_last"]),
    ("almost auto", "memory: {n_swap: Auto}\n", ".yaml", ["memory.n_swap", "'Auto'", '"auto"']),
    ("betas length", "optimizer: {betas: [0.9]}\n", ".yaml", ["optimizer.betas", "two numbers"]),
    ("beta is one", "optimizer: {betas: [0.9, 1.0]}\n", ".yaml", ["optimizer.betas"]),
    ("section not a mapping", "optimizer: adamw\n", ".yaml", ["optimizer", "a mapping"]),
    ("loss scaling without fp16", "loss_scaling: {initial: 1024}\n", ".yaml", ["loss_scaling", "fp16"]),
    (
        "warmup beyond total",
        "scheduler: {type: warmup_cosine, warmup_steps: 50, total_steps: 10}\n",
        ".yaml",
        ["scheduler.warmup_steps", "50", "10"],
    ),
    (
        "cosine without total",
        "scheduler: {type: warmup_cosine}\n",
        ".yaml",
        ["scheduler.total_steps", "warmup_cosine"],
    ),
    (
        "node rank beyond nodes",
        "launcher: {nnodes: 2, node_rank: 2}\n",
        ".yaml",
        ["launcher.node_rank", "below nnodes"],
    ),
    ("ssd without path", "memory: {ssd: {n_offload: 2}}\n", ".yaml", ["memory.ssd.path", "n_offload"]),
    (
        "block mode unknown",
        "memory: {block_modes: [keep, fast]}\n",
        ".yaml",
        ["memory.block_modes", "keep, swap"],
    ),
    (
        "block modes vs count",
        "memory: {block_modes: [swap, keep], n_swap: 2}\n",
        ".yaml",
        ["memory.n_swap", "block_modes"],
    ),
    ("checkpoint interval without dir", "checkpoint: {interval_steps: 10}\n", ".yaml", ["checkpoint.dir"]),
    ("port out of range", "launcher: {master_port: 70000}\n", ".yaml", ["launcher.master_port", "70000"]),
    ("yaml syntax", "seed: [1, 2\n", ".yaml", ["YAML syntax error", "line"]),
    ("json syntax", '{"seed": 1,}\n', ".json", ["JSON syntax error", "line 1"]),
    ("duplicate yaml key", "seed: 1\nseed: 2\n", ".yaml", ["duplicate key 'seed'", "line 2"]),
    ("duplicate json key", '{"seed": 1, "seed": 2}\n', ".json", ["duplicate key 'seed'"]),
    ("empty file", "", ".yaml", ["empty file"]),
    ("top level list", "- seed\n", ".yaml", ["top level must be a mapping"]),
    ("json wrong type", '{"precision": 16}\n', ".json", ["precision", "16"]),
    ("list as a key", "? [a, b]\n: 1\n", ".yaml", ["keys must be plain names", "line 1"]),
    ("json nested too deeply", "[" * 100000, ".json", ["nested too deeply"]),
    (
        "yaml 1.1 boolean",
        "checkpoint: {async_save: on}\n",
        ".yaml",
        ["checkpoint.async_save", "'on'", "true or false"],
    ),
    ("sexagesimal number", "seed: 1:30\n", ".yaml", ["seed", "'1:30'"]),
    ("unknown scheduler key", "scheduler: {warmup: 5}\n", ".yaml", ["scheduler.warmup", "warmup_steps"]),
    ("unknown profiler key", "profiler: {steps: 5}\n", ".yaml", ["profiler.steps", "profile_steps"]),
    (
        "ssd blocks without a directory",
        "memory: {ssd: {n_offload: 2}}\n",
        ".yaml",
        ["memory.ssd.path", "n_offload=2 needs ssd.path"],
    ),
]


@pytest.mark.parametrize(
    ("text", "suffix", "needles"), [c[1:] for c in BAD_SPECS], ids=[c[0] for c in BAD_SPECS]
)
def test_bad_spec_exits_2_naming_file_and_key(
    tmp_path: Path,
    script: Path,
    capsys: pytest.CaptureFixture[str],
    text: str,
    suffix: str,
    needles: list[str],
) -> None:
    config = tmp_path / f"job{suffix}"
    config.write_text(text)
    assert main([str(script), "--config", str(config)]) == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert str(config) in err
    for needle in needles:
        assert needle in err, f"{needle!r} not in {err!r}"


def test_missing_file(tmp_path: Path, script: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "nope.yaml"
    assert main([str(script), "--config", str(missing)]) == EXIT_BAD_INPUT
    assert f"{missing}: no such file" in capsys.readouterr().err


def test_directory_as_config(tmp_path: Path, script: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(script), "--config", str(tmp_path)]) == EXIT_BAD_INPUT
    assert "is a directory" in capsys.readouterr().err


def test_not_utf8(tmp_path: Path, script: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "job.yaml"
    config.write_bytes(b"seed: \xff\xfe\n")
    assert main([str(script), "--config", str(config)]) == EXIT_BAD_INPUT
    assert "not UTF-8" in capsys.readouterr().err


def test_missing_script(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(tmp_path / "train.py")]) == EXIT_BAD_INPUT
    assert "no such training script" in capsys.readouterr().err


BAD_SETS: list[tuple[str, list[str]]] = [
    ("memory.n_swap=-1", ["--set memory.n_swap=-1", "memory.n_swap", "an integer >= 0"]),
    ("memory.n_swap", ["KEY.PATH=VALUE"]),
    ("memory..n_swap=1", ["not a key path"]),
    ("memory.bogus=1", ["--set memory.bogus=1", "unknown key 'bogus'"]),
    ("seed.inner=1", ["--set seed.inner=1", "seed", "an integer >= 0"]),
    ("optimizer.betas=[0.9,", ["--set optimizer.betas=[0.9,", "YAML syntax error"]),
    ("precision=", ["missing value"]),
    (
        "checkpoint.resume=/nonexistent/ckpt",
        ["checkpoint.resume", "/nonexistent/ckpt does not exist", "auto, never, or a checkpoint directory"],
    ),
    ("checkpoint.interval_steps=5", ["checkpoint.dir", "interval_steps=5 needs dir"]),
]


@pytest.mark.parametrize(("override", "needles"), BAD_SETS, ids=[s[0] for s in BAD_SETS])
def test_bad_set(script: Path, capsys: pytest.CaptureFixture[str], override: str, needles: list[str]) -> None:
    assert main([str(script), "--set", override]) == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    for needle in needles:
        assert needle in err, f"{needle!r} not in {err!r}"


@pytest.mark.parametrize(
    ("argv", "needles"),
    [
        (["--nproc-per-node", "0"], ["--nproc-per-node 0", "launcher.nproc_per_node", "an integer >= 1"]),
        (["--nproc-per-node", "two"], ["launcher.nproc_per_node", "'two'"]),
        (["--nnodes", "2", "--node-rank", "5"], ["launcher.node_rank", "below nnodes"]),
        (["--master-port", "99999"], ["--master-port 99999", "launcher.master_port"]),
        (["--bogus-option"], ["command line", "--bogus-option"]),
    ],
)
def test_bad_launcher_option(
    script: Path, capsys: pytest.CaptureFixture[str], argv: list[str], needles: list[str]
) -> None:
    assert main([*argv, str(script)]) == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    for needle in needles:
        assert needle in err, f"{needle!r} not in {err!r}"


def test_every_problem_is_listed(tmp_path: Path, script: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "job.yaml"
    config.write_text("seed: x\nmicro_batch_size: 0\nmemory: {bogus: 1}\n")
    assert main([str(script), "--config", str(config)]) == EXIT_BAD_INPUT
    lines = [line for line in capsys.readouterr().err.splitlines() if str(config) in line]
    assert len(lines) == 3


# --------------------------------------------------------------------------------------------
# What only the machine can tell: checked before any rank starts (and a dry run checks the
# run folder without making it).
# --------------------------------------------------------------------------------------------


@pytest.fixture
def a_file(tmp_path: Path) -> Path:
    path = tmp_path / "a_file"
    path.write_text("not a directory\n")
    return path


@pytest.mark.parametrize("dry_run", [False, True], ids=["launch", "dry-run"])
@pytest.mark.parametrize(
    ("output_dir", "needles"),
    [
        ("{file}", ["output_dir: {file} is a file"]),
        ("{file}/sub", ["output_dir: {file}/sub cannot be a directory: {file} is a file"]),
        ("/proc/nope", ["output_dir: /proc/nope cannot be created", "No such file or directory"]),
    ],
    ids=["is-a-file", "under-a-file", "cannot-create"],
)
def test_unusable_output_dir_exits_2_before_any_rank(
    script: Path,
    a_file: Path,
    capsys: pytest.CaptureFixture[str],
    output_dir: str,
    needles: list[str],
    dry_run: bool,
) -> None:
    value = output_dir.format(file=a_file)
    argv = [*(["--dry-run"] if dry_run else []), str(script), "--set", f"output_dir={value}"]
    assert main(argv) == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    for needle in [f"--set output_dir={value}: ", *needles, "e.g. --set output_dir=runs"]:
        assert needle.format(file=a_file) in err, f"{needle!r} not in {err!r}"
    assert "Traceback" not in err


def test_output_dir_from_the_spec_file_names_the_file(
    tmp_path: Path, script: Path, a_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "job.yaml"
    config.write_text(f"output_dir: {a_file}\n")
    assert main([str(script), "--config", str(config)]) == EXIT_BAD_INPUT
    assert f"{config}: output_dir: {a_file} is a file" in capsys.readouterr().err


def test_a_dry_run_checks_output_dir_without_making_it(tmp_path: Path) -> None:
    target = tmp_path / "runs" / "nested"
    check_output_dir(target, create=False, source="test")
    assert list(tmp_path.iterdir()) == [], "the write check leaves nothing behind"
    check_output_dir(target, create=True, source="test")
    assert target.is_dir() and list(target.iterdir()) == []


@pytest.mark.parametrize(
    ("argv", "needles"),
    [
        (
            ["--master-addr", "no.such.host.invalid"],  # master_port 0: a free port would be picked
            ["command line --master-addr no.such.host.invalid: launcher.master_addr:", "does not resolve"],
        ),
        (
            ["--master-addr", "no.such.host.invalid", "--master-port", "29517"],
            ["launcher.master_addr: 'no.such.host.invalid' does not resolve", "127.0.0.1"],
        ),
        (
            # TEST-NET-1 (RFC 5737): never an address of this host; one node would wait the whole
            # rendezvous timeout for a store that is not there.
            ["--master-addr", "192.0.2.1", "--master-port", "29517"],
            ["launcher.master_addr: '192.0.2.1' is not an address of this host", "use 127.0.0.1"],
        ),
        (
            ["--nnodes", "2", "--node-rank", "0", "--master-addr", "192.0.2.1", "--master-port", "29517"],
            ["launcher.master_addr: '192.0.2.1' is not an address of this host", "node rank 0 serves"],
        ),
    ],
    ids=["unresolvable-port-0", "unresolvable-fixed-port", "not-this-host", "not-this-host-node-0"],
)
def test_bad_master_addr_exits_2_before_any_rank(
    tmp_path: Path, script: Path, capsys: pytest.CaptureFixture[str], argv: list[str], needles: list[str]
) -> None:
    runs = tmp_path / "runs"
    # Launcher options win over --set: the fixed-port cases keep their port.
    sets = ["--set", "launcher.master_port=0", "--set", f"output_dir={runs}"]
    assert main([*argv, str(script), *sets]) == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    for needle in needles:
        assert needle in err, f"{needle!r} not in {err!r}"
    assert not runs.exists(), "a refused launch leaves no run folder"


def test_other_nodes_and_c10d_rendezvous_only_need_master_addr_to_resolve() -> None:
    """Only node rank 0 under static rendezvous serves the store; the other nodes (and every node
    under c10d, which picks the server by address) just connect to it."""
    for launcher in (
        LauncherSpec(nnodes=2, node_rank=1, master_addr="192.0.2.1", master_port=29517),
        LauncherSpec(nnodes=2, master_addr="192.0.2.1", master_port=29517),
    ):
        check_master_addr(launcher, source="test")
