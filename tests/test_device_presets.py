"""Device presets hold the total memory the card reports, cited, and refuse a budget above it
(issue 25, point 9)."""

from __future__ import annotations

import re

import pytest

import microbatch as mb
from microbatch.cli import main
from microbatch.errors import ConfigError
from microbatch.memory.device_specs import devices
from microbatch.workload import seed_linear

MIB = 2**20


@pytest.mark.parametrize("name", [name for name in devices() if name != "cpu"])
def test_each_gpu_preset_holds_the_cited_nvidia_smi_total(name: str) -> None:
    spec = devices()[name]
    cited = re.findall(r"(\d+)MiB", spec.source)
    assert cited, f"{name}: no nvidia-smi figure cited in {spec.source!r}"
    assert spec.memory_bytes == int(cited[-1]) * MIB
    assert re.search(r"[\w.-]+/[\w.-]+#\d+|public logs", spec.source), spec.source  # where it was read


def test_an_h100_80gb_is_79_6_gib_not_80() -> None:
    assert devices()["h100-80gb"].memory_bytes / 2**30 == pytest.approx(79.65, abs=0.01)


def test_a_budget_above_a_preset_is_refused_by_the_library() -> None:
    with pytest.raises(ConfigError, match=r"memory=80.00 GiB is above h100-80gb's total memory 79.65 GiB"):
        mb.plan(seed_linear(), batch=8, memory="80GiB", device="h100-80gb")


def test_a_budget_above_a_preset_is_refused_by_the_cli(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "llama-3.1-8b", "--device", "h100-80gb", "--batch", "8", "--memory", "80GiB"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "above h100-80gb's total memory 79.65 GiB (81,559 MiB, what the card reports)" in err
