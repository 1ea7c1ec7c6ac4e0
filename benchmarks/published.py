"""Simulated against published GPU runs: the time model and the peak beside what others measured.

Each row is a training run someone published with its whole configuration (model, GPUs, data
parallelism, micro-batch, sequence length, precision, activation checkpointing) and its throughput
in tokens per second per GPU, and where given its peak memory. The simulation plans that exact
configuration for the device preset (fake tensors, the roofline on achieved rates per op class,
memory/device_specs.py): the micro-batch and the policy are the run's, not chosen by the planner.
Beside them: the prediction's error, (predicted - published) / published.

Rows the project cannot express (tensor parallelism, float8, torch.compile's fused kernels,
context parallelism) are listed with what is missing. Nothing here is fitted: the rates come from
the sources cited at the presets; this table only checks them.

    python benchmarks/published.py            # all rows, writes RESULTS.md
    python benchmarks/published.py --quick    # the first row only, no RESULTS.md
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import resource
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import results
from microbatch.hf.configs import PRECISIONS, ModelSetup, simulate_config_profile
from microbatch.memory import format_bytes
from microbatch.memory.device_specs import devices
from microbatch.planner import plan

SECTION_TITLE = "Simulated against published GPU runs"
TOKENS_TARGET, PEAK_TARGET = 0.15, 0.05  # issue 20: tokens/s within 15 %, peak within 5 %
GIB = 1024**3
TORCHTITAN_H100 = "https://github.com/pytorch/torchtitan/blob/main/docs/performance.md"
# The Llama 3 / Llama 2 A100 tables, before the H100 rewrite of the same file (commit 0413364).
TORCHTITAN_A100 = (
    "https://github.com/pytorch/torchtitan/blob/041336434916bdc0f88c1f89fda176fd3c2092e4/docs/performance.md"
)
# torchtitan's launch script turns expandable segments on from 2024-10-22 (a5e57e4), before the H100
# figures (2025-01-30, d4c86e3) and after the A100 ones (2024-04-24, 0413364).
TORCHTITAN_EXPANDABLE = "https://github.com/pytorch/torchtitan/commit/a5e57e4"
# The A100-era configs: Llama 3 8B and Llama 2 13B ran torchtitan's Triton fused RMSNorm, the 70B runs
# the eager one.
TORCHTITAN_FUSED_NORM = "https://github.com/pytorch/torchtitan/blob/041336434916bdc0f88c1f89fda176fd3c2092e4/train_configs/llama2_13b.toml"
NANOGPT = "https://github.com/karpathy/nanoGPT/blob/master/README.md"
TORCHTUNE = "https://github.com/pytorch/torchtune/blob/main/README.md#optimization-flags"
TORCHTITAN_DSV3_OOM = "https://github.com/pytorch/torchtitan/issues/1789"
PITHTRAIN_79 = "https://github.com/mlc-ai/pith-train/issues/79"
# Llama 2 13B's public config.json (meta-llama/Llama-2-13b-hf): not among the named architectures.
LLAMA2_13B = {
    "model_type": "llama",
    "num_hidden_layers": 40,
    "hidden_size": 5120,
    "intermediate_size": 13824,
    "num_attention_heads": 40,
    "num_key_value_heads": 40,
    "vocab_size": 32000,
    "max_position_embeddings": 4096,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
}
LLAMA2_70B = {
    **LLAMA2_13B,
    "num_hidden_layers": 80,
    "hidden_size": 8192,
    "intermediate_size": 28672,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
}


@dataclass(frozen=True)
class Run:
    """One published run: its configuration, its figures and where they are published."""

    name: str
    model: str  # a named architecture, or a key of CONFIGS
    device: str  # the preset
    world_size: int
    micro_batch: int  # per GPU
    steps: int  # micro-batches per optimizer step (gradient accumulation)
    seq_len: int
    precision: str  # "mixed": fp32 parameters and optimizer state, bf16 compute (FSDP2 / autocast)
    policy: str  # activation checkpointing: none, full, selective, selective-half (torchtitan's op SAC)
    shard: str  # fsdp or ddp
    tokens_per_second: float | None  # per GPU, as published; None: a peak-only row (published_device)
    peak_gib: float | None  # as published, None when not given
    source: str
    detail: str  # what the source says, and what differs from the simulation
    # What the published peak counts: "reserved" (torch.cuda.max_memory_reserved, torchtitan's
    # "memory") or "active" (max allocated bytes: no allocator cache, no CUDA context).
    peak_kind: str = "reserved"
    # PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, as the run's launch script set it.
    expandable_segments: bool = False
    moe: bool = False  # a mixture of experts (simulated under balanced routing, see MOE_NOTE)
    head_chunks: int = 0  # the loss head in this many chunks of the micro-batch's tokens (0: whole)
    # The run's GPU when no preset has it: the peak is simulated on ``device``'s allocator model
    # (memory does not depend on the rates) and tokens/s is not simulated.
    published_device: str | None = None


# BERT-large (bert-large-uncased's config.json, DeepLearningExamples' vocabulary padded to 30528):
# built as transformers' BertLMHeadModel (the causal-LM class of a BERT config): the encoder and
# the MLM head over every token, as DeepLearningExamples' pretraining computes them.
BERT_LARGE = {
    "model_type": "bert",
    "num_hidden_layers": 24,
    "hidden_size": 1024,
    "intermediate_size": 4096,
    "num_attention_heads": 16,
    "vocab_size": 30528,
    "max_position_embeddings": 512,
    "type_vocab_size": 2,
    "is_decoder": True,
}
# torchtitan's DeepSeek-V3 16B flavor (torchtitan/models/deepseek_v3/__init__.py at 82a9530, the
# commit that answered issue 1789) as transformers' DeepseekV3 config: 27 layers (the first dense),
# width 2048, dense FFN 10944, 64 routed experts of width 1408, top-6, 2 shared experts, MLA without
# a query LoRA (KV LoRA rank 512, heads 128 + 64 rope, values 128), 16 heads, vocabulary 102400;
# its router scores by softmax (route_norm off), one expert group.
DEEPSEEK_V3_16B = {
    "model_type": "deepseek_v3",
    "num_hidden_layers": 27,
    "first_k_dense_replace": 1,
    "hidden_size": 2048,
    "intermediate_size": 10944,
    "moe_intermediate_size": 1408,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "n_routed_experts": 64,
    "n_shared_experts": 2,
    "num_experts_per_tok": 6,
    "n_group": 1,
    "topk_group": 1,
    "norm_topk_prob": False,
    "q_lora_rank": None,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "vocab_size": 102400,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
}
# Qwen3-30B-A3B's public config.json (torchtitan's "30B-A3B" flavor has the same numbers): 48
# layers, width 2048, 128 experts of width 768, top-8 (probabilities renormalized), 32 query and 4
# key/value heads of 128, vocabulary 151936, untied head.
QWEN3_30B_A3B = {
    "model_type": "qwen3_moe",
    "num_hidden_layers": 48,
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "norm_topk_prob": True,
    "vocab_size": 151936,
    "max_position_embeddings": 40960,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": False,
}
CONFIGS = {
    "llama-2-13b": LLAMA2_13B,
    "llama-2-70b": LLAMA2_70B,
    "bert-large": BERT_LARGE,
    "deepseek-v3-16b": DEEPSEEK_V3_16B,
    "qwen3-30b-a3b": QWEN3_30B_A3B,
}
DLE_BERT = (
    "https://github.com/NVIDIA/DeepLearningExamples/blob/master/PyTorch/LanguageModeling/BERT/README.md"
    "#pre-training-nvidia-dgx-1-with-16g"
)

RUNS = (
    Run(
        "torchtitan Llama 3.1 8B, 8 H100, FSDP",
        "llama-3.1-8b",
        "h100-96gb",
        8,
        2,
        1,
        8192,
        "mixed",
        "selective-half",
        "fsdp",
        5762,
        82.4,
        TORCHTITAN_H100,
        "Table 1, row FSDP: local batch 2, seq 8192 (torchtitan's llama3_8b.toml), selective (op) AC, "
        "bf16 FSDP2 mixed precision, eager; H100 96GB HBM2e at 500 W; run_llama_train.sh sets "
        f"expandable_segments:True ({TORCHTITAN_EXPANDABLE})",
        expandable_segments=True,
    ),
    Run(
        "torchtitan Llama 3.1 8B, 128 H100, FSDP",
        "llama-3.1-8b",
        "h100-96gb",
        128,
        2,
        1,
        8192,
        "mixed",
        "selective-half",
        "fsdp",
        5605,
        67.0,
        TORCHTITAN_H100,
        "Table 3, row FSDP: as Table 1 on 16 nodes, 400 Gb/s RDMA per GPU",
        expandable_segments=True,
    ),
    Run(
        "torchtitan Llama 3 8B, 64 A100, FSDP",
        "llama-3.1-8b",
        "a100-80gb",
        64,
        1,
        1,
        8192,
        "mixed",
        "selective-half",
        "fsdp",
        2973,
        None,
        TORCHTITAN_A100,
        "Llama 3 table: local batch 1, selective op AC, 2973 WPS (58.2 % MFU); memory not published; "
        f"llama3_8b.toml sets norm_type fused_rmsnorm ({TORCHTITAN_FUSED_NORM}), simulated as eager RMSNorm",
    ),
    Run(
        "torchtitan Llama 3 70B, 64 A100, FSDP",
        "llama-3.1-70b",
        "a100-80gb",
        64,
        1,
        1,
        8192,
        "mixed",
        "full",
        "fsdp",
        331,
        None,
        TORCHTITAN_A100,
        "Llama 3 table (later revision: 331 WPS, 51.7 % MFU; first revision 323): local batch 1, full AC",
    ),
    Run(
        "torchtitan Llama 2 13B, 64 A100, FSDP, no AC",
        "llama-2-13b",
        "a100-80gb",
        64,
        2,
        1,
        4096,
        "mixed",
        "none",
        "fsdp",
        2162,
        None,
        TORCHTITAN_A100,
        "Llama 2 table: local batch 2, seq 4096, no AC, 2162 WPS (61.1 % MFU); llama2_13b.toml sets "
        f"norm_type fused_rmsnorm ({TORCHTITAN_FUSED_NORM}), simulated as eager RMSNorm",
    ),
    Run(
        "torchtitan Llama 2 13B, 64 A100, FSDP, selective AC",
        "llama-2-13b",
        "a100-80gb",
        64,
        2,
        1,
        4096,
        "mixed",
        "selective-half",
        "fsdp",
        1904,
        None,
        TORCHTITAN_A100,
        "Llama 2 table: local batch 2, selective op AC, 1904 WPS (53.8 % MFU); fused_rmsnorm, as above",
    ),
    Run(
        "torchtitan Llama 2 70B, 64 A100, FSDP, full AC",
        "llama-2-70b",
        "a100-80gb",
        64,
        2,
        1,
        4096,
        "mixed",
        "full",
        "fsdp",
        353,
        None,
        TORCHTITAN_A100,
        "Llama 2 table: local batch 2, full AC, 353 WPS (50.5 % MFU)",
    ),
    Run(
        "torchtune Llama 3.2 3B, 1 A100, full finetune",
        "llama-3.2-3b",
        "a100-80gb",
        1,
        2,
        1,
        4096,
        "bf16",
        "none",
        "none",
        7075,
        60.0,
        TORCHTUNE,
        "Optimization flags table, row '+ Packed Dataset': full_finetune_single_device, batch 2, packed "
        "to 4096, bf16 parameters and AdamW state, no compile, no AC, no chunked loss; 'Peak Memory "
        "Active' (allocated bytes)",
        peak_kind="active",
    ),
    Run(
        "DeepLearningExamples BERT-large pretraining, 1 V100 16GB",
        "bert-large",
        "v100-16gb",
        1,
        16,
        1,
        128,
        "mixed-fp16",
        "none",
        "none",
        125.44 * 128,
        None,
        DLE_BERT,
        "Pre-training DGX-1 16G table: 1 GPU, batch 16 (mixed precision), seq 128, 125.44 sequences/s; "
        "APEX AMP with fused LAMB, fused GeLU and LayerNorm kernels (simulated: fp32 parameters under fp16 "
        "autocast, AdamW, eager, attention as transformers' BERT runs it: matmuls and softmax)",
    ),
    Run(
        "DeepLearningExamples BERT-large pretraining, 8 V100 16GB, DDP",
        "bert-large",
        "v100-16gb",
        8,
        16,
        1,
        128,
        "mixed-fp16",
        "none",
        "ddp",
        919.04 * 128 / 8,
        None,
        DLE_BERT,
        "as the 1-GPU row on 8 GPUs (one DGX-1, NVLink 2): 919.04 sequences/s",
    ),
    Run(
        "nanoGPT GPT-2 124M, 8 A100 40GB, DDP",
        "gpt2",
        "a100-40gb",
        8,
        12,
        5,
        1024,
        "mixed",
        "none",
        "ddp",
        106_667,
        None,
        NANOGPT,
        "config/train_gpt2.py: batch_size 12, block_size 1024, gradient_accumulation_steps 5 x 8 (5 "
        "per GPU), 600k iterations in 'about 4 days': 491,520 tokens per 0.576 s, 106.7k per GPU; bf16 "
        "autocast, fused AdamW, torch.compile (simulated eager); 'about' makes this row approximate",
    ),
    Run(
        "torchtitan DeepSeek-V3 16B (MoE), 8 H100 80GB, FSDP (run: EP 8)",
        "deepseek-v3-16b",
        "h100-80gb",
        8,
        4,
        1,
        4096,
        "mixed",
        "selective-half",
        "fsdp",
        (11_636 + 11_758 + 11_533 + 11_254) / 4,
        73.32,
        TORCHTITAN_DSV3_OOM,
        "the issue's log with local_batch_size lowered to 4 (the fix its commit 82a9530 made the default): "
        "steps 10-40 at 11,636 / 11,758 / 11,533 / 11,254 tps (their mean here), memory 73.32 GiB "
        "(92.70 %); deepseek_v3_16b.toml at 8a2686c: seq 4096, FSDP 8 with expert_parallel_degree 8, "
        "selective op AC, compile of the loss only, bf16 FSDP2 mixed precision; run_train.sh sets "
        "expandable_segments:True. Simulated without expert parallelism (FSDP all-gathers the experts, "
        "no all-to-all), transformers' DeepseekV3 (grouped-GEMM experts, sigmoid router) for torchtitan's "
        "(softmax router), its latent attention as CUDA's memory-efficient SDPA kernel for the run's "
        "FlexAttention block-causal mask, eager loss",
        expandable_segments=True,
        moe=True,
    ),
    Run(
        "torchtitan Qwen3-30B-A3B (MoE), 8 B200, FSDP, EP 1",
        "qwen3-30b-a3b",
        "h200",
        8,
        8,
        1,
        8192,
        "mixed",
        "selective-half",
        "fsdp",
        None,
        141.79,
        PITHTRAIN_79,
        "TorchTitan baseline in the issue: BF16, seq 8192, FSDP 8, EP 1, PP 1, micro-batch 8 (global 64), "
        "selective AC, eight loss chunks, compiled blocks and loss; stable steps 19.41k / 19.53k / 19.52k "
        "tokens/s/GPU, 141.79 GiB peak. No B200 preset: peak only, simulated with the h200 preset's "
        "allocator model (the peak does not depend on the rates; the card's 179 GiB is not the h200's), "
        "the loss head in eight chunks as the run, eager blocks for its compiled ones; its launch is not "
        "published: expandable segments as torchtitan's run_train.sh sets them",
        expandable_segments=True,
        moe=True,
        head_chunks=8,
        published_device="8 x B200 (no preset)",
    ),
)

# Published runs the project cannot express, and what is missing.
TORCHTUNE_TABLE = "https://github.com/pytorch/torchtune/blob/main/README.md#memory-and-training-speed"
NOT_EXPRESSIBLE = (
    (
        "torchtune Llama 3.2 3B, 1 A100, baseline (unpacked)",
        "2,091 TPS, 25.5 GiB active",
        TORCHTUNE,
        "unpacked variable-length batches: the dataset's length distribution is not published",
    ),
    (
        "torchtune Llama 3.2 3B, 1 A100, + compile ... + 8-bit AdamW, LoRA, QLoRA",
        "8,998 ... 6,960 TPS, 51.0 ... 4.6 GiB",
        TORCHTUNE,
        "torch.compile (every later row), chunked cross-entropy, optimizer step fused into backward, "
        "activation offloading to CPU, 8-bit AdamW, NF4 quantized weights",
    ),
    (
        "torchtune Llama 3.1 8B / 70B / 405B, full, LoRA, QLoRA (4090, A6000, 8 A100)",
        "1,650 ... 653 TPS",
        TORCHTUNE_TABLE,
        "torch.compile on every row (the table's note); no A6000 preset; 70B full with CPU offload, "
        "405B QLoRA",
    ),
    (
        "torchtitan Llama 3.1 8B, 8 H100, FSDP + torch.compile",
        "6,667 TPS, 77.0 GiB",
        TORCHTITAN_H100,
        "torch.compile's fused kernels (the roofline prices eager aten ops)",
    ),
    (
        "torchtitan Llama 3.1 8B, 8 H100, FSDP + compile + Float8",
        "8,532 TPS, 76.8 GiB",
        TORCHTITAN_H100,
        "float8 matmuls (no fp8 rate or dtype in the simulation), torch.compile",
    ),
    (
        "torchtitan Llama 3.1 8B, 128 H100, FSDP + compile (+ Float8)",
        "6,514 / 8,380 TPS",
        TORCHTITAN_H100,
        "torch.compile, float8",
    ),
    (
        "torchtitan Llama 3.1 8B, FSDP + CP, seq 32k-262k",
        "3,890 ... 548 TPS",
        TORCHTITAN_H100,
        "context parallelism, float8, torch.compile",
    ),
    (
        "torchtitan Llama 3.1 70B, 256 H100, FSDP 32 x TP 8",
        "829 / 876 TPS",
        TORCHTITAN_H100,
        "tensor parallelism (and async TP), float8, torch.compile",
    ),
    (
        "torchtitan Llama 3.1 405B, 512 H100, 3D / 4D",
        "100 ... 16 TPS",
        TORCHTITAN_H100,
        "tensor parallelism with pipeline stages of FSDP ranks, float8, torch.compile",
    ),
)


def _config_path(model: str, folder: Path) -> str:
    """A named architecture as is; a CONFIGS entry written to a config.json in ``folder``."""
    if model not in CONFIGS:
        return model
    path = folder / model / "config.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(CONFIGS[model]), encoding="utf-8")
    return str(path)


def precision_of(run: Run) -> tuple[str, str | None]:
    """The run's precision when the simulation knows it, else bf16 and a note saying so."""
    if run.precision in PRECISIONS:
        return run.precision, None
    note = (
        f"precision {run.precision!r} is not a mode of this microbatch ({', '.join(PRECISIONS)}): "
        "simulated in bf16 (bf16 parameters, gradients and AdamW state: less memory than the run's fp32)"
    )
    return "bf16", note


def simulate_run(run: Run, folder: Path) -> dict[str, Any]:
    """The run as simulated. Its attention is priced causal as on a GPU: under the simulation
    transformers calls SDPA with ``is_causal=True`` and no mask tensor (profile/device_path.py).
    Its allocator is configured as the run's was: the peak replays the allocations through the
    allocator model with expandable segments where the run's launch script turned them on."""
    with _allocator_config(run):
        return _simulate(run, folder)


@contextlib.contextmanager
def _allocator_config(run: Run) -> Iterator[None]:
    """PYTORCH_CUDA_ALLOC_CONF as the run set it, for the simulation (the allocator model reads it)."""
    saved = os.environ.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    if run.expandable_segments:
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    try:
        yield
    finally:
        os.environ.pop("PYTORCH_CUDA_ALLOC_CONF", None)
        if saved is not None:
            os.environ["PYTORCH_CUDA_ALLOC_CONF"] = saved


def _simulate(run: Run, folder: Path) -> dict[str, Any]:
    """The run's configuration planned on its preset: predicted peak and tokens/s per GPU."""
    began = time.perf_counter()
    precision, note = precision_of(run)
    if note:
        print(f"{run.name}: {note}", file=sys.stderr)
    spec = devices()[run.device]
    roomy = spec.replace(memory_bytes=2**40)  # the published peak may exceed what the preset holds
    setup = ModelSetup(seq_len=run.seq_len, precision=precision)
    chunk_tokens = run.micro_batch * run.seq_len // run.head_chunks if run.head_chunks else None
    workload, profile = simulate_config_profile(
        _config_path(run.model, folder),
        setup,
        roomy,
        max_micro_batch_size=run.micro_batch,
        policies=[run.policy],
        shard=run.shard,  # mixed under FSDP2: bf16 gathered blocks, no per-rank autocast copies
        head_chunk_tokens=chunk_tokens,
    )
    chosen = plan(
        workload,
        batch=run.micro_batch * run.steps * run.world_size,
        memory="1TiB",
        world_size=run.world_size,
        policies=[run.policy],
        profile=profile,
        device=roomy,
        shard=run.shard,
        min_micro_batch_size=run.micro_batch,
        even=True,
    )
    # The planner always may leave a block unchecked (none); the run checkpoints every block with
    # its policy: that point of the frontier (with a roomy budget, the fastest plan is all none).
    point = next(
        (
            point
            for point in chosen.frontier
            if point.micro_batch_size == run.micro_batch
            and point.steps == run.steps
            and {policy for _, policy in point.block_policies} == {run.policy}
        ),
        None,
    )
    if point is None:
        raise RuntimeError(
            f"{run.name}: no plan of micro-batch {run.micro_batch} x {run.steps}, {run.policy}"
        )
    tokens = run.micro_batch * run.steps * run.seq_len  # per GPU per optimizer step
    predicted = tokens / point.seconds_per_step
    peak = point.predicted_peak_bytes
    if run.peak_kind == "active":
        # Allocated bytes: the prediction less what only reserved bytes count (the chosen plan's
        # allocator cache, the same micro-batch, and the CUDA context allowance).
        outside = ("CUDA context and workspaces (allowance)", "caching allocator (reserved - live)")
        peak -= sum(value for name, value in chosen.rank_parts if name in outside)
    return {
        "name": run.name,
        "precision_simulated": precision,
        "precision_note": note,
        "published_tokens_per_second": run.tokens_per_second,
        "predicted_tokens_per_second": None if run.published_device else predicted,
        "tokens_error": None
        if run.tokens_per_second is None or run.published_device
        else predicted / run.tokens_per_second - 1,
        "published_peak_gib": run.peak_gib,
        "predicted_peak_bytes": peak,
        "peak_error": None if run.peak_gib is None else peak / (run.peak_gib * GIB) - 1,
        "seconds_per_step": point.seconds_per_step,
        "reserved_bytes": point.predicted_peak_bytes,
        "card_bytes": spec.memory_bytes,
        "planning_seconds": time.perf_counter() - began,
    }


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:+.1f} %"


def _configuration(run: Run, row: dict[str, Any]) -> str:
    steps = f" x {run.steps}" if run.steps > 1 else ""
    precision = (
        run.precision if not row["precision_note"] else f"{run.precision} (as {row['precision_simulated']})"
    )
    return (
        f"{run.world_size} x {run.device}, {run.shard.upper() if run.shard != 'none' else 'one GPU'}, "
        f"micro-batch {run.micro_batch}{steps}, "
        f"seq {run.seq_len}, {precision}, AC {run.policy}"
    )


# Each of the two settings that express torchtitan's H100 runs undone alone (the rows' peaks then).
VARIANTS = {
    "selective": lambda run: dataclasses.replace(run, policy="selective"),
    "native allocator": lambda run: dataclasses.replace(run, expandable_segments=False),
}


def simulate_variants(runs: tuple[Run, ...], folder: Path) -> list[dict[str, Any]]:
    """The dense rows with torchtitan's policy and allocator setting, each setting undone alone."""
    varied = [
        run for run in runs if run.policy == "selective-half" and run.expandable_segments and not run.moe
    ]
    return [
        {"name": run.name, "variant": name, "peak_error": simulate_run(change(run), folder)["peak_error"]}
        for run in varied
        for name, change in VARIANTS.items()
    ]


def _variant(report: dict[str, Any], name: str) -> str:
    errors = [_percent(row["peak_error"]) for row in report["variants"] if row["variant"] == name]
    return " and ".join(errors) if errors else "(not simulated)"


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}"


def _cells(run: Run, row: dict[str, Any]) -> list[str]:
    """One row of the table: the run, its configuration, tokens/s and peak beside the published."""
    if run.published_device:
        fits = f"- (simulated on the {run.device} preset's allocator; ran on {run.published_device})"
    elif row["reserved_bytes"] <= row["card_bytes"]:
        fits = "yes"
    else:
        fits = f"no ({format_bytes(row['card_bytes'])})"
    return [
        run.name,
        _configuration(run, row),
        _number(run.tokens_per_second),
        _number(row["predicted_tokens_per_second"]),
        _percent(row["tokens_error"]),
        "-" if run.peak_gib is None else f"{run.peak_gib:.1f} GiB {run.peak_kind}",
        format_bytes(row["predicted_peak_bytes"]),
        _percent(row["peak_error"]),
        fits,
        f"[source]({run.source}): {run.detail}",
    ]


HEADERS = [
    "run",
    "configuration (per GPU)",
    "published tokens/s/GPU",
    "predicted",
    "error",
    "published peak",
    "predicted peak",
    "error",
    "fits the card (the run did)",
    "source",
]


def section(report: dict[str, Any]) -> str:
    runs = {run.name: run for run in RUNS}
    dense = [row for row in report["rows"] if not runs[row["name"]].moe]
    moe = [row for row in report["rows"] if runs[row["name"]].moe]
    rows = [_cells(runs[row["name"]], row) for row in dense]
    headers = HEADERS
    missing = [[name, figures, f"[source]({source})", why] for name, figures, source, why in NOT_EXPRESSIBLE]
    all_rows = dense
    tokens_ok = [row for row in all_rows if abs(row["tokens_error"]) <= TOKENS_TARGET]
    peaks = [row for row in all_rows if row["peak_error"] is not None]
    peaks_ok = [row for row in peaks if abs(row["peak_error"]) <= PEAK_TARGET]
    misses = [
        f"{row['name']} (tokens/s {_percent(row['tokens_error'])})"
        for row in all_rows
        if row not in tokens_ok
    ] + [f"{row['name']} (peak {_percent(row['peak_error'])})" for row in peaks if row not in peaks_ok]
    too_big = [row["name"] for row in all_rows if row["reserved_bytes"] > row["card_bytes"]]
    notes = sorted({row["precision_note"] for row in all_rows if row["precision_note"]})
    return "\n".join(
        [
            f"`{report['command']}`: each published run's own configuration (micro-batch, policy, ranks) "
            "simulated on its device preset on this CPU (fake tensors; three layers of the big models "
            "simulated, the middle one repeated), priced by the roofline on achieved rates per op class "
            "(memory/device_specs.py cites each; none is fitted to these rows). "
            "Error = predicted / published - 1. Targets (issue 20): tokens/s within 15 %, peak within 5 %. "
            f"Tokens/s within target: {len(tokens_ok)} of {len(all_rows)} rows. Peak within "
            f"target: {len(peaks_ok)} of {len(peaks)} rows that publish one. The simulation takes the "
            "GPU's code paths (profile/device_path.py: foreach AdamW, transformers' causal SDPA without "
            "a mask tensor, CUDA autocast's fp32 ops), and 'mixed' is FSDP2's MixedPrecisionPolicy "
            "(fp32 parameters, gradients and AdamW state, bf16 compute) or, without FSDP, fp32 "
            "parameters under bf16 autocast.",
            "",
            results.markdown_table(headers, rows),
            "",
            "Misses: "
            + ("; ".join(misses) if misses else "none")
            + ". "
            + (f"Predicted above the card although the run fitted: {'; '.join(too_big)}. " if too_big else "")
            + "torchtitan's selective rows run its op-level SAC (every second aten.mm output saved with the"
            " attention output, the other projections recomputed), simulated as microbatch's "
            "'selective-half', the same rule (checkpointing/selective.py); with microbatch's own "
            "'selective' (every projection's output saved) those rows' peaks read "
            f"{_variant(report, 'selective')}."
            " The H100 runs' launch script set expandable_segments:True, and their allocations are "
            "replayed with it (with the native allocator's least reserved bytes they read "
            f"{_variant(report, 'native allocator')}: at 82 "
            "of 95 GiB the run's allocator is not pressed, and the 8 GiB loss tensors leave a 4 GiB hole "
            "the next one cannot use). Known causes, none corrected for here: each 8B prediction includes"
            " the planner's 1 % safety margin and its 512 MiB CUDA context allowance, which torch's "
            "max_memory_reserved (torchtitan's memory column) does not count, so the runs' allocations "
            "are under-counted by more than the 3.3 GiB (8 H100) and 1.9 GiB (128 H100) the rows show, by"
            " causes not found; the run's own two peaks differ by 15.4 GiB, the predictions by 14.0 GiB, "
            "as the sharded fp32 parameters, gradients and state do (FSDP2's gradient shards stay "
            "reserved in the reduce-scatter stream's pool between steps, planner/target/per_rank.py). "
            "Llama 2 13B without AC is predicted 1.8 GiB above its card, which the run fitted: its config "
            "ran "
            "torchtitan's Triton fused RMSNorm, which keeps the bf16 input and a per-row statistic where "
            "the eager norm simulated keeps an fp32 copy and the bf16 normalized tensor, 4 bytes more per"
            " element: 2 norms x 40 layers x 8192 tokens x 5120 x 4 B = 12.5 GiB (this row read 84.8 GiB "
            "before the profile credited a layer's input that dies after it to the layer, "
            "profile/assemble.py: 3.0 GiB over 38 middle layers); the simulated FSDP all-gathers and "
            "reduce-scatters are not overlapped with compute (an upper bound on time); nanoGPT compiles "
            "its model, which fuses the elementwise and fp32 autocast ops that the eager simulation "
            "prices one by one (in pure bf16, before mixed precision was simulated, this row read +3.2 "
            "%); DeepLearningExamples' BERT runs APEX AMP (fp32 master weights, fp16 compute), simulated "
            "as 'mixed-fp16' (fp32 parameters and state under fp16 autocast; with fp16 parameters "
            "throughout, which AMP does not run, it read +33 %), its fused LAMB, GeLU and LayerNorm "
            "kernels priced as the eager ops they replace and its GradScaler's unscale not priced; the "
            "A100 clusters' network "
            "is not published, taken as DGX A100's (8 x 200 Gb/s InfiniBand).",
            "",
            *(f"Note: {note}." for note in notes),
            "",
            "Published runs the simulation cannot express:",
            "",
            results.markdown_table(["run", "published", "source", "missing"], missing),
            "",
            *(moe_section(runs, moe) if moe else []),
            f"Load while simulating: {report['load_before']} before, {report['load_after']} after "
            f"(/proc/loadavg); {report['seconds']:.0f} s in all; peak RSS {report['max_rss_mib']:.0f} MiB.",
            "",
            results.environment_line(),
        ]
    )


# What the simulation assumes of a mixture of experts' routing (issue 36).
MOE_NOTE = (
    "the experts run as transformers runs them by default, grouped GEMMs (experts_implementation "
    "grouped_mm: the tokens sorted by expert, one GEMM per expert over its rows, aten._grouped_mm), "
    "whose shapes are the routed rows, tokens x top-k, whatever the routing: the simulated memory and "
    "FLOPs are those of any routing, balanced (top_k / E of the tokens per expert) or not, and the "
    "roofline prices the grouped GEMMs at the dense matmul rate (2 m k n over the routed rows; an "
    "imbalanced routing's small experts run below it, which is not modeled). transformers' eager "
    "expert loop (nonzero / torch.where on the routing mask, one expert at a time) has data-dependent "
    "shapes that fake tensors cannot size: simulated, each expert runs on the rows a stated routing "
    "gives it, balanced by default, or the busiest expert moe_capacity_factor times its balanced share "
    "(profile/routing.py), and the plan's notes say which; a real profile measures the batches' own "
    "routing (tests/test_hf_moe_peak.py)"
)
# Published MoE runs the simulation cannot express, and what is missing.
NOT_EXPRESSIBLE_MOE = (
    (
        "torchtitan DeepSeek-V3 16B, 8 H100 80GB, FSDP 8 x EP 8, local batch 8 (the toml's default then)",
        "out of memory on 80 GB",
        TORCHTITAN_DSV3_OOM,
        "expert parallelism (experts placed by rank, tokens moved by all-to-all)",
    ),
    (
        "PithTrain Qwen3-30B-A3B, 8 B200, EP 4 x PP 2, seq 8192",
        "about 17.5k tokens/s/GPU",
        PITHTRAIN_79,
        "expert and pipeline parallelism; no B200 preset",
    ),
    (
        "NousResearch torchtitan Qwen3-30B-A3B, DeepEP EP 8, 1 to 16 nodes of 8 GPUs",
        "14,796 ... 13,856 tokens/s, 167.93 ... 114.78 GiB per GPU",
        "https://github.com/NousResearch/torchtitan/pull/19",
        "expert parallelism over DeepEP's all-to-all, fused kernels; the GPU (178 GiB cards by its "
        "percentages) has no preset",
    ),
    (
        "TRL Qwen3-30B-A3B full fine-tune, 8 H100, transformers ep=8",
        "0.9 s a step, 34 GB peak",
        "https://github.com/huggingface/trl/pull/6869",
        "transformers' expert parallelism (the expert-parallel group shares one batch), chunked NLL loss",
    ),
    (
        "Megatron-LM Mixtral 8x7B, 16 H100, EP 8",
        "130 TFLOPS per GPU",
        "https://github.com/NVIDIA/Megatron-LM/issues/756",
        "expert parallelism, Megatron-Core's fused kernels and distributed optimizer",
    ),
)


def moe_section(runs: dict[str, Run], moe: list[dict[str, Any]]) -> list[str]:
    """The mixture-of-experts rows (issue 36): their table, the routing assumed, what is missing."""
    missing = [
        [name, figures, f"[source]({source})", why] for name, figures, source, why in NOT_EXPRESSIBLE_MOE
    ]
    return [
        "Mixtures of experts (issue 36): each run's configuration simulated as the dense rows (three "
        "layers, the middle one repeated; DeepSeek-V3's first layer is its dense one), the published "
        "figures beside it; the expert parallelism the DeepSeek-V3 run used is not simulated (its "
        "experts all-gathered by FSDP instead, no all-to-all), and the Qwen3-30B-A3B row ran on B200s, "
        "which no preset models: its peak only. The DeepSeek-V3 run's op-level selective checkpointing "
        "saves aten.mm, the attention kernels, reduce-scatter and all-to-all "
        "(deepseek_v3/infra/parallelize.py at 8a2686c), no grouped GEMM: the experts are recomputed in "
        "backward, as microbatch's 'selective-half' does (it saves matmul-class ops only); the Qwen3 "
        "run's torchtitan revision is not published and is simulated alike.",
        "",
        results.markdown_table(HEADERS, [_cells(runs[row["name"]], row) for row in moe]),
        "",
        f"Routing: {MOE_NOTE}.",
        "",
        "Published MoE runs the simulation cannot express:",
        "",
        results.markdown_table(["run", "published", "source", "missing"], missing),
        "",
    ]


def _load() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text(encoding="utf-8").split()[:3])
    except OSError:
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the first row only")
    parser.add_argument("--only", default=None, help="rows whose name contains this text")
    results.add_output_arguments(parser)
    args = parser.parse_args(argv)
    runs = RUNS[:1] if args.quick else RUNS
    if args.only:
        runs = tuple(run for run in runs if args.only.lower() in run.name.lower())
    load_before, began = _load(), time.perf_counter()
    quiet = contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext()
    with quiet, tempfile.TemporaryDirectory() as folder:
        rows = []
        for run in runs:
            row = simulate_run(run, Path(folder))
            print(
                f"{run.name}: {_number(row['predicted_tokens_per_second'])} tokens/s/GPU "
                f"({_percent(row['tokens_error'])}), "
                f"peak {format_bytes(row['predicted_peak_bytes'])} "
                f"({_percent(row['peak_error'])}), {row['planning_seconds']:.0f} s",
                file=sys.stderr,
            )
            rows.append(row)
        variants = simulate_variants(runs, Path(folder))
    report: dict[str, Any] = {
        "rows": rows,
        "variants": variants,
        "load_before": load_before,
        "load_after": _load(),
        "seconds": time.perf_counter() - began,
        "max_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "command": results.reproducing_command(
            "published", sys.argv[1:] if argv is None else list(argv), json_mode=args.json
        ),
    }
    write = not args.no_write and not args.quick and not args.only
    return results.emit(SECTION_TITLE, section(report), report, json_mode=args.json, write=write)


if __name__ == "__main__":
    sys.exit(main())
