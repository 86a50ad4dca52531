"""Which rank protrain-run names as the cause when several fail: the one that failed by itself,
not the one the agent stopped afterwards (which often prints a peer-lost error of its own)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import pytest

from protrain.launcher.env_names import BAD_INPUT_PREFIX as PREFIX
from protrain.launcher.launch import _report_failures
from protrain.launcher.request import EXIT_BAD_INPUT, EXIT_RANK_FAILED


@dataclass
class Failure:
    exitcode: int
    timestamp: int
    error_file: str
    message: str

    def signal_name(self) -> str:
        return {-15: "SIGTERM", -6: "SIGABRT"}.get(self.exitcode, f"signal {-self.exitcode}")


@dataclass
class ChildFailed:
    failures: dict[int, Failure]


def _error_file(tmp_path: Path, name: str, mtime_ns: int) -> str:
    path = tmp_path / name
    path.write_text("{}")
    os.utime(path, ns=(mtime_ns, mtime_ns))
    return str(path)


def test_the_rank_that_exited_is_named_before_one_the_agent_killed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    second = 1_700_000_000
    stopped = Failure(-15, second, _error_file(tmp_path, "r0", second * 10**9 + 1), "RuntimeError: peer lost")
    cause = Failure(1, second, _error_file(tmp_path, "r1", second * 10**9 + 9), "RuntimeError: boom")
    _report_failures(ChildFailed({0: stopped, 1: cause}))
    err = capsys.readouterr().err
    assert "rank 1 failed with exit code 1: RuntimeError: boom" in err
    assert "stopped rank(s) 0 after that failure" in err


def test_within_one_second_the_earlier_error_file_wins(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    second = 1_700_000_000
    later = Failure(1, second, _error_file(tmp_path, "r0", second * 10**9 + 900_000_000), "RuntimeError: late")
    earlier = Failure(1, second, _error_file(tmp_path, "r1", second * 10**9 + 100_000_000), "RuntimeError: first")
    _report_failures(ChildFailed({0: later, 1: earlier}))
    assert "rank 1 failed with exit code 1: RuntimeError: first" in capsys.readouterr().err


def test_a_crashed_rank_is_the_cause_not_the_one_the_agent_then_stopped(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    second = 1_700_000_000
    base_ns = second * 10**9
    stopped = Failure(-15, second, _error_file(tmp_path, "r0", base_ns + 1), "")
    crashed = Failure(-6, second, _error_file(tmp_path, "r1", base_ns + 9), "")  # SIGABRT
    _report_failures(ChildFailed({0: stopped, 1: crashed}))
    assert "rank 1 failed with signal SIGABRT" in capsys.readouterr().err


def test_bad_input_found_in_a_rank_is_one_message_and_exit_code_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A rank that stopped on a SpecError (exit code 2, its message in the error file) makes
    protrain-run exit 2 with that message alone, as bad input found before launch does."""
    second = 1_700_000_000
    message = "memory.n_buffer=0 is too few: ...\nsecond line"
    files = [_error_file(tmp_path, f"r{rank}", second * 10**9 + rank) for rank in range(2)]
    both = {rank: Failure(2, second, files[rank], f"{PREFIX}{message}") for rank in range(2)}
    assert _report_failures(ChildFailed(both)) == EXIT_BAD_INPUT
    assert capsys.readouterr().err == f"protrain-run: error: {message}\n"


def test_other_failures_keep_exit_code_1_and_a_script_usage_error_is_bad_input(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    second = 1_700_000_000
    crash = Failure(1, second, _error_file(tmp_path, "r0", second * 10**9), "RuntimeError: boom")
    assert _report_failures(ChildFailed({0: crash})) == EXIT_RANK_FAILED
    # The script's own argparse error: exit code 2 and no error file message of ours.
    usage = Failure(2, second, _error_file(tmp_path, "r1", second * 10**9), "")
    assert _report_failures(ChildFailed({0: usage})) == EXIT_BAD_INPUT
    assert "rank 0 failed with exit code 2" in capsys.readouterr().err


def test_a_rank_that_exited_143_on_the_agents_sigterm_was_stopped_not_the_cause(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The agent's SIGTERM reaches a rank whose handler exits with 128 + SIGTERM (143), with no
    error file: within the same second it sorted before the rank that failed (whole seconds),
    and protrain-run named it the cause (seen once in CI: "rank 0 failed with exit code 143")."""
    second = 1_700_000_000
    stopped = Failure(143, second, "", "")
    cause = Failure(1, second, _error_file(tmp_path, "r1", second * 10**9 + 500_000_000), "RuntimeError: boom")
    _report_failures(ChildFailed({0: stopped, 1: cause}))
    err = capsys.readouterr().err
    assert "rank 1 failed with exit code 1: RuntimeError: boom" in err
    assert "stopped rank(s) 0 after that failure" in err


def test_a_signal_that_lands_inside_torchs_metrics_wrapper_still_exits_as_the_signal() -> None:
    """Ctrl-C becomes a SIGTERM whose handler may raise before torch's elastic metrics wrapper
    read its clock: its ``finally`` then raises UnboundLocalError with the SignalException as the
    context. protrain-run exits 130 (143 for a SIGTERM of its own) either way, and any other
    UnboundLocalError is not mistaken for one."""
    import signal

    from torch.distributed.elastic.multiprocessing.api import SignalException

    from protrain.launcher.launch import signal_exit_code

    def wrapped(signum: int) -> UnboundLocalError:
        try:
            try:
                raise SignalException("stopped", sigval=signal.Signals(signum))
            finally:
                raise UnboundLocalError("cannot access local variable 'start'")
        except UnboundLocalError as err:
            return err

    assert signal_exit_code(wrapped(signal.SIGTERM), interrupted=True) == 130
    assert signal_exit_code(wrapped(signal.SIGTERM), interrupted=False) == 143
    assert signal_exit_code(SignalException("stopped", sigval=signal.SIGTERM), interrupted=False) == 143
    assert signal_exit_code(UnboundLocalError("a bug of ours"), interrupted=True) is None
