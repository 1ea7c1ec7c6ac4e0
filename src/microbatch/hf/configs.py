"""Well-known open model architectures by name, built with fake weights: planning without downloads.

The numbers are the public ``config.json`` fields of each model (layers, widths, heads, key/value
heads, vocabulary, tied embeddings); nothing is downloaded and no weight is allocated: the model is
built on the meta device (shapes and dtypes only) and run by the simulated profiler with fake
weights.
``config_workload`` also takes a local ``config.json`` path.

An LLM's decoder layers are identical, so ``simulate_config_profile`` simulates a three-layer copy
of the model (the first layer, whose input needs no gradient, a middle one and the last: the
middle layer's input dies after it, the last one's in the head, hf/layer_profiles.py), repeats
the middle layer's costs for every layer between the first and the last, and measures the static memory
(parameters, gradients, optimizer state, the step's temporaries) on the full model.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..checkpointing.head import chunk_head
from ..errors import ConfigError, WorkloadError
from ..memory.device_specs import DeviceSpec
from ..planner.result.checks import read_plan_file
from ..profile.costs import Profile
from ..profile.cuda_autocast import simulating_cuda
from ..profile.measure import ProgressFn
from ..profile.simulate import simulate_profile, simulation, static_costs
from ..workload import Workload
from .layer_profiles import SIMULATED_LAYERS, fsdp_mixed_profile, full_model_notes, repeat_blocks

_LLAMA = {"model_type": "llama", "rope_theta": 500000.0, "max_position_embeddings": 131072}
_QWEN = {"model_type": "qwen2", "rope_theta": 1000000.0, "max_position_embeddings": 32768}
# Public config.json numbers of each model (only the fields that shape memory and time).
ARCHITECTURES: dict[str, dict[str, Any]] = {
    "gpt2": {"model_type": "gpt2", "n_layer": 12, "n_embd": 768, "n_head": 12, "vocab_size": 50257},
    "gpt2-medium": {"model_type": "gpt2", "n_layer": 24, "n_embd": 1024, "n_head": 16, "vocab_size": 50257},
    "llama-3.2-1b": {
        **_LLAMA,
        "num_hidden_layers": 16,
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "vocab_size": 128256,
        "tie_word_embeddings": True,
    },
    "llama-3.2-3b": {
        **_LLAMA,
        "num_hidden_layers": 28,
        "hidden_size": 3072,
        "intermediate_size": 8192,
        "num_attention_heads": 24,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 128256,
        "tie_word_embeddings": True,
    },
    "llama-3.1-8b": {
        **_LLAMA,
        "num_hidden_layers": 32,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "tie_word_embeddings": False,
    },
    "llama-3.1-70b": {
        **_LLAMA,
        "num_hidden_layers": 80,
        "hidden_size": 8192,
        "intermediate_size": 28672,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "tie_word_embeddings": False,
    },
    "qwen2.5-0.5b": {
        **_QWEN,
        "num_hidden_layers": 24,
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
    },
    "qwen2.5-7b": {
        **_QWEN,
        "num_hidden_layers": 28,
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "vocab_size": 152064,
        "tie_word_embeddings": False,
    },
    "mistral-7b": {
        "model_type": "mistral",
        "num_hidden_layers": 32,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 32000,
        "max_position_embeddings": 32768,
        "sliding_window": 4096,
        "tie_word_embeddings": False,
    },
}
# The parameters' dtype per precision. "mixed" is what torchtitan, FSDP2's MixedPrecisionPolicy
# and HF AMP train with: float32 parameters, gradients and optimizer state (16 B per parameter
# with AdamW: 4 + 4 + 8), the forward and backward under bfloat16 autocast.
# "mixed": fp32 parameters, gradients and optimizer state, the forward under bf16 autocast (torchtitan,
# FSDP2 MixedPrecisionPolicy, HF AMP in bf16); "mixed-fp16" the same in fp16 (AMP on GPUs without
# bf16, such as the V100; its GradScaler's unscale and inf checks are not simulated).
PRECISIONS = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "mixed": torch.float32,
    "mixed-fp16": torch.float32,
}
AUTOCAST_DTYPES = {"mixed": torch.bfloat16, "mixed-fp16": torch.float16}
# What FSDP2 runs the gathered blocks in under each mixed mode (its MixedPrecisionPolicy.param_dtype).
GATHERED_PRECISIONS = {"mixed": "bf16", "mixed-fp16": "fp16"}
OPTIMIZERS = ("adamw", "sgd", "adafactor")
LORA_TARGETS = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
    "c_attn",
    "c_proj",
)


@dataclass(frozen=True)
class ModelSetup:
    """How to train an architecture: sequence length, precision, optimizer, LoRA rank (0: full)."""

    seq_len: int = 2048
    precision: str = "bf16"
    optimizer: str = "adamw"
    lora_rank: int = 0

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise ConfigError(f"precision={self.precision!r}: choose one of {', '.join(PRECISIONS)}")
        if self.optimizer not in OPTIMIZERS:
            raise ConfigError(f"optimizer={self.optimizer!r}: choose one of {', '.join(OPTIMIZERS)}")
        if self.seq_len < 2 or self.lora_rank < 0:
            raise ConfigError(
                f"seq_len must be >= 2 and lora_rank >= 0, got {self.seq_len} and {self.lora_rank}"
            )

    @property
    def dtype(self) -> torch.dtype:
        return PRECISIONS[self.precision]

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        """The dtype the loss runs in under autocast ("mixed", "mixed-fp16"), or None: the parameters' own."""
        return AUTOCAST_DTYPES.get(self.precision)


def is_architecture(spec: str) -> bool:
    """A name of ARCHITECTURES, or a path to a config.json."""
    return spec.lower() in ARCHITECTURES or (spec.endswith(".json") and os.path.isfile(spec))


def architecture_config(spec: str) -> dict[str, Any]:
    """The config fields of an embedded architecture or a local config.json."""
    if spec.lower() in ARCHITECTURES:
        return dict(ARCHITECTURES[spec.lower()])
    try:  # a regular file of bounded size, never a FIFO that blocks (plan_checks.read_plan_file)
        fields = json.loads(read_plan_file(spec).decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as error:
        raise ConfigError(f"cannot read the config {spec!r}: {error}") from error
    if not isinstance(fields, dict) or "model_type" not in fields:
        raise ConfigError(f"{spec!r} is not a Hugging Face config.json (it has no model_type)")
    _check_shape_fields(spec, fields)
    return fields


# Bounds far above any public model (Llama 3.1 405B: 126 layers, width 16,384, vocabulary 128,256),
# so that a typo (num_hidden_layers 10^9) is refused at once instead of building a model for hours.
SHAPE_LIMITS = {
    "num_hidden_layers": 10_000,
    "n_layer": 10_000,
    "hidden_size": 1 << 20,
    "n_embd": 1 << 20,
    "intermediate_size": 1 << 22,
    "num_attention_heads": 1 << 14,
    "num_key_value_heads": 1 << 14,
    "vocab_size": 1 << 24,
    "max_position_embeddings": 1 << 24,
}


def _check_shape_fields(spec: str, fields: dict[str, Any]) -> None:
    for name, limit in SHAPE_LIMITS.items():
        value = fields.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= limit:
            raise ConfigError(
                f"{spec!r}: field {name} is {value!r}; it must be an integer from 1 to {limit:,} "
                "(far above any public model); fix the config"
            )


def layer_count(fields: dict[str, Any]) -> int:
    return int(fields.get("num_hidden_layers", fields.get("n_layer", 0)))


def _with_layers(fields: dict[str, Any], layers: int) -> dict[str, Any]:
    key = "num_hidden_layers" if "num_hidden_layers" in fields or "n_layer" not in fields else "n_layer"
    return {**fields, key: layers}


def build_model(fields: dict[str, Any], setup: ModelSetup) -> nn.Module:
    """The causal LM of ``fields`` in ``setup.dtype`` on the meta device (LoRA adapters with peft).

    The simulation gives it fake weights on the CPU (``profile.simulate.fake_model``).
    """
    try:
        import transformers
    except ImportError as error:
        raise WorkloadError(
            "planning a named architecture needs transformers: pip install 'transformers>=4.46' "
            "(from the microbatch checkout: pip install -e '.[hf]')"
        ) from error
    settings = {key: value for key, value in fields.items() if key != "model_type"}
    config = transformers.AutoConfig.for_model(fields["model_type"], **settings)
    config.use_cache = False
    with torch.device("meta"):
        model: nn.Module = transformers.AutoModelForCausalLM.from_config(config, dtype=setup.dtype)
    model.train()
    if getattr(model, "loss_type", "") is None:
        setattr(model, "loss_type", "ForCausalLM")  # noqa: B010 - transformers 5 finds the loss by class name
    if setup.lora_rank:
        model = _lora(model, setup.lora_rank)
    return model


def _lora(model: nn.Module, rank: int) -> nn.Module:
    """LoRA adapters (peft) on the attention and MLP projections, on the meta device."""
    try:
        import peft
    except ImportError as error:
        raise ConfigError("lora_rank needs peft: pip install peft (or plan without --lora-rank)") from error
    present = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    targets = [name for name in LORA_TARGETS if name in present]
    # GPT-2's projections are transformers' Conv1D (weights stored in x out): peft needs
    # fan_in_fan_out=True for them, and warns and sets it itself otherwise.
    conv1d = any(
        type(module).__name__ == "Conv1D" and name.rsplit(".", 1)[-1] in targets
        for name, module in model.named_modules()
    )
    config = peft.LoraConfig(
        r=rank, lora_alpha=2 * rank, target_modules=targets, lora_dropout=0.0, fan_in_fan_out=conv1d
    )
    with torch.device("meta"), warnings.catch_warnings():
        # peft's PeftModel reads transformers' deprecated is_gradient_checkpointing itself
        # (peft 0.21 with transformers 5): a FutureWarning no user of microbatch can act on.
        warnings.filterwarnings(
            "ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning
        )
        wrapped: Any = peft.get_peft_model(model, config)
    return wrapped if isinstance(wrapped, nn.Module) else model


def _optimizer(name: str) -> Callable[[nn.Module], torch.optim.Optimizer]:
    def make(model: nn.Module) -> torch.optim.Optimizer:
        trainable = [p for p in model.parameters() if p.requires_grad]
        if name == "sgd":
            return torch.optim.SGD(trainable, lr=1e-3, momentum=0.9)
        if name == "adafactor":
            return torch.optim.Adafactor(trainable, lr=1e-3)
        return torch.optim.AdamW(trainable, lr=1e-4)

    return make


def _autocast(setup: ModelSetup, ids: torch.Tensor) -> contextlib.AbstractContextManager[Any]:
    """The forward's autocast for ``setup``: CUDA's when simulating a GPU, else the batch's device's."""
    if setup.autocast_dtype is None:
        return contextlib.nullcontext()
    device_type = "cuda" if simulating_cuda() else ids.device.type
    return torch.autocast(device_type, dtype=setup.autocast_dtype)


def config_workload(spec: str, setup: ModelSetup, *, layers: int | None = None) -> Workload:
    """A Workload of the named architecture (or config.json) with fake weights; ``layers`` cuts it."""
    fields = architecture_config(spec)
    if layers is not None:
        fields = _with_layers(fields, layers)
    model = build_model(fields, setup)
    vocab = int(fields.get("vocab_size", 32000))
    generator = torch.Generator().manual_seed(0)

    def make_batch(size: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(vocab, (size, setup.seq_len), generator=generator)
        return {"input_ids": ids, "labels": ids}

    def loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int]:
        with _autocast(setup, batch["input_ids"]):
            output = model(input_ids=batch["input_ids"], labels=batch["labels"])
        # The model's loss is the mean over the shifted labels: seq_len - 1 per row.
        return output.loss, int(batch["input_ids"].shape[0]) * (setup.seq_len - 1)

    name = spec if spec.lower() in ARCHITECTURES else os.path.basename(os.path.dirname(os.path.abspath(spec)))
    return Workload(
        model=model,
        make_batch=make_batch,
        loss=loss,
        optimizer=_optimizer(setup.optimizer),
        name=f"{name} ({setup.precision}, seq {setup.seq_len}"
        + (f", LoRA r={setup.lora_rank})" if setup.lora_rank else ")"),
        description=f"{fields['model_type']} architecture with fake weights, {layer_count(fields)} layers",
    )


@contextlib.contextmanager
def _chunked(model: nn.Module, tokens: int | None) -> Iterator[None]:
    handle = chunk_head(model, tokens=tokens) if tokens is not None else None
    try:
        yield
    finally:
        if handle is not None:
            handle.remove()


def simulate_config_profile(
    spec: str,
    setup: ModelSetup,
    device: DeviceSpec,
    *,
    max_micro_batch_size: int = 16,
    policies: Any = None,
    progress: ProgressFn | None = None,
    shard: str = "none",
    head_chunk_tokens: int | None = None,
    moe_capacity_factor: float = 1.0,
) -> tuple[Workload, Profile]:
    """The full model's Workload and its simulated profile (three layers simulated, see the docstring).

    ``precision="mixed"`` with ``shard="fsdp"``: the blocks run as FSDP2 with
    ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` runs them (``fsdp_mixed``).
    ``head_chunk_tokens``: the runs with the loss head in chunks of that many tokens (chunk_head).
    ``moe_capacity_factor``: a mixture of experts' routing in the eager expert loop (profile/routing.py).
    """
    fields = architecture_config(spec)
    layers = layer_count(fields)
    full = config_workload(spec, setup)
    fsdp_mixed = shard == "fsdp" and setup.autocast_dtype is not None
    options: dict[str, Any] = {
        "max_micro_batch_size": max_micro_batch_size,
        "policies": policies,
        "progress": progress,
        "moe_capacity_factor": moe_capacity_factor,
    }
    if layers <= SIMULATED_LAYERS and not fsdp_mixed:
        with _chunked(full.model, head_chunk_tokens):
            return full, simulate_profile(full, device, **options)
    run_setup = (
        dataclasses.replace(setup, precision=GATHERED_PRECISIONS[setup.precision]) if fsdp_mixed else setup
    )
    small = config_workload(spec, run_setup, layers=SIMULATED_LAYERS if layers > SIMULATED_LAYERS else None)
    with _chunked(small.model, head_chunk_tokens):
        profile = simulate_profile(small, device, **options)
    with simulation(full.model, device) as (_, clock):
        optimizer = full.make_optimizer()
        static, step_peak_bytes, step_seconds = static_costs(
            full.model, optimizer, clock, cuda=device.kind == "cuda"
        )
    notes = profile.notes
    if layers > SIMULATED_LAYERS:
        profile = repeat_blocks(profile, layers)
        notes = full_model_notes(profile, layers)
    profile = dataclasses.replace(
        profile,
        name=full.name,
        parameter_bytes=static.get("parameters", 0),
        gradient_bytes=static.get("gradients", 0),
        optimizer_bytes=static.get("optimizer state", 0),
        step_peak_bytes=step_peak_bytes,
        step_seconds=step_seconds,
        notes=notes,
    )
    return full, fsdp_mixed_profile(profile) if fsdp_mixed else profile
