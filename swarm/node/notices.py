"""What a node tells its user: one-line notices, membership changes, and its life as events.

``join`` prints notices on stderr, membership changes on stdout and (``--json``) the node's
life as JSON events: plan, loading, serving, waiting, replan, leaving, handover. A node process
without a UI logs its notices instead. Every component reports through one :class:`Notices`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("swarm.node")


@dataclass
class Hooks:
    """The UI's callbacks (each optional)."""

    on_event: Callable[[str], None] | None = None  # a one-line notice for the user
    on_member: Callable[[Any], None] | None = None  # a MemberEvent (membership.py)
    on_life: Callable[[dict[str, Any]], None] | None = None  # a life event (join --json)


class Notices:
    def __init__(self, hooks: Hooks) -> None:
        self.hooks = hooks
        # shown once, not twice: a notice the UI prints is only a debug log line
        self._level = logging.DEBUG if hooks.on_event is not None else logging.INFO

    def event(self, text: str) -> None:
        """A line for the UI only (the log has its own, more detailed, line)."""
        if self.hooks.on_event is not None:
            self.hooks.on_event(text)

    def notice(self, text: str) -> None:
        """A one-line notice for the user (and the log)."""
        log.log(self._level, "%s", text)
        self.event(text)

    def life(self, event: str, **fields: Any) -> None:
        """One event of this node's life for a machine reader (``join --json``)."""
        if self.hooks.on_life is not None:
            self.hooks.on_life({"event": event, **fields})
