"""PlanOptions: plan()'s options as one value, with defaults and checks in one place."""

from __future__ import annotations

import pytest

import microbatch as mb
from microbatch.errors import ConfigError
from microbatch.models.gpt import GPTConfig
from microbatch.models.workloads import gpt_workload
from microbatch.planner import PlanOptions


def test_keywords_build_the_options_and_replace_fields_of_a_given_one() -> None:
    assert PlanOptions.of(None, {}) == PlanOptions()
    base = PlanOptions(trial=False, max_trials=3)
    merged = PlanOptions.of(base, {"max_trials": 2, "even": True})
    assert (merged.trial, merged.max_trials, merged.even) == (False, 2, True)
    assert base.max_trials == 3  # frozen: the given options are not changed


def test_an_unknown_keyword_is_refused_naming_it_and_the_fields() -> None:
    with pytest.raises(ConfigError, match=r"unknown option\(s\) max_trails.*max_trials"):
        PlanOptions.of(None, {"max_trails": 2})


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("world_size", 0, "world_size must be a positive integer"),
        ("max_trials", 0, "max_trials must be a positive integer"),
        ("min_micro_batch_size", True, "min_micro_batch_size must be a positive integer"),
        ("max_profile_micro_batch_size", -1, "max_profile_micro_batch_size must be a positive"),
        ("shard", "zero3", "shard='zero3': choose one of none, ddp, fsdp"),
        ("trial", "yes", "trial must be True or False"),
    ],
)
def test_each_field_is_checked_where_it_is_defined(field: str, value: object, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        PlanOptions(**{field: value})  # type: ignore[arg-type]


def test_plan_takes_keywords_or_options_alike() -> None:
    tiny_workload = gpt_workload(GPTConfig(n_layer=2, n_head=2, n_embd=16, block_size=16), max_bytes=50_000)
    by_keywords = mb.plan(tiny_workload, batch=8, memory="64MiB", trial=False, max_profile_micro_batch_size=4)
    by_options = mb.plan(
        tiny_workload,
        batch=8,
        memory="64MiB",
        options=PlanOptions(trial=False, max_profile_micro_batch_size=4),
    )
    assert (by_keywords.micro_batch_size, by_keywords.steps) == (
        by_options.micro_batch_size,
        by_options.steps,
    )
    with pytest.raises(ConfigError, match="unknown option"):
        mb.plan(tiny_workload, batch=8, memory="64MiB", trail=False)
