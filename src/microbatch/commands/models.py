"""The model names every command takes, from one list: what `--help` shows and what errors offer.

``microbatch plan`` and ``verify`` take a built-in workload (every GPT size ``microbatch train
--model`` takes among them), ``package.module:function``, and ``plan`` also an embedded
architecture or a config.json; an unknown name gets one error listing every form, with "did you
mean" over all the names.
"""

from __future__ import annotations

from ..errors import WorkloadError
from ..hf.configs import ARCHITECTURES, is_architecture
from ..workload import BUILTIN_WORKLOADS, Workload, load_workload, unknown_model_message

ARCHITECTURE_LIST = "embedded architectures (simulated with --device PRESET)"


def model_help(*, architectures: bool) -> str:
    """The MODEL argument's help of plan (``architectures``) and verify."""
    text = f"a built-in workload ({', '.join(BUILTIN_WORKLOADS)}) or package.module:function returning one"
    if architectures:
        text += f", a Hugging Face config.json, or an architecture ({', '.join(ARCHITECTURES)})"
    return text + " (a module beside you is found as with python -m)"


def load_named_workload(name: str, *, architectures: bool) -> Workload:
    """The workload ``name`` names; one error with every accepted form for a name that is none."""
    if name in BUILTIN_WORKLOADS or ":" in name:
        return load_workload(name)
    more = {ARCHITECTURE_LIST: list(ARCHITECTURES)} if architectures else {}
    message = unknown_model_message(name, more=more)
    if not architectures and is_architecture(name):
        message = (
            f"{name!r} is an architecture with fake weights: `microbatch plan {name} --device PRESET` "
            "plans it; verify needs real weights. " + message
        )
    raise WorkloadError(message)
