"""What people report running Llama 3.x fine-tuning on single GPUs, beside benchmarks/consumer.py's plans.

Figures only, each with its source and the configuration it was measured with; where that differs
from the simulated cells (8-bit or paged optimizer, QLoRA, another batch) the row says so.
"""

from __future__ import annotations

TORCHTUNE = "https://github.com/pytorch/torchtune/blob/main/README.md (Memory and training speed)"
TORCHTUNE_SETUP = (
    "batch 2, no gradient accumulation, packed to 2,048 tokens, torch.compile on; torchtune's single-device "
    "configs: bf16 weights"
)
UNSLOTH_REQUIREMENTS = "https://unsloth.ai/docs/get-started/fine-tuning-for-beginners/unsloth-requirements"

REPORTED: list[dict[str, str]] = [
    {
        "what": "Llama 3.1 8B full fine-tune, 1x RTX 4090 (torchtune)",
        "figure": "peak 18.9 GiB, 1,650 tokens/s",
        "configuration": TORCHTUNE_SETUP + "; the full single-device config (recipes/configs/llama3_1/"
        "8B_full_single_device.yaml) steps bitsandbytes' PagedAdamW8bit inside backward (optimizer_in_bwd, "
        "no accumulation) with activation checkpointing: 8-bit paged state and bf16 weights, unlike the "
        "table's float32 AdamW",
        "source": TORCHTUNE,
    },
    {
        "what": "Llama 3.1 8B LoRA, 1x RTX 4090 (torchtune)",
        "figure": "peak 16.2 GiB, 3,083 tokens/s",
        "configuration": TORCHTUNE_SETUP + "; bf16 frozen base as in the table, torchtune's own LoRA "
        "targets and rank (8B_lora_single_device.yaml), not the table's rank 16 on all projections",
        "source": TORCHTUNE,
    },
    {
        "what": "Llama 3.1 8B QLoRA, 1x RTX 4090 (torchtune)",
        "figure": "peak 7.4 GiB, 2,413 tokens/s",
        "configuration": TORCHTUNE_SETUP + "; 4-bit NF4 base weights (QLoRA), which the table does not plan",
        "source": TORCHTUNE,
    },
    {
        "what": "Llama 3.1 8B full fine-tune, 1x A6000 48 GB (torchtune)",
        "figure": "peak 37.4 GiB, 2,579 tokens/s",
        "configuration": TORCHTUNE_SETUP + "; 48 GB card, not the A100 40 GB; 8-bit paged AdamW as above",
        "source": TORCHTUNE,
    },
    {
        "what": "3B and 8B LoRA minimum VRAM (unsloth)",
        "figure": "3B: 8 GB LoRA 16-bit, 3.5 GB QLoRA; 8B: 22 GB LoRA 16-bit, 6 GB QLoRA",
        "configuration": "unsloth's stated absolute minimum with its own kernels (LoRA in 16-bit, QLoRA "
        "in 4-bit); no batch, sequence length or throughput given",
        "source": UNSLOTH_REQUIREMENTS,
    },
    {
        "what": "Llama 3.1 8B QLoRA longest context (unsloth)",
        "figure": "342,000 tokens with unsloth vs 28,000 with Hugging Face + FlashAttention 2 on an 80 GB "
        "GPU; 2,900 vs out of memory on an 8 GB GPU",
        "configuration": "4-bit QLoRA rank 32 on all linear layers, batch 1, unsloth's offloaded "
        "checkpointing and Apple's Cut Cross Entropy (a fused head)",
        "source": "https://unsloth.ai/blog/llama3-3",
    },
    {
        "what": "Llama 3 8B chunked cross-entropy (torchtitan PR #996)",
        "figure": "peak 49.58 GiB -> 42.26 GiB, about 5,960 tokens/s per GPU before and after",
        "configuration": "torchtitan's Llama 3 8B training on H100s (52.2 % of the card's memory), FSDP; a "
        "datacenter card and sharded, cited for the saving the chunked head gives",
        "source": "https://github.com/pytorch/torchtitan/pull/996",
    },
]


def section() -> str:
    """The cited rows as a markdown list (empty rows refused: every figure names its source)."""
    lines = ["What people report on such cards (their configuration, not the table's, unless stated):", ""]
    for row in REPORTED:
        if not row.get("source") or not row.get("figure"):
            raise ValueError(f"a reported row without a source or figure: {row}")
        lines.append(f"- {row['what']}: {row['figure']} ({row['configuration']}). Source: {row['source']}")
    if not REPORTED:
        lines.append("- none cited yet")
    return "\n".join(lines)
