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
    "FrontierPoint",
    "InfeasibleBudgetError",
    "MemoryTracker",
    "Micro",
    "MicrobatchError",
    "Plan",
    "Profile",
    "ResumeError",
    "TokenStats",
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
    "corrected_momentum",
    "devices",
    "distributed",
    "find_blocks",
    "format_bytes",
    "load_workload",
    "parse_bytes",
    "plan",
    "plan_cached",
    "profile_workload",
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
