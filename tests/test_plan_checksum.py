"""Plan files prove themselves (issue 35): Plan.save writes a checksum, Plan.load checks it and
names the file when it fails; a plan without one (an older microbatch's) loads as before."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from microbatch.errors import ConfigError
from microbatch.planner import Plan


def _saved(tmp_path: Path) -> Path:
    path = tmp_path / "plan.json"
    Plan.manual(batch_size=12, micro_batch_size=4, parameters=20).save(path)
    return path


def test_a_saved_plan_carries_a_checksum_and_loads_back(tmp_path: Path) -> None:
    path = _saved(tmp_path)
    data = json.loads(path.read_text())
    assert data["checksum"].startswith("sha256:") and len(data["checksum"]) == len("sha256:") + 64
    loaded = Plan.load(path)
    assert loaded == Plan.manual(batch_size=12, micro_batch_size=4, parameters=20)
    loaded.save(path)
    assert json.loads(path.read_text())["checksum"] == data["checksum"]  # the same plan, the same sum


@pytest.mark.parametrize(
    "edit",
    [
        # each still a valid plan (the field checks pass), but not the one saved
        lambda text: text.replace('"parameters": 20', '"parameters": 2000000'),
        lambda text: text.replace('"workload": "manual"', '"workload": "gpt-nano"'),
        lambda text: text.replace('"sha256:', '"sha256:0', 1),  # the checksum itself damaged
    ],
)
def test_a_changed_plan_is_refused_naming_the_file(tmp_path: Path, edit) -> None:  # type: ignore[no-untyped-def]
    path = _saved(tmp_path)
    text = path.read_text()
    changed = edit(text)
    assert changed != text
    path.write_text(changed)
    with pytest.raises(ConfigError, match="checksum") as caught:
        Plan.load(path)
    assert str(path) in str(caught.value) and "delete the 'checksum' field" in str(caught.value)


def test_one_flipped_bit_is_refused(tmp_path: Path) -> None:
    path = _saved(tmp_path)
    raw = bytearray(path.read_bytes())
    where = raw.index(b'"parameters": 20') + len(b'"parameters": ')
    raw[where] ^= 0b1  # '2' -> '3': 30 parameters, still a valid plan, not the one saved
    path.write_bytes(bytes(raw))
    with pytest.raises(ConfigError, match="fails its checksum"):
        Plan.load(path)


def test_a_plan_without_a_checksum_still_loads(tmp_path: Path) -> None:
    path = _saved(tmp_path)
    data = json.loads(path.read_text())
    del data["checksum"]
    path.write_text(json.dumps(data, indent=2))  # as an older microbatch wrote it
    assert Plan.load(path) == Plan.manual(batch_size=12, micro_batch_size=4, parameters=20)


def test_a_field_made_invalid_is_named_before_the_checksum(tmp_path: Path) -> None:
    path = _saved(tmp_path)
    path.write_text(path.read_text().replace('"batch_size": 12', '"batch_size": "twelve"'))
    with pytest.raises(ConfigError, match="field batch_size"):
        Plan.load(path)
