"""The ``llmc-fsm`` command line.

Subcommands:
    lifecycle   print the session lifecycle (``--mermaid``: the diagram generated from the table)
    modifiers   list every discovered modifier plugin (exit status 1 when a plugin failed to load)
    explain     print a recipe's plan without touching a model
    oneshot     compress a model in one shot and report perplexity before/after
    model-free  quantize a safetensors checkpoint shard by shard with a data-free scheme (no model built)
    report      re-print a saved one-shot report (``--plot``: draw per-layer sparsity)

``llmc-fsm --version`` prints the package version; ``-v`` / ``--verbose`` (before or after the subcommand) logs
debug messages and lets an error raise with its traceback. An error is one line on stderr (exit status 1, or 2 for a
command line argparse rejects, with a pointer to ``--help`` instead of the usage block; a module of the ``hf`` extra
not installed, e.g. transformers for ``oneshot``: exit status 1 and ``pip install "llmc-fsm[hf]"``; a recipe with
several problems: a heading line, then one line per problem, all found before any work); under
``torchrun`` an error every rank raises alike is printed once, by rank 0, and a rank's own error (a file missing on
its node, a crash) by that rank, prefixed ``rank N: `` (:func:`~llmc_fsm.toolkit.distributed.error_line_to_print`;
every rank exits with 1; ``-v`` shows each rank's traceback).

Each subcommand lives in the module that implements it and contributes an
``add_cli(subparsers)`` function; this module only wires them together.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import logging
import os
import re
import sys
from collections.abc import Iterator, Sequence
from typing import Any, NoReturn

from tqdm.contrib.logging import logging_redirect_tqdm

from llmc_fsm.cli import lifecycle, model_free, oneshot, plugins, report
from llmc_fsm.core.errors import ModifierError
from llmc_fsm.core.registry import missing_extra_hint
from llmc_fsm.core.version import __version__
from llmc_fsm.toolkit.distributed import (
    error_line_to_print,
    launched_world_size,
    peer_failure,
    process_group_from_env,
)
from llmc_fsm.toolkit.heap import use_huge_pages

__all__ = ["main"]

_VERBOSE = "log debug messages, and show an error with its traceback instead of one line"

#: Modules that contribute subcommands through ``add_cli(subparsers)``.
#: The subcommands, in the order ``--help`` lists them; each module has ``add_cli(subparsers)``.
_SUBCOMMANDS = (lifecycle, plugins, oneshot, model_free, report)


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (the command's usage block is what ``--help`` is for), and an option
    is spelled out: argparse's prefix matching ran ``--num-sample 8`` as ``--num-samples 8`` (found by a README-only
    newcomer), where a misspelt option is a mistake to name (``did you mean --num-samples?``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)  # the subcommands' parsers are made by this class too
        super().__init__(*args, **kwargs)

    def parse_known_args(self, args: Sequence[str] | None = None, namespace: Any = None) -> Any:
        self._tokens = list(sys.argv[1:] if args is None else args)  # for error(): the options this parser was given
        return super().parse_known_args(args, namespace)

    def error(self, message: str) -> NoReturn:
        hint = _did_you_mean(message)
        if message.startswith("the following arguments are required"):
            hint += self._misspelt_options()
        elif not hint and "invalid choice" in message:  # ``llmc-fsm --oneshot --model x``: 'x' taken as COMMAND
            hint = self._misspelt_options()
        self.exit(2, f"{self.prog}: error: {message}{hint}; see '{self.prog} --help'\n")

    def _misspelt_options(self, tokens: Sequence[str] | None = None, *, named: bool = False) -> str:
        """`` (--outpu was given: did you mean --output?)`` for the options given that this parser does not know
        and that are close to one it does: argparse reports a missing required option before the unknown ones, so
        ``--outpu DIR`` said only that ``--output`` was missing; ``""`` when there is none."""
        tokens = list(getattr(self, "_tokens", []) if tokens is None else tokens)
        given = tokens[: tokens.index("--")] if "--" in tokens else tokens
        known = [o for o in self._option_string_actions if o not in ("-h", "--help")]  # argparse's option strings
        positional = {  # MODEL given as --model: name it (it was told "did you mean --help?")
            name: action.metavar or action.dest
            for action in self._actions
            if not action.option_strings
            for name in {str(action.dest).lower(), str(action.metavar or "").lower()}
            if name
        }
        subcommands = [  # ``llmc-fsm --oneshot``: the subcommand given as an option
            str(choice) for action in self._actions if isinstance(action.choices, dict) for choice in action.choices
        ]
        hints = []
        for option in dict.fromkeys(t.split("=")[0] for t in given if t.startswith("--") and len(t) > 2):
            if option in known:
                continue
            given_as = "" if named else f"{option} was given: "  # the message names the unknown options already
            close = difflib.get_close_matches(option[2:].lower(), list(positional), 1)
            if close:
                hints.append(f"{given_as}{positional[close[0]]} is positional, give it without {option}")
            elif close := difflib.get_close_matches(option[2:].lower(), subcommands, 1, cutoff=0.8):
                hints.append(f"{given_as}{close[0]} is a subcommand, give it without --")
            elif close := difflib.get_close_matches(option, known, 1):
                hints.append(f"{given_as}did you mean {close[0]}?")
        everything = getattr(self, "_tokens", given)  # ``given`` is only the unknown ones when ``named``
        given_model = any(t == "--model" or t.startswith("--model=") for t in everything)
        if "--model" in known and not positional and not given_model:  # ``explain R x``: x need not be a model
            bare = [  # ``oneshot smollm2-135m``: the model is an option (a value after an unknown option is its own)
                t
                for i, t in enumerate(given)
                if not t.startswith("-") and not (i and given[i - 1].startswith("-") and "=" not in given[i - 1])
            ]
            if bare:
                hints.append(f"{'' if named else bare[0] + ' was given: '}give the model as --model {bare[0]}")
        return f" ({'; '.join(hints)})" if hints else ""


def _did_you_mean(message: str) -> str:
    """`` (did you mean 'oneshot'?)`` for argparse's ``invalid choice: 'onesht' (choose from ...)`` when a choice is
    close to the value given (a misspelt subcommand or ``--method``); ``""`` otherwise."""
    found = re.search(r"invalid choice: '?(.*?)'? \(choose from (.*)\)$", message)
    if found is None:
        return ""
    choices = [c.strip().strip("'\"") for c in found.group(2).split(",")]
    close = difflib.get_close_matches(found.group(1), choices, 1)
    return f" (did you mean '{close[0]}'?)" if close else ""


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="llmc-fsm",
        description="Compress LLMs through a session with a guarded lifecycle and plugin modifiers.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help=_VERBOSE)
    parser.add_argument("--version", action="version", version=f"llmc-fsm {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in _SUBCOMMANDS:
        module.add_cli(sub)
    for command in sub.choices.values():  # ``llmc-fsm oneshot -v ...`` as well as ``llmc-fsm -v oneshot ...``
        command.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help=_VERBOSE)
    parser.set_defaults(_commands=sub.choices)
    return parser


def _reject_unknown(args: argparse.Namespace, extra: list[str]) -> None:
    """Exit with status 2 through the subcommand's own parser (its usage line, not the top level's), naming the
    unknown arguments and, for a misspelt option, the option meant."""
    command = args._commands[args.command]
    command.error(f"unrecognized arguments: {' '.join(extra)}{command._misspelt_options(extra, named=True)}")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the process exit status (0 ok, 1 error, 2 usage)."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if not getattr(args, "low_memory", False):  # --low-memory maps each large tensor afresh: whole huge pages cost
        use_huge_pages()  # before the first tensor (the plugins' imports make some): torch reads it once
    if extra:
        _reject_unknown(args, extra)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING, format=_log_format())
    _compressed_tensors_logs_once()
    try:
        with _logs_above_the_bars(), process_group_from_env():  # under torchrun (WORLD_SIZE > 1): one rank
            try:
                return int(args.func(args) or 0)
            except BrokenPipeError:  # below: nothing to say
                raise
            except ModuleNotFoundError as exc:  # the [hf] extra not installed: which command needs what
                said = _missing_extra(exc, args.command)
                if said is None or args.verbose:
                    raise
                line = error_line_to_print(f"llmc-fsm {args.command}: error: {said}", exc)
                if line is not None:
                    print(line, file=sys.stderr)
                return 1
            except (ValueError, RuntimeError, OSError) as exc:  # said while the ranks can still compare lines
                if args.verbose:
                    raise
                said = _one_line(exc)
                notes = getattr(exc, "__notes__", None)
                if notes and peer_failure(exc) is not None:  # the progress kept for --resume, as an interruption
                    said = f"{said.rstrip('.')}; {notes[-1]}"
                line = error_line_to_print(f"llmc-fsm {args.command}: error: {said}", exc)
                if line is not None:
                    print(line, file=sys.stderr)
                return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # stdout's reader stopped (`llmc-fsm report OUT | head -1`): nothing left to say
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # Python's flush at exit would raise again
        return 0
    except (ValueError, RuntimeError, OSError) as exc:  # OSError: FileNotFoundError, PermissionError, ...
        if args.verbose:
            raise
        if _launch_rank() == 0:  # the process group's own checks fail alike on every rank: one line, from rank 0
            print(f"llmc-fsm {args.command}: error: {_one_line(exc)}", file=sys.stderr)
        return 1


def _missing_extra(exc: ModuleNotFoundError, command: str) -> str | None:
    """What the command prints when ``exc`` is a module of an llmc-fsm extra that is not installed (``llmc-fsm
    oneshot`` with llmc-fsm installed without extras ended in a traceback, found by a tester), else ``None`` (then
    it is raised as it is)."""
    hint = missing_extra_hint(exc)
    if hint is None:
        return None
    missing = (exc.name or "").split(".")[0]
    return f"{missing} is not installed, and {command} needs it to read Hugging Face models; {hint}"


def _one_line(exc: BaseException) -> str:
    """What the command prints for ``exc``. A modifier's failure (:class:`~llmc_fsm.ModifierError`) without the
    session's advice to library callers ("Continue, or finalize()/reset() the session"): the command owns its session
    and keeps nothing of the model it held. A modifier's own refusal (a ``ValueError``, which names the modifier) is
    printed as it is; anything else with the hook that raised it. A ``ModifierError`` with a message of its own (not
    the session's "<modifier>.<hook>() raised ...") is printed as it is."""
    cause = exc.__cause__
    if not isinstance(exc, ModifierError) or cause is None:
        return str(exc)
    where = f"{exc.modifier}'s {exc.hook} on {exc.module}" if exc.module else f"{exc.modifier}.{exc.hook}()"
    if not str(exc).startswith(where):  # a message of its own (model_free_ptq's refusal): as it is
        return str(exc)
    if isinstance(cause, ValueError):
        return str(cause)
    return f"{where} raised {type(cause).__name__}: {cause}"


def _compressed_tensors_logs_once() -> None:
    """compressed-tensors logs through loguru and marks the warnings it repeats per module ``log_once`` (e.g. a block
    size that does not divide a width), which only a handler with its ``support_log_once`` filter honours: loguru's
    default handler printed one of them 180 times for SmolLM2 (found by a tester). The command owns its process, so
    it gives loguru's default stderr handler that filter (compressed-tensors is imported only when a record comes,
    by then it is); the library itself leaves loguru alone."""
    try:
        from loguru import logger as loguru_logger
    except ImportError:  # no compressed-tensors installed: no loguru records either
        return

    def once(record: Any) -> bool:
        from compressed_tensors.logger import support_log_once

        return support_log_once(record)

    loguru_logger.remove()  # the default handler (stderr, every level), as compressed-tensors' own configuration does
    loguru_logger.add(lambda message: sys.stderr.write(message), filter=once)  # the stderr of the moment


@contextlib.contextmanager
def _logs_above_the_bars() -> Iterator[None]:
    """Inside the block the root logger's console handlers write through ``tqdm.write``, each line above the
    progress bars (a warning raised mid-bar went on the bar's line: found by a tester). Without a console handler
    (the caller's logging writes elsewhere, e.g. ``main()`` called under pytest's log capture) nothing is added."""
    streams = (sys.stdout, sys.stderr)
    console = [h for h in logging.root.handlers if isinstance(h, logging.StreamHandler) and h.stream in streams]
    with logging_redirect_tqdm() if console else contextlib.nullcontext():
        yield


def _log_format() -> str:
    """The CLI's log line: ``WARNING name: message``, under torchrun with the rank first (``rank 1: WARNING ...``).

    Every rank prints its warnings: a rank compresses its own share of the modules, and their warnings (a
    dampening retry) exist on that rank only (a tester found them lost when only rank 0 printed); the warnings
    every rank raises alike come once per rank, each line saying whose."""
    rank = f"rank {_launch_rank()}: " if launched_world_size() > 1 else ""
    return f"{rank}%(levelname)s %(name)s: %(message)s"


def _launch_rank() -> int:
    """This process's rank as ``torchrun`` set it (``RANK`` with ``WORLD_SIZE`` > 1), else 0."""
    try:
        return int(os.environ.get("RANK", "0")) if launched_world_size() > 1 else 0
    except ValueError:
        return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
