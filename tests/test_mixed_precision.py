"""--precision mixed for named architectures: fp32 parameters, gradients and AdamW state (16 B per
parameter), the forward under bf16 autocast; sharded by FSDP as the whole static memory is."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from microbatch.hf.configs import ModelSetup, config_workload, simulate_config_profile
from microbatch.memory.device_specs import devices
from microbatch.planner.pipeline.layouts import FSDP_UNSHARDED, PipelineContext, price
from microbatch.planner.pipeline.stage_cost import balanced_block_cuts, stage_parameters
from microbatch.planner.search.splits import WindowSizes
from microbatch.planner.target.per_rank import shard_profile
from microbatch.profile.costs import Profile
from microbatch.profile.simulate import simulation, static_costs

pytest.importorskip("transformers")
H100 = devices()["h100-80gb"]
W = 8
TINY = {
    "model_type": "llama",
    "num_hidden_layers": 3,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 256,
    "tie_word_embeddings": False,
}


@pytest.fixture
def config(tmp_path: Path) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY))
    return str(path)


class _MatmulDtypes(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.dtypes: set[torch.dtype] = set()

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        if func._overloadpacket.__name__ in {"mm", "addmm", "bmm"}:
            self.dtypes.add(out.dtype)
        return out


@pytest.mark.parametrize(("precision", "compute"), [("mixed", torch.bfloat16), ("mixed-fp16", torch.float16)])
def test_mixed_keeps_16_bytes_per_parameter_and_computes_in_16_bits(
    config: str, precision: str, compute: torch.dtype
) -> None:
    workload = config_workload(config, ModelSetup(seq_len=32, precision=precision))
    model = workload.model
    count = sum(p.numel() for p in model.parameters())
    buffer_bytes = sum(b.numel() * b.element_size() for b in model.buffers())  # RoPE's inv_freq
    with simulation(model, H100) as (mode, clock):
        static, _, _ = static_costs(model, workload.make_optimizer(), clock, cuda=False)
        ids = mode.from_tensor(torch.zeros(2, 32, dtype=torch.long))
        with _MatmulDtypes() as seen:
            workload.loss(model, {"input_ids": ids, "labels": ids})
    # 4 B fp32 parameter + 4 B fp32 gradient + 8 B AdamW state (exp_avg, exp_avg_sq in fp32)
    assert static["parameters"] == 4 * count + buffer_bytes
    assert static["gradients"] == 4 * count
    assert static["optimizer state"] == 8 * count + 4 * len(list(model.parameters()))  # + fp32 steps
    assert seen.dtypes == {compute}  # the forward's matmuls under CUDA autocast in the mode's dtype
    pure = config_workload(config, ModelSetup(seq_len=32, precision="bf16"))
    with simulation(pure.model, H100) as (_, clock):
        pure_static, _, _ = static_costs(pure.model, pure.make_optimizer(), clock, cuda=False)
    assert pure_static["parameters"] + pure_static["gradients"] == 4 * count + buffer_bytes  # 2 + 2 B


def test_fsdp_shards_the_mixed_static_memory(config: str) -> None:
    setup = ModelSetup(seq_len=32, precision="mixed")
    workload, profile = simulate_config_profile(
        config, setup, H100, max_micro_batch_size=2, policies=["none"]
    )
    count = sum(p.numel() for p in workload.model.parameters())
    # Allocator blocks of 512 B round each tensor up: within 512 B per tensor of 16 B per parameter.
    tensors = 4 * len(list(workload.model.parameters()))
    assert 16 * count <= profile.static_bytes <= 16 * count + 512 * tensors
    sharded, _ = shard_profile(
        profile, workload.model, shard="fsdp", world_size=W, spec=H100, gradient_sync="micro-batch"
    )
    assert sharded.parameter_bytes == math.ceil(profile.parameter_bytes / W)
    assert sharded.gradient_bytes == math.ceil(profile.gradient_bytes / W)
    assert sharded.optimizer_bytes == math.ceil(profile.optimizer_bytes / W)
    assert sharded.static_bytes == pytest.approx(profile.static_bytes / W, abs=3)


def test_fsdp_mixed_reads_like_fsdp2_mixed_precision_policy(config: str) -> None:
    setup = ModelSetup(seq_len=32, precision="mixed")
    workload, autocast = simulate_config_profile(
        config, setup, H100, max_micro_batch_size=2, policies=["none"]
    )
    _, policy = simulate_config_profile(
        config, setup, H100, max_micro_batch_size=2, policies=["none"], shard="fsdp"
    )
    # The same fp32 static memory, and the step's temporaries, from the full fp32 model.
    assert policy.static_bytes == autocast.static_bytes
    assert policy.step_peak_bytes == autocast.step_peak_bytes
    sharded, extras = shard_profile(
        policy, workload.model, shard="fsdp", world_size=W, spec=H100, gradient_sync="micro-batch"
    )
    parts = dict(extras)
    block = workload.model.model.layers[1]
    block_parameters = sum(p.numel() for p in block.parameters())
    # Two blocks' parameters gathered in bf16 (param_dtype), not in their fp32.
    assert parts["FSDP all-gathered parameters (2 blocks in flight)"] == 2 * 2 * block_parameters
    # Gradients reduce-scattered in fp32 (reduce_dtype): a block's fp32 gradients, allocator-rounded.
    block_gradients = 4 * block_parameters
    tensors = len(list(block.parameters()))
    assert block_gradients <= parts["FSDP reduce-scatter buffers"] <= block_gradients + 512 * tensors
    assert sharded.step_peak_bytes == math.ceil(policy.step_peak_bytes / W)
    # The blocks ran in bf16 without autocast: no cached bf16 copy of every weight kept for backward.
    kept = sum(segment.costs["none"].kept(2) for segment in policy.blocks)
    kept_autocast = sum(segment.costs["none"].kept(2) for segment in autocast.blocks)
    assert kept < kept_autocast


def test_pipeline_stages_under_fsdp_mixed_gather_bf16(config: str) -> None:
    setup = ModelSetup(seq_len=32, precision="mixed")
    workload, policy = simulate_config_profile(
        config, setup, H100, max_micro_batch_size=2, policies=["none"], shard="fsdp"
    )
    stages, replicas = 2, 4
    names = [segment.name for segment in policy.blocks]

    def parts(profile: Profile) -> list[dict[str, int]]:
        ctx = PipelineContext(
            profile, workload.model, stages, replicas, capacity_bytes=1 << 40, spec=H100, shard="fsdp"
        )
        candidate = price(ctx, "gpipe", WindowSizes(4, 2), 2, least=True)
        assert candidate is not None
        return [dict(stage) for stage in candidate.stage_parts]

    cuts = tuple(balanced_block_cuts(policy, stages, 2))
    fp32_bytes = [stage.parameter_bytes for stage in stage_parameters(workload.model, names, cuts)]
    mixed = parts(policy)
    own_dtype = parts(dataclasses.replace(policy, gather_itemsize=None))
    for stage in range(stages):
        # The stage's fp32 parameters gathered by the MixedPrecisionPolicy in bf16: half their bytes.
        assert own_dtype[stage][FSDP_UNSHARDED] == fp32_bytes[stage]
        assert mixed[stage][FSDP_UNSHARDED] == math.ceil(fp32_bytes[stage] / 2)
        assert mixed[stage]["parameters"] == math.ceil(fp32_bytes[stage] / replicas)  # fp32 shards
