"""Exact pipeline-parallel windows on torch.distributed.pipelining.

torch's schedules (ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B) divide every
micro-batch's gradient by the micro-batch count (``scale_grads=True``), which is the mean loss of the
batch only when every micro-batch carries the same number of items; and they refuse micro-batches of
different shapes (pytorch #126600). Here the schedules run with ``scale_grads=False`` and each
micro-batch's loss is weighted by its share of the whole window:

    loss_i' = mean_i * items_i / global_items,  global_items = sum over the window's micro-batches,
    its pipeline steps and the data-parallel replicas,

so the summed gradient is exactly the gradient of the mean loss over every item of the optimizer
step, whatever the token counts. A micro-batch with fewer rows is padded with rows whose labels are
all ``ignore_index`` (weight 0); a last pipeline step with fewer micro-batches is filled with
micro-batches of padding alone (pipeline_batches). Items are counted from the labels before the loss
is called: a micro-batch without items adds an exact zero and the user's loss is not called on it
(a masked mean ``(per_token * mask).sum() / mask.sum()`` would be 0/0 there, NaN in every gradient).
The stages' gradients are then summed over replicas and tied copies (stage_grads), and clipped on the
norm of the whole model's gradient. Only trainable parameters (``requires_grad``) get a gradient,
are reduced, clipped and listed for the optimizer; frozen ones are left as they are.

The window's step keeps the Accumulator's rules (stepping.step_guard): a window without items on
any rank is refused, a step that began is never repeated (backward() waits for step() to finish,
a half-made step is not retried), and every rank agrees on the window's shapes before the first
collective, so an error on one replica raises on every rank.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn

from ..errors import ConfigError, UsageError
from ..stepping.step_guard import (
    StepProgress,
    guarded_optimizer_step,
    refuse_retry,
    refuse_work_while_step_unfinished,
    require_items,
)
from .collectives import agree_on_status, all_reduce_values
from .pipeline_batches import count_items, padded_window, pipeline_steps
from .stage_grads import clip_, global_grad_norm, reduce_gradients_, tied_sets, used_parameter_names
from .stages import PipelineLayout, pipeline_layout, stage_starts
from .sync import data_parallel_kind

ScheduleName = Literal["gpipe", "1f1b", "interleaved-1f1b"]
SCHEDULES: tuple[str, ...] = ("gpipe", "1f1b", "interleaved-1f1b")
Batch = tuple[torch.Tensor, torch.Tensor]
LossFn = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class PipelineStats:
    """One window (optimizer step) of a pipeline, the same numbers on every rank.

    ``loss`` is the mean over every item of the window (all replicas); ``items`` their count;
    ``micro_batches`` this replica's real ones; ``pipeline_steps`` the schedule runs they took.
    """

    loss: float
    items: int
    micro_batches: int
    pipeline_steps: int
    grad_norm: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class Pipeline:
    """A model cut into stages over the ranks, trained window by window with exact gradients.

    ``model``: the whole model, built the same way (same seed) on every rank; each rank keeps the
    stage(s) it runs (``parameters()`` for its optimizer). ``example``: one micro-batch of model inputs
    at full size (rows x ...): the shape every micro-batch is padded to. ``loss_fn(output, labels)``
    returns (mean loss over the micro-batch's items, item count), as everywhere in microbatch; items
    are counted from the labels (not ``ignore_index``) on every rank before the step.
    ``micro_batches``: micro-batches per pipeline step (the schedule's m). ``blocks``: "auto" or the
    names of the modules where stages 1..S-1 begin; ``block_costs`` balances "auto" by seconds.
    ``prepare_stage(stage_module)`` is called on each of this rank's stage modules once it is cut
    (e.g. ``lambda m: mb.checkpoint(m, policy={"blocks.3": "full"})``: a stage module keeps the
    model's module names); ``autocast_dtype`` runs every forward and loss under
    ``torch.autocast(device, dtype)`` (bfloat16 on the CPU; backward in the dtypes the forward chose).
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        num_stages: int,
        micro_batches: int,
        example: torch.Tensor,
        loss_fn: LossFn,
        schedule: ScheduleName = "1f1b",
        blocks: Sequence[str] | str = "auto",
        block_costs: Mapping[str, float] | None = None,
        virtual_stages: int = 2,
        ignore_index: int = -100,
        prepare_stage: Callable[[nn.Module], Any] | None = None,
        autocast_dtype: torch.dtype | None = None,
    ) -> None:
        _check_options(num_stages, micro_batches, schedule, virtual_stages)
        _check_model(model)
        self.layout: PipelineLayout = pipeline_layout(num_stages)
        if schedule == "1f1b" and micro_batches < num_stages:  # after the layout: its error comes first
            raise ConfigError(
                f"schedule='1f1b' needs micro_batches >= num_stages ({micro_batches} < {num_stages}: torch's "
                "Schedule1F1B refuses fewer); use more micro-batches per pipeline step, or schedule='gpipe'"
            )
        self.schedule_name = schedule
        self.micro_batches = micro_batches
        self.ignore_index = ignore_index
        self._loss_fn = loss_fn
        self._example = example
        per_rank = virtual_stages if schedule == "interleaved-1f1b" else 1
        self.stage_indices = [self.layout.stage_index + k * num_stages for k in range(per_rank)]
        self.stage_starts = stage_starts(model, num_stages * per_rank, blocks, block_costs=block_costs)
        self._check_same_cuts()
        self.modules, self._stages, self._tied = self._build(model, num_stages * per_rank)
        self.autocast_dtype = autocast_dtype
        self.prepared = [prepare_stage(module) for module in self.modules] if prepare_stage else []
        if autocast_dtype is not None:
            for module in self.modules:
                _autocast_forward(module, example.device.type, autocast_dtype)
        self._schedule = self._make_schedule()
        self.window = 0  # windows stepped (or dropped): the index of the one in progress
        self._progress = StepProgress()
        self._awaiting_step = False
        self._global_items = 1.0
        self._loss_sum = 0.0
        self._items_seen = 0.0
        self._bad_loss = False

    # ------------------------------------------------------------------ building

    def _check_same_cuts(self) -> None:
        """Every rank of the pipeline must cut at the same blocks, or a block would run twice (or never)."""
        group = self.layout.pipe_group
        if group is None:
            return
        seen: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(seen, list(self.stage_starts), group=group)
        if any(cuts != seen[0] for cuts in seen):
            raise ConfigError(
                f"the pipeline's ranks cut the model at different blocks ({seen}); pass the same "
                "blocks=[...] on every rank (a cut balanced by measured block_costs differs from rank "
                "to rank: measure on one rank and send its choice)"
            )

    def _build(self, model: nn.Module, total_stages: int) -> tuple[list[nn.Module], list[Any], list[Any]]:
        from torch.distributed.pipelining import SplitPoint, pipeline

        device = self._example.device
        split_spec = {name: SplitPoint.BEGINNING for name in self.stage_starts}
        pipe = pipeline(model, mb_args=(self._example,), split_spec=split_spec)
        if pipe.num_stages != total_stages:
            raise ConfigError(
                f"the model traced into {pipe.num_stages} stages, not {total_stages}: the cut points "
                f"{self.stage_starts} must be modules the forward calls once, in order"
            )
        every_module = [pipe.get_stage_module(i) for i in range(total_stages)]
        trainable = {name: p.requires_grad for name, p in model.named_parameters(remove_duplicate=False)}
        for module in every_module:
            _generated_code_(module)
            for name, parameter in module.named_parameters(remove_duplicate=False):
                parameter.requires_grad_(trainable.get(name, parameter.requires_grad))  # frozen stays frozen
        stages = [pipe.build_stage(i, device, group=self.layout.pipe_group) for i in self.stage_indices]
        size = self.layout.num_stages
        tied = tied_sets(
            model, every_module, self.stage_indices, lambda s: s % size, self.layout.num_replicas, size
        )
        return [every_module[i] for i in self.stage_indices], stages, tied

    def _make_schedule(self) -> Any:
        from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

        common: dict[str, Any] = {
            "n_microbatches": self.micro_batches,
            "loss_fn": self._scaled_loss,
            "scale_grads": False,
        }
        if self.schedule_name == "interleaved-1f1b":
            return ScheduleInterleaved1F1B(self._stages, **common)
        single = ScheduleGPipe if self.schedule_name == "gpipe" else Schedule1F1B
        return single(self._stages[0], **common)

    def named_weights(self) -> Iterator[tuple[str, nn.Parameter]]:
        """Every parameter this rank's stages use (tied copies included, frozen ones too), by model name:
        for copying weights into or out of the stages."""
        seen: set[int] = set()
        for module in self.modules:
            used = used_parameter_names(module)
            for name, parameter in module.named_parameters(remove_duplicate=False):
                if name in used and id(parameter) not in seen:
                    seen.add(id(parameter))
                    yield name, parameter

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """This rank's trained parameters (its stages' used ones that require grad; tied copies
        included), by model name. Frozen ones get no gradient and are not handed to the optimizer."""
        return ((name, p) for name, p in self.named_weights() if p.requires_grad)

    def parameters(self) -> list[nn.Parameter]:
        return [parameter for _, parameter in self.named_parameters()]

    @property
    def has_first_stage(self) -> bool:
        return 0 in self.stage_indices

    @property
    def has_last_stage(self) -> bool:
        return self.layout.num_stages * len(self.stage_indices) - 1 in self.stage_indices

    # ------------------------------------------------------------------ one window

    def _scaled_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The schedule's loss for one micro-batch: mean_i * items_i / global_items (see the top).

        A micro-batch without items (all padding) is an exact zero: the loss is not called on it."""
        if count_items(target, self.ignore_index) == 0:
            return output.sum() * 0.0
        with self._autocast():
            result = self._loss_fn(output, target)
        if not (isinstance(result, tuple) and len(result) == 2):
            # Raising here would leave the other stages waiting; the window's end raises on every rank.
            self._bad_loss = True
            return output.sum() * 0.0
        mean, items = result
        if mean.dtype in (torch.bfloat16, torch.float16):  # an autocast loss: weighted in float32
            mean = mean.float()
        weighted = mean * items
        self._loss_sum += float(weighted.detach())
        self._items_seen += float(items)
        return weighted / self._global_items

    def backward(self, batches: Sequence[Batch], *, max_grad_norm: float | None = None) -> PipelineStats:
        """Forward and backward over this replica's micro-batches of one window (one optimizer step).

        On return every trained parameter's ``.grad`` holds its part of the gradient of the window's
        global mean loss (summed over replicas and tied copies), clipped when ``max_grad_norm`` is set.
        Every rank of a replica passes the same ``batches``; replicas pass their own (a replica whose
        data has run out passes [] and adds nothing, while the others finish the window). Then
        ``step(optimizer)``: a second backward() before it is refused (it would add two windows).
        """
        self._check_window_start()
        padded, problem = padded_window(batches, self._example, self.ignore_index)
        # Agreed before any collective: a shape error on one replica raises on every rank.
        agree_on_status(problem, what=f"Pipeline.backward() of window {self.window}")
        local_items = float(sum(count_items(labels, self.ignore_index) for _, labels in padded))
        global_items = self._sum_over_replicas(local_items)
        require_items(global_items, "Pipeline.backward()")
        self._global_items = global_items
        self._loss_sum, self._items_seen, self._bad_loss = 0.0, 0.0, False
        self._awaiting_step = True
        steps = pipeline_steps(padded, self.micro_batches, self.ignore_index)
        for chunk in steps:
            self._run_step(chunk)
        loss_sum = self._check_window(local_items)
        parameters = self.parameters()
        for parameter in parameters:
            if parameter.grad is None:  # no micro-batch here: every replica still reduces the same list
                parameter.grad = torch.zeros_like(parameter)
        reduce_gradients_(parameters, self._tied, self.layout.stage_group)
        norm = global_grad_norm(parameters, self._tied, self.layout.pipe_group)
        if max_grad_norm is not None:
            clip_(parameters, norm, max_grad_norm)
        return PipelineStats(
            loss=loss_sum / self._global_items,
            items=int(global_items),
            micro_batches=len(batches),
            pipeline_steps=len(steps),
            grad_norm=norm,
        )

    def _check_window_start(self) -> None:
        refuse_work_while_step_unfinished(
            self._progress,
            "Pipeline.backward()",
            self.window,
            fix="call pipe.step(optimizer) again (or pipe.discard_window() after restoring model and "
            "optimizer from a checkpoint, if step() says so)",
        )
        if self._awaiting_step:
            raise UsageError(
                f"Pipeline.backward() twice for window {self.window}: its gradients would add into the "
                "last window's; call pipe.step(optimizer) (or pipe.discard_window()) between windows"
            )

    def step(self, optimizer: torch.optim.Optimizer, scheduler: Any | None = None) -> None:
        """The window's one optimizer step (and scheduler step), then the gradients cleared.

        As the Accumulator's step(): if the optimizer raised having changed nothing, a retry is exact;
        if it had changed parameters or state, a retry is refused (restore from a checkpoint, then
        discard_window()); if the scheduler raised, a retry runs only the scheduler.
        """
        progress = self._progress
        if progress.stats is None:
            refuse_retry(progress, self.window, drop="pipe.discard_window()")
            if not self._awaiting_step:
                raise UsageError("Pipeline.step() with no backward() in this window: there is no gradient")
            guarded_optimizer_step(progress, optimizer, optimizer.step)
            progress.stats = self.window
        if not progress.scheduled:
            if scheduler is not None:
                scheduler.step()
            progress.scheduled = True
        optimizer.zero_grad(set_to_none=True)
        self._end_window()

    def discard_window(self) -> None:
        """Drop the window in progress (its gradients); refused once its optimizer step is done."""
        if self._progress.stats is not None:
            raise UsageError(
                f"discard_window(): window {self.window}'s optimizer step is done (the scheduler raised); "
                "call pipe.step(optimizer, scheduler) again: it runs only what did not happen"
            )
        for _, parameter in self.named_weights():
            parameter.grad = None
        self._end_window()

    def _end_window(self) -> None:
        self.window += 1
        self._progress = StepProgress()
        self._awaiting_step = False

    def _run_step(self, chunk: Sequence[Batch]) -> None:
        # torch's step() cuts the concatenation back into the m equal micro-batches (tensor_split).
        inputs = torch.cat([batch[0] for batch in chunk])
        labels = torch.cat([batch[1] for batch in chunk])
        args = (inputs,) if self.has_first_stage else ()
        target = labels if self.has_last_stage else None
        self._schedule.step(*args, target=target, return_outputs=False)

    def _autocast(self) -> Any:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self._example.device.type, dtype=self.autocast_dtype)

    def _sum_over_replicas(self, value: float) -> float:
        if self.layout.stage_group is None:
            return value
        tensor = torch.tensor([value], dtype=torch.float64, device=self._example.device)
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.layout.stage_group)
        return float(tensor[0])

    def _check_window(self, local_items: float) -> float:
        """The window's global loss sum, and the loss checks, agreed by every rank (one all-reduce)."""
        last = self.has_last_stage
        mismatch = float(last and self._items_seen != local_items)
        loss_sum, bad, mismatched = all_reduce_values(
            [self._loss_sum if last else 0.0, float(self._bad_loss), mismatch]
        )
        if bad:
            raise ConfigError(
                "the pipeline's loss_fn(output, labels) must return (mean loss, item count) per "
                "micro-batch; a loss that couples the samples of a batch (contrastive, in-batch "
                "negatives) cannot be cut into micro-batches exactly: use mb.cached_backward without "
                "pipelining"
            )
        if mismatched:
            raise ConfigError(
                f"loss_fn counted different items than the labels hold (labels != {self.ignore_index}); "
                "return the count of the items the mean is over, or set ignore_index"
            )
        return loss_sum


def _generated_code_(stage: nn.Module) -> None:
    """Run the traced stage's submodules as the Python code fx generates, not through fx's Interpreter.

    torch's tracer rebuilds each submodule as an ``InterpreterModule`` that executes its graph node by
    node in ``torch.fx.Interpreter`` unless ``_run_with_interpreter`` is off, when it calls the
    GraphModule's generated forward instead (torch/export/unflatten.py): the same operations, without
    the interpreter's Python work per node (measured here: a traced GPT stage's forward + backward took
    1.26x the eager model's time under the interpreter).
    """
    for module in stage.modules():
        if hasattr(module, "_run_with_interpreter"):
            module.__dict__["_run_with_interpreter"] = False


def _autocast_forward(module: nn.Module, device_type: str, dtype: torch.dtype) -> None:
    """``module``'s forward run under autocast: the schedule calls each stage's forward alone, and
    its backward runs outside autocast (torch's rule: autocast the forward and the loss only)."""
    forward = module.forward

    def autocast_forward(*args: Any, **kwargs: Any) -> Any:
        with torch.autocast(device_type, dtype=dtype):
            return forward(*args, **kwargs)

    module.__dict__["forward"] = autocast_forward


def _check_model(model: nn.Module) -> None:
    """What the pipeline cannot keep exact: wrapped models and batch statistics."""
    kind = data_parallel_kind(model)
    if kind is not None:
        raise ConfigError(
            f"Pipeline got a {kind.upper()}-wrapped model; pass the plain model: the pipeline sums each "
            "stage's gradients over the data-parallel replicas itself (FSDP2 sharding of pipeline stages "
            "is not supported yet)"
        )
    norms = [name for name, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    if norms:
        raise ConfigError(
            f"the model has BatchNorm ({', '.join(norms[:3])}): its statistics couple the rows of a "
            "micro-batch, and the zero-weight rows the pipeline pads short micro-batches with would change "
            "them; convert it with mb.convert_batchnorm_to_groupnorm(model) first"
        )


def _check_options(num_stages: int, micro_batches: int, schedule: str, virtual_stages: int) -> None:
    if not isinstance(num_stages, int) or num_stages < 2:
        raise ConfigError(
            f"num_stages must be an integer >= 2 for a pipeline, got {num_stages!r} "
            "(one stage is plain accumulation: use mb.Accumulator)"
        )
    if schedule not in SCHEDULES:
        raise ConfigError(f"schedule must be one of {', '.join(SCHEDULES)}, got {schedule!r}")
    if not isinstance(micro_batches, int) or micro_batches < 1:
        raise ConfigError(
            f"micro_batches (per pipeline step) must be a positive integer, got {micro_batches!r}"
        )
    if schedule == "interleaved-1f1b" and (not isinstance(virtual_stages, int) or virtual_stages < 2):
        raise ConfigError(
            f"virtual_stages must be an integer >= 2 for interleaved-1f1b, got {virtual_stages!r}"
        )
