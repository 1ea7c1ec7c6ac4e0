"""Each example's docstring gives an install command that works from the checkout (issue 25, point 5)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library from Python 3.11")

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))


def install_lines(path: Path) -> list[str]:
    docstring = ast.get_docstring(ast.parse(path.read_text())) or ""
    return [line.split("#")[0].strip() for line in docstring.splitlines() if "pip install" in line]


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda path: path.name)
def test_the_install_line_installs_the_checkout_with_extras_that_exist(path: Path) -> None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    (line,) = install_lines(path)
    words = line.split()
    assert words[:2] == ["pip", "install"]
    assert "microbatch" not in line  # not on PyPI: `pip install microbatch` fails
    targets = [word.strip("'\"") for word in words[2:]]
    local = [target for target in targets if re.fullmatch(r"\.(\[[a-z,]+\])?", target)]
    assert words[2] == "-e" and len(local) == 1, line
    for extra in re.findall(r"[a-z]+", local[0]):
        assert extra in extras, f"{path.name}: no extra {extra!r} in pyproject.toml"
    others = [target for target in targets[1:] if target not in local]
    known = {re.split(r"[<>=]", requirement)[0] for values in extras.values() for requirement in values}
    assert set(others) <= known, f"{path.name}: {others} are not in any extra"
