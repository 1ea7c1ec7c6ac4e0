"""Named architectures, per-rank data-parallel memory, and the estimates beside a simulated plan."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from microbatch.cli import main
from microbatch.errors import ConfigError, InfeasibleBudgetError
from microbatch.memory.device_specs import devices
from microbatch.planner import plan
from microbatch.planner.target.per_rank import accelerate_estimate, korthikanti_bytes, shard_profile
from microbatch.profile.simulate import simulate_profile
from microbatch.workload import load_workload

pytest.importorskip("transformers")

from microbatch.hf.configs import ARCHITECTURES, ModelSetup, config_workload, simulate_config_profile

NAMES = (
    "gpt2",
    "gpt2-medium",
    "llama-3.2-1b",
    "llama-3.2-3b",
    "llama-3.1-8b",
    "llama-3.1-70b",
    "qwen2.5-0.5b",
    "qwen2.5-7b",
    "mistral-7b",
)


def test_embedded_architectures_have_their_published_sizes() -> None:
    assert set(NAMES) <= set(ARCHITECTURES)
    # Parameter counts as the model cards state them (billions, rounded).
    expected = {
        "gpt2": 0.124,
        "llama-3.2-1b": 1.24,
        "llama-3.1-8b": 8.03,
        "llama-3.1-70b": 70.55,  # 70,553,706,496: the model card's 70.6B
        "qwen2.5-0.5b": 0.494,
        "mistral-7b": 7.24,
    }
    for name, billions in expected.items():
        model = config_workload(name, ModelSetup(seq_len=16)).model
        count = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values()) / 1e9
        assert count == pytest.approx(billions, rel=0.01), name
        assert all(p.device.type == "meta" for p in model.parameters())


def test_cli_plans_an_architecture_as_json(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "gpt2", "--device", "l4", "--batch", "8", "--seq-len", "128", "--memory", "8GiB"]
    assert main([*argv, "--world-size", "2", "--shard", "fsdp", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["simulated"] and result["device_name"] == "l4" and result["shard"] == "fsdp"
    assert sum(result["micro_batch_sizes"]) * result["world_size"] == 8
    assert result["predicted_peak_bytes"] <= 8 * 1024**3
    assert result["rank_parts"]["FSDP all-gathered parameters (2 blocks in flight)"] > 0
    assert len(result["policies"]) == 12  # two layers simulated, twelve planned
    assert "Korthikanti sbh(34 + 5as/h), all layers" in result["estimates"]


def test_too_small_a_budget_says_the_minimum() -> None:
    workload, profile = simulate_config_profile(
        "gpt2", ModelSetup(seq_len=128), devices()["l4"], max_micro_batch_size=2, policies=["none", "full"]
    )
    with pytest.raises(InfeasibleBudgetError, match="Raise memory to at least") as caught:
        plan(workload, batch=4, memory="1.3GiB", profile=profile, device="l4")
    assert caught.value.minimum_bytes > 1.3 * 1024**3


def test_fsdp_shards_static_memory_and_adds_gathered_blocks() -> None:
    workload = load_workload("gpt-mini")
    spec = devices()["h100-80gb"]
    profile = simulate_profile(workload, spec, micro_batch_sizes=[1, 2], policies=["none"])
    sharded, parts = shard_profile(profile, workload.model, shard="fsdp", world_size=4, spec=spec)
    assert sharded.parameter_bytes == pytest.approx(profile.parameter_bytes / 4, abs=1)
    assert sharded.optimizer_bytes == pytest.approx(profile.optimizer_bytes / 4, abs=1)
    block = sum(p.numel() * p.element_size() for p in workload.model.blocks[0].parameters())
    assert dict(parts)["FSDP all-gathered parameters (2 blocks in flight)"] == 2 * block
    assert sharded.slack_bytes == profile.slack_bytes + sum(v for _, v in parts)
    ddp, ddp_parts = shard_profile(profile, workload.model, shard="ddp", world_size=4, spec=spec)
    assert dict(ddp_parts)["DDP gradient buckets"] == profile.gradient_bytes
    assert ddp.step_seconds > profile.step_seconds
    with pytest.raises(ConfigError, match="shard"):
        shard_profile(profile, workload.model, shard="zero3", world_size=4, spec=spec)


def test_lora_trains_only_the_adapters() -> None:
    pytest.importorskip("peft")
    workload = config_workload("gpt2", ModelSetup(seq_len=32, lora_rank=4))
    trainable = sum(p.numel() for p in workload.model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in workload.model.parameters())
    assert 0 < trainable < total / 100
    profile = simulate_profile(workload, devices()["rtx4090"], micro_batch_sizes=[1], policies=["none"])
    # Gradients of the adapters only, in their dtype (peft keeps adapters in float32 by default).
    adapter_bytes = sum(p.numel() * p.element_size() for p in workload.model.parameters() if p.requires_grad)
    assert profile.gradient_bytes == adapter_bytes
    assert profile.optimizer_bytes >= 2 * adapter_bytes  # Adam's two moments


def test_estimates_match_accelerate_and_the_formula() -> None:
    model = config_workload("gpt2", ModelSetup(seq_len=16)).model
    count = sum(p.numel() for p in model.parameters()) + sum(b.numel() for b in model.buffers())
    assert accelerate_estimate(model, "fp32") == 4 * (4 * count)  # Adam: model, grads, 2 states
    assert accelerate_estimate(model, "bf16") == 2 * (4 * count)
    s, b, h, a = 1024, 2, 768, 12
    assert korthikanti_bytes(model, seq_len=s, micro_batch_size=b) == pytest.approx(
        12 * s * b * h * (34 + 5 * a * s / h)
    )
    assert korthikanti_bytes(torch.nn.Linear(2, 2), seq_len=s, micro_batch_size=b) is None


def test_a_local_config_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / "my-model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({**ARCHITECTURES["gpt2"], "n_layer": 3}))
    argv = ["plan", str(folder / "config.json"), "--device", "l4", "--batch", "4", "--seq-len", "64"]
    assert main([*argv, "--memory", "4GiB", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["workload"].startswith("my-model") and len(result["policies"]) == 3
