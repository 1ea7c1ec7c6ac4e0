"""The shape of the package: its public names, and the size limits a newcomer can rely on.

Every function in src/ is at most MAX_FUNCTION_LINES lines and every module at most
MAX_MODULE_LINES, with no exceptions: a module that grows past them is split by idea.
"""

from __future__ import annotations

import ast
from pathlib import Path

import microbatch

SOURCE = Path(__file__).resolve().parents[1] / "src" / "microbatch"
MAX_FUNCTION_LINES = 60
MAX_MODULE_LINES = 450

PUBLIC_NAMES = [
    "Accumulator",
    "CachedPlan",
    "CheckpointError",
    "CheckpointHandle",
    "ConfigError",
    "DeviceSpec",
    "InfeasibleBudgetError",
    "MemoryTracker",
    "Micro",
    "MicrobatchError",
    "Plan",
    "ResumeError",
    "TokenWindows",
    "UsageError",
    "VerifyReport",
    "WindowStats",
    "Workload",
    "WorkloadError",
    "__version__",
    "cached_backward",
    "checkpoint",
    "convert_batchnorm_to_groupnorm",
    "devices",
    "distributed",
    "find_blocks",
    "format_bytes",
    "load_workload",
    "parse_bytes",
    "plan",
    "plan_cached",
    "schedules",
    "split_by_tokens",
    "verify",
]


def _modules() -> list[tuple[str, Path]]:
    return [(path.relative_to(SOURCE).as_posix(), path) for path in sorted(SOURCE.rglob("*.py"))]


def test_public_names_are_pinned() -> None:
    # A change to the public API is deliberate: update this list with it.
    assert microbatch.__all__ == PUBLIC_NAMES
    assert sorted(microbatch.__all__) == microbatch.__all__
    for name in microbatch.__all__:
        assert hasattr(microbatch, name), name


def test_the_package_docstring_points_at_the_design() -> None:
    assert microbatch.__doc__ is not None
    assert "docs/design.md" in microbatch.__doc__
    assert (SOURCE.parents[1] / "docs" / "design.md").is_file()


def test_no_module_is_too_long() -> None:
    too_long = {
        name: len(path.read_text().splitlines())
        for name, path in _modules()
        if len(path.read_text().splitlines()) > MAX_MODULE_LINES
    }
    assert not too_long, f"modules over {MAX_MODULE_LINES} lines (split by idea): {too_long}"


def test_no_function_is_too_long() -> None:
    too_long = {}
    for name, path in _modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno is not None:
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    too_long[f"{name}:{node.lineno} {node.name}"] = length
    assert not too_long, f"functions over {MAX_FUNCTION_LINES} lines: {too_long}"


# ---------------------------------------------------------------------- layers and circles

ROOT_MODULES = {"__init__.py", "__main__.py", "cli.py", "errors.py", "workload.py"}

# What each part of the package may import (besides itself), lowest layer first: measure ->
# profile -> plan -> apply -> train, with the mechanisms (accumulate, checkpointing, distributed)
# below the profile that measures them. A lower layer never imports a higher one.
ALLOWED_IMPORTS: dict[str, set[str]] = {
    "errors": set(),
    "stepping": {"errors"},
    "trees": {"errors"},
    "memory": {"errors", "trees"},
    "workload": {"errors", "memory"},
    "distributed": {"errors", "trees", "stepping"},
    "accumulate": {"errors", "trees", "memory", "distributed", "stepping"},
    "checkpointing": {"errors", "trees", "memory", "workload"},
    "verification": {"errors", "trees", "memory", "workload", "distributed", "accumulate", "stepping"},
    "profile": {
        "errors", "trees", "memory", "workload", "distributed", "accumulate", "checkpointing", "stepping",
    },
    "planner": {
        "errors", "trees", "memory", "workload", "distributed", "accumulate", "checkpointing", "profile",
        "stepping",
    },
    "models": {"errors", "trees", "memory", "workload", "checkpointing"},
    "hf": {
        "errors", "trees", "memory", "workload", "distributed", "accumulate", "checkpointing", "profile",
        "planner", "models", "stepping",
    },
    "lightning": {
        "errors", "trees", "memory", "workload", "distributed", "accumulate", "checkpointing", "planner",
        "stepping",
    },
    "training": {
        "errors", "trees", "memory", "workload", "distributed", "accumulate", "checkpointing", "profile",
        "planner", "models", "stepping",
    },
    "commands": {
        "errors", "trees", "memory", "workload", "distributed", "accumulate", "checkpointing", "profile",
        "planner", "models", "hf", "training", "verification", "stepping",
    },
    "cli": {"errors", "commands", "distributed", "__init__"},
    "__main__": {"cli"},
}  # fmt: skip


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SOURCE).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(["microbatch", *parts])


def _imports(path: Path) -> set[str]:
    """Every microbatch module ``path`` imports (at any depth of the file, TYPE_CHECKING included)."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("microbatch"))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if not target.startswith("microbatch"):
                continue
            for alias in node.names:  # `from . import distributed` imports a module
                candidate = f"{target}.{alias.name}"
                found.add(candidate if candidate in _MODULES else target)
    return found & _MODULES


_MODULES = {_module_name(path) for _, path in _modules()}


def _part(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_the_root_holds_only_the_face_the_cli_errors_and_workload() -> None:
    root = {p.name for p in SOURCE.glob("*.py")}
    assert root == ROOT_MODULES, f"modules at the root that belong in a package: {root - ROOT_MODULES}"
    for package in (p for p in SOURCE.iterdir() if p.is_dir() and p.name != "__pycache__"):
        face = package / "__init__.py"
        assert face.is_file(), f"{package.name}/ has no __init__.py"
        doc = ast.get_docstring(ast.parse(face.read_text()))
        assert doc and "May import" in doc, f"{package.name}/__init__.py: say what it owns and may import"


def test_a_lower_layer_never_imports_a_higher_one() -> None:
    wrong = []
    for _, path in _modules():
        module = _module_name(path)
        part = _part(module)
        if part == "__init__":
            continue  # the public face re-exports every layer
        allowed = ALLOWED_IMPORTS[part] | {part}
        wrong += [f"{module} -> {t}" for t in sorted(_imports(path)) if _part(t) not in allowed]
    assert not wrong, (
        "imports against the layer table (tests/test_structure.py ALLOWED_IMPORTS):\n" + "\n".join(wrong)
    )


def test_no_import_circle() -> None:
    # A package's face importing its own modules is no circle; a module importing its package's
    # face back is (`from . import name` for a name the face defines).
    graph = {_module_name(path): _imports(path) for _, path in _modules()}
    circles = _strongly_connected(graph)
    assert circles == [], f"import circles: {circles}"


def _strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm: the components of more than one module (each an import circle)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_public_name_shadows_a_module() -> None:
    """``from microbatch.X import name`` must never hide a module called ``name`` (mb.checkpoint was
    once a function hiding microbatch/checkpoint.py)."""
    import importlib

    shadowed = []
    for module in sorted(_MODULES):
        if not (SOURCE / Path(*module.split(".")[1:]) / "__init__.py").is_file() and module != "microbatch":
            continue
        face = importlib.import_module(module)
        for name in getattr(face, "__all__", []):
            if f"{module}.{name}" in _MODULES and not isinstance(getattr(face, name), type(face)):
                shadowed.append(f"{module}.{name}")
    assert not shadowed, f"public names that hide a module of the same name: {shadowed}"


# ---------------------------------------------------------------------- the planner's rooms

# planner/'s rooms, lowest first: each may import only the rooms before it (and itself). A room is
# a sub-package or a top-level module of planner/.
PLANNER_ROOMS = [
    "search",       # sizes, the peak and time model, the per-block policy solver
    "result",       # the Plan value: its checks, text, plot, apply
    "options",      # PlanOptions
    "target",       # per-rank memory, simulated devices, the reserve outside the model
    "refusals",     # what the planner refuses
    "proof",        # the trial window, prove(), which plan to try next
    "outcome",      # the request and the Plan made of a chosen candidate
    "levers",       # exact levers: the optimizer step's implementation, the loss head in chunks
    "pipeline",     # plan(..., pipeline=S)
    "planning",     # plan()
    "cached_plan",  # plan_cached()
]  # fmt: skip
MAX_PLANNER_ENTRIES = 12


def _planner_room(module: str) -> str | None:
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[1] == "planner" else None


def test_the_planner_has_few_rooms_each_importing_only_lower_ones() -> None:
    planner = SOURCE / "planner"
    entries = sorted(p.name for p in planner.iterdir() if p.name != "__pycache__")
    assert len(entries) <= MAX_PLANNER_ENTRIES, f"planner/ has {len(entries)} entries: {entries}"
    rooms = {p.stem for p in planner.iterdir() if p.name not in ("__init__.py", "__pycache__")}
    assert rooms == set(PLANNER_ROOMS), f"rooms not in PLANNER_ROOMS: {rooms ^ set(PLANNER_ROOMS)}"
    wrong = []
    for _, path in _modules():
        module = _module_name(path)
        room = _planner_room(module)
        if room is None:
            continue
        allowed = set(PLANNER_ROOMS[: PLANNER_ROOMS.index(room) + 1])
        wrong += [
            f"{module} -> {t}"
            for t in sorted(_imports(path))
            if _planner_room(t) is not None and _planner_room(t) not in allowed
        ]
    assert not wrong, "planner rooms importing higher ones (PLANNER_ROOMS):\n" + "\n".join(wrong)


def test_sub_packages_say_what_they_own_and_may_import() -> None:
    for face in sorted(SOURCE.glob("*/*/__init__.py")):
        doc = ast.get_docstring(ast.parse(face.read_text()))
        assert doc and "May import" in doc, f"{face.relative_to(SOURCE)}: say what it owns and may import"


def test_no_two_modules_share_a_file_name() -> None:
    # A module's name says what it holds; two unrelated jobs under one name (three tokens.py, a
    # pipeline.py that was the run's flow) make a reader open the wrong file.
    seen: dict[str, list[str]] = {}
    for name, path in _modules():
        if path.name not in ("__init__.py", "__main__.py"):
            seen.setdefault(path.name, []).append(name)
    shared = {file: names for file, names in seen.items() if len(names) > 1}
    assert not shared, f"modules sharing a file name: {shared}"
