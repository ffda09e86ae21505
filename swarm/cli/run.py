"""(placeholder until its issue lands: register() adds nothing yet)"""

import typer


def register(app: typer.Typer) -> None:
    return None
