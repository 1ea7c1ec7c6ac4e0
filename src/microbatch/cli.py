"""The ``microbatch`` command: a thin shell over the public API.

Each subcommand lives in ``microbatch.commands.<name>`` with ``add_arguments(parser)`` and
``run(args) -> int``; they are imported only when used, so ``microbatch --help`` stays fast.
User mistakes (microbatch's own errors) print one clear line and exit with status 2, no traceback;
so does an exception raised by the user's own code (a workload's make_batch, loss or model), named
by its function, with the traceback under --verbose. Exit statuses are in EXIT_STATUS.
"""

from __future__ import annotations

import argparse
import errno
import importlib
import logging
import os
import sys
import sysconfig
import traceback
from collections.abc import Sequence
from types import TracebackType

import torch

from . import __version__, distributed
from .errors import MicrobatchError

# name -> one-line help; the module is microbatch.commands.<name>
COMMANDS: dict[str, str] = {
    "train": "train the built-in GPT (or a workload) with a plan for this machine's memory",
    "plan": "choose micro-batch size, accumulation steps and checkpointing for a memory budget",
    "verify": "check that accumulated gradients equal the full-batch gradient",
    "bench": "run the benchmark suites and write benchmarks/RESULTS.md",
}


EXIT_STATUS = (
    "Exit status: 0 done (verify: the gradients agree); 1 verify: the accumulated gradient differs from "
    "the full batch's; 2 a usage mistake or an error raised by your own code (run with -v/--verbose for "
    "its traceback); 3 an internal error of microbatch (a bug: the traceback is printed); 130 interrupted."
)
INTERNAL_ERROR = 3


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="microbatch",
        description="Train with the batch size your recipe asks for, on the memory you have.",
        epilog=EXIT_STATUS,
    )
    parser.add_argument("--version", action="version", version=f"microbatch {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug messages")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, help_text in COMMANDS.items():
        module = importlib.import_module(f"microbatch.commands.{name}")
        sub = subparsers.add_parser(name, help=help_text, description=help_text, epilog=EXIT_STATUS)
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
    except Exception as error:
        where = user_code_frame(error.__traceback__)
        if where is None and isinstance(error, OSError) and error.errno in _ENVIRONMENT_ERRNOS:
            # The machine, not the code: a full disk or TMPDIR, a read-only folder, a quota.
            print(f"microbatch {args.command}: error: {_os_error_line(error)}", file=sys.stderr)
            return 2
        if where is None:
            traceback.print_exception(error, file=sys.stderr)
            print(
                f"microbatch {args.command}: internal error {type(error).__name__}: {error}. "
                "This is a bug in microbatch; please report it with the traceback above",
                file=sys.stderr,
            )
            return INTERNAL_ERROR
        if args.verbose:
            traceback.print_exception(error, file=sys.stderr)
        hint = "" if args.verbose else " (run `microbatch --verbose ...` for the traceback)"
        print(
            f"microbatch {args.command}: error in your code: {where} raised "
            f"{type(error).__name__}: {_one_line(error)}{hint}",
            file=sys.stderr,
        )
        return 2


# microbatch's, torch's and the standard library's own files: frames in them are not the user's
# code (json, contextlib or subprocess raising inside our own calls is not "error in your code").
# Installed packages (site-packages) may sit inside the standard library's folder: they are not it.
_LIBRARIES = tuple(os.path.dirname(os.path.abspath(path)) + os.sep for path in (__file__, torch.__file__))
_PATHS = sysconfig.get_paths()
_STANDARD_LIBRARY = tuple({os.path.abspath(_PATHS[name]) + os.sep for name in ("stdlib", "platstdlib")})
_INSTALLED = tuple({os.path.abspath(_PATHS[name]) + os.sep for name in ("purelib", "platlib")})
_ENVIRONMENT_ERRNOS = frozenset(
    {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EFBIG}
)


def _os_error_line(error: OSError) -> str:
    where = f"{error.filename!r}: " if error.filename else ""
    name = errno.errorcode.get(error.errno or 0, "")
    return f"{where}{error.strerror or error} ({name}); free space or fix the permissions, then run it again"


def _is_library(filename: str) -> bool:
    path = os.path.abspath(filename)
    standard = path.startswith(_STANDARD_LIBRARY) and not path.startswith(_INSTALLED)
    return path.startswith(_LIBRARIES) or standard or filename.startswith("<frozen")


def user_code_frame(tb: TracebackType | None) -> str | None:
    """'function (file:line)' of the user's code an exception came from; None if it came from ours.

    The user's function is where the call stack last entered user code from microbatch or torch
    (make_batch, loss, a model's forward), so an error deeper in a third library still names it;
    the innermost frame of user code is added when it is another function.
    """
    entry = innermost = None
    previous_is_library = False
    for frame, line in traceback.walk_tb(tb):
        filename = frame.f_code.co_filename
        is_library = _is_library(filename)
        if not is_library:
            name = getattr(frame.f_code, "co_qualname", frame.f_code.co_name)
            innermost = f"{name} ({_short_path(filename)}:{line})"
            if previous_is_library:
                entry = innermost
        previous_is_library = is_library
    if entry is None or innermost is None:
        return None
    return entry if innermost == entry else f"{entry}, in {innermost}"


def _short_path(filename: str) -> str:
    relative = os.path.relpath(filename)
    return filename if relative.startswith("..") else relative


def _one_line(error: BaseException) -> str:
    text = " ".join(str(error).split())
    return text if len(text) <= 300 else text[:297] + "..."


if __name__ == "__main__":
    sys.exit(main())
