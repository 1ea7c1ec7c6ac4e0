"""The HF Trainer, with a model that takes the window's item count and with one that does not."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .protocol import LossFn


class CountedLoss(nn.Module):
    """A model written the way transformers' own are: ``forward(**batch)`` returns the loss, and
    when the Trainer passes ``num_items_in_batch`` (the window's count of labels that are not
    -100) the loss is the sum over the micro-batch's items divided by it, else the mean.
    ``takes_count=False``: a model that returns its mean loss and takes no count (the Trainer reads
    ``accepts_loss_kwargs`` and then divides by the window's number of micro-batches)."""

    def __init__(
        self, model: nn.Module, loss: LossFn, unpack: Callable[[dict[str, Any]], Any], *, takes_count: bool
    ) -> None:
        super().__init__()
        self.model, self.loss, self.unpack = model, loss, unpack
        self.accepts_loss_kwargs = takes_count

    def forward(self, **batch: Any) -> dict[str, torch.Tensor]:
        window_items = batch.pop("num_items_in_batch", None)
        mean, items = self.loss(self.model, self.unpack(batch))
        return {"loss": mean if window_items is None else mean * items / window_items}


def loop_hf_trainer(
    model: Any, make_optimizer: Any, micro_batches: list[Any], *, takes_count: bool = True, **kw: Any
) -> None:
    import tempfile

    from accelerate.state import AcceleratorState, GradientState
    from transformers import Trainer, TrainingArguments

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    # The Trainer batches the rows of a dataset itself; a tuple (inputs, targets) travels as a dict.
    as_dict = not isinstance(micro_batches[0], dict)
    batches = [{"inputs": b[0], "labels": b[1]} if as_dict else b for b in micro_batches]
    rows = [{key: value[i] for key, value in b.items()} for b in batches for i in range(len(b["labels"]))]
    unpack = (lambda b: (b["inputs"], b["labels"])) if as_dict else (lambda b: b)
    optimizer = make_optimizer(model)
    with tempfile.TemporaryDirectory() as output_dir:
        args = TrainingArguments(
            output_dir=output_dir,
            per_device_train_batch_size=len(batches[0]["labels"]),
            gradient_accumulation_steps=kw["steps"],
            num_train_epochs=1,
            max_grad_norm=kw["max_grad_norm"] or 0.0,  # 0: no clipping
            train_sampling_strategy="sequential",
            remove_unused_columns=False,
            report_to="none",
            save_strategy="no",
            logging_strategy="no",
            disable_tqdm=True,
            use_cpu=not torch.cuda.is_available(),
        )
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
        trainer = Trainer(
            model=CountedLoss(model, kw["loss"], unpack, takes_count=takes_count),
            args=args,
            train_dataset=rows,  # type: ignore[arg-type]
            optimizers=(optimizer, schedule),
        )
        trainer.train()
