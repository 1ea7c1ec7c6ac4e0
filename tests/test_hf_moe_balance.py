"""A transformers MoE's load-balancing loss through the real Trainer: exact over the window (hf/moe.py).

One optimizer step of a tiny float64 Qwen3-MoE (8 experts, top-2, router_aux_loss_coef 0.01, eager
experts: grouped_mm fails in float64 on the CPU) at 4 x 4 on 16 variable-length samples, against the
full-batch gradient of the model's own loss (token mean + coef * aux) on the 16 samples at once.
Tolerance rtol 1e-6 / atol 1e-8: transformers computes the cross-entropy and the aux sums in float32
(tests/test_hf_exact.py). Without the window's aux (exact_loss_weighting alone) the step is off by far
more, which the second test measures.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import microbatch as mb
import test_hf_exact as exact
from microbatch import hf


def _moe() -> torch.nn.Module:
    return hf.tiny_moe("qwen3_moe", vocab_size=exact.VOCAB, num_experts=8, top_k=2, dtype=torch.float64)


def _step(tmp_path: Any, window_aux: bool) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    model = _moe()
    reference = copy.deepcopy(model)
    dataset = exact.Examples(exact.causal_example)
    trainer = exact._trainer(tmp_path, model, dataset)
    hf.exact_loss_weighting(trainer)
    if window_aux:
        assert "routing pre-pass" in (hf.exact_router_balance(trainer) or "")
    got = exact._first_step(trainer)
    want = exact.full_batch_gradient(reference, exact.collate([dataset[i] for i in range(exact.SAMPLES)]))
    return got, want


def test_window_aux_through_the_trainer_gives_the_full_batch_gradient(tmp_path: Any) -> None:
    got, want = _step(tmp_path, window_aux=True)
    assert set(got) == set(want)
    for name in want:
        torch.testing.assert_close(
            got[name], want[name], **exact.FLOAT32_LOSS_TOL, msg=lambda m, n=name: f"{n} {m}"
        )


def test_per_micro_batch_aux_is_off(tmp_path: Any) -> None:
    got, want = _step(tmp_path, window_aux=False)
    error = exact._relative_error(got, want)
    print(f"per-micro-batch aux through the Trainer: {error:.2e} relative over the whole gradient")
    assert error > 1e-5


def test_models_without_aux_are_left_alone(tmp_path: Any) -> None:
    model = hf.tiny_moe("qwen3_moe", vocab_size=exact.VOCAB, output_router_logits=False)
    trainer = exact._trainer(tmp_path, model, exact.Examples(exact.causal_example))
    assert hf.moe_routing(model) is None
    assert hf.exact_router_balance(trainer) is None


def _moe_workload(aux: bool) -> mb.Workload:
    model = hf.tiny_moe("qwen3_moe", vocab_size=exact.VOCAB, output_router_logits=aux)
    generator = torch.Generator().manual_seed(0)

    def make_batch(size: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(3, exact.VOCAB, (size, 9), generator=generator)
        return {"input_ids": ids, "labels": ids}

    def loss(module: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int]:
        return module(**batch, use_cache=False).loss, batch["labels"][:, 1:].numel()

    return mb.Workload(model=model, make_batch=make_batch, loss=loss)


def test_verify_names_the_load_balancing_loss() -> None:
    # rtol 1e-5: transformers' float32 internals (RMSNorm, router softmax) leave ~1e-7 in float64.
    report = mb.verify(_moe_workload(aux=True), batch=16, steps=4, dtype=torch.float64, rtol=1e-5)
    found = [d for d in report.diagnostics if d.kind == "router_balance"]
    assert found, [d.kind for d in report.diagnostics]
    assert "WindowLoadBalance" in found[0].message and "fit_trainer" in found[0].message
    plain = mb.verify(_moe_workload(aux=False), batch=16, steps=4, dtype=torch.float64, rtol=1e-5)
    assert not [d for d in plain.diagnostics if d.kind == "router_balance"]


def test_fit_trainer_installs_the_window_aux(tmp_path: Any) -> None:
    model = _moe()
    reference = copy.deepcopy(model)
    dataset = exact.Examples(exact.causal_example)
    trainer = exact._trainer(tmp_path, model, dataset)
    plan = hf.fit_trainer(trainer, batch=exact.SAMPLES, memory="2GiB", trial=False, policies=["none"])
    assert any("routing pre-pass" in note for note in plan.notes)
    got = exact._first_step(trainer)
    want = exact.full_batch_gradient(reference, exact.collate([dataset[i] for i in range(exact.SAMPLES)]))
    for name in want:
        torch.testing.assert_close(
            got[name], want[name], **exact.FLOAT32_LOSS_TOL, msg=lambda m, n=name: f"{n} {m}"
        )
