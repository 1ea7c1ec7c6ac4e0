"""The ``microbatch`` command: a thin shell over the public API.

Each subcommand lives in ``microbatch.commands.<name>`` with ``add_arguments(parser)`` and
``run(args) -> int``; they are imported only when used, so ``microbatch --help`` stays fast.
User mistakes (microbatch's own errors) print one clear line and exit with status 2, no traceback;
so does an exception raised by the user's own code (a workload's make_batch, loss or model), named
by its function, with the traceback under --verbose. Exit statuses are in EXIT_STATUS.
"""

from __future__ import annotations

import argparse
import difflib
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
from .commands import quiet
from .commands.host_memory import host_memory_line, host_out_of_memory
from .errors import MicrobatchError, planning_notes

# name -> one-line help; the module is microbatch.commands.<name>
COMMANDS: dict[str, str] = {
    "train": "train a built-in GPT size with a plan for this machine's memory",
    "plan": "choose micro-batch size, accumulation steps and checkpointing for a memory budget",
    "verify": "check that accumulated gradients equal the full-batch gradient",
    "bench": "run the benchmark suites and write benchmarks/RESULTS.md",
}


# Each command's help ends with its own exit statuses (its module's EXIT_STATUS); `microbatch --help`
# with all of them.
EXIT_STATUS = (
    "Exit status: 0 done; 1 verify: the accumulated gradient differs from the full batch's, bench: a "
    "suite failed; 2 a usage mistake or an error raised by your own code (run with -v/--verbose for its "
    "traceback); 3 an internal error of microbatch (a bug: the traceback is printed); 130 interrupted "
    "(train: 128 + the signal's number, e.g. 130 SIGINT, 143 SIGTERM, the checkpoint saved). "
    "`microbatch COMMAND --help` gives each command's own."
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
        sub = subparsers.add_parser(name, help=help_text, description=help_text, epilog=module.EXIT_STATUS)
        module.add_arguments(sub)
        sub.set_defaults(_run=module.run)
    return parser


def parse_arguments(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """``parser.parse_args(argv)``, with "did you mean --memory?" for a mistyped option.

    argparse names an unknown option but suggests nothing before Python 3.14 (suggest_on_error),
    and a mistyped required option is reported as missing. So the options after the command are
    checked first against the command's own (an unambiguous prefix is one, as argparse allows).
    """
    command_name = next((word for word in argv if word in COMMANDS), None)
    command = _subcommand(parser, command_name)
    if command is not None and command_name is not None:
        options = [option for action in command._actions for option in action.option_strings]
        for word in argv[argv.index(command_name) + 1 :]:
            key = word.split("=")[0]
            if not key.startswith("--") or key == "--" or any(option.startswith(key) for option in options):
                continue
            close = difflib.get_close_matches(key, options, n=1)
            if close:
                command.error(f"unrecognized argument {word} (did you mean {close[0]}?)")
    return parser.parse_args(argv)


def _subcommand(parser: argparse.ArgumentParser, name: str | None) -> argparse.ArgumentParser | None:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and name in action.choices:
            chosen: argparse.ArgumentParser = action.choices[name]
            return chosen
    return None


class _CurrentStderrHandler(logging.StreamHandler):
    """Writes to whatever sys.stderr is at the time of each record (tests swap it)."""

    @property
    def stream(self) -> object:
        return sys.stderr

    @stream.setter
    def stream(self, _value: object) -> None:
        pass

    def handleError(self, record: logging.LogRecord) -> None:  # noqa: N802 (logging's name)
        # A log line that cannot be written (a hang-up, a full disk, a closed pipe) never costs the run.
        if isinstance(sys.exc_info()[1], (OSError, ValueError)):
            quiet.silence(sys.stderr)
        else:
            super().handleError(record)


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
    args = parse_arguments(parser, list(argv) if argv is not None else sys.argv[1:])
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
        if host_out_of_memory(error):
            line = host_memory_line(args.command, error, args)
            print(f"microbatch {args.command}: error: {line}", file=sys.stderr)
            return 2
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
        during = "".join(f" ({note})" for note in planning_notes(error))
        print(
            f"microbatch {args.command}: error in your code: {where} raised "
            f"{type(error).__name__}: {_one_line(error)}{during}{hint}",
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
