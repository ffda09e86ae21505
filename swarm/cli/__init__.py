"""The ``shard-swarm`` command line (typer). ``ui.py`` is the only importer of rich.

Each command group lives in its own module with a ``register(app)`` function; ``main.py`` wires
them together and maps :class:`swarm.errors.SwarmError` to one line on stderr and an exit code.
"""
