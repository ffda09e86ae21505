"""``shard-swarm config``: show the settings in force (and where each came from), create the file.

``config show`` prints every setting with its value and source (default, file); ``--json`` for
scripts. ``config init`` writes a commented template; ``config path`` prints where the file is.
The API token is shown only as set / not set.
"""

from __future__ import annotations

from pathlib import Path

import typer

from swarm.cli import ui
from swarm.cli.settings import config_path, load_config, write_template

config_app = typer.Typer(help="Show or create the configuration file.", no_args_is_help=True)


@config_app.command("show")
def show(
    file: Path | None = typer.Option(None, "--file", help="Config file (default: <config dir>/config.toml)."),
    as_json: bool = typer.Option(False, "--json", help="JSON on stdout."),
) -> None:
    """Print the settings in force and where each came from."""
    cfg = load_config(file)
    rows = cfg.describe()
    if as_json:
        ui.print_json({"path": str(cfg.path), "exists": cfg.loaded, "settings": rows})
        return
    if not cfg.loaded:
        ui.notice(f"no config file at {cfg.path}: defaults in force (create one with `shard-swarm config init`)")
    ui.print_table(f"settings ({cfg.path})", ["key", "value", "source"],
                   [[r["key"], r["value"], r["source"]] for r in rows])  # fmt: skip


@config_app.command("path")
def path() -> None:
    """Print where the config file is (or would be)."""
    typer.echo(str(config_path()))


@config_app.command("init")
def init(
    file: Path | None = typer.Option(None, "--file", help="Where to write (default: <config dir>/config.toml)."),
    force: bool = typer.Option(False, "--force", help="Overwrite an existing file."),
) -> None:
    """Write a commented template to fill in."""
    written = write_template(file or config_path(), force=force)
    ui.notice(f"wrote {written}")
    typer.echo(str(written))


def register(app: typer.Typer) -> None:
    app.add_typer(config_app, name="config")
