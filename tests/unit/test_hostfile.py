"""protrain-run --hostfile (protrain_launcher/hostfile.py, multinode.py): DeepSpeed's hostfile and
filters read as DeepSpeed reads them, the variables each node gets, each node's command, and
bad input refused with exit 2 and one line."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest

from protrain.launcher import cli
from protrain.launcher.hostfile import HostfileError, Node, forwarded_env, read_hostfile, select_nodes
from protrain.launcher.multinode import node_arguments, node_command, run_nodes


def hostfile(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "hostfile"
    path.write_text(text)
    return path


def test_a_hostfile_lists_hosts_and_slots_in_order(tmp_path: Path) -> None:
    text = "# the job's machines\nworker-1 slots=8\n\nworker-0   slots = 4  # the small one\n"
    assert read_hostfile(hostfile(tmp_path, text)) == {"worker-1": 8, "worker-0": 4}


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("worker-0\n", "hostfile:1: 'worker-0' is not 'HOST slots=N'"),
        ("a slots=2\nb slots=two\n", "hostfile:2: 'b slots=two' is not 'HOST slots=N'"),
        ("a slots=2\na slots=2\n", "hostfile:2: a is listed twice"),
        ("a slots=0\n", "a has slots=0"),
        ("# nothing\n", "names no host"),
    ],
)
def test_a_malformed_hostfile_is_refused_naming_the_line(tmp_path: Path, text: str, words: str) -> None:
    with pytest.raises(HostfileError) as refused:
        read_hostfile(hostfile(tmp_path, text))
    assert words in str(refused.value)


HOSTS = {"w0": 4, "w1": 4, "w2": 2}


def test_include_and_exclude_pick_hosts_and_slots_as_deepspeed_does() -> None:
    every = select_nodes(HOSTS, include=None, exclude=None)
    assert every == [Node("w0", (0, 1, 2, 3)), Node("w1", (0, 1, 2, 3)), Node("w2", (0, 1))]
    assert select_nodes(HOSTS, include="w1:0,2@w2", exclude=None) == [Node("w1", (0, 2)), Node("w2", (0, 1))]
    assert select_nodes(HOSTS, include=None, exclude="w0@w1:3") == [Node("w1", (0, 1, 2)), Node("w2", (0, 1))]


@pytest.mark.parametrize(
    ("include", "exclude", "words"),
    [
        ("w0", "w1", "give one of them, not both"),
        ("w9", None, "'w9' is not in the hostfile (w0, w1, w2)"),
        ("w2:2", None, "slot '2' of w2 is not one of 0-1"),
        (None, "w0@w1@w2", "--exclude leaves no slot"),
    ],
)
def test_a_bad_filter_is_refused_naming_it(include: str | None, exclude: str | None, words: str) -> None:
    with pytest.raises(HostfileError) as refused:
        select_nodes(HOSTS, include=include, exclude=exclude)
    assert words in str(refused.value)


def test_nodes_get_the_python_and_protrain_variables_and_the_env_file(tmp_path: Path) -> None:
    environ = {"PYTHONPATH": "/code", "NCCL_DEBUG": "INFO", "CUDA_VISIBLE_DEVICES": "0", "SECRET": "x"}
    home = tmp_path / "home"
    home.mkdir()
    (home / ".protrain_env").write_text("# forwarded\nWANDB_PROJECT=runs\nNCCL_DEBUG=WARN\n")
    env = forwarded_env(environ, tmp_path, home)
    assert env == {"PYTHONPATH": "/code", "NCCL_DEBUG": "WARN", "WANDB_PROJECT": "runs"}
    (tmp_path / ".protrain_env").write_text("just words\n")  # the working directory's comes first
    with pytest.raises(HostfileError, match=r"\.protrain_env:1: 'just words' is not 'NAME=VALUE'"):
        forwarded_env(environ, tmp_path, home)


def test_each_node_is_told_the_jobs_shape_and_a_remote_one_starts_over_ssh(tmp_path: Path) -> None:
    nodes = [Node("localhost", (0, 1)), Node("w1", (1, 3))]
    rest = ["--config", "job.yaml", "train.py", "--lr", "1e-3"]
    arguments = node_arguments(nodes, 1, master_port=29555, rest=rest)
    assert arguments == [
        "--nnodes", "2", "--node-rank", "1", "--master-addr", "localhost", "--master-port", "29555",
        "--nproc-per-node", "2", *rest,
    ]  # fmt: skip
    local, env = node_command(nodes[0], arguments, cwd=tmp_path, env={"PYTHONPATH": "/code"}, total_slots=2)
    assert local[1:3] == ["-m", "protrain.launcher"] and env is not None and env["PYTHONPATH"] == "/code"
    assert "CUDA_VISIBLE_DEVICES" not in env or env["CUDA_VISIBLE_DEVICES"] == "0,1"
    remote, none = node_command(nodes[1], arguments, cwd=tmp_path, env={"PYTHONPATH": "/a b"}, total_slots=4)
    assert none is None and remote[:4] == ["ssh", "-o", "BatchMode=yes", "w1"]
    assert remote[4].startswith(f"cd {tmp_path} && env CUDA_VISIBLE_DEVICES=1,3 PYTHONPATH='/a b' ")
    assert remote[4].endswith("-m protrain.launcher " + " ".join(arguments))


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--include", "w0"], "--include and --exclude filter a --hostfile"),
        (["--hostfile", "HOSTFILE", "--nnodes", "2"], "command line --nnodes 2: the hostfile decides launcher.nnodes"),
        (["--hostfile", "HOSTFILE", "--exclude", "w7"], "--exclude w7: 'w7' is not in the hostfile"),
        (["--hostfile", "missing"], "missing: cannot be read"),
        (["--hostfile", "HOSTFILE", "--set", "launcher.nnodes=3"], "launcher.nnodes is 3, but the hostfile says 2"),
        (
            ["--hostfile", "HOSTFILE", "--set", "launcher.node_rank=0"],
            "launcher.node_rank is 0, but the hostfile decides it per node",
        ),
    ],
)
def test_bad_hostfile_input_exits_2_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], words: str
) -> None:
    script = tmp_path / "train.py"
    script.write_text("pass\n")
    path = hostfile(tmp_path, "w0 slots=1\nw1 slots=1\n")
    argv = [str(path) if arg == "HOSTFILE" else str(tmp_path / arg) if arg == "missing" else arg for arg in argv]
    assert cli.main([*argv, str(script)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and words in err, err


def test_the_nodes_run_the_command_line_without_the_hostfile_options() -> None:
    argv = ["--hostfile", "h", "--include=w0", "--master-port", "2", "--config", "c.yaml", "t.py", "--hostfile", "x"]
    assert cli._without_hostfile_options(argv) == [
        "--master-port",
        "2",
        "--config",
        "c.yaml",
        "t.py",
        "--hostfile",
        "x",
    ]


def test_the_first_node_to_fail_ends_the_others_and_gives_the_exit_code(tmp_path: Path) -> None:
    started = time.monotonic()
    code = run_nodes([(["sleep", "60"], None), (["bash", "-c", "sleep 0.3; exit 3"], None)], cwd=tmp_path)
    assert code == 3 and time.monotonic() - started < 10  # the sleeping node got SIGTERM


def test_ctrl_c_reaches_every_node_and_the_job_exits_130(tmp_path: Path) -> None:
    # Each node stops on SIGINT after writing where it was (as protrain-run saves and exits 130).
    node = "trap 'echo stopped > {0}; exit 130' INT; touch {0}.up; while true; do sleep 0.05; done"
    marks = [tmp_path / f"node{i}" for i in range(2)]
    commands: list[tuple[list[str], dict[str, str] | None]] = [(["bash", "-c", node.format(m)], None) for m in marks]

    def press_ctrl_c() -> None:
        deadline = time.monotonic() + 10
        while not all(Path(f"{m}.up").exists() for m in marks) and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=press_ctrl_c, daemon=True).start()
    assert run_nodes(commands, cwd=tmp_path) == 130
    assert [m.read_text() for m in marks] == ["stopped\n", "stopped\n"]
