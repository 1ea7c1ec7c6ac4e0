"""TRL's DPOTrainer under exact_loss_weighting / fit_trainer against the DPO loss computed here.

The reference does not go through TRL: for each of the first optimizer step's 16 preference pairs it
runs the policy and a reference model (another tiny float64 Llama, so that the margins differ from pair
to pair and the sigmoid's curvature matters) on prompt + chosen and prompt + rejected, each sequence on
its own (no padding), sums the log-probabilities of the completion tokens, and backpropagates the
sigmoid DPO loss of Rafailov et al. (2023), eq. 7, averaged over the batch's pairs:

    L = -1/P sum_i log sigmoid(beta * ((pi_c - ref_c) - (pi_r - ref_r))),   beta = 0.5,

in float64. The token ids are rebuilt from the texts (word i of the in-memory vocabulary is id i, TRL
appends <eos> to each completion) and checked against TRL's tokenization, so the reference depends on
TRL for nothing.

The trainers run with bf16=False (DPOConfig defaults to bf16 autocast, under which TRL's fused LM head
computes in bfloat16). Tolerance per element rtol 1e-5 and atol 1e-5 x the tensor's largest |element|,
and 5e-6 on the relative error of the whole gradient: TRL's fused head
(trl.kernels.ChunkedLogProbFunction) keeps its log-sum-exp statistics in float32, so each sequence's
log-probability sum carries float32 rounding before the sigmoid (measured at 4 x 4: 5.4e-7 on the whole
gradient, at most 8.7e-7 of a tensor's largest element); weighting micro-batches by their tokens instead
of their pairs is off by 11 % (measured), and the test checks the reference tells it apart.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch.nn import functional as F

from microbatch import hf

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")
trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

import test_hf_trl as sft  # noqa: E402  (after the importorskips, like the modules it needs)

TOL = {"rtol": 1e-5, "atol_of_max": 1e-5}
WHOLE_TOL = 5e-6  # |g - g_ref| / |g_ref| over all parameters
BETA = 0.5
MICRO, STEPS = 4, 4
PAIRS = MICRO * STEPS
ROWS = 24
# micro-batches of 4 pairs fit (30.9 MB predicted), of 8 do not (62.9 MB): fit_trainer plans 4 x 4.
FIT_MEMORY = "40MiB"


def _reference_model() -> Any:
    model = sft._model()
    torch.manual_seed(1)  # other weights than the policy's: margins differ from pair to pair
    for parameter in model.parameters():
        parameter.data.add_(0.05 * torch.randn_like(parameter))
    return model


def _dpo(tmp_path: Any, policy: Any, *, micro: int = MICRO, steps: int = STEPS) -> Any:
    args = trl.DPOConfig(
        output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=micro,
        gradient_accumulation_steps=steps, learning_rate=1e-3, max_grad_norm=0.0, report_to=[],
        save_strategy="no", use_cpu=True, dataloader_num_workers=0, train_sampling_strategy="sequential",
        loss_type=["sigmoid"], beta=BETA, bf16=False,
    )  # fmt: skip
    dataset = datasets.Dataset.from_dict(sft._preference_rows(ROWS))
    return trl.DPOTrainer(
        model=policy, ref_model=_reference_model(), args=args, train_dataset=dataset,
        processing_class=sft._tokenizer(),
    )  # fmt: skip


def _ids(text: str) -> list[int]:
    return [int(word[1:]) for word in text.split()]


def pairs(count: int) -> list[tuple[list[int], list[int], list[int]]]:
    """(prompt, chosen + <eos>, rejected + <eos>) token ids, rebuilt from the texts."""
    rows = sft._preference_rows(ROWS)
    return [
        (_ids(rows["prompt"][i]), [*_ids(rows["chosen"][i]), sft.EOS], [*_ids(rows["rejected"][i]), sft.EOS])
        for i in range(count)
    ]


def completion_log_prob(model: Any, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """sum_t log p(completion_t | prompt, completion_<t), one unpadded sequence."""
    ids = torch.tensor([prompt + completion])
    logits = model(input_ids=ids, use_cache=False).logits[0]
    # Position p predicts token p + 1: the completion's tokens are predicted from len(prompt) - 1 on.
    log_probs = F.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)
    return log_probs.gather(1, torch.tensor(completion)[:, None]).sum()


def dpo_gradient(
    policy: Any, reference: Any, batch: list[tuple[list[int], list[int], list[int]]]
) -> dict[str, torch.Tensor]:
    policy.train()
    policy.zero_grad()
    losses = []
    for prompt, chosen, rejected in batch:
        with torch.no_grad():
            reference_margin = completion_log_prob(reference, prompt, chosen) - completion_log_prob(
                reference, prompt, rejected
            )
        policy_margin = completion_log_prob(policy, prompt, chosen) - completion_log_prob(
            policy, prompt, rejected
        )
        losses.append(-F.logsigmoid(BETA * (policy_margin - reference_margin)))
    torch.stack(losses).mean().backward()
    return {n: p.grad.detach().clone() for n, p in policy.named_parameters() if p.grad is not None}


def _relative_error(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    difference = sum(float((got[n] - want[n]).norm() ** 2) for n in want) ** 0.5
    return difference / sum(float(w.norm() ** 2) for w in want.values()) ** 0.5


def test_trl_tokenizes_the_pairs_as_the_reference_does(tmp_path: Any) -> None:
    rows = _dpo(tmp_path, sft._model()).train_dataset
    for index, (prompt, chosen, rejected) in enumerate(pairs(ROWS)):
        assert rows[index]["prompt_ids"] == prompt
        assert rows[index]["chosen_ids"] == chosen
        assert rows[index]["rejected_ids"] == rejected


@pytest.mark.parametrize("how", ["exact_loss_weighting", "fit_trainer"])
def test_dpo_step_is_the_float64_dpo_gradient(tmp_path: Any, how: str) -> None:
    policy = sft._model()
    initial = copy.deepcopy(policy)
    trainer = _dpo(tmp_path, policy)
    if how == "fit_trainer":
        plan = hf.fit_trainer(trainer, batch=PAIRS, memory=FIT_MEMORY, trial=False, policies=["none"])
        assert plan.steps > 1 and plan.micro_batch_size * plan.steps == PAIRS
    else:
        hf.exact_loss_weighting(trainer)
    got = sft._first_step(trainer)
    want = dpo_gradient(initial, _reference_model(), pairs(PAIRS))
    assert set(got) == set(want)
    for key in want:
        # float32 rounding is relative to the tensor's scale, not to each (possibly tiny) element
        atol = TOL["atol_of_max"] * float(want[key].abs().max())
        torch.testing.assert_close(
            got[key], want[key], rtol=TOL["rtol"], atol=atol, msg=lambda m, key=key: f"{key}: {m}"
        )
    assert _relative_error(got, want) < WHOLE_TOL


def test_the_reference_tells_wrong_weightings_apart() -> None:
    # Each micro-batch's mean weighted by its tokens instead of its pairs: what a token count would do.
    batch = pairs(PAIRS)
    want = dpo_gradient(sft._model(), _reference_model(), batch)
    parts = [
        dpo_gradient(sft._model(), _reference_model(), batch[i : i + MICRO]) for i in range(0, PAIRS, MICRO)
    ]
    tokens = [sum(len(c) + len(r) for _, c, r in batch[i : i + MICRO]) for i in range(0, PAIRS, MICRO)]
    by_tokens = {
        k: sum(t * part[k] for t, part in zip(tokens, parts, strict=True)) / sum(tokens) for k in want
    }
    assert _relative_error(by_tokens, want) > 0.05  # measured 0.11
