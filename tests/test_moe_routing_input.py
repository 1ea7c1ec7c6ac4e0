"""A mixture of experts' routing as a stated planning input (issue 36): the simulation has no router
values, so ``moe_capacity_factor`` (1: balanced, top_k / E of the tokens per expert) sizes the rows
transformers' eager expert loop runs each expert on, and the plan's notes say which routing was
assumed. Grouped GEMMs (transformers' default) have the routed rows' shapes whatever the routing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from microbatch.errors import ConfigError
from microbatch.hf.configs import ModelSetup, simulate_config_profile
from microbatch.memory.device_specs import devices
from microbatch.planner import plan
from microbatch.profile.routing import expert_rows

pytest.importorskip("transformers")

EXPERTS, TOP_K, SEQ, BATCH = 8, 2, 64, 4
TINY_QWEN3_MOE = {
    "model_type": "qwen3_moe",
    "num_hidden_layers": 2,
    "hidden_size": 64,
    "intermediate_size": 256,
    "moe_intermediate_size": 256,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_experts": EXPERTS,
    "num_experts_per_tok": TOP_K,
    "vocab_size": 128,
    "max_position_embeddings": 128,
    "tie_word_embeddings": False,
}


def test_expert_rows_keep_every_routed_token_and_give_the_busiest_its_factor() -> None:
    tokens = BATCH * SEQ
    balanced = expert_rows(tokens, experts=EXPERTS, top_k=TOP_K)
    assert balanced == [tokens * TOP_K // EXPERTS] * EXPERTS
    skewed = expert_rows(tokens, experts=EXPERTS, top_k=TOP_K, capacity_factor=3.0)
    assert sum(skewed) == tokens * TOP_K and skewed[0] == 3 * balanced[0]
    assert max(skewed[1:]) - min(skewed[1:]) <= 1
    # an expert takes a token at most once: the busiest is capped at every token
    assert expert_rows(tokens, experts=EXPERTS, top_k=TOP_K, capacity_factor=100.0)[0] == tokens
    for bad in (0.5, float("nan"), float("inf")):
        with pytest.raises(ConfigError, match="moe_capacity_factor"):
            expert_rows(tokens, experts=EXPERTS, top_k=TOP_K, capacity_factor=bad)


def _planned(
    folder: Path, implementation: str, capacity_factor: float
) -> tuple[list[float], int, tuple[str, ...]]:
    """The simulated blocks' peaks at micro-batch BATCH, the plan's predicted peak and its notes."""
    path = folder / implementation / "config.json"
    path.parent.mkdir(exist_ok=True)
    path.write_text(
        json.dumps({**TINY_QWEN3_MOE, "experts_implementation": implementation}), encoding="utf-8"
    )
    spec = devices()["h100-80gb"]
    workload, profile = simulate_config_profile(
        str(path), ModelSetup(seq_len=SEQ, precision="bf16"), spec, max_micro_batch_size=BATCH,
        policies=["none"], moe_capacity_factor=capacity_factor,
    )  # fmt: skip
    chosen = plan(workload, batch=BATCH, memory="8GiB", policies=["none"], profile=profile, device=spec)
    assert chosen.micro_batch_size == BATCH
    blocks = [block.costs["none"].peak_bytes(BATCH) for block in profile.blocks]
    return blocks, chosen.predicted_peak_bytes, chosen.notes


def test_a_higher_capacity_factor_raises_the_eager_loops_peak_and_the_notes_say_so(tmp_path: Path) -> None:
    """The busiest expert's rows, 64 at factor 1, 128 at 2, 256 at 4: every layer's peak grows with
    them (its temporaries), and so does the plan's; what autograd keeps is the routed rows' either way."""
    runs = {factor: _planned(tmp_path, "eager", factor) for factor in (1.0, 2.0, 4.0)}
    for layer in range(len(runs[1.0][0])):
        assert runs[1.0][0][layer] < runs[2.0][0][layer] < runs[4.0][0][layer]
    assert runs[1.0][1] < runs[4.0][1]
    assert any("under balanced routing (moe_capacity_factor 1)" in note for note in runs[1.0][2])
    assert any("busiest expert taking 4 x its balanced share of 2/8" in note for note in runs[4.0][2])


def test_grouped_gemms_hold_for_any_routing_and_the_notes_say_so(tmp_path: Path) -> None:
    balanced_blocks, balanced_bytes, _ = _planned(tmp_path, "grouped_mm", 1.0)
    skewed_blocks, skewed_bytes, notes = _planned(tmp_path, "grouped_mm", 4.0)
    assert (skewed_blocks, skewed_bytes) == (balanced_blocks, balanced_bytes)
    assert any(
        "as grouped GEMMs" in note and "moe_capacity_factor 4 sizes no tensor" in note for note in notes
    )


def test_the_cli_takes_the_capacity_factor_and_the_plan_says_which_routing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from microbatch.cli import main

    path = tmp_path / "config.json"
    path.write_text(json.dumps({**TINY_QWEN3_MOE, "experts_implementation": "eager"}), encoding="utf-8")
    argv = ["plan", str(path), "--device", "h100-80gb", "--batch", "4", "--seq-len", str(SEQ)]
    assert main([*argv, "--memory", "8GiB", "--no-progress", "--moe-capacity-factor", "2"]) == 0
    assert "busiest expert taking 2 x its balanced share of 2/8 of the tokens" in capsys.readouterr().out
    assert main([*argv, "--memory", "8GiB", "--no-progress", "--moe-capacity-factor", "0.5"]) != 0
    assert "moe_capacity_factor must be a finite number >= 1" in capsys.readouterr().err
