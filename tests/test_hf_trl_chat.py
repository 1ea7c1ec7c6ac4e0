"""fit_trainer under TRL's SFTTrainer(assistant_only_loss=True) on a conversational dataset.

A tiny chat template written here (Jinja, with ``{% generation %}`` markers around each assistant
reply and its end-of-turn token) and a word-level tokenizer built in memory (nothing downloaded) make
SFTTrainer tokenize the conversations and mask everything but the assistant's tokens. The reference is
independent of TRL: the token ids and the assistant mask are rebuilt here from the messages (and
checked against what TRL made), and the full-batch gradient of the mean cross-entropy over the
assistant tokens of the 16 conversations is computed in float64 from a copy of the initial model.

The trainer runs with bf16=False: SFTConfig turns bf16 autocast on by default, which alone puts the
step 0.2 % away from float64 (measured, on every parameter). Tolerance rtol 1e-5, atol 1e-8 on each
parameter's gradient: SFTTrainer's loss goes through its own fused LM head
(trl.kernels.ChunkedLogProbFunction), which keeps its log-sum-exp statistics in float32 whatever the
model's dtype, so the step carries float32 rounding (1.4e-7 relative on lm_head measured); the errors
this guards against (user tokens in the loss, micro-batches weighted equally instead of tokens) are
percents.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch.nn import functional as F

from microbatch import hf
from test_hf_exact import Gradients  # the first optimizer step's gradient, as the optimizer sees it

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")
trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")
tokenizers = pytest.importorskip("tokenizers")

TOL = {"rtol": 1e-5, "atol": 1e-8}
VOCAB = 48
PAD, EOS, UNK, USER, ASSISTANT = 0, 1, 2, 3, 4
FIRST_WORD = 5
MICRO, STEPS = 4, 4
BATCH = MICRO * STEPS

# Each user turn renders "<user> words", each assistant turn "<assistant> words <eos>" with the words
# and the <eos> inside the generation markers: the assistant's tokens (end-of-turn included) are trained.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}<user> {{ message['content'] }} "
    "{% else %}<assistant> {% generation %}{{ message['content'] }} <eos>{% endgeneration %} "
    "{% endif %}"
    "{% endfor %}"
)


def _tokenizer() -> Any:
    vocab = {"<pad>": PAD, "<eos>": EOS, "<unk>": UNK, "<user>": USER, "<assistant>": ASSISTANT}
    vocab |= {f"w{i}": i for i in range(FIRST_WORD, VOCAB)}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>"
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def conversations(count: int) -> list[list[dict[str, str]]]:
    """1 - 3 exchanges of random words; replies of very different lengths, so micro-batches' counts differ."""
    generator = torch.Generator().manual_seed(2)

    def words(low: int, high: int) -> list[int]:
        length = int(torch.randint(low, high, (1,), generator=generator))
        return torch.randint(FIRST_WORD, VOCAB, (length,), generator=generator).tolist()

    result = []
    for _ in range(count):
        messages = []
        for _ in range(int(torch.randint(1, 4, (1,), generator=generator))):
            messages.append({"role": "user", "content": " ".join(f"w{i}" for i in words(2, 8))})
            messages.append({"role": "assistant", "content": " ".join(f"w{i}" for i in words(1, 12))})
        result.append(messages)
    return result


def expected_tokens(messages: list[dict[str, str]]) -> tuple[list[int], list[int]]:
    """The template's ids and assistant mask, rebuilt from the messages without the tokenizer."""
    ids: list[int] = []
    mask: list[int] = []
    for message in messages:
        words = [int(word[1:]) for word in message["content"].split()]
        if message["role"] == "user":
            ids += [USER, *words]
            mask += [0] * (1 + len(words))
        else:
            ids += [ASSISTANT, *words, EOS]
            mask += [0] + [1] * (len(words) + 1)
    return ids, mask


def _model() -> Any:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, pad_token_id=PAD, eos_token_id=EOS,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config).to(torch.float64)


def _sft(tmp_path: Any, model: Any, *, micro: int = MICRO, steps: int = STEPS) -> Any:
    args = trl.SFTConfig(
        output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=micro,
        gradient_accumulation_steps=steps, learning_rate=1e-3, max_grad_norm=0.0, report_to=[],
        save_strategy="no", use_cpu=True, dataloader_num_workers=0, train_sampling_strategy="sequential",
        assistant_only_loss=True, bf16=False,  # SFTConfig defaults to bf16 autocast, 0.2 % off float64
    )  # fmt: skip
    dataset = datasets.Dataset.from_dict({"messages": conversations(40)})
    return trl.SFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=_tokenizer())


def _first_step(trainer: Any) -> dict[str, torch.Tensor]:
    recorder = Gradients(trainer.model)
    trainer.add_callback(recorder)
    trainer.train()
    return recorder.grads


def full_batch_gradient(model: Any, rows: list[tuple[list[int], list[int]]]) -> dict[str, torch.Tensor]:
    """The mean next-token cross-entropy over every assistant token of ``rows``, one float64 batch."""
    width = max(len(ids) for ids, _ in rows)
    input_ids = torch.full((len(rows), width), PAD)
    attention = torch.zeros(len(rows), width, dtype=torch.long)
    labels = torch.full((len(rows), width), -100)
    for row, (ids, mask) in enumerate(rows):
        input_ids[row, : len(ids)] = torch.tensor(ids)
        attention[row, : len(ids)] = 1
        labels[row, : len(ids)] = torch.tensor(ids).masked_fill(torch.tensor(mask) == 0, -100)
    model.train()
    model.zero_grad()
    logits = model(input_ids=input_ids, attention_mask=attention, use_cache=False).logits
    # Position t predicts token t + 1; only assistant tokens are targets.
    F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100).backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _relative_error(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    difference = sum(float((got[n] - want[n]).norm() ** 2) for n in want) ** 0.5
    return difference / sum(float(w.norm() ** 2) for w in want.values()) ** 0.5


def test_trl_masks_what_the_template_marks_as_generation(tmp_path: Any) -> None:
    trainer = _sft(tmp_path, _model())
    rows = trainer.train_dataset  # TRL folds the template's assistant masks into the labels
    for index, messages in enumerate(conversations(40)):
        ids, mask = expected_tokens(messages)
        assert rows[index]["input_ids"] == ids
        assert rows[index]["labels"] == [i if m else -100 for i, m in zip(ids, mask, strict=True)]


@pytest.mark.parametrize("how", ["exact_loss_weighting", "fit_trainer"])
def test_assistant_only_step_is_the_full_batch_gradient(tmp_path: Any, how: str) -> None:
    model = _model()
    reference = copy.deepcopy(model)
    trainer = _sft(tmp_path, model)
    if how == "fit_trainer":
        # 20 MiB: micro-batches of 1 fit (13.3 MiB predicted), of 2 do not (28.5 MiB): 16 steps.
        plan = hf.fit_trainer(trainer, batch=BATCH, memory="20MiB", trial=False, policies=["none"])
        assert plan.steps > 1
        assert trainer.args.per_device_train_batch_size * trainer.args.gradient_accumulation_steps == BATCH
        assert any("window's items" in note for note in plan.notes)
    else:
        hf.exact_loss_weighting(trainer)
    got = _first_step(trainer)
    rows = [expected_tokens(messages) for messages in conversations(BATCH)]
    want = full_batch_gradient(reference, rows)
    assert set(got) == set(want)
    for key in want:
        torch.testing.assert_close(got[key], want[key], **TOL, msg=lambda m, key=key: f"{key}: {m}")
    # What the test can tell apart: the same batch with the users' tokens trained too.
    everything = full_batch_gradient(copy.deepcopy(reference), [(ids, [1] * len(ids)) for ids, _ in rows])
    assert _relative_error(everything, want) > 0.05


def test_equal_micro_batch_weights_would_be_off(tmp_path: Any) -> None:
    # Each of the 4 micro-batches' assistant-token mean weighted 1/4: the plain accumulation's error.
    reference = _model()
    rows = [expected_tokens(messages) for messages in conversations(BATCH)]
    want = full_batch_gradient(copy.deepcopy(reference), rows)
    parts = [
        full_batch_gradient(copy.deepcopy(reference), rows[i : i + MICRO]) for i in range(0, BATCH, MICRO)
    ]
    averaged = {key: sum(part[key] for part in parts) / STEPS for key in want}
    assert _relative_error(averaged, want) > 0.05  # measured 0.23
