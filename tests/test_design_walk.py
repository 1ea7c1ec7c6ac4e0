"""docs/design.md walks one call of mb.plan() through the modules it crosses: every name it gives exists.

The walk names functions as `room/module.function` (or `module.py:function`); each must resolve to
an attribute of a microbatch module, so a rename that leaves the walk behind fails here.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

DESIGN = Path(__file__).resolve().parents[1] / "docs" / "design.md"
REFERENCE = re.compile(r"`([a-z_]+(?:/[a-z_]+)*)(?:\.py)?[.:]([A-Za-z_]+)`")


def _walk() -> str:
    text = DESIGN.read_text()
    start = text.index("## One call of `mb.plan()`, walked")
    return text[start : text.index("\n## ", start + 1)]


def _resolve(path: str, name: str) -> bool:
    dotted = path.replace("/", ".")
    for prefix in ("microbatch.planner.", "microbatch."):
        try:
            module = importlib.import_module(prefix + dotted)
        except ModuleNotFoundError:
            continue
        if name == "py" or hasattr(module, name):  # `room/module.py` names the module itself
            return True
    return False


def test_the_walk_of_plan_names_only_what_exists() -> None:
    references = REFERENCE.findall(_walk())
    assert len(references) >= 20, references  # the walk names the modules it crosses
    missing = [f"{path}.{name}" for path, name in references if not _resolve(path, name)]
    assert not missing, f"docs/design.md's walk of mb.plan() names what the code lacks: {missing}"
