"""The ``loca`` command. Thin: every subcommand is a recipe module with ``add_arguments`` and
``run``; the logic lives in the library."""

from __future__ import annotations

import argparse
import logging
import signal
import sys

from .. import __version__
from . import (
    bench_command,
    calibrate_command,
    compare_command,
    evaluate_command,
    fit_command,
    generate_command,
    report_command,
    tasks_command,
)

COMMANDS = {  # subcommand -> its module (add_arguments, run)
    "fit": fit_command,
    "calibrate": calibrate_command,
    "evaluate": evaluate_command,
    "tasks": tasks_command,
    "bench": bench_command,
    "compare": compare_command,
    "generate": generate_command,
    "report": report_command,
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="loca", description="Forward-only tuning of frozen language models (LoCA)."
    )
    parser.add_argument("--debug", action="store_true", help="show the full traceback of an error")
    parser.add_argument("--version", action="version", version=f"loca {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, recipe in COMMANDS.items():
        p = sub.add_parser(
            name,
            help=recipe.__doc__.strip().splitlines()[0],
            description=recipe.__doc__,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        recipe.add_arguments(p)
        p.set_defaults(_run=recipe.run, _parser=p)
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, parsed; an unknown flag is reported with the usage of the subcommand it
    was given to (argparse would show the top-level usage), and exits with status 2."""
    args, unknown = build_parser().parse_known_args(argv)
    if unknown:
        args._parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run one subcommand. An error ends in one line on stderr (exit 2 for bad input, 1 for any
    other failure); ``loca --debug ...`` shows the traceback instead."""
    args = parse_args(argv)
    from ..infra import distributed

    distributed.init_from_env(getattr(args, "device", None) or "auto")  # under torchrun
    quiet = getattr(args, "quiet", False) or not distributed.is_main()  # rank 0 speaks
    configure_logging(quiet=quiet, verbose=getattr(args, "verbose", False))
    if not distributed.is_main():
        logging.getLogger("loca").setLevel(logging.ERROR)
    previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        return int(args._run(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Terminated:
        print("terminated", file=sys.stderr)
        return 143
    except Exception as exc:
        if args.debug:
            raise
        bad_input = isinstance(exc, ValueError | FileNotFoundError | FileExistsError | KeyError)
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        kind = "" if isinstance(exc, ValueError | FileNotFoundError) else f"{type(exc).__name__}: "
        hint = f"(loca --debug {args.command} ... shows the traceback)"
        print(f"loca {args.command}: error: {kind}{text} {hint}", file=sys.stderr)
        return 2 if bad_input else 1
    finally:
        signal.signal(signal.SIGTERM, previous)
        distributed.shutdown()


class _StderrHandler(logging.Handler):
    """Writes to whatever ``sys.stderr`` is at the time (so captured streams see the lines)."""

    def emit(self, record: logging.LogRecord) -> None:
        print(self.format(record), file=sys.stderr, flush=True)


class _Format(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        text = record.getMessage()
        if record.levelno >= logging.WARNING:
            return f"loca: {record.levelname.lower()}: {text}"
        return text


def configure_logging(quiet: bool = False, verbose: bool = False) -> None:
    """The ``loca`` logger for the command line: messages on stderr, warnings as ``loca:
    warning: ...``; ``quiet`` keeps warnings and errors only, ``verbose`` adds debug lines."""
    logger = logging.getLogger("loca")
    for h in [h for h in logger.handlers if isinstance(h, _StderrHandler)]:
        logger.removeHandler(h)
    handler = _StderrHandler()
    handler.setFormatter(_Format())
    logger.addHandler(handler)
    logger.setLevel(logging.WARNING if quiet else logging.DEBUG if verbose else logging.INFO)
    logger.propagate = False
    if quiet:  # transformers' own bars (loading weights) too
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()


class Terminated(BaseException):
    """SIGTERM, raised like Ctrl-C so that every ``finally`` runs: the best snapshot is restored
    and no temporary folder is left behind."""


def _terminate(signum, frame) -> None:
    raise Terminated()
