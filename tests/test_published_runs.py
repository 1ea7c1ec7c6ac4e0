"""benchmarks/published.py's table of published runs: every row stated in full and sourced, and the
run's precision carried over, or refused by name with bf16 in its place (issue 20)."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

import pytest

from microbatch.checkpointing.api import POLICIES
from microbatch.hf.configs import ARCHITECTURES, PRECISIONS
from microbatch.memory.allocator import expandable_segments_enabled
from microbatch.memory.device_specs import devices
from microbatch.planner.options import SHARDS

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def _published() -> ModuleType:
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location("bench_script_published", BENCHMARKS / "published.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while it runs
    spec.loader.exec_module(module)
    return module


def test_every_row_is_a_whole_configuration_with_its_source() -> None:
    published = _published()
    assert len(published.RUNS) >= 6  # the issue asks for at least six expressible runs
    for run in published.RUNS:
        assert run.model in ARCHITECTURES or run.model in published.CONFIGS, run.name
        assert run.device in devices(), run.name
        assert run.shard in SHARDS and run.policy in ("none", *POLICIES), run.name
        assert run.world_size >= 1 and run.micro_batch >= 1 and run.steps >= 1 and run.seq_len >= 2
        assert run.source.startswith("https://github.com/"), run.name
        # tokens/s is compared only on a preset's own GPU; a peak-only row names the GPU it ran on
        if run.published_device is None:
            assert run.tokens_per_second is not None and run.tokens_per_second > 0, run.name
        else:
            assert run.peak_gib is not None and run.published_device not in devices(), run.name
        assert run.peak_kind in ("reserved", "active"), run.name
    for name, figures, source, missing in published.NOT_EXPRESSIBLE:
        assert figures and missing and source.startswith("https://"), name


def test_each_run_is_simulated_with_its_own_allocator_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    """torchtitan's H100 and B200 runs set expandable segments (their launch script, from
    2024-10-22); its A100 runs predate that. The setting holds inside the row's simulation and is
    restored after."""
    published = _published()
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "garbage_collection_threshold:0.6")
    expandable = {run.name for run in published.RUNS if run.expandable_segments}
    assert expandable == {run.name for run in published.RUNS if "H100" in run.name or "B200" in run.name}
    for run in published.RUNS:
        with published._allocator_config(run):
            assert expandable_segments_enabled() == run.expandable_segments, run.name
        assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "garbage_collection_threshold:0.6"


def test_a_precision_this_microbatch_lacks_falls_back_to_bf16_with_a_note() -> None:
    published = _published()
    mixed = next(run for run in published.RUNS if run.precision == "mixed")
    precision, note = published.precision_of(mixed)
    if "mixed" in PRECISIONS:  # once the mode exists, the row runs in it unchanged
        assert (precision, note) == ("mixed", None)
    else:
        assert precision == "bf16" and note is not None and "'mixed'" in note
    plain = next(run for run in published.RUNS if run.precision == "bf16")
    assert published.precision_of(plain) == ("bf16", None)


@pytest.mark.parametrize(("error", "shown"), [(0.1234, "+12.3 %"), (-0.05, "-5.0 %"), (None, "-")])
def test_errors_are_shown_signed(error: float | None, shown: str) -> None:
    assert _published()._percent(error) == shown


def test_mixture_of_experts_rows_are_sourced_moe_configs_with_a_published_peak() -> None:
    """Issue 36: at least two published MoE runs simulated beside their figures, each a transformers
    MoE config (experts and top-k), and the MoE runs the simulation cannot express named with what
    is missing (expert parallelism first of all)."""
    published = _published()
    moe = [run for run in published.RUNS if run.moe]
    assert len(moe) >= 2
    for run in moe:
        fields = published.CONFIGS[run.model]
        experts = next(
            fields[key] for key in ("num_experts", "n_routed_experts", "num_local_experts") if key in fields
        )
        assert 1 <= fields["num_experts_per_tok"] < experts, run.name
        assert run.peak_gib is not None and run.peak_gib > 0, run.name
    assert [run for run in published.RUNS if not run.moe]  # the dense rows stay as they were
    for name, figures, source, missing in published.NOT_EXPRESSIBLE_MOE:
        assert figures and missing and source.startswith("https://github.com/"), name
    assert any("expert parallelism" in missing for *_, missing in published.NOT_EXPRESSIBLE_MOE)
    assert "grouped" in published.MOE_NOTE and "top_k / E" in published.MOE_NOTE
