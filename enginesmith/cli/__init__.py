"""The `enginesmith` command line: export | build | trt-lint | triton | run | chat | serve | bench | eval | doctor |
plugins | models.

One module per verb (trtexec/polygraphy style), each with `add_parser(verbs)` and `cmd_<verb>(args)`;
the flags several verbs share live in cli.flags. This module assembles the parser and runs a verb.

Every user mistake ends as one line on stderr, `error: <what> (fix: <how>)`, and a non-zero exit
code (2 bad input, 3 bad engine directory, 130 interrupted). Set ENGINESMITH_DEBUG=1 for tracebacks.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import traceback

from enginesmith import __version__
from enginesmith.cli import bench, build, chat, doctor, export, models, plugins, serve, triton, trt_lint
from enginesmith.cli import eval as eval_verb  # not the builtin
from enginesmith.cli import run as run_verb  # the module; run() below is the `enginesmith` command
from enginesmith.core import interrupts
from enginesmith.core.errors import EXIT_INTERRUPTED, EXIT_TERMINATED, EngineError, UserError

VERBS = (export, build, trt_lint, triton, run_verb, chat, serve, bench, eval_verb, doctor, plugins, models)  # in --help's order


class _Parser(argparse.ArgumentParser):
    """argparse with the CLI's one-line error contract for usage mistakes (exit 2)."""

    def error(self, message: str):
        self.exit(2, f"error: {message} (fix: see `{self.prog} --help`)\n")


def parser() -> argparse.ArgumentParser:
    top = _Parser(
        prog="enginesmith",
        description="Turn a Hugging Face causal LM into an inference engine and run it.",
        epilog="Example: enginesmith run \"What is the capital of France?\"")
    top.add_argument("--version", action="version", version=f"enginesmith {__version__}")
    verbs = top.add_subparsers(dest="verb", metavar="VERB", required=True)
    for verb in VERBS:
        verb.add_parser(verbs)
    return top


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:300] if text else type(exc).__name__


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    debug = os.environ.get("ENGINESMITH_DEBUG") == "1"
    # SIGINT and SIGTERM raise while the command runs, so every cleanup path runs (temp dirs, partial
    # outputs); the handlers below run inside, so their SIG_IGN stays after a first signal
    with interrupts.as_exceptions():
        try:
            return args.func(args) or 0
        except UserError as exc:
            if debug:
                traceback.print_exc()
            print(f"error: {exc}", file=sys.stderr)
            return exc.exit_code
        except KeyboardInterrupt as exc:
            for sig in (signal.SIGINT, signal.SIGTERM):  # a late second signal must not change the exit status
                signal.signal(sig, signal.SIG_IGN)
            terminated = isinstance(exc, interrupts.Terminated)
            print(f"\n{'terminated' if terminated else 'interrupted'} (nothing half-written was kept)", file=sys.stderr)
            return EXIT_TERMINATED if terminated else EXIT_INTERRUPTED
        except BrokenPipeError:
            return 0
        except Exception as exc:  # a bug of ours: one line, and how to see more
            if debug:
                traceback.print_exc()
            if type(exc).__module__.startswith("onnxruntime."):  # the engine's graph failed inside ONNX Runtime
                print(f"error: onnxruntime failed running the engine: {_first_line(exc)} (fix: rebuild the engine "
                      "with `enginesmith build`; if this enginesmith built it, rerun with ENGINESMITH_DEBUG=1 and report "
                      "it)", file=sys.stderr)
                return EngineError.exit_code
            print(f"error: internal error: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''} "
                  "(fix: rerun with ENGINESMITH_DEBUG=1 and report the traceback)", file=sys.stderr)
            return 1


def run() -> None:
    """The `enginesmith` command: main(), then exit with its status. After an interrupt the process
    leaves at once (os._exit) once its message is out, skipping interpreter shutdown (atexit hooks,
    the worker threads of torch and ONNX Runtime): a full-suite run under load saw such a process,
    its "interrupted" line printed, end by SIGINT (-2) instead of exit status 130."""
    code = main()
    if code in (EXIT_INTERRUPTED, EXIT_TERMINATED):
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):  # a closed or broken pipe: nothing more to say
                pass
        os._exit(code)
    sys.exit(code)
