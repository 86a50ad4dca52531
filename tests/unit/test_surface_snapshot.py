"""The user-facing surface is frozen: every spec key (what it accepts and its default, as the
spec reference page shows them), every option of protrain-run, protrain-run --what-if,
protrain-run --report and protrain-run --plot, and the Python API ``import protrain`` offers
(its names, ``initialize``'s signature, the Engine's public methods and properties).
A change to either must be deliberate: the snapshot file is updated and reviewed with it.

    PROTRAIN_UPDATE_SURFACE=1 .venv/bin/python -m pytest tests/unit/test_surface_snapshot.py
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import os
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path
from typing import Any

import protrain
from protrain.launcher.cli import LAUNCHER_OPTIONS, SPEC_OPTIONS, build_parser
from protrain.launcher.plot_cli import build_parser as build_plot_parser
from protrain.launcher.report_cli import build_parser as build_report_parser
from protrain.launcher.what_if_cli import build_parser as build_what_if_parser
from protrain.runtime.config.spec_doc import reference_rows
from protrain.profiler.plan import UpdateMode
from protrain.runtime.observability.observer import UpdateObserver
from protrain.runtime.optim.registry import ADAMW, register
from protrain.runtime.optim.rule import OptimizerHyper, OptimizerRule
from protrain.runtime.planning.profilers import Profilers
from protrain.runtime.training.delegation import Reads

SNAPSHOT = Path(__file__).with_name("surface_snapshot.json")
UPDATE_ENV = "PROTRAIN_UPDATE_SURFACE"


def spec_surface() -> dict[str, dict[str, str]]:
    return {row.key: {"allowed": row.allowed, "default": row.default} for row in reference_rows()}


def _argument(action: argparse.Action) -> dict[str, Any]:
    takes = "nothing" if action.nargs == 0 else str(action.metavar or action.dest)
    if action.type is not None:
        takes += f" ({getattr(action.type, '__name__', repr(action.type))})"
    if action.nargs not in (None, 0):
        takes += f" nargs={action.nargs}"
    described: dict[str, Any] = {"takes": takes, "default": action.default, "required": action.required}
    if action.choices is not None:
        described["choices"] = list(action.choices)
    return described


def parser_surface(parser: argparse.ArgumentParser) -> dict[str, dict[str, Any]]:
    """Each option (by its strings) or positional (by its name) with what it takes, and each
    required choice between options."""
    surface: dict[str, dict[str, Any]] = {
        ", ".join(action.option_strings) or action.dest: _argument(action) for action in parser._actions
    }
    for group in parser._mutually_exclusive_groups:
        names = " | ".join(", ".join(action.option_strings) for action in group._group_actions)
        surface[f"({names})"] = {"takes": "exactly one" if group.required else "at most one"}
    return surface


def launcher_surface() -> dict[str, dict[str, Any]]:
    options = parser_surface(build_parser())
    # --config and --set are taken before the parser runs (anywhere before '--').
    takes = {"--config": "FILE", "--set": "KEY.PATH=VALUE"}
    for option in SPEC_OPTIONS:
        options[option] = {
            "takes": takes[option],
            "where": "anywhere before --",
            "repeatable": option == "--set",
        }
    for option, key in LAUNCHER_OPTIONS.items():
        spelled = next(name for name in options if option in name.split(", "))  # with its underscore form
        options[spelled]["overrides"] = f"launcher.{key}"
    return options


def _signature(value: Any) -> str:
    if isinstance(value, property | Reads):
        return "property"
    return f"{'async ' if inspect.iscoroutinefunction(value) else ''}{inspect.signature(value)}"


def python_surface() -> dict[str, dict[str, str]]:
    """``protrain``'s exported names, with ``initialize``'s signature and, for the Engine, each
    public method's signature (or ``property``); the seams tests and extensions use: the
    measuring functions ``initialize`` takes, the optimizer rules, the plan's update modes and
    the observer hooks."""
    names = {name: type(getattr(protrain, name)).__name__ for name in protrain.__all__ if name != "__version__"}
    engine = {
        name: _signature(member)
        for cls in reversed(protrain.Engine.__mro__[:-1])
        for name, member in vars(cls).items()
        if not name.startswith("_") and (callable(member) or isinstance(member, property | Reads))
    }
    profilers = {item.name: str(item.type) for item in dataclasses.fields(Profilers)}
    hooks = {name: _signature(member) for name, member in vars(UpdateObserver).items() if not name.startswith("_")}
    return {
        "protrain": {"__all__": ", ".join(sorted(protrain.__all__)), **names},
        "protrain.initialize": {"signature": _signature(protrain.initialize)},
        "protrain.Engine": dict(sorted(engine.items())),
        "Profilers (initialize's measuring functions)": profilers,
        "optimizer rules (runtime/optim/)": {
            "register": _signature(register),
            "ADAMW.state_names": ", ".join(ADAMW.state_names),
            **{f"OptimizerRule.{item.name}": str(item.type) for item in dataclasses.fields(OptimizerRule)},
            **{f"OptimizerHyper.{item.name}": str(item.type) for item in dataclasses.fields(OptimizerHyper)},
        },
        "Plan.update_mode": {"values": ", ".join(mode.value for mode in UpdateMode)},
        "UpdateObserver (runtime/observability/observer.py)": dict(sorted(hooks.items())),
    }


def surface() -> dict[str, Any]:
    return {
        **python_surface(),
        "spec": spec_surface(),
        "protrain-run": launcher_surface(),
        "protrain-run --what-if": parser_surface(build_what_if_parser()),
        "protrain-run --report": parser_surface(build_report_parser()),
        "protrain-run --plot": parser_surface(build_plot_parser()),
    }


def _changes(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    lines = []
    for part in sorted(set(old) | set(new)):
        before, after = old.get(part, {}), new.get(part, {})
        lines += [f"  {part}: added {key}: {after[key]}" for key in after if key not in before]
        lines += [f"  {part}: removed {key}" for key in before if key not in after]
        lines += [
            f"  {part}: changed {key}: {before[key]} -> {after[key]}"
            for key in after
            if key in before and before[key] != after[key]
        ]
    return lines


def test_spec_keys_and_launcher_options_match_the_snapshot() -> None:
    current = json.loads(json.dumps(surface()))  # as the file holds it: tuples become lists
    if os.environ.get(UPDATE_ENV) == "1":
        SNAPSHOT.write_text(json.dumps(current, indent=2) + "\n")
    frozen = json.loads(SNAPSHOT.read_text())
    changes = _changes(frozen, current)
    assert not changes, (
        "The spec keys or protrain-run's options changed:\n"
        + "\n".join(changes)
        + f"\nIf the change is deliberate, run `{UPDATE_ENV}=1 .venv/bin/python -m pytest "
        "tests/unit/test_surface_snapshot.py`, commit tests/unit/surface_snapshot.json with it, and "
        "run `make spec-reference` if a spec key changed."
    )


def test_the_snapshot_holds_every_key_and_option() -> None:
    """The snapshot is not vacuous: it names the spec's nested keys and both commands' options."""
    frozen = json.loads(SNAPSHOT.read_text())
    assert {"memory.ssd.n_offload", "launcher.dist_timeout_s", "optimizer.betas"} <= set(frozen["spec"])
    assert frozen["spec"]["memory.device_budget"]["default"] == '"auto"'
    launcher = {"--config", "--set", "--dry-run", "--nproc-per-node, --nproc_per_node", "--standalone", "--version"}
    assert launcher | {"script"} <= set(frozen["protrain-run"])
    assert {"--what-if", "--largest", "--seq-len"} <= set(frozen["protrain-run --what-if"])
    assert {"--report", "--ssd-path", "--json"} <= set(frozen["protrain-run --report"])
    assert {"initialize", "Engine", "ProTrainTrainer"} <= set(frozen["protrain"])
    assert {"backward", "step", "save_checkpoint", "state_dict"} <= set(frozen["protrain.Engine"])


def test_import_protrain_is_cheap_and_versioned() -> None:
    """``import protrain`` loads neither torch nor transformers (the launcher's bad-input path
    imports it); ``protrain.__version__`` is the installed distribution's version."""
    code = (
        "import sys, protrain\n"
        "heavy = sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'transformers'})\n"
        "assert not heavy, heavy\n"
        "print(protrain.__version__)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == protrain.__version__ == version("protrain")
    assert {"initialize", "Engine", "ProTrainTrainer"} <= set(dir(protrain))
