"""protrain-run under ``srun`` (protrain_launcher/slurm.py): Slurm's node list expanded as Slurm
writes it, and the job's nodes, this node's rank, the master and the port read from a task's
environment, one task per node or one per GPU; a command line or spec that disagrees is refused
with exit 2 and one line."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from protrain.launcher import cli, launch, rank_entry
from protrain.launcher.env_names import LOCAL_RANK_ENV, LOCAL_WORLD_SIZE_ENV
from protrain.launcher.slurm import (
    PORT_BASE,
    PORT_SPAN,
    SlurmError,
    expand_nodelist,
    expand_tasks_per_node,
    read_slurm_job,
)

NODE_LISTS = [
    ("node01", ["node01"]),
    ("node[01-03]", ["node01", "node02", "node03"]),
    ("node[01-04,07]", ["node01", "node02", "node03", "node04", "node07"]),
    ("a1,b[2-3]", ["a1", "b2", "b3"]),
    ("gpu[1,3],cpu[10-11]", ["gpu1", "gpu3", "cpu10", "cpu11"]),
    ("rack[1-2]-n[01-02]", ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"]),
    ("n[08-10]", ["n08", "n09", "n10"]),  # zero padding kept across the carry
    ("n[9-11]", ["n9", "n10", "n11"]),  # no padding: none added
    ("n[098-101]", ["n098", "n099", "n100", "n101"]),
    ("gpu-[8-9].cluster.local", ["gpu-8.cluster.local", "gpu-9.cluster.local"]),
    ("node-001", ["node-001"]),
]


@pytest.mark.parametrize(("text", "expected"), NODE_LISTS, ids=[text for text, _ in NODE_LISTS])
def test_node_lists_expand_as_slurm_writes_them(text: str, expected: list[str]) -> None:
    assert expand_nodelist(text) == expected


MALFORMED = [
    ("node[01-", "without its ']'"),
    ("node01]", "without its '['"),
    ("node[03-01]", "runs backwards"),
    ("node[a-b]", "is not a number"),
    ("node[]", "is not a number"),
    ("node[1-]", "is not a number"),
    ("a,,b", "an empty host name"),
    ("", "an empty host name"),
    ("n[[1]]", "nested brackets"),
]


@pytest.mark.parametrize(("text", "words"), MALFORMED, ids=[text or "empty" for text, _ in MALFORMED])
def test_malformed_node_lists_are_refused_naming_the_part(text: str, words: str) -> None:
    with pytest.raises(SlurmError) as refused:
        expand_nodelist(text)
    assert words in str(refused.value)


def srun_env(**changes: str) -> dict[str, str]:
    """A task's environment as ``srun -N 2 --ntasks-per-node=1`` gives it on the second node."""
    env = {
        "SLURM_JOB_ID": "4242",
        "SLURM_STEP_ID": "0",
        "SLURM_JOB_NODELIST": "gpu[07-08]",
        "SLURM_NNODES": "2",
        "SLURM_NODEID": "1",
        "SLURM_NTASKS": "2",
        "SLURM_PROCID": "1",
        "SLURM_LOCALID": "0",
    }
    env.update(changes)
    return {k: v for k, v in env.items() if v != ""}


def test_a_task_reads_its_job_from_the_environment() -> None:
    job = read_slurm_job(srun_env())
    assert job.nodes == ("gpu07", "gpu08") and job.node_id == 1 and job.job_id == "4242"
    assert job.launcher_values() == {
        "nnodes": "2",
        "node_rank": "1",
        "master_addr": "gpu07",
        "master_port": str(PORT_BASE + 4242 % PORT_SPAN),
    }


@pytest.mark.parametrize(
    ("changes", "words"),
    [
        ({"SLURM_NNODES": "3"}, r"SLURM_NNODES=3 but SLURM_JOB_NODELIST=gpu\[07-08\] names 2"),
        ({"SLURM_NODEID": "2"}, "SLURM_NODEID=2 is not below SLURM_NNODES=2"),
        ({"SLURM_NTASKS": "1"}, "SLURM_NTASKS=1 is below SLURM_NNODES=2"),
        ({"SLURM_NTASKS": "16"}, "SLURM_TASKS_PER_NODE is not set"),
        ({"SLURM_NTASKS": "4", "SLURM_TASKS_PER_NODE": "3(x2)"}, "SLURM_TASKS_PER_NODE=3\\(x2\\) does not give"),
        ({"SLURM_NTASKS": "4", "SLURM_TASKS_PER_NODE": "2x2"}, "'2x2' in '2x2' is not a task count"),
        ({"SLURM_NTASKS": "4", "SLURM_TASKS_PER_NODE": "2(x2)", "SLURM_LOCALID": "2"}, "do not fit"),
        ({"SLURM_NODEID": ""}, "SLURM_NODEID is not set"),
        ({"SLURM_NNODES": "two"}, "SLURM_NNODES='two' is not a whole number"),
        ({"SLURM_JOB_NODELIST": "gpu[07-"}, "SLURM_JOB_NODELIST: a '\\[' without its '\\]'"),
    ],
)
def test_a_broken_slurm_environment_is_refused_naming_the_variable(changes: dict[str, str], words: str) -> None:
    with pytest.raises(SlurmError, match=words):
        read_slurm_job(srun_env(**changes))


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "train.py"
    path.write_text("print('hello')\n")
    return path


def resolved(monkeypatch: pytest.MonkeyPatch, env: dict[str, str], argv: list[str]) -> cli.Spec:
    for name in [n for n in os.environ if n.startswith("SLURM_")]:
        monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return cli.resolve_spec(cli.parse_command_line(argv))


def test_under_srun_the_launcher_takes_slurms_nodes_rank_master_and_port(
    monkeypatch: pytest.MonkeyPatch, script: Path
) -> None:
    spec = resolved(monkeypatch, srun_env(), [str(script)])
    launcher = spec.launcher
    assert (launcher.nnodes, launcher.node_rank, launcher.master_addr) == (2, 1, "gpu07")
    assert launcher.master_port == PORT_BASE + 4242
    # A master set by hand is kept; a node count that agrees is fine.
    spec = resolved(monkeypatch, srun_env(), ["--master-addr", "10.0.0.1", "--nnodes", "2", str(script)])
    assert (spec.launcher.master_addr, spec.launcher.nnodes) == ("10.0.0.1", 2)
    # Outside srun (an sbatch script itself: no step) nothing is read.
    spec = resolved(monkeypatch, srun_env(SLURM_STEP_ID=""), [str(script)])
    assert spec.launcher.nnodes == 1


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (
            ["--nnodes", "4"],
            "command line --nnodes 4: launcher.nnodes is 4, but Slurm (SLURM_JOB_NODELIST=gpu07,gpu08) says 2",
        ),
        (["--node-rank", "0"], "launcher.node_rank is 0, but Slurm (SLURM_NODEID=1) says 1"),
        (["--set", "launcher.nnodes=3"], "launcher.nnodes is 3, but Slurm"),
    ],
)
def test_a_disagreement_with_slurm_exits_2_with_one_line_naming_both(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], script: Path, argv: list[str], words: str
) -> None:
    for name, value in srun_env().items():
        monkeypatch.setenv(name, value)
    assert cli.main([*argv, str(script)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and words in err, err
    assert "Traceback" not in err


def test_a_broken_slurm_environment_exits_2(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], script: Path
) -> None:
    for name, value in srun_env(SLURM_NTASKS="1").items():
        monkeypatch.setenv(name, value)
    assert cli.main([str(script)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("protrain-run: error: Slurm: SLURM_NTASKS=1 is below SLURM_NNODES=2") and err.count("\n") == 1


@pytest.mark.parametrize(
    ("text", "counts"), [("8(x4)", [8, 8, 8, 8]), ("2(x3),1", [2, 2, 2, 1]), ("4", [4]), ("1,2(x2)", [1, 2, 2])]
)
def test_tasks_per_node_expand_as_slurm_writes_them(text: str, counts: list[int]) -> None:
    assert expand_tasks_per_node(text) == counts


def per_gpu_env() -> dict[str, str]:
    """``srun -N 2 --ntasks-per-node=2``: the fourth task, the second on the second node."""
    return srun_env(SLURM_NTASKS="4", SLURM_TASKS_PER_NODE="2(x2)", SLURM_PROCID="3", SLURM_LOCALID="1")


def test_one_task_per_gpu_makes_each_task_one_rank(monkeypatch: pytest.MonkeyPatch, script: Path) -> None:
    """Each task is a rendezvous "node" of one rank; its place on its machine goes to the rank
    (LOCAL_RANK picks its GPU, LOCAL_WORLD_SIZE its share of the host), as do its cores."""
    job = read_slurm_job(per_gpu_env())
    assert job.per_task and (job.local_id, job.tasks_here) == (1, 2)
    spec = resolved(monkeypatch, per_gpu_env(), [str(script)])
    launcher = spec.launcher
    assert (launcher.nnodes, launcher.node_rank, launcher.nproc_per_node) == (4, 3, 1)
    assert launcher.master_addr == "gpu07"
    env = launch._child_env(Path("spec.json"), 1, job)
    assert (env[LOCAL_RANK_ENV], env[LOCAL_WORLD_SIZE_ENV]) == ("1", "2")
    monkeypatch.setenv("LOCAL_RANK", "0")  # what torch's agent gives its one worker
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    monkeypatch.setenv(LOCAL_RANK_ENV, "1")
    monkeypatch.setenv(LOCAL_WORLD_SIZE_ENV, "2")
    rank_entry.take_local_place()
    assert (os.environ["LOCAL_RANK"], os.environ["LOCAL_WORLD_SIZE"]) == ("1", "2")


def test_ranks_per_node_other_than_one_are_refused_with_a_task_per_gpu(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], script: Path
) -> None:
    for name, value in per_gpu_env().items():
        monkeypatch.setenv(name, value)
    assert cli.main(["--nproc-per-node", "2", str(script)]) == 2
    err = capsys.readouterr().err
    assert "launcher.nproc_per_node is 2, but Slurm (SLURM_NTASKS=4 on 2 node(s): each task is one rank) says 1" in err
