"""Entry point: builds the typer app from the command modules and maps errors to exit codes."""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from typing import Any

import typer

from swarm.cli import ui
from swarm.errors import SwarmError

app = typer.Typer(
    name="shard-swarm",
    help="Run one large language model across a few friends' machines.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@app.callback()
def _root(
    verbose: bool = typer.Option(False, "-v", "--verbose", help="Debug logging on stderr."),
    quiet: bool = typer.Option(False, "-q", "--quiet", help="No progress output."),
) -> None:
    ui.configure(verbose=verbose, quiet=quiet)


def _register_commands() -> None:
    # Each module owns one command (group) and exposes register(app).
    from swarm.cli import bootstrap, config, demo, invite, join, model, plan, run, status

    for module in (run, demo, plan, invite, join, bootstrap, status, config, model):
        module.register(app)


_register_commands()


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; a SwarmError becomes one line on stderr and its documented exit code."""
    return run_guarded(lambda: app(args=argv, standalone_mode=False))


def run_guarded(call: Callable[[], Any]) -> int:
    """Run a command and map what it raises to one line and an exit code (README, "Exit codes").
    trio wraps errors in exception groups: the first SwarmError (or Ctrl-C) inside one is what the
    user meets. A traceback is printed only for a bug (exit 1), or with ``--verbose``."""
    try:
        code = call()
    except BaseException as exc:  # noqa: BLE001 - this is the boundary that maps everything
        return _exit_code(exc)
    return int(code) if isinstance(code, int) else 0


def _exit_code(exc: BaseException) -> int:
    from swarm.node.errors_util import first_leaf

    verbose = logging.getLogger("swarm").isEnabledFor(logging.DEBUG)
    err = first_leaf(exc, SwarmError)
    if isinstance(err, SwarmError):
        if verbose:
            logging.getLogger("swarm").debug("details", exc_info=exc)
        ui.error(str(err), hint=getattr(err, "hint", None) or _HINTS.get(type(err).exit_code))
        return err.exit_code
    if isinstance(exc, typer.Exit):
        return int(exc.exit_code or 0)
    if isinstance(exc, typer.Abort):
        ui.error("aborted")
        return 130
    if first_leaf(exc, KeyboardInterrupt) is not None:
        return 130
    if isinstance(exc, SystemExit):
        return int(exc.code) if isinstance(exc.code, int) else 0
    code = getattr(exc, "exit_code", None)
    if isinstance(code, int) and hasattr(exc, "format_message"):  # click usage errors
        ui.error(exc.format_message(), hint="see --help")  # type: ignore[attr-defined]
        return 2
    logging.getLogger("swarm").error("internal error (a bug: please report it)", exc_info=exc)
    return 1


_HINTS = {
    4: "check the invite file: `shard-swarm invite verify FILE` says what is wrong with it",
    5: "the swarm cannot hold the model yet: more peers, or more --memory each",
    7: "is the swarm up and reachable? `shard-swarm status --manifest FILE`; add -v for details",
}


if __name__ == "__main__":
    sys.exit(main())
