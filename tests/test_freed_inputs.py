"""A block's input that dies after it is credited to the block (profile/assemble.fold_freed_inputs).

transformers' Llama layer keeps an fp32 copy of its input (its RMSNorm upcasts), not the input,
so without checkpointing the caller frees each layer's input once the layer returns; the layer
after the embeddings is the exception (transformers keeps ``inputs_embeds``). The references are
a real model's peak under MemoryTracker, and the simulated model profiled whole.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

import microbatch as mb
from microbatch.hf.causal_lm import causal_lm_workload
from microbatch.hf.configs import ModelSetup, config_workload, simulate_config_profile
from microbatch.memory.device_specs import devices
from microbatch.planner.pipeline.stage_cost import solve_stage
from microbatch.profile import NONE, profile_workload
from microbatch.profile.costs import Fit, PolicyCost, SegmentProfile
from microbatch.profile.simulate import simulate_profile
from test_plan_referee import referee_peaks  # every window's peak under a tracker of its own

transformers = pytest.importorskip("transformers")

LAYERS, WIDTH, SEQ, VOCAB = 6, 256, 256, 500


def _llama() -> tuple[torch.nn.Module, Any]:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=WIDTH,
        intermediate_size=704,
        num_attention_heads=4,
        num_key_value_heads=4,
        num_hidden_layers=LAYERS,
        vocab_size=VOCAB,
        attn_implementation="sdpa",
    )
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    generator = torch.Generator().manual_seed(1)

    def make_batch(size: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, VOCAB, (size, SEQ), generator=generator)
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}

    return model, make_batch


def test_the_predicted_peak_is_the_measured_one_without_checkpointing() -> None:
    """6 layers, d 256, micro-batch 4 x 256 tokens in bf16: the plan's peak less its 1 % margin is
    the peak MemoryTracker measures in a real step (within 0.01 %); crediting nothing, it was 2 MiB
    over: 4 middle layers x 4 x 256 x 256 x 2 B."""
    model, make_batch = _llama()
    workload = causal_lm_workload(model, make_batch)
    profile = profile_workload(workload, micro_batch_sizes=(1, 2, 4), policies=[NONE], repeats=1)
    unit = 4 * SEQ * WIDTH * 2
    blocks = [segment for segment in profile.segments if segment.is_block]
    kept = [block.costs[NONE].kept(4) for block in blocks]
    assert kept[0] - kept[1] == unit  # the first layer's input (the embeddings) stays alive
    assert kept[1:-1] == [kept[1]] * (LAYERS - 2)
    assert kept[-1] == kept[0]  # the last layer's input dies in the head, after the blocks

    plan = mb.plan(workload, batch=4, memory="1GiB", profile=profile, policies=[NONE], trial=False)
    assert plan.micro_batch_sizes == (4,)
    predicted = plan.predicted_peak_bytes - dict(plan.peak_parts)["safety margin (1%)"]
    peaks = referee_peaks(workload, plan, {})  # from the second window on, the optimizer's state is held
    assert abs(predicted - peaks[-1]) <= 1e-4 * peaks[-1], (predicted, peaks)


def test_three_simulated_layers_repeated_are_the_whole_model(tmp_path: Path) -> None:
    """A 6-layer Llama config simulated as 3 layers (first, middle, last) with the middle repeated
    keeps, part by part, what the whole 6-layer simulation keeps, with and without checkpointing."""
    config = {
        "model_type": "llama",
        "num_hidden_layers": LAYERS,
        "hidden_size": 512,
        "intermediate_size": 1408,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "vocab_size": 1000,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
    }
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config), encoding="utf-8")
    spec = devices()["a100-80gb"].replace(memory_bytes=2**40)
    setup = ModelSetup(seq_len=512, precision="bf16")
    policies = [NONE, "full"]
    _, repeated = simulate_config_profile(str(path), setup, spec, max_micro_batch_size=2, policies=policies)
    whole = simulate_profile(
        config_workload(str(path), setup), spec, max_micro_batch_size=2, policies=policies
    )
    assert [s.name for s in repeated.segments] == [s.name for s in whole.segments]
    for policy in (NONE, "full"):
        for ours, theirs in zip(repeated.segments, whole.segments, strict=True):
            cost, reference = (s.costs[policy if s.is_block else NONE] for s in (ours, theirs))
            assert cost.kept(2) == reference.kept(2), (policy, ours.name)
            assert cost.peak(2) == reference.peak(2), (policy, ours.name)


def test_a_pipeline_stage_holds_the_input_it_receives() -> None:
    """A stage after the first begins at a block whose input torch's receive buffer keeps: the
    credit for that input dying after the block is taken back there, and only there."""

    def cost(kept: float) -> PolicyCost:
        return PolicyCost(
            kept_bytes=Fit.constant(kept),
            peak_bytes=Fit.constant(kept + 50),
            forward_seconds=Fit.constant(1.0),
            backward_seconds=Fit.constant(2.0),
        )

    block = SegmentProfile(
        "layers.3", True, {NONE: cost(100), "full": cost(10)}, freed_input_bytes=Fit.constant(40)
    )
    before = SegmentProfile("(before blocks)", False, {NONE: cost(5)})
    common: dict[str, Any] = {"size": 1, "gradient_bytes": 0, "held_first": 1, "held_steady": None}
    received = solve_stage([block], capacity_bytes=math.inf, policies=[NONE], **common)
    first_stage = solve_stage([before, block], capacity_bytes=math.inf, policies=[NONE], **common)
    checkpointed = solve_stage([block], capacity_bytes=100, policies=["full"], **common)  # none: 140 + 150
    assert received is not None and first_stage is not None and checkpointed is not None
    assert received.kept_bytes == 100 + 40
    assert first_stage.kept_bytes == 5 + 100
    assert dict(checkpointed.policies) == {"layers.3": "full"} and checkpointed.kept_bytes == 10
