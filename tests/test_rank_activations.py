"""The activations of a data-parallel plan do not depend on how many ranks share the model.

Sharding divides parameters, gradients and optimizer state by the world size W; what a micro-batch
keeps for backward is the same on every rank whatever W is. So for one micro-batch size and the
same policies, a plan's "activations" part must read the same at W = 8 and W = 128, and on CUDA,
where FSDP2's gradient shards stay reserved under every micro-batch (planner/target/per_rank.py), so must
its peak less the parts that sharding sets (the sharded static memory and the extras it adds).
Off CUDA the peak is of live tensors: at the top of a window's first backward no gradient is.
"""

from __future__ import annotations

import json
import math

import pytest

from microbatch.hf.configs import ModelSetup, simulate_config_profile
from microbatch.memory.device_specs import devices
from microbatch.planner.search.pricing import Model
from microbatch.planner.target.per_rank import HELD_SHARDS, shard_profile
from microbatch.profile.costs import Profile
from microbatch.workload import Workload
from test_mixed_precision import TINY  # the tiny Llama config both files simulate

pytest.importorskip("transformers")
H100 = devices()["h100-80gb"]
WORLD_SIZES = (8, 128)


@pytest.fixture(scope="module")
def config(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("tiny") / "config.json"
    path.write_text(json.dumps(TINY))
    return str(path)


def _beside_sharding(
    workload: Workload, profile: Profile, *, world_size: int, shard: str, sync: str, steps: int
) -> tuple[int, int]:
    """A plan's activations part and its peak less the sharded static memory and the extras."""
    sharded, extras = shard_profile(
        profile, workload.model, shard=shard, world_size=world_size, spec=H100, gradient_sync=sync
    )
    candidate = Model(sharded).evaluate([2] * steps, {})
    parts = dict(candidate.parts)
    rest = candidate.peak_bytes - sharded.static_bytes - sum(value for _, value in extras)
    return parts["activations"], rest


@pytest.mark.parametrize("device", ["h100-80gb", "cpu"])
@pytest.mark.parametrize("precision", ["mixed", "bf16"])
@pytest.mark.parametrize(
    ("shard", "sync"), [("fsdp", "micro-batch"), ("fsdp", "window"), ("ddp", "window"), ("none", "window")]
)
@pytest.mark.parametrize("steps", [1, 2])
def test_activations_do_not_grow_with_the_world_size(
    config: str, device: str, precision: str, shard: str, sync: str, steps: int
) -> None:
    setup = ModelSetup(seq_len=256, precision=precision)
    workload, profile = simulate_config_profile(
        config, setup, devices()[device], max_micro_batch_size=2, policies=["none"], shard=shard
    )
    (small, small_rest), (large, large_rest) = (
        _beside_sharding(workload, profile, world_size=w, shard=shard, sync=sync, steps=steps)
        for w in WORLD_SIZES
    )
    assert small > 0
    assert small == large
    if device != "cpu":
        assert small_rest == large_rest


@pytest.mark.parametrize("device", ["h100-80gb", "cpu"])
def test_window_sync_holds_its_unsharded_gradients_and_on_cuda_the_last_windows_shards(
    config: str, device: str
) -> None:
    setup = ModelSetup(seq_len=256, precision="mixed")
    workload, profile = simulate_config_profile(
        config, setup, devices()[device], max_micro_batch_size=2, policies=["none"], shard="fsdp"
    )
    w = WORLD_SIZES[0]
    shards = math.ceil(profile.gradient_bytes / w)
    peaks = {}
    for sync in ("window", "micro-batch"):
        sharded, extras = shard_profile(
            profile, workload.model, shard="fsdp", world_size=w, spec=H100, gradient_sync=sync
        )
        once = sync == "window"
        assert sharded.gradient_bytes == (profile.gradient_bytes if once else shards)
        held = dict(extras).get(HELD_SHARDS, 0)
        assert held == (shards if once and device != "cpu" else 0)
        assert sharded.gradients_held == (not once and device != "cpu")
        peaks[sync] = Model(sharded).evaluate([2], {}).peak_bytes
    # One micro-batch per window: the same run, which the "micro-batch" profile prices exactly;
    # "window" adds its unsharded gradients of the segments after each (and on CUDA both hold the
    # shards' pool).
    assert peaks["micro-batch"] <= peaks["window"]
