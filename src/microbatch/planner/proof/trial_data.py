"""Telling data from model: did the trial's batch differ from the profiled ones?

``make_batch(b)`` may return different data on each call (a dataset read in order, short chat turns
first and long documents stored last). When a trial measures more than predicted *because its rows
are longer* than the profile's, the excess is no error of the memory model: adding it to every
candidate as a flat correction turns a data difference into a false "infeasible" (issue 33: a
16 x 1 trial on the long rows measured 62 MiB against 9.7 MiB predicted, and a 52 MiB correction on
every plan refused a budget that 2 x 8 fits).

So the planner compares like with like. It records the input bytes per sample of every batch the
profile drew and of every batch a trial drew. When a trial over the budget drew heavier samples than
any profiled one, the profile is measured again on the trial's heaviest batch (its rows repeated to
each size: the worst micro-batch seen so far, of any size), the later trials draw the same rows, and
no correction is added. Only a trial on data like the profile's turns its excess into a correction.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ...errors import MicrobatchError
from ...memory import format_bytes
from ...trees.batches import batch_size_of, map_tensors, tensor_bytes, tensors_of
from ...workload import Workload

MAX_REPROFILES = 2  # each one pins heavier data; the trials then draw the pinned rows


@dataclass
class TrialData:
    """The input bytes per sample the profile's batches and the current trial's batches held."""

    phase: str = "profile"  # "profile" while the profile draws, "trial" while a trial draws
    profiled_bytes_per_sample: int = 0  # the heaviest profiled batch's
    trial_bytes_per_sample: int = 0  # the heaviest batch of the last trial
    heaviest_trial_batch: Any = None
    reprofiles: int = 0

    def see(self, batch: Any) -> Any:
        """Record ``batch`` (in the current phase) and return it."""
        try:
            per_sample = tensor_bytes(batch) // max(1, batch_size_of(batch))
        except MicrobatchError:  # a batch without a sized tensor: check_make_batch refuses it
            return batch
        if self.phase == "profile":
            self.profiled_bytes_per_sample = max(self.profiled_bytes_per_sample, per_sample)
        elif per_sample > self.trial_bytes_per_sample:
            self.trial_bytes_per_sample = per_sample
            # Held only when heavier than every profiled batch (then needed to re-profile): a batch
            # held here stays alive through the trial and its bytes would count in the trial's peak.
            if per_sample > self.profiled_bytes_per_sample:
                self.heaviest_trial_batch = batch
        return batch

    def start_trial(self) -> None:
        self.phase, self.trial_bytes_per_sample, self.heaviest_trial_batch = "trial", 0, None


def recording(workload: Workload, data: TrialData) -> Workload:
    """``workload`` whose ``make_batch`` reports every batch it gives to ``data``."""
    make_batch = workload.make_batch

    def make_recorded(size: int) -> Any:
        return data.see(make_batch(size))

    return dataclasses.replace(workload, make_batch=make_recorded)


def rows_repeated(batch: Any, size: int) -> Any:
    """``size`` samples made of ``batch``'s rows, in order, cycling."""
    rows = batch_size_of(batch)
    index = torch.arange(size) % rows
    return map_tensors(lambda tensor: tensor.index_select(0, index.to(tensor.device)), batch)


def _row_major(batch: Any) -> bool:
    """Every tensor of dimension >= 1 holds the samples along dimension 0 (a packed batch does not)."""
    rows = batch_size_of(batch)
    return all(t.dim() == 0 or t.shape[0] == rows for t in tensors_of(batch))


def differs_from_profile(data: TrialData) -> bool:
    """The last trial drew samples heavier than any the profile measured, and they can be pinned."""
    return (
        data.heaviest_trial_batch is not None
        and data.trial_bytes_per_sample > data.profiled_bytes_per_sample
        and data.reprofiles < MAX_REPROFILES
        and _row_major(data.heaviest_trial_batch)
    )


def reprofile_on_trial_data(
    workload: Workload, data: TrialData, remeasure: Callable[[Workload], None], notes: list[str]
) -> Workload:
    """The workload pinned to the trial's heaviest rows, after ``remeasure(pinned)`` profiled it again.

    Call only when ``differs_from_profile(data)``.
    """
    heaviest, profiled = data.heaviest_trial_batch, data.profiled_bytes_per_sample
    drawn = data.trial_bytes_per_sample
    rows = batch_size_of(heaviest)
    pinned = dataclasses.replace(workload, make_batch=lambda size: data.see(rows_repeated(heaviest, size)))
    data.reprofiles += 1
    data.phase, data.profiled_bytes_per_sample = "profile", 0
    remeasure(pinned)
    notes.append(
        f"the trial drew heavier samples than the profile ({format_bytes(drawn)} of inputs per sample "
        f"against {format_bytes(profiled)}): a data difference, not a model error, so the profile was "
        f"measured again on the trial's {rows} heaviest rows (repeated to each micro-batch size) and the "
        "plan is made for them, with no correction added"
    )
    return pinned
