"""A simulated CUDA device takes CUDA's code paths (profile/device_path.py): the optimizer's foreach
step, and transformers' causal attention with no materialized mask and no repeated K/V."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from microbatch.memory import MemoryTracker
from microbatch.memory.device_specs import devices
from microbatch.profile.simulate import SimulatedTracker, simulation

H100 = devices()["h100-80gb"]
CPU = devices()["cpu"].replace(context_bytes=0)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Linear(256, 256) for _ in range(8)))


def _zero_grads(model: nn.Module) -> None:
    for parameter in model.parameters():
        parameter.grad = torch.zeros_like(parameter)


def _step_temporaries(model: nn.Module, optimizer: torch.optim.Optimizer, tracker: MemoryTracker) -> int:
    """Peak above the live bytes of a step after the one that made the optimizer's state."""
    _zero_grads(model)
    optimizer.step()
    with tracker:
        start = tracker.current_bytes
        optimizer.step()
    return tracker.peak_bytes - start


def _simulated_step(spec: Any, **options: Any) -> int:
    model = _model()
    with simulation(model, spec):
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, **options)
        tracker = SimulatedTracker(cuda=False, model=model, optimizer=optimizer)  # live bytes, unrounded
        return _step_temporaries(model, optimizer, tracker)


def _real_step(**options: Any) -> int:
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, **options)
    return _step_temporaries(model, optimizer, MemoryTracker("cpu", model=model, optimizer=optimizer))


def test_default_adamw_steps_as_foreach_on_a_cuda_target() -> None:
    parameter_bytes = sum(p.numel() * p.element_size() for p in _model().parameters())
    largest_bytes = max(p.numel() * p.element_size() for p in _model().parameters())
    # The reference: the same optimizer with foreach=True run for real on CPU tensors. Its step
    # makes _foreach_sqrt(exp_avg_sqs), a temporary the size of all parameters, at once.
    foreach_bytes = _real_step(foreach=True)
    assert foreach_bytes >= parameter_bytes
    # AdamW() with foreach and fused unset, simulated for an H100: the path CUDA takes (foreach).
    assert _simulated_step(H100) == foreach_bytes
    # Simulated for the CPU it keeps the CPU's default, the per-tensor loop, as measured for real:
    # one parameter's worth at a time (sqrt of one exp_avg_sq, then its sum with eps).
    per_tensor_bytes = _simulated_step(CPU)
    assert per_tensor_bytes == _real_step(foreach=False)
    assert 2 * largest_bytes <= per_tensor_bytes < parameter_bytes / 2
    # What the user asks for is kept: foreach=False stays per-tensor, fused=True is fused.
    assert _simulated_step(H100, foreach=False) == per_tensor_bytes
    assert _simulated_step(H100, fused=True) == _real_step(fused=True) < largest_bytes


class _Shapes(TorchDispatchMode):
    """The shapes of the tensors every op returns."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        for value in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(value, torch.Tensor):
                self.shapes.append(tuple(value.shape))
        return out


HEADS, KV_HEADS, HEAD_DIM, BATCH = 4, 2, 16, 2


def _llama() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        num_hidden_layers=1,
        hidden_size=HEADS * HEAD_DIM,
        intermediate_size=128,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        vocab_size=100,
        use_cache=False,
        attn_implementation="sdpa",
    )
    model: nn.Module = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    return model.train()


def _forward(
    model: nn.Module, spec: Any, seq_len: int, batch: int = BATCH
) -> tuple[list[tuple[int, ...]], int]:
    """Shapes of every tensor the forward makes, and the bytes it leaves for backward."""
    with simulation(model, spec):
        ids = torch.zeros(batch, seq_len, dtype=torch.long)
        tracker = SimulatedTracker(cuda=False, model=model, optimizer=torch.optim.SGD(model.parameters()))
        with tracker, _Shapes() as shapes:
            start = tracker.current_bytes
            loss = model(input_ids=ids, labels=ids).loss
            kept = tracker.current_bytes - start
        del loss
    return shapes.shapes, kept


def test_transformers_attention_takes_the_gpu_path() -> None:
    model, seq_len, batch = _llama(), 96, BATCH
    square = [shape for shape in _forward(model, CPU, seq_len)[0] if shape.count(seq_len) >= 2]
    # On fake CPU tensors transformers takes its tracing path: a (b, 1, s, s) causal mask ...
    assert (batch, 1, seq_len, seq_len) in square
    repeated = (batch, HEADS, seq_len, HEAD_DIM)
    shapes, _ = _forward(model, H100, seq_len)
    # ... where a GPU calls SDPA with is_causal=True and enable_gqa=True: no s x s tensor at all,
    # and K/V keep their KV_HEADS heads (a repeat_kv copy would make HEADS-head K and V; the
    # only HEADS-head tensors are the query's: its projection, RoPE and the attention output).
    assert not [shape for shape in shapes if shape.count(seq_len) >= 2]
    assert (batch, KV_HEADS, seq_len, HEAD_DIM) in shapes
    cpu_shapes, _ = _forward(model, CPU, seq_len)
    assert cpu_shapes.count(repeated) > shapes.count(repeated)


def test_long_sequence_activations_grow_linearly() -> None:
    # Without an s x s term, what the forward keeps is b s c for a constant c per token: the same
    # bytes per token at 256 and at 1024 tokens (the mask that SDPA keeps, b s^2 in 16 bits, would
    # add 2 b s bytes per token: 2 b 1024 at s = 1024 against 2 b 256 at 256).
    model = _llama()
    short, long = 256, 1024
    _, short_bytes = _forward(model, H100, short)
    _, long_bytes = _forward(model, H100, long)
    assert long_bytes == pytest.approx(short_bytes * long / short, rel=1e-3)
    _, cpu_long_bytes = _forward(model, CPU, long)
    # The tracing path keeps that (b, 1, s, s) mask in bf16 for SDPA's backward, and the K/V copies.
    assert cpu_long_bytes - long_bytes >= BATCH * long * long * 2


def _tiny_deepseek_v3() -> nn.Module:
    """Multi-head latent attention (queries and keys of 24, values of 16) with grouped-GEMM experts."""
    transformers = pytest.importorskip("transformers")
    config = transformers.DeepseekV3Config(
        hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, n_shared_experts=1,
        num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1, q_lora_rank=None,
        kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, vocab_size=100,
        use_cache=False, attn_implementation="sdpa",
    )  # fmt: skip
    with torch.device("meta"):
        model: nn.Module = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    return model.train()


def test_latent_attention_runs_the_memory_efficient_kernel_on_a_gpu_target() -> None:
    """Values narrower than queries and keys (DeepSeek-V3's MLA): CUDA's flash kernel wants one head
    size, so SDPA runs the memory-efficient kernel (output and log-sum-exp kept); the CPU's fallback
    is the math path, which keeps the b h s s attention matrix. The GPU target keeps no s x s tensor
    and its forward keeps the same bytes per token at 80 and at 320 tokens."""
    model = _tiny_deepseek_v3()
    shapes, short_bytes = _forward(model, H100, 80, batch=1)
    assert not [shape for shape in shapes if shape.count(80) >= 2]
    _, long_bytes = _forward(model, H100, 320, batch=1)
    assert long_bytes == pytest.approx(short_bytes * 4, rel=1e-3)
    cpu_shapes, _ = _forward(model, CPU, 80, batch=1)
    assert [shape for shape in cpu_shapes if shape.count(80) >= 2]
