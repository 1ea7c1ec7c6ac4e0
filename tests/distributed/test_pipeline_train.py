"""``microbatch train --pipeline 2`` on 2 gloo processes (and 2 replicas x 2 stages on 4): the run
folder, metrics and resume of an ordinary run, and the same training as one process.

The one-process run reads the same sequences (replica 0's stream is the single process's stream,
and a 2-replica run's batch is the concatenation of both streams), so its losses agree with the
pipeline's up to float32 rounding (rtol 1e-5 on step 1; AdamW steps then carry the rounding on).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pipeline_workers as w
import pytest
import torch

from microbatch.distributed.launch import launch
from microbatch.training import TrainConfig, train

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

EXACT_FIELDS = ("step", "loss", "items", "lr", "grad_norm", "skipped", "micro_batches")
# A run's own files, with the ownership marker and the writer's lock (training/ownership.py).
RUN_FILES = (
    "metrics.jsonl", "plan.json", "loss.png", "summary.json", "checkpoint.pt", "config.json",
    ".microbatch-run.json", ".microbatch.lock",
)  # fmt: skip


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def two_stage_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("pipe2")
    launch(w.train_runs, str(root), 2, 8, 2, world_size=2, timeout_s=400.0)
    return root


def test_whole_and_resumed_runs_agree_exactly(two_stage_run: Path) -> None:
    whole, halves = read_metrics(two_stage_run / "whole"), read_metrics(two_stage_run / "halves")
    assert [m["step"] for m in whole] == [1, 2, 3, 4]
    for a, b in zip(whole, halves, strict=True):
        assert {k: a[k] for k in EXACT_FIELDS} == {k: b[k] for k in EXACT_FIELDS}
    whole_state = torch.load(two_stage_run / "whole" / "checkpoint.pt", weights_only=False)
    halves_state = torch.load(two_stage_run / "halves" / "checkpoint.pt", weights_only=False)
    for name, tensor in whole_state["model"].items():
        assert torch.equal(tensor, halves_state["model"][name]), name
    assert sorted(p.name for p in (two_stage_run / "whole").iterdir()) == sorted(RUN_FILES)
    assert "val_loss" in whole[1] and "val_loss" in whole[3]


def test_pipeline_trains_like_one_process(two_stage_run: Path, tmp_path: Path) -> None:
    single = TrainConfig(model="gpt-nano", batch=8, micro_batch=2, eval_interval=2, warmup_steps=2, steps=4)
    train(dataclasses.replace(single, out=str(tmp_path / "one")))
    ours, reference = read_metrics(two_stage_run / "whole"), read_metrics(tmp_path / "one")
    assert [m["items"] for m in ours] == [m["items"] for m in reference]
    assert [m["micro_batches"] for m in ours] == [m["micro_batches"] for m in reference] == [4] * 4
    assert ours[0]["loss"] == pytest.approx(reference[0]["loss"], rel=1e-5)
    assert ours[0]["grad_norm"] == pytest.approx(reference[0]["grad_norm"], rel=1e-5)
    for a, b in zip(ours, reference, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-3)
        assert a["val_loss" if "val_loss" in a else "loss"] == pytest.approx(
            b["val_loss" if "val_loss" in b else "loss"], rel=1e-3
        )


def test_two_replicas_of_two_stages_train_like_ddp(tmp_path: Path) -> None:
    # 4 ranks = 2 replicas x 2 stages; replica j reads the stream DDP's rank j reads, so the run
    # is the 2-rank DDP run up to float32 rounding; and its resumed halves agree exactly.
    launch(w.train_runs, str(tmp_path), 2, 8, 2, world_size=4, timeout_s=600.0)
    launch(w.train_plain, str(tmp_path), 8, 2, world_size=2, timeout_s=400.0)
    ours, ddp = read_metrics(tmp_path / "whole"), read_metrics(tmp_path / "ddp")
    assert [m["items"] for m in ours] == [m["items"] for m in ddp]
    assert [m["micro_batches"] for m in ours] == [2] * 4  # each replica's 4 sequences, 2 per micro-batch
    assert ours[0]["loss"] == pytest.approx(ddp[0]["loss"], rel=1e-5)
    assert ours[0]["grad_norm"] == pytest.approx(ddp[0]["grad_norm"], rel=1e-5)
    for a, b in zip(ours, ddp, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-3)
    for a, b in zip(ours, read_metrics(tmp_path / "halves"), strict=True):
        assert {k: a[k] for k in EXACT_FIELDS} == {k: b[k] for k in EXACT_FIELDS}
