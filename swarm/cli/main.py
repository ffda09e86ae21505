"""Entry point: builds the typer app from the command modules and maps errors to exit codes."""

from __future__ import annotations

import logging
import sys

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
    from swarm.cli import bootstrap, config, demo, invite, join, plan, run, status

    for module in (run, demo, plan, invite, join, bootstrap, status, config):
        module.register(app)


_register_commands()


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; a SwarmError becomes one line on stderr and its documented exit code."""
    try:
        code = app(args=argv, standalone_mode=False)
    except SwarmError as exc:
        ui.error(str(exc))
        return exc.exit_code
    except typer.Exit as exc:
        return int(exc.exit_code or 0)
    except typer.Abort:
        ui.error("aborted")
        return 130
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # click usage errors carry their own exit code
        code = getattr(exc, "exit_code", None)
        if isinstance(code, int) and hasattr(exc, "format_message"):
            ui.error(exc.format_message(), hint="see --help")  # type: ignore[attr-defined]
            return 2
        logging.getLogger("swarm").exception("internal error")
        return 1
    return int(code) if isinstance(code, int) else 0


if __name__ == "__main__":
    sys.exit(main())
