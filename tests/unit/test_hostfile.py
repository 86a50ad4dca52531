"""protrain-run --hostfile (protrain_launcher/hostfile.py, multinode.py, remote_node.py): DeepSpeed's
hostfile and filters read as DeepSpeed reads them, the variables each node gets, each node's
command (ssh, or pdsh when it is on PATH), bad input refused with exit 2 and one line, and how
the head stops nodes: a local one by a signal, a remote one by the end of its stdin."""

from __future__ import annotations

import json
import os
import shlex
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from protrain.launcher import cli
from protrain.launcher.hostfile import HostfileError, Node, forwarded_env, read_hostfile, select_nodes
from protrain.launcher.multinode import NodeLaunch, node_arguments, node_launches, run_nodes
from protrain.launcher.remote_node import node_side_argv

FAKE_PDSH = f"""#!{sys.executable}
# pdsh [-S] [-f N] -w HOST,HOST... COMMAND: record the arguments, then run COMMAND here once per
# host, %h %n %u %% substituted as pdsh's ssh module does, each in its own session (as on another
# machine) with a stdin this process holds open and never writes (as pdsh holds its ssh
# children's); exit with the largest exit code (-S).
import json, os, re, subprocess, sys
args = sys.argv[1:]
if os.environ.get("FAKE_PDSH_LOG"):
    with open(os.environ["FAKE_PDSH_LOG"], "a") as log:
        log.write(json.dumps({{"argv": args, "rcmd": os.environ.get("PDSH_RCMD_TYPE")}}) + "\\n")
at = 0
while args[at].startswith("-"):
    if args[at] == "-w":
        hosts = args[at + 1].split(",")
    at += 2 if args[at] in ("-w", "-f") else 1
command = " ".join(args[at:])
def on(host, rank):
    values = {{"h": host, "n": str(rank), "u": os.environ.get("USER", ""), "%": "%"}}
    return re.sub("%([hnu%])", lambda match: values[match[1]], command)
procs = [subprocess.Popen(["bash", "-c", on(host, rank)], stdin=subprocess.PIPE, start_new_session=True)
         for rank, host in enumerate(hosts)]
sys.exit(max(proc.wait() for proc in procs))
"""


def put_on_path(monkeypatch: pytest.MonkeyPatch, folder: Path, name: str, text: str) -> Path:
    """An executable ``name`` in ``folder``, which goes first on PATH."""
    folder.mkdir(exist_ok=True)
    path = folder / name
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{folder}{os.pathsep}{os.environ['PATH']}")
    return path


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


def test_each_node_is_told_the_jobs_shape_and_a_remote_one_starts_over_ssh(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    put_on_path(monkeypatch, tmp_path / "bin", "pdsh", FAKE_PDSH)  # there, but --remote ssh
    nodes = [Node("localhost", (0, 1)), Node("w1", (1, 3))]
    rest = ["--config", "job.yaml", "train.py", "--lr", "1e-3"]
    arguments = node_arguments(nodes, 1, master_port=29555, rest=rest)
    assert arguments == [
        "--nnodes", "2", "--node-rank", "1", "--master-addr", "localhost", "--master-port", "29555",
        "--nproc-per-node", "2", *rest,
    ]  # fmt: skip
    local, remote = node_launches(
        nodes, hosts={"localhost": 2, "w1": 4}, master_port=29555, rest=rest, cwd=tmp_path,
        env={"PYTHONPATH": "/a b"}, remote="ssh",
    )  # fmt: skip
    assert local.argv[1:3] == ["-m", "protrain.launcher"] and local.via == "local"
    assert local.env is not None and local.env["PYTHONPATH"] == "/a b"
    assert "CUDA_VISIBLE_DEVICES" not in local.env or local.env["CUDA_VISIBLE_DEVICES"] == "0,1"
    assert remote.env is None and remote.via == "ssh" and remote.argv[:4] == ["ssh", "-o", "BatchMode=yes", "w1"]
    assert remote.argv[4].startswith(f"cd {tmp_path} && env CUDA_VISIBLE_DEVICES=1,3 PYTHONPATH='/a b' ")
    assert remote.argv[4].endswith("-m protrain.launcher --stop-on-stdin-eof " + " ".join(arguments))


def test_pdsh_when_on_path_starts_the_remote_hosts_of_one_shape_with_one_command(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    nodes = [Node("localhost", (0, 1)), Node("w1", (0, 1)), Node("w2", (0, 1)), Node("w3", (1,))]
    hosts = {"localhost": 2, "w1": 2, "w2": 2, "w3": 2}
    rest = ["train.py", "--note", "100%n"]  # a % of the user's own is not pdsh's

    def launches(remote: str = "auto") -> list[NodeLaunch]:
        return node_launches(
            nodes, hosts=hosts, master_port=29555, rest=rest, cwd=tmp_path, env={"PYTHONPATH": "/a b"}, remote=remote
        )

    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert [launch.via for launch in launches()] == ["local", "ssh", "ssh", "ssh"]  # no pdsh: ssh
    with pytest.raises(HostfileError, match="--remote pdsh: pdsh is not on PATH"):
        launches("pdsh")
    put_on_path(monkeypatch, tmp_path / "bin", "pdsh", FAKE_PDSH)
    local, two, one = launches()
    assert local.via == "local" and two.via == one.via == "pdsh"
    assert two.argv[:6] == ["pdsh", "-S", "-f", "1024", "-w", "w1,w2"] and one.argv[5] == "w3"
    assert two.env is not None and two.env["PDSH_RCMD_TYPE"] == "ssh"
    command = two.argv[6]
    assert command.startswith(f"cd {tmp_path} && env PYTHONPATH='/a b' ")
    job = "--nnodes 4 --master-addr localhost --master-port 29555 --nproc-per-node 2 train.py --note 100%%n"
    assert command.endswith(
        f"-m protrain.launcher --stop-on-stdin-eof --node-rank-of %h --node-hosts localhost,w1,w2,w3 {job}"
    )
    assert "CUDA_VISIBLE_DEVICES=1 " in one.argv[6] and "--nproc-per-node 1 " in one.argv[6]
    words = shlex.split(command.replace("%h", "w2").replace("%%", "%"))  # as pdsh runs it on w2
    node_argv = words[words.index("--stop-on-stdin-eof") + 1 :]  # (the stdin watch stays off here)
    assert node_side_argv(node_argv) == ["--node-rank", "2", *job.replace("%%", "%").split()]
    assert [launch.via for launch in launches("ssh")] == ["local", "ssh", "ssh", "ssh"]
    nodes[2] = Node("user@w2", (0, 1))  # not a name pdsh's -w takes as it is
    hosts["user@w2"] = 2
    assert [launch.via for launch in launches()] == ["local", "ssh", "ssh", "ssh"]
    with pytest.raises(HostfileError, match="pdsh's -w would not take the host 'user@w2'"):
        launches("pdsh")


def test_a_node_started_by_pdsh_finds_its_rank_from_its_name() -> None:
    argv = ["--node-rank-of", "w2", "--node-hosts", "w0,w1,w2", "--nnodes", "3", "t.py", "--node-rank-of", "x"]
    assert node_side_argv(argv) == ["--node-rank", "2", "--nnodes", "3", "t.py", "--node-rank-of", "x"]
    assert node_side_argv(["--nnodes", "3", "t.py"]) == ["--nnodes", "3", "t.py"]
    with pytest.raises(cli.SpecError, match="--node-rank-of w9: not one of --node-hosts w0,w1"):
        node_side_argv(["--node-rank-of", "w9", "--node-hosts", "w0,w1", "t.py"])


def test_a_remote_node_stops_itself_when_its_stdin_ends(tmp_path: Path) -> None:
    """--stop-on-stdin-eof: SIGTERM to itself at the end of its input, not before."""
    code = (
        "import sys, time\n"
        "from protrain.launcher.remote_node import node_side_argv\n"
        "assert node_side_argv(['--stop-on-stdin-eof', 't.py']) == ['t.py']\n"
        "print('watching', flush=True)\n"
        "time.sleep(60)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "watching\n"
        time.sleep(0.3)
        assert proc.poll() is None  # its input is still open
        assert proc.stdin is not None
        proc.stdin.close()
        assert proc.wait(timeout=5) == -signal.SIGTERM
    finally:
        proc.kill()


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--include", "w0"], "--include and --exclude filter a --hostfile"),
        (["--remote", "ssh"], "--remote picks how a --hostfile's hosts are started"),
        (["--hostfile", "HOSTFILE", "--remote", "pdsh"], "--remote pdsh: pdsh is not on PATH"),
        (["--hostfile", "HOSTFILE", "--remote", "rsh"], "argument --remote: invalid choice: 'rsh'"),
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
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, argv: list[str], words: str
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no pdsh (nor ssh): nothing can start
    script = tmp_path / "train.py"
    script.write_text("pass\n")
    path = hostfile(tmp_path, "w0 slots=1\nw1 slots=1\n")
    argv = [str(path) if arg == "HOSTFILE" else str(tmp_path / arg) if arg == "missing" else arg for arg in argv]
    assert cli.main([*argv, str(script)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and words in err, err


def test_the_nodes_run_the_command_line_without_the_hostfile_options() -> None:
    argv = ["--hostfile", "h", "--include=w0", "--remote", "ssh", "--master-port", "2", "--config", "c.yaml", "t.py"]
    argv += ["--hostfile", "x"]
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
    code = run_nodes([NodeLaunch(["sleep", "60"]), NodeLaunch(["bash", "-c", "sleep 0.3; exit 3"])], cwd=tmp_path)
    assert code == 3 and time.monotonic() - started < 10  # the sleeping node got SIGTERM


def test_ctrl_c_reaches_every_node_and_the_job_exits_130(tmp_path: Path) -> None:
    # Each node stops on SIGINT after writing where it was (as protrain-run saves and exits 130);
    # the remote one, which no signal reaches, when its input ends.
    node = "trap 'echo stopped > {0}; exit 130' INT; touch {0}.up; while true; do sleep 0.05; done"
    remote = "trap '' INT TERM; touch {0}.up; cat > /dev/null; echo stopped > {0}; exit 130"
    marks = [tmp_path / f"node{i}" for i in range(3)]
    commands = [NodeLaunch(["bash", "-c", node.format(m)]) for m in marks[:2]]
    commands.append(NodeLaunch(["bash", "-c", remote.format(marks[2])], via="ssh"))

    def press_ctrl_c() -> None:
        deadline = time.monotonic() + 10
        while not all(Path(f"{m}.up").exists() for m in marks) and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=press_ctrl_c, daemon=True).start()
    assert run_nodes(commands, cwd=tmp_path) == 130
    assert [m.read_text() for m in marks] == ["stopped\n"] * 3


# A remote node as the head sees it: it ignores signals (they would not reach another machine
# through ssh) and ends when its input does; it marks that end only after the local node failed.
REMOTE_NODE = "trap '' TERM INT; cat > /dev/null; if [ -e failed ]; then echo {mark} > stopped-{mark}; fi"
LOCAL_FAILURE = "sleep 0.5; touch failed; exit 3"


def test_a_failure_ends_a_remote_node_by_closing_its_stdin(tmp_path: Path) -> None:
    started = time.monotonic()
    remote = NodeLaunch(["bash", "-c", REMOTE_NODE.format(mark="ssh")], via="ssh")
    assert run_nodes([NodeLaunch(["bash", "-c", LOCAL_FAILURE]), remote], cwd=tmp_path) == 3
    assert time.monotonic() - started < 10  # well before the grace ends in SIGKILL
    assert (tmp_path / "stopped-ssh").read_text() == "ssh\n"


def test_a_failure_ends_pdsh_whose_hosts_see_their_stdin_end(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    put_on_path(monkeypatch, tmp_path / "bin", "pdsh", FAKE_PDSH)
    monkeypatch.setenv("FAKE_PDSH_LOG", str(tmp_path / "pdsh.log"))
    started = time.monotonic()
    pdsh = NodeLaunch(["pdsh", "-S", "-f", "1024", "-w", "w1,w2", REMOTE_NODE.format(mark="%h")], via="pdsh")
    assert run_nodes([NodeLaunch(["bash", "-c", LOCAL_FAILURE]), pdsh], cwd=tmp_path) == 3
    deadline = time.monotonic() + 5
    while not all((tmp_path / f"stopped-{host}").exists() for host in ("w1", "w2")) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [(tmp_path / f"stopped-{host}").read_text() for host in ("w1", "w2")] == ["w1\n", "w2\n"]
    assert time.monotonic() - started < 10
    assert json.loads((tmp_path / "pdsh.log").read_text())["argv"][:5] == ["-S", "-f", "1024", "-w", "w1,w2"]
