"""``microbatch verify MODEL --batch B --steps N [--autocast bf16] [--json]``: accumulated vs full batch.

Exit status 0 when the gradients agree within the tolerance, 1 when they differ (the diagnostics
say why), 2 for a usage mistake or an error in the user's own code, 3 for an internal error.
"""

from __future__ import annotations

import argparse

import torch

from ..verification.check import verify
from .models import load_named_workload, model_help
from .output import dumps

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "float64": torch.float64}
AUTOCAST: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16}


EXIT_STATUS = (
    "Exit status: 0 when the accumulated gradient equals the full-batch gradient within the "
    "tolerance, 1 when it differs (the diagnostics say why), 2 for a usage mistake or an error "
    "raised by your own code (named in one line; -v/--verbose shows its traceback), 3 for an "
    "internal error of microbatch, 130 interrupted."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", metavar="MODEL", help=model_help(architectures=False))
    parser.add_argument("--batch", type=int, default=32, help="full batch size (default 32)")
    parser.add_argument("--steps", type=int, default=4, help="micro-batches it is cut into (default 4)")
    parser.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        default=None,
        help="run the comparison in this precision (float64 makes it sharp); default: the model's",
    )
    parser.add_argument(
        "--rtol",
        type=float,
        default=None,
        help="tolerance on max|accumulated - full| / max|full| (default 1e-5 in float32, 1e-10 in float64)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed for the model's randomness (default 0)")
    parser.add_argument(
        "--autocast",
        choices=sorted(AUTOCAST),
        default=None,
        help="run the loss under torch.autocast in this dtype; the tolerance then comes from it",
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")


def run(args: argparse.Namespace) -> int:
    workload = load_named_workload(args.model, architectures=False)
    report = verify(
        workload,
        batch=args.batch,
        steps=args.steps,
        dtype=DTYPES[args.dtype] if args.dtype else None,
        rtol=args.rtol,
        seed=args.seed,
        autocast=AUTOCAST[args.autocast] if args.autocast else None,
    )
    print(dumps(report.to_dict()) if args.json else report)
    return 0 if report.equivalent else 1
