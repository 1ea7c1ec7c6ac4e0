"""A simulated profile of three layers made the full model's: the layers repeated, the notes stated for
all of them, and FSDP2's mixed-precision policy (hf/configs.simulate_config_profile uses them)."""

from __future__ import annotations

import dataclasses

import torch

from ..errors import ConfigError
from ..profile.costs import Profile, SegmentProfile
from ..profile.timeline import gap_names

SIMULATED_LAYERS = 3  # the first layer, a middle one, the last


def repeat_blocks(profile: Profile, layers: int) -> Profile:
    """A profile of three identical blocks extended to ``layers``: the middle block repeats.

    The three are the first layer (its input, the embeddings, stays alive: transformers keeps
    ``inputs_embeds``), a middle one and the last. A middle layer run without checkpointing may
    let its input die after it (assemble.fold_freed_inputs credits that to its "none" cost, seen in
    the part after it, before the last layer); the last layer's input dies in the part after the
    blocks, as in the whole model. So the middle layer and the part before it repeat for layers
    1 .. layers - 2.
    """
    blocks = profile.blocks
    if len(blocks) != SIMULATED_LAYERS or layers < SIMULATED_LAYERS:
        raise ConfigError(
            f"repeat_blocks needs a profile of {SIMULATED_LAYERS} blocks and layers >= {SIMULATED_LAYERS}, "
            f"got {len(blocks)} and {layers}"
        )
    before, first, first_gap, middle, gap, last, after = profile.segments
    stem = middle.name.rsplit(".", 1)[0]
    names = [first.name, *(f"{stem}.{index}" for index in range(1, layers))]
    gaps = gap_names(names)
    segments: list[SegmentProfile] = [before, first]
    for index, name in enumerate(names[1:], start=1):
        segments.append(dataclasses.replace(first_gap if index == 1 else gap, name=gaps[index]))
        segments.append(dataclasses.replace(last if index == layers - 1 else middle, name=name))
    segments.append(after)
    return dataclasses.replace(profile, segments=tuple(segments))


def fsdp_mixed_profile(profile: Profile) -> Profile:
    """A profile of the blocks run in bf16, as FSDP2's MixedPrecisionPolicy(bf16, fp32) holds them.

    FSDP2 with ``param_dtype=bf16`` all-gathers each block's fp32 shards as bf16 parameters and
    runs the block in bf16 (no autocast, so no cached bf16 copy of every weight is kept for
    backward: the gathered parameters are freed after the block, counted by
    planner/target/per_rank.py as the blocks in flight). With ``reduce_dtype=fp32`` the block's
    gradients are reduce-scattered, and summed
    across micro-batches, in fp32 onto the fp32 shards: the segments' gradient bytes, simulated in
    bf16, are doubled (4 B / 2 B). Parameters, gradients, AdamW state and the step's temporaries
    come from the full fp32 model.
    """
    ratio = torch.finfo(torch.float32).bits // torch.finfo(torch.bfloat16).bits
    segments = tuple(
        dataclasses.replace(segment, gradient_bytes=segment.gradient_bytes * ratio)
        for segment in profile.segments
    )
    return dataclasses.replace(
        profile,
        segments=segments,
        gather_itemsize=torch.bfloat16.itemsize,
        notes=(
            *profile.notes,
            "precision mixed under FSDP: the blocks simulated as FSDP2 MixedPrecisionPolicy(param_dtype="
            "bf16, reduce_dtype=fp32) runs them: bf16 parameters gathered, fp32 shards, gradients and "
            "AdamW state",
        ),
    )


def full_model_notes(profile: Profile, layers: int) -> tuple[str, ...]:
    """The notes of a profile simulated on three layers, stated for the whole model.

    blocks='auto' ran on the three-layer model and said so ("picked 3 ... blocks"); the plan is for
    all ``layers``, so the note names them all and says which were simulated.
    """
    blocks = [segment.name for segment in profile.blocks]
    simulated = (
        f"{blocks[0]}, {blocks[1]} and {blocks[-1]} simulated (the first, a middle and the last), the "
        f"middle one's costs repeated for the other {layers - SIMULATED_LAYERS}"
    )
    notes = []
    for note in profile.notes:
        if note.startswith(f"blocks='auto' picked {SIMULATED_LAYERS} "):
            kind = note.split()[3]
            note = f"blocks='auto' picked {layers} {kind} blocks ({blocks[0]} .. {blocks[-1]}); {simulated}"
            simulated = ""
        notes.append(note)
    return (*notes, *([f"{layers} identical layers: {simulated}"] if simulated else []))
