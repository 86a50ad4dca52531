"""The import arrows of DESIGN section 2 (protrain_launcher -> runtime -> profiler), the one
installed name (the folders are protrain.launcher, protrain.runtime and protrain.profiler), and the
launcher's bad-input path staying free of torch."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# repository folder -> its installed name under protrain
INSTALLED = {"protrain_launcher": "launcher", "runtime": "runtime", "profiler": "profiler"}
ALLOWED = {
    "protrain_launcher": {"protrain_launcher", "runtime"},
    "runtime": {"runtime", "profiler"},
    "profiler": {"profiler"},
}
FOLDER_OF = {installed: folder for folder, installed in INSTALLED.items()}
OLD_TOP_LEVEL = {"runtime", "profiler", "protrain_launcher"}


def imported_modules(path: Path) -> list[str]:
    """Every absolute import of the file, ``from a.b import c`` as ``a.b`` and ``a.b.c``."""
    modules = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            modules += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            modules += [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
    return modules


def repository_folder(module: str) -> str | None:
    """``protrain.runtime.entry`` -> ``runtime`` (the folder that holds it); None for others."""
    parts = module.split(".")
    return FOLDER_OF.get(parts[1]) if parts[0] == "protrain" and len(parts) > 1 else None


def imported_packages(path: Path) -> set[str]:
    return {folder for module in imported_modules(path) if (folder := repository_folder(module))}


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_imports_point_one_way(package: str) -> None:
    offenders = {
        str(path.relative_to(ROOT)): sorted(imported_packages(path) - ALLOWED[package])
        for path in (ROOT / package).rglob("*.py")
        if imported_packages(path) - ALLOWED[package]
    }
    assert not offenders, f"back edges: {offenders}"


def test_setup_cfg_installs_every_package_folder() -> None:
    """setup.cfg lists the packages by hand (package_dir maps folders to other names): a new
    folder missing from the list would be left out of the wheel."""
    import configparser

    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    listed = set(config["options"]["packages"].split())
    folders = {
        ".".join(["protrain", INSTALLED[folder], *init.parent.relative_to(ROOT / folder).parts])
        for folder in INSTALLED
        for init in (ROOT / folder).rglob("__init__.py")
        if init.parent.name != "protrain_root"
    }
    assert folders <= listed, f"not in setup.cfg's packages: {sorted(folders - listed)}"


def test_nothing_imports_the_folders_by_their_repository_names() -> None:
    """Installed, there is no top-level ``runtime``, ``profiler`` or ``protrain_launcher``: code
    that imports one works only from a checkout, and a user's ``profiler.py`` would shadow it."""
    offenders = [
        f"{path.relative_to(ROOT)} imports {module}"
        for top in (*INSTALLED, "scripts", "tests")
        for path in (ROOT / top).rglob("*.py")
        for module in imported_modules(path)
        if module.split(".")[0] in OLD_TOP_LEVEL
    ]
    assert not offenders, "\n".join(offenders)


def test_launcher_only_uses_the_spec_and_the_commands_from_runtime() -> None:
    """The spec (``config.spec``, ``config.spec_io``) and ``commands/``: the what-if planning
    command (which plans from files, without torch), the environment report (whose probes import
    torch only when they run), the memory timeline's file (``--plot``) and the stop hub's answer.
    No lookup of a runtime module in ``sys.modules`` either."""
    allowed = ("protrain.runtime.config.spec", "protrain.runtime.config.spec_io")
    offenders = [
        f"{path.name} imports {module}"
        for path in (ROOT / "protrain_launcher").rglob("*.py")
        for module in imported_modules(path)
        if module.startswith("protrain.runtime")
        and not module.startswith("protrain.runtime.commands.")
        and not any(module == name or module.startswith(name + ".") for name in allowed)
    ]
    offenders += [
        f"{path.name} looks a runtime module up in sys.modules"
        for path in (ROOT / "protrain_launcher").rglob("*.py")
        if 'sys.modules.get("protrain' in path.read_text()
    ]
    assert not offenders, "\n".join(offenders)


def launcher_import_graph() -> dict[str, set[str]]:
    """protrain_launcher's modules -> the launcher modules each imports, at any depth (an import
    inside a function counts: it closes a cycle just the same)."""
    graph: dict[str, set[str]] = {}
    for path in (ROOT / "protrain_launcher").glob("*.py"):
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            targets |= {name for name in names if name.startswith("protrain.launcher.")}
        graph[f"protrain.launcher.{path.stem}"] = targets
    return graph


def test_the_launcher_imports_have_no_cycle() -> None:
    graph = launcher_import_graph()
    done: set[str] = set()

    def visit(module: str, trail: tuple[str, ...]) -> None:
        assert module not in trail, f"import cycle: {' -> '.join((*trail, module))}"
        if module in done:
            return
        for target in sorted(graph.get(module, ())):
            visit(target, (*trail, module))
        done.add(module)

    for module in sorted(graph):
        visit(module, ())


def test_exit_codes_are_defined_once() -> None:
    """In protrain_launcher/request.py, which the entry point and the ranks import too."""
    defined = {
        f"{path.name}: {target.id}"
        for path in (ROOT / "protrain_launcher").glob("*.py")
        for node in ast.parse(path.read_text()).body
        if isinstance(node, ast.Assign)
        for target in node.targets
        if isinstance(target, ast.Name) and target.id.startswith("EXIT_")
    }
    assert defined == {
        f"request.py: EXIT_{name}" for name in ("OK", "RANK_FAILED", "BAD_INPUT", "INTERRUPTED")
    }


def test_the_plan_value_imports_nothing_of_ours() -> None:
    """profiler/plan.py is the leaf every package reads (the spec takes BlockMode from it); what
    builds plans lives in profiler/plan_builder.py."""
    assert imported_packages(ROOT / "profiler" / "plan.py") == set()


def test_reading_a_spec_loads_neither_the_search_nor_torch() -> None:
    code = (
        "import sys, protrain.runtime.config.spec\n"
        "loaded = sorted(m for m in sys.modules if m.startswith(('protrain.profiler', 'torch')))\n"
        "assert loaded == ['protrain.profiler', 'protrain.profiler.plan'], loaded"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_profiler_does_not_import_torch() -> None:
    code = "import sys, protrain.profiler.plan; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_spec_and_launcher_cli_do_not_import_torch() -> None:
    code = (
        "import sys, protrain, protrain.runtime.config.spec, protrain.runtime.config.spec_io\n"
        "import protrain.launcher.cli, protrain.launcher.what_if_cli, protrain.launcher.report_cli\n"
        "import protrain.launcher.plot_cli, protrain.runtime.commands.stop\n"
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


# Inside runtime/, every folder and loose module has a floor (docs/architecture.md draws them):
# it may import only what stands on a lower floor, never its own floor's neighbours nor anything
# above. The hardware layer and the optimizer rules are the ground; the composition root (entry)
# and the package's own __init__ are the top.
RUNTIME_FLOORS: list[set[str]] = [
    {"hw", "optim"},
    {"config", "data", "blocks"},
    {"param_groups", "model_cache", "chunks"},
    {"activations", "checkpoint", "model_io"},
    {"planning"},
    {"observability"},
    {"training"},
    {"integrations", "commands"},
    {"dry_run"},
    {"entry"},
    {"__init__", "protrain_root"},
]
FLOOR_OF = {name: floor for floor, names in enumerate(RUNTIME_FLOORS) for name in names}
MAX_LOOSE_MODULES = 5


def runtime_folder(module: str) -> str | None:
    parts = module.split(".")
    return parts[2] if parts[:2] == ["protrain", "runtime"] and len(parts) > 2 else None


def runtime_rooms() -> set[str]:
    """runtime/'s folders and loose modules, by the name an import sees."""
    runtime = ROOT / "runtime"
    folders = {path.name for path in runtime.iterdir() if path.is_dir() and (path / "__init__.py").exists()}
    return folders | {path.stem for path in runtime.glob("*.py")}


def test_every_runtime_room_has_a_floor_and_few_modules_are_loose() -> None:
    """A new folder or loose module must be placed (and so checked); at most five modules sit
    loose at the top of runtime/, the rest live in rooms."""
    assert runtime_rooms() == set(FLOOR_OF), f"place these in RUNTIME_FLOORS: {runtime_rooms() ^ set(FLOOR_OF)}"
    loose = sorted(path.name for path in (ROOT / "runtime").glob("*.py") if path.name != "__init__.py")
    assert len(loose) <= MAX_LOOSE_MODULES, f"{len(loose)} loose modules in runtime/: {loose}"


@pytest.mark.parametrize("room", sorted(FLOOR_OF))
def test_runtime_rooms_import_only_lower_floors(room: str) -> None:
    runtime = ROOT / "runtime"
    paths = list((runtime / room).rglob("*.py")) if (runtime / room).is_dir() else [runtime / f"{room}.py"]
    offenders = [
        f"{path.relative_to(ROOT)} imports {module} (floor {FLOOR_OF[target]}, not below {FLOOR_OF[room]})"
        for path in paths
        for module in imported_modules(path)
        if (target := runtime_folder(module)) is not None
        and target != room
        and target in FLOOR_OF
        and FLOOR_OF[target] >= FLOOR_OF[room]
    ]
    assert not offenders, "\n".join(offenders)


def test_nothing_of_the_runtime_imports_the_launchers_commands() -> None:
    """runtime/commands/ is the launcher's window onto the runtime, its top floor: the rest of the
    runtime (and the profiler) never imports it."""
    offenders = [
        f"{path.relative_to(ROOT)} imports {module}"
        for top in ("runtime", "profiler")
        for path in (ROOT / top).rglob("*.py")
        if "commands" not in path.relative_to(ROOT).parts
        for module in imported_modules(path)
        if module.startswith("protrain.runtime.commands")
    ]
    assert not offenders, "\n".join(offenders)


def test_the_hardware_layer_imports_nothing_else_of_ours() -> None:
    """runtime/hw/ (device, host memory, collectives, disk I/O, ...) is the floor every other
    folder stands on: it imports nothing of runtime/ but itself, nor the profiler."""
    offenders = [
        f"{path.relative_to(ROOT)} imports {module}"
        for path in (ROOT / "runtime" / "hw").rglob("*.py")
        for module in imported_modules(path)
        if module.split(".")[0] == "protrain" and not module.startswith("protrain.runtime.hw")
    ]
    assert not offenders, "\n".join(offenders)


MAX_MODULE_LINES = 450
LONG_MODULES_ALLOWED: dict[str, str] = {}
"""Modules allowed past MAX_MODULE_LINES, each with its reason: only a file that is one
declarative table (none today)."""


def test_modules_stay_short_enough_to_read() -> None:
    """One concept per module, readable at once (STYLE.md): runtime/ and profiler/ files stay
    under about 450 lines, the Engine under 400."""
    long = {
        str(path.relative_to(ROOT)): lines
        for package in ("runtime", "profiler")
        for path in (ROOT / package).rglob("*.py")
        if (lines := len(path.read_text().splitlines())) > MAX_MODULE_LINES
        and str(path.relative_to(ROOT)) not in LONG_MODULES_ALLOWED
    }
    assert not long, f"modules over {MAX_MODULE_LINES} lines (split them along a seam): {long}"
    engine_lines = len((ROOT / "runtime" / "training" / "engine.py").read_text().splitlines())
    assert engine_lines < 400, f"runtime/training/engine.py has {engine_lines} lines; the Engine stays under 400"


MAX_CLASS_LINES = 400
MAX_ENGINE_LINES = 300


def test_classes_stay_small_and_the_engine_is_a_composition() -> None:
    """A class past about 400 lines holds two concepts; the Engine, which a newcomer reads first,
    composes parts it owns (training/state.py, window.py, the PlanController...): no base class,
    under 300 lines."""
    classes = {
        f"{path.relative_to(ROOT)}::{node.name}": (node.end_lineno or node.lineno) - node.lineno + 1
        for package in ("runtime", "profiler", "protrain_launcher")
        for path in (ROOT / package).rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ClassDef)
    }
    long = {name: lines for name, lines in classes.items() if lines > MAX_CLASS_LINES}
    assert not long, f"classes over {MAX_CLASS_LINES} lines (split them along a seam): {long}"
    engine = classes["runtime/training/engine.py::Engine"]
    assert engine <= MAX_ENGINE_LINES, f"the Engine has {engine} lines; it stays under {MAX_ENGINE_LINES}"
    tree = ast.parse((ROOT / "runtime" / "training" / "engine.py").read_text())
    (engine_class,) = [node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "Engine"]
    assert not engine_class.bases, "the Engine is a composition over its parts, not a subclass"
