"""exact_loss_weighting under TRL's SFTTrainer: plain LM, completion-only, assistant-only, packing.

One optimizer step of a tiny float64 Llama (from a config; a word-level tokenizer built in memory,
nothing downloaded) at 4 x 4 on pre-tokenized variable-length sequences, compared with the
full-batch gradient: the same trainer at 16 x 1 (one micro-batch of the window's 16 rows), from the
same initial weights. The trainers run with bf16=False: SFTConfig and DPOConfig default to bf16,
under which TRL's fused LM head (trl.kernels.ChunkedLogProbFunction) computes in bfloat16, 0.2 %
away from the model's plain float64 loss on every parameter (measured; without bf16 the head is
1.4e-7 away, its float32 statistics). Independent float64 references for assistant-only loss and
DPO: test_hf_trl_chat.py and test_hf_dpo_reference.py.
Tolerance rtol 1e-6, atol 1e-8, measured 1e-9-ish: the errors this guards against (each micro-batch
weighted equally instead of each token) are percents.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from microbatch import hf
from microbatch.errors import ConfigError
from microbatch.hf.lengths import read_lengths
from test_hf_exact import Gradients  # the first optimizer step's gradient, as the optimizer sees it

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")
trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")
tokenizers = pytest.importorskip("tokenizers")

TOL = {"rtol": 1e-6, "atol": 1e-8}
# DPO sums log-probabilities over whole completions through the same float32 fused head before the
# sigmoid: measured 2e-6 relative on one element of 1536, the rest below 1e-6.
DPO_TOL = {"rtol": 1e-5, "atol": 1e-7}
VOCAB = 48
PAD, EOS = 0, 1
MICRO, STEPS = 4, 4


def _tokenizer() -> Any:
    vocab = {"<pad>": PAD, "<eos>": EOS, "<unk>": 2, **{f"w{i}": i for i in range(3, VOCAB)}}
    model = tokenizers.models.WordLevel(vocab=vocab, unk_token="<unk>")
    backend = tokenizers.Tokenizer(model)
    backend.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>"
    )


def _rows(count: int, *, mask: str | None) -> dict[str, list[list[int]]]:
    generator = torch.Generator().manual_seed(0)
    columns: dict[str, list[list[int]]] = {"input_ids": []}
    if mask:
        columns[mask] = []
    for _ in range(count):
        length = int(torch.randint(5, 17, (1,), generator=generator))
        ids = [*torch.randint(3, VOCAB, (length,), generator=generator).tolist(), EOS]
        columns["input_ids"].append(ids)
        if mask:
            prompt = int(torch.randint(1, length - 1, (1,), generator=generator))
            columns[mask].append([0] * prompt + [1] * (len(ids) - prompt))
    return columns


def _model() -> Any:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, pad_token_id=PAD, eos_token_id=EOS,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config).to(torch.float64)


def _sft(
    tmp_path: Any, rows: dict[str, list[list[int]]], *, micro: int = MICRO, steps: int = STEPS, **config: Any
) -> Any:
    args = trl.SFTConfig(
        output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=micro,
        gradient_accumulation_steps=steps, learning_rate=1e-3, max_grad_norm=0.0, report_to=[],
        save_strategy="no", use_cpu=True, dataloader_num_workers=0, train_sampling_strategy="sequential",
        logging_steps=1, bf16=False, **config,
    )  # fmt: skip
    dataset = datasets.Dataset.from_dict(rows)
    return trl.SFTTrainer(model=_model(), args=args, train_dataset=dataset, processing_class=_tokenizer())


def _first_step(trainer: Any) -> dict[str, torch.Tensor]:
    recorder = Gradients(trainer.model)
    trainer.add_callback(recorder)
    trainer.train()
    return recorder.grads


CASES = {
    "plain-lm": ({}, None),
    "completion-only": ({"completion_only_loss": True}, "completion_mask"),
    # assistant_only_loss=True asks a conversational dataset's chat template for these masks; a
    # pre-tokenized dataset gives them as is, and TRL folds them into the labels the same way.
    "assistant-only": ({}, "assistant_masks"),
    "packing-padding-free": ({"packing": True, "max_length": 24}, None),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_sft_trainer_step_is_the_full_batch_gradient(tmp_path: Any, case: str) -> None:
    config, mask = CASES[case]
    trainer = _sft(tmp_path, _rows(40, mask=mask), **config)
    if case.startswith("packing"):
        assert trainer.padding_free  # TRL's default packing ("bfd") is padding-free
        assert len(trainer.train_dataset) < 40  # rows hold several sequences
    hf.exact_loss_weighting(trainer)
    got = _first_step(trainer)
    want = _first_step(_sft(tmp_path, _rows(40, mask=mask), micro=MICRO * STEPS, steps=1, **config))
    assert set(got) == set(want)
    for key in want:
        torch.testing.assert_close(got[key], want[key], **TOL, msg=lambda m, key=key: f"{key}: {m}")


def test_fit_trainer_plans_padding_free_packing(tmp_path: Any) -> None:
    trainer = _sft(tmp_path, _rows(40, mask=None), packing=True, max_length=24)
    plan = hf.fit_trainer(trainer, batch=MICRO * STEPS, memory="2GiB", trial=False, policies=["none"])
    assert (
        trainer.args.per_device_train_batch_size * trainer.args.gradient_accumulation_steps == plan.batch_size
    )
    assert any("window's items" in note for note in plan.notes)


def _preference_rows(count: int) -> dict[str, list[str]]:
    """Prompt / chosen / rejected texts of random words of the in-memory vocabulary."""
    generator = torch.Generator().manual_seed(1)

    def text(low: int, high: int) -> str:
        length = int(torch.randint(low, high, (1,), generator=generator))
        return " ".join(f"w{i}" for i in torch.randint(3, VOCAB, (length,), generator=generator).tolist())

    rows: dict[str, list[str]] = {"prompt": [], "chosen": [], "rejected": []}
    for _ in range(count):
        rows["prompt"].append(text(2, 8))
        rows["chosen"].append(" " + text(2, 10))
        rows["rejected"].append(" " + text(2, 10))
    return rows


def _dpo(tmp_path: Any, *, micro: int, steps: int, loss_type: str = "sigmoid") -> Any:
    args = trl.DPOConfig(
        output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=micro,
        gradient_accumulation_steps=steps, learning_rate=1e-3, max_grad_norm=0.0, report_to=[],
        save_strategy="no", use_cpu=True, dataloader_num_workers=0, train_sampling_strategy="sequential",
        loss_type=[loss_type], beta=0.5, bf16=False,
    )  # fmt: skip
    dataset = datasets.Dataset.from_dict(_preference_rows(24))
    # An explicit reference model: a fresh build of the same initial weights, as TRL would load it.
    return trl.DPOTrainer(
        model=_model(), ref_model=_model(), args=args, train_dataset=dataset, processing_class=_tokenizer()
    )


def test_dpo_step_is_the_full_batch_gradient(tmp_path: Any) -> None:
    # The sigmoid DPO loss is a mean over pairs: weighted by each micro-batch's pairs it is exact.
    trainer = _dpo(tmp_path, micro=MICRO, steps=STEPS)
    assert "preference pairs" in hf.exact_loss_weighting(trainer)
    got = _first_step(trainer)
    want = _first_step(_dpo(tmp_path, micro=MICRO * STEPS, steps=1))
    assert set(got) == set(want)
    for key in want:
        torch.testing.assert_close(got[key], want[key], **DPO_TOL, msg=lambda m, key=key: f"{key}: {m}")


def test_dpo_losses_that_are_no_mean_over_pairs_are_refused_untouched(tmp_path: Any) -> None:
    trainer = _dpo(tmp_path, micro=MICRO, steps=STEPS, loss_type="sft")
    with pytest.raises(ConfigError, match="not a mean over pairs"):
        hf.fit_trainer(trainer, batch=MICRO * STEPS, memory="2GiB", trial=False)
    assert (trainer.args.per_device_train_batch_size, trainer.args.gradient_accumulation_steps) == (
        MICRO,
        STEPS,
    )
    assert "compute_loss" not in vars(trainer)


def test_fit_trainer_reads_sft_lengths_and_plans_on_the_longest(tmp_path: Any) -> None:
    """Issue 33 through TRL: SFTTrainer's tokenized dataset (a datasets.Dataset of input_ids lists) is
    read by hf/lengths.py, lengths only, and the plan is profiled on its longest samples."""
    rows = _rows(40, mask=None)
    generator = torch.Generator().manual_seed(2)
    for length in (57, 61, 59):  # a long tail stored last, as a dataset concatenated from two sources
        rows["input_ids"].append([*torch.randint(3, VOCAB, (length,), generator=generator).tolist(), EOS])
    trainer = _sft(tmp_path, rows)
    lengths = read_lengths(trainer.train_dataset)
    assert lengths is not None and not lengths.sampled
    assert list(lengths.lengths) == sorted((len(r) for r in rows["input_ids"]), reverse=True)
    plan = hf.fit_trainer(trainer, batch=MICRO * STEPS, memory="2GiB", trial=False, policies=["none"])
    longest = ", ".join(str(n) for n in lengths.longest_lengths(plan.micro_batch_size)[:8])
    assert any(f"longest samples: {longest}" in note for note in plan.notes), plan.notes
    assert lengths.lengths[:3] == (62, 60, 58)
