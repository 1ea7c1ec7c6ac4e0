"""The trial tells data from model: a trial on longer rows than the profile's re-profiles on them
(planner/proof/trial_data.py) instead of adding the excess to every plan as a flat correction."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import microbatch as mb
from microbatch.planner import plan
from microbatch.planner.proof.trial_data import TrialData, differs_from_profile, rows_repeated
from microbatch.profile import measure
from microbatch.workload import Workload

SHORT, LONG, VOCAB, BATCH = 8, 96, 32, 8


class TokenMLP(nn.Module):
    """Per-token blocks: activation memory grows with the rows' length."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 32)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 32)) for _ in range(2)
        )
        self.head = nn.Linear(32, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)  # type: ignore[no-any-return]


def _loss(model: nn.Module, batch: torch.Tensor) -> tuple[torch.Tensor, int]:
    logits = model(batch)
    return nn.functional.cross_entropy(logits.flatten(0, 1), batch.flatten()), int(batch.numel())


def _in_order(short_samples: int) -> Workload:
    """A dataset read in order: ``short_samples`` rows of SHORT tokens, then rows of LONG (a set
    concatenated from two sources, the long one stored last)."""
    torch.manual_seed(0)
    model = TokenMLP()
    generator = torch.Generator().manual_seed(1)
    drawn = 0

    def make_batch(size: int) -> torch.Tensor:
        nonlocal drawn
        length = SHORT if drawn + size <= short_samples else LONG
        drawn += size
        return torch.randint(0, VOCAB, (size, length), generator=generator)

    return Workload(model=model, make_batch=make_batch, loss=_loss, name="in-order")


def _step_peak(model: nn.Module, batch: torch.Tensor) -> int:
    optimizer = torch.optim.AdamW(model.parameters())
    with mb.MemoryTracker(model=model, optimizer=optimizer) as tracker:
        loss, _ = _loss(model, batch)
        loss.backward()
        optimizer.step()
    model.zero_grad(set_to_none=True)
    return tracker.peak_bytes


@pytest.fixture
def samples_the_profile_draws(one_torch_thread: None, monkeypatch: pytest.MonkeyPatch) -> int:
    # The profile repeats timed rounds while its timings are noisy (profile/measure.py): how many
    # samples it draws would then depend on the machine's load, and the long rows could begin
    # inside the profile. Without the extra rounds it draws the same samples every time.
    monkeypatch.setattr(measure, "EXTRA_ROUNDS", 0)
    counted = _in_order(10**9)
    inner = counted.make_batch
    drawn = [0]

    def counting(size: int) -> torch.Tensor:
        drawn[0] += size
        return inner(size)

    counted.make_batch = counting
    plan(counted, batch=BATCH, memory="1GiB", trial=False, policies=["none"], max_profile_micro_batch_size=4)
    return drawn[0]


def test_a_trial_on_longer_rows_reprofiles_instead_of_correcting(samples_the_profile_draws: int) -> None:
    workload = _in_order(samples_the_profile_draws)
    # Room for micro-batches of 2 long rows, not for the whole batch of long rows at once.
    budget = int(1.3 * _step_peak(TokenMLP(), torch.randint(0, VOCAB, (2, LONG))))
    options = {"policies": ["none"], "max_profile_micro_batch_size": 4}
    result = plan(workload, batch=BATCH, memory=budget, **options)
    assert any("heavier samples than the profile" in note for note in result.notes), result.notes
    assert not any("more per plan" in note for note in result.notes), result.notes
    assert result.measured_peak_bytes is not None and result.measured_peak_bytes <= budget
    # The plan holds on the long rows, by a tracker opened here: a whole window of them.
    model = workload.model
    optimizer = torch.optim.AdamW(model.parameters())
    accumulator = mb.Accumulator(model, optimizer, steps=result.steps)
    with mb.MemoryTracker(model=model, optimizer=optimizer) as tracker:
        for size in result.micro_batch_sizes:
            loss, items = _loss(model, torch.randint(0, VOCAB, (size, LONG)))
            accumulator.backward(loss, items=items)
    assert tracker.peak_bytes <= budget, (tracker.peak_bytes, budget)


def test_only_heavier_row_major_trial_data_reprofiles() -> None:
    data = TrialData()
    data.see(torch.zeros(4, SHORT, dtype=torch.long))
    data.start_trial()
    data.see(torch.zeros(2, SHORT, dtype=torch.long))
    assert not differs_from_profile(data)  # the same rows: an excess would be the model's
    data.see(torch.zeros(2, LONG, dtype=torch.long))
    assert differs_from_profile(data)
    repeated = rows_repeated(torch.arange(6).reshape(2, 3), 5)
    assert repeated[:, 0].tolist() == [0, 3, 0, 3, 0]
    data.start_trial()
    data.see({"packed": torch.zeros(1, 4 * LONG), "rows": torch.zeros(4, 0)})
    assert not differs_from_profile(data)  # a packed batch cannot be cut into rows to re-profile on
