"""Hugging Face transformers causal LMs (tiny configs, random weights) under microbatch.

Tolerances. The models run in float64, but transformers' causal LM loss casts the logits to
float32 (ForCausalLMLoss: ``logits.float()``), so every per-token gradient of the model's own loss
carries float32 rounding (~6e-8 relative; measured max 1.6e-7 relative per parameter): those
comparisons use rtol 1e-5, atol 1e-7. Llama-style models also compute RMSNorm and the rotary
angles in float32. GPT-2 is float64 throughout once its loss function is replaced by the same
formula kept in float64: that comparison is sharp, rtol 1e-10, atol 1e-12. Mistakes in the count
move the gradient by 1e-2 and more on these batches.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import json
import logging
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.nn import functional as F

pytest.importorskip("transformers")

import microbatch as mb
from equivalence import accumulated_grads, assert_grads_close, full_batch_grads, grads_of, max_relative_error
from microbatch import hf
from microbatch.cli import main
from microbatch.errors import ConfigError, WorkloadError
from microbatch.planner import plan
from microbatch.trees.batches import split_batch

OWN_LOSS = {"rtol": 1e-5, "atol": 1e-7}
F64 = {"rtol": 1e-10, "atol": 1e-12}
FACTORIES = {"gpt2": hf.tiny_gpt2, "llama": hf.tiny_llama}


def varlen_batch(num: int, *, length: int = 16, vocab: int = 256, seed: int = 0) -> dict[str, torch.Tensor]:
    """Right-padded sequences of 2..length tokens; a quarter have one predicted token; some rows mask
    a prompt (labels -100 on their first tokens), as instruction fine-tuning does."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, vocab, (num, length), generator=g)
    lengths = torch.randint(2, length + 1, (num,), generator=g)
    lengths[: num // 4] = 2
    batch = hf.pad_causal_lm_batch([tokens[i, : lengths[i]] for i in range(num)])
    for row in range(num // 4, num, 3):  # masked prompts, always leaving a predicted token
        batch["labels"][row, : int(lengths[row]) // 2] = hf.IGNORE_INDEX
    return batch


def float64_causal_lm_loss(
    logits: torch.Tensor, labels: torch.Tensor, vocab_size: int, ignore_index: int = -100, **kwargs: Any
) -> torch.Tensor:
    """transformers' ForCausalLMLoss without its cast of the logits to float32."""
    shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    return F.cross_entropy(
        logits.reshape(-1, vocab_size), shift_labels.reshape(-1), ignore_index=ignore_index
    )


def cache_of(output: Any) -> Any:
    """The KV cache of a model output: ``cache`` in transformers 5, ``past_key_values`` before."""
    return output["cache"] if "cache" in output else output["past_key_values"]


# ------------------------------------------------------------------------------------------------
# Counting and batches


def test_import_microbatch_does_not_import_transformers() -> None:
    code = "import sys, microbatch, microbatch.hf; sys.exit('transformers' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


def test_count_shifted_labels() -> None:
    labels = torch.tensor([[5, 6, -100, -100], [-100, -100, 7, 8], [1, 2, 3, 4]])
    # Shifted: [6, -100, -100], [-100, 7, 8], [2, 3, 4] -> 1 + 2 + 3; the unshifted count is 8.
    assert hf.count_causal_lm_items(labels) == 6
    assert int((labels != -100).sum()) == 8
    assert hf.count_causal_lm_items(labels[:, 1:], shifted=True) == 6


def test_pad_causal_lm_batch() -> None:
    batch = hf.pad_causal_lm_batch([[3, 4, 5], torch.tensor([6, 7]), [8, 9, 10, 11, 12]], pad_token_id=1)
    assert batch["input_ids"].tolist() == [[3, 4, 5, 1, 1], [6, 7, 1, 1, 1], [8, 9, 10, 11, 12]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 1]]
    assert batch["labels"].tolist() == [[3, 4, 5, -100, -100], [6, 7, -100, -100, -100], [8, 9, 10, 11, 12]]
    cut = hf.pad_causal_lm_batch([[3, 4, 5], [6]], max_length=2)
    assert cut["input_ids"].tolist() == [[3, 4], [6, 0]]
    with pytest.raises(ConfigError, match="max_length"):
        hf.pad_causal_lm_batch([[1, 2]], max_length=1)


# ------------------------------------------------------------------------------------------------
# Exactness on the models' own token-mean loss


@pytest.mark.parametrize(
    ("family", "loss_precision"),
    [
        ("gpt2", "model"),
        ("gpt2", "float64"),
        # Llama computes RMSNorm and the rotary angles in float32 whatever the dtype
        # (LlamaRMSNorm: hidden_states.to(torch.float32)), so it allows no sharper comparison.
        ("llama", "model"),
    ],
)
def test_accumulated_equals_full_batch_token_mean(family: str, loss_precision: str) -> None:
    model = FACTORIES[family](dtype=torch.float64)
    tolerance = OWN_LOSS
    if loss_precision == "float64":
        model.loss_function = float64_causal_lm_loss
        tolerance = F64
    batch = varlen_batch(16)
    expected, full_loss = full_batch_grads(model, hf.causal_lm_loss, batch)

    for sizes in ([4, 4, 4, 4], [1, 7, 3, 5]):
        micro = split_batch(batch, sizes)
        actual, stats = accumulated_grads(model, hf.causal_lm_loss, micro)
        assert_grads_close(actual, expected, **tolerance)
        assert stats.items == hf.count_causal_lm_items(batch["labels"])
        assert stats.loss == pytest.approx(full_loss, rel=tolerance["rtol"])

    # The per-micro-batch-mean way: each micro-batch's token mean divided by the number of steps.
    naive = copy.deepcopy(model)
    micro = split_batch(batch, [4, 4, 4, 4])
    for piece in micro:
        (hf.causal_lm_loss(naive, piece)[0] / len(micro)).backward()
    gap = max_relative_error(grads_of(naive), expected)
    assert gap > 1e-2, f"per-micro-batch means should differ visibly on these lengths, gap {gap:.2e}"


def test_counting_labels_before_the_shift_is_wrong() -> None:
    """transformers #46204: counting labels != -100 before the shift mis-weighs micro-batches."""
    model = hf.tiny_gpt2(dtype=torch.float64)
    model.loss_function = float64_causal_lm_loss
    batch = varlen_batch(16)
    expected, _ = full_batch_grads(model, hf.causal_lm_loss, batch)

    def unshifted_count(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int]:
        loss, _ = hf.causal_lm_loss(model, batch)
        return loss, int((batch["labels"] != -100).sum())

    actual, _ = accumulated_grads(model, unshifted_count, split_batch(batch, [4, 4, 4, 4]))
    gap = max_relative_error(actual, expected)
    assert gap > 1e-3, f"the unshifted count should be visibly wrong, gap {gap:.2e}"


# ------------------------------------------------------------------------------------------------
# The workload


def test_workload_batch_sources() -> None:
    model = hf.tiny_gpt2()
    rows = hf.pad_causal_lm_batch([[1, 2, 3], [4, 5], [6, 7, 8, 9]])
    from_rows = hf.causal_lm_workload(model, rows)
    assert from_rows.make_batch(2)["input_ids"].tolist() == rows["input_ids"][:2].tolist()
    assert from_rows.make_batch(2)["input_ids"].tolist() == rows["input_ids"][[2, 0]].tolist()  # cycles

    from_sequences = hf.causal_lm_workload(model, [[1, 2, 3], [4, 5]], max_length=4)
    batch = from_sequences.make_batch(3)
    assert batch["input_ids"].tolist() == [[1, 2, 3, 0], [4, 5, 0, 0], [1, 2, 3, 0]]
    loss, items = from_sequences.loss(model, batch)
    assert items == 2 + 1 + 2 and loss.requires_grad

    calls: list[int] = []

    def make_batch(b: int) -> dict[str, torch.Tensor]:
        calls.append(b)
        return varlen_batch(b)

    assert hf.causal_lm_workload(model, make_batch).make_batch is make_batch
    with pytest.raises(ConfigError, match="batches must be"):
        hf.causal_lm_workload(model, 42)  # type: ignore[arg-type]


def test_loss_defaults_labels_and_drops_window_count() -> None:
    model = hf.tiny_gpt2(dtype=torch.float64)
    batch = varlen_batch(4, seed=1)
    batch["labels"] = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)  # no prompt masks
    with_labels, items = hf.causal_lm_loss(model, batch)
    without = {key: value for key, value in batch.items() if key != "labels"}
    # A Trainer-style window count would turn the mean into sum / count; it is dropped.
    without["num_items_in_batch"] = torch.tensor(1000)
    loss, same_items = hf.causal_lm_loss(model, without)
    assert same_items == items == hf.count_causal_lm_items(batch["labels"])
    torch.testing.assert_close(loss, with_labels, rtol=0, atol=0)


def test_micro_batch_without_predicted_tokens_is_refused() -> None:
    # The count stays on the device (no host sync per micro-batch): the window's end refuses it.
    model = hf.tiny_gpt2()
    batch = hf.pad_causal_lm_batch([[5], [6]], max_length=4)
    loss, items = hf.causal_lm_loss(model, batch)
    acc = mb.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1))
    acc.backward(loss, items=items)
    with pytest.raises(ConfigError, match="no predicted tokens"):
        acc.step()


def test_check_loss_refuses_a_model_whose_loss_is_not_the_shifted_mean() -> None:
    masked_lm = hf.tiny_bert()  # its loss does not shift the labels
    with pytest.raises(WorkloadError, match="shifted labels"):
        hf.causal_lm_workload(masked_lm, [[1, 2, 3]])
    hf.check_causal_lm_loss(hf.tiny_llama())  # the causal LM passes


def test_factories_are_seeded_and_leave_the_global_rng_alone() -> None:
    state = torch.get_rng_state()
    first, second = hf.tiny_llama(seed=3), hf.tiny_llama(seed=3)
    assert torch.equal(torch.get_rng_state(), state)
    for (name, a), (_, b) in zip(first.named_parameters(), second.named_parameters(), strict=True):
        assert torch.equal(a, b), name
    assert not torch.equal(next(hf.tiny_llama(seed=4).parameters()), next(first.parameters()))


def test_tiny_workload_text_batches() -> None:
    workload = hf.tiny_gpt2_workload()
    batch = workload.make_batch(8)
    mask, labels = batch["attention_mask"], batch["labels"]
    lengths = mask.sum(dim=1)
    assert int(lengths.min()) >= 2 and batch["input_ids"].shape == (8, 64)
    # Right padding only; labels are the input ids where the mask is on.
    assert torch.equal(mask, (torch.arange(64)[None, :] < lengths[:, None]).long())
    assert torch.equal(labels, batch["input_ids"].masked_fill(mask == 0, -100))
    loss, items = workload.loss(workload.model, batch)
    assert items == int(lengths.sum()) - 8  # one predicted token fewer than tokens, per row
    assert 4.0 < loss.item() < 7.0  # random weights over 256 bytes: about ln(256) = 5.55


# ------------------------------------------------------------------------------------------------
# Checkpointing


@pytest.mark.parametrize(
    ("factory", "prefix"),
    [(hf.tiny_gpt2, "transformer.h"), (hf.tiny_llama, "model.layers"), (hf.tiny_bert, "bert.encoder.layer")],
)
def test_auto_finds_the_decoder_layers(factory: Any, prefix: str) -> None:
    found = mb.find_blocks(factory(num_layers=3), "auto")
    assert [name for name, _ in found] == [f"{prefix}.{i}" for i in range(3)]


@pytest.mark.parametrize("policy", ["full", "selective", "selective-half", "offload"])
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_checkpointing_gives_the_same_gradients(family: str, policy: str) -> None:
    model = FACTORIES[family](num_layers=3, dtype=torch.float64)
    batch = varlen_batch(6)
    expected, expected_loss = full_batch_grads(model, hf.causal_lm_loss, batch)
    checkpointed = copy.deepcopy(model)
    handle = mb.checkpoint(checkpointed, blocks="auto", policy=policy)
    assert len(handle.blocks) == 3
    loss, _ = hf.causal_lm_loss(checkpointed, batch)
    loss.backward()
    assert loss.item() == expected_loss
    assert_grads_close(grads_of(checkpointed), expected, **F64)
    handle.remove()
    assert all("forward" not in module.__dict__ for module in checkpointed.modules())


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_use_cache_does_not_break_checkpointed_training(
    family: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Configs default to use_cache=True; a checkpointed layer must not write the cache twice."""
    model = FACTORIES[family](num_layers=2, dtype=torch.float64)
    assert model.config.use_cache
    batch = varlen_batch(4)
    reference = copy.deepcopy(model)
    reference(**batch, use_cache=True).loss.backward()

    checkpointed = copy.deepcopy(model)
    handle = mb.checkpoint(checkpointed, policy="full")
    with caplog.at_level(logging.INFO, logger="microbatch.checkpointing.api"):
        output = checkpointed(**batch, use_cache=True)
        output.loss.backward()
    assert_grads_close(grads_of(checkpointed), grads_of(reference), **F64)
    assert "cache is turned off" in caplog.text

    # Without gradients (evaluation, generation) the layers run as they are, cache included.
    with torch.no_grad():
        cached = checkpointed(input_ids=batch["input_ids"][:1, :5], use_cache=True)
        plain = model(input_ids=batch["input_ids"][:1, :5], use_cache=True)
    assert cache_of(cached).get_seq_length() == 5
    torch.testing.assert_close(cached.logits, plain.logits, **F64)
    handle.remove()


# ------------------------------------------------------------------------------------------------
# verify's diagnostics on a token-mean model


def test_verify_recognises_the_token_mean_and_says_how_it_is_fixed() -> None:
    # make_batch(16) hands out the 16 rows (a quarter of them with one predicted token).
    workload = hf.causal_lm_workload(hf.tiny_gpt2(), varlen_batch(16, seed=2), name="tiny-gpt2-varlen")
    report = mb.verify(workload, batch=16, steps=4)
    assert report.equivalent, str(report)
    assert report.naive_max_rel_diff > 1e-2
    (counts,) = [d for d in report.diagnostics if d.kind == "item-counts"]
    assert "(loss, items)" in counts.message and "not samples" in counts.message
    assert counts.details["items"] == list(report.items)


def test_verify_finds_a_token_mean_loss_reported_per_sample() -> None:
    """The common mistake: an HF model's loss with items = sequences (the Trainer before #34191)."""
    batch = varlen_batch(16, seed=2)
    workload = hf.causal_lm_workload(hf.tiny_gpt2(), batch, name="per-sample")
    per_sample = dataclasses.replace(
        workload, loss=lambda m, b: (hf.causal_lm_loss(m, b)[0], int(b["input_ids"].shape[0]))
    )
    report = mb.verify(per_sample, batch=16, steps=4, dtype=torch.float64)
    assert not report.equivalent
    (mismatch,) = [d for d in report.diagnostics if d.kind == "items-mismatch"]
    # The weights verify fits are the micro-batches' shares of the shifted-label count.
    counts = torch.tensor(
        [hf.count_causal_lm_items(piece["labels"]) for piece in split_batch(batch, [4] * 4)]
    )
    shares = (counts / counts.sum()).tolist()
    assert mismatch.details["fitted_weights"] == pytest.approx(shares, abs=1e-5)


# ------------------------------------------------------------------------------------------------
# The planner, the command line and the example


@pytest.mark.slow
def test_plan_a_transformers_model_and_train_exactly_with_it() -> None:
    workload = hf.tiny_gpt2_workload()
    workload.model.double()
    the_plan = plan(workload, batch=16, memory="10MiB", max_profile_micro_batch_size=8)
    assert [name for name, _ in the_plan.block_policies] == [f"transformer.h.{i}" for i in range(4)]
    assert the_plan.steps > 1 and sum(the_plan.micro_batch_sizes) == 16
    assert the_plan.measured_peak_bytes is not None and the_plan.measured_peak_bytes <= the_plan.budget_bytes

    batch = workload.make_batch(16)
    expected, _ = full_batch_grads(workload.model, hf.causal_lm_loss, batch)
    model = copy.deepcopy(workload.model)
    captured: dict[str, torch.Tensor] = {}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    optimizer.register_step_pre_hook(lambda *_: captured.update(grads_of(model)))
    acc = the_plan.apply(model, optimizer)
    for micro in acc.iterate(the_plan.split(batch)):
        loss, items = hf.causal_lm_loss(model, micro.batch)
        acc.backward(loss, items=items)
        if micro.is_last:
            acc.step()
    assert_grads_close(captured, expected, **OWN_LOSS)


def test_cli_verify_accepts_a_transformers_model(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["verify", "microbatch.hf:tiny_gpt2_workload", "--batch", "8", "--steps", "2", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["equivalent"], report
    assert report["workload"] == "tiny-gpt2"
    first_batch = hf.tiny_gpt2_workload().make_batch(8)  # verify draws the same first batch
    assert sum(report["items"]) == hf.count_causal_lm_items(first_batch["labels"])


def test_cli_plan_accepts_a_transformers_model(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["plan", "microbatch.hf:tiny_llama_workload", "--batch", "8", "--memory", "1GiB", "--json"])
    result = json.loads(capsys.readouterr().out)
    assert code == 0
    assert sorted(result["policies"]) == [f"model.layers.{i}" for i in range(4)]
    assert result["micro_batch_size"] * result["steps"] >= 8


@pytest.mark.slow
def test_example_finetunes_a_tiny_gpt2_with_a_plan(capsys: pytest.CaptureFixture[str]) -> None:
    path = Path(__file__).resolve().parents[1] / "examples" / "finetune_gpt2.py"
    spec = importlib.util.spec_from_file_location("finetune_gpt2", path)
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    before, after = example.main(["--batch", "16", "--windows", "4", "--memory", "10MiB"])
    assert after < before - 0.2, (before, after)
    printed = capsys.readouterr().out
    assert "Plan for tiny-gpt2-finetune" in printed and "window 3:" in printed
