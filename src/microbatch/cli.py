"""The ``microbatch`` command: a thin shell over the public API.

Each subcommand lives in ``microbatch.commands.<name>`` with ``add_arguments(parser)`` and
``run(args) -> int``; they are imported only when used, so ``microbatch --help`` stays fast.
User mistakes (microbatch's own errors) print one clear line and exit with status 2, no traceback.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence

from . import __version__, distributed
from .errors import MicrobatchError

# name -> one-line help; the module is microbatch.commands.<name>
COMMANDS: dict[str, str] = {
    "train": "train the built-in GPT (or a workload) with a plan for this machine's memory",
    "plan": "choose micro-batch size, accumulation steps and checkpointing for a memory budget",
    "verify": "check that accumulated gradients equal the full-batch gradient",
    "bench": "run the benchmark suites and write benchmarks/RESULTS.md",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="microbatch",
        description="Train with the batch size your recipe asks for, on the memory you have.",
    )
    parser.add_argument("--version", action="version", version=f"microbatch {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug messages")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, help_text in COMMANDS.items():
        module = importlib.import_module(f"microbatch.commands.{name}")
        sub = subparsers.add_parser(name, help=help_text, description=help_text)
        module.add_arguments(sub)
        sub.set_defaults(_run=module.run)
    return parser


class _CurrentStderrHandler(logging.StreamHandler):
    """Writes to whatever sys.stderr is at the time of each record (tests swap it)."""

    @property
    def stream(self) -> object:
        return sys.stderr

    @stream.setter
    def stream(self, _value: object) -> None:
        pass


def _configure_logging(verbose: bool) -> None:
    handler = _CurrentStderrHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    handler.addFilter(distributed.RankZeroFilter())  # under torchrun only rank 0 speaks
    package_logger = logging.getLogger("microbatch")
    package_logger.handlers[:] = [handler]
    package_logger.setLevel(logging.DEBUG if verbose else logging.INFO)
    package_logger.propagate = False


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(list(argv) if argv is not None else None)
    if args.command is None:
        parser.print_help()
        return 2
    _configure_logging(args.verbose)
    try:
        return int(args._run(args) or 0)
    except MicrobatchError as error:
        print(f"microbatch {args.command}: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"microbatch {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
