"""Terminal output: the only module that imports rich.

Results go to stdout; progress, logs and errors go to stderr. On a TTY progress is a bar; when
stderr is not a TTY it is plain lines; with ``--quiet`` it is nothing.
"""

from __future__ import annotations

import contextlib
import json
import logging
import sys
from collections.abc import Iterator
from typing import Any

from rich.console import Console
from rich.logging import RichHandler
from rich.markup import escape
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

out = Console(soft_wrap=True)
err = Console(stderr=True, soft_wrap=True)
_quiet = False


class _StderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to whatever ``sys.stderr`` is when a record comes, not the one at set-up (which a
    test harness, or a daemon that redirected it, may have closed since)."""

    @property  # type: ignore[override]
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:
        pass


def configure(*, verbose: bool = False, quiet: bool = False) -> None:
    global _quiet
    _quiet = quiet
    # library news (connections admitted, epochs set up) is INFO: below the default level, shown
    # with --verbose; what the user needs to know comes as notices (ui.notice), not as log lines
    level = logging.DEBUG if verbose else logging.WARNING
    handler: logging.Handler
    if err.is_terminal:
        handler = RichHandler(console=err, show_path=False)
    else:
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger("swarm")
    root.handlers[:] = [handler]
    root.setLevel(level)
    root.propagate = False
    # py-libp2p logs its dial retries and refused handshakes at ERROR ("failed to upgrade
    # security for peer ..." dozens of times on a WAN): our own messages say what matters
    # (its modules set their own levels, so the level goes on a handler of its own)
    lib_handler = _StderrHandler()
    lib_handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    lib_handler.setLevel(logging.DEBUG if verbose else logging.CRITICAL + 1)
    lib = logging.getLogger("libp2p")
    lib.handlers[:] = [lib_handler]
    lib.setLevel(logging.DEBUG if verbose else logging.CRITICAL)
    lib.propagate = False


def error(message: str, hint: str | None = None) -> None:
    """One line on stderr: what went wrong, and (after " -- hint: ") what to do about it."""
    line = " ".join(message.split())  # a message never spans lines
    tail = f" [dim]-- hint: {escape(hint)}[/]" if hint else ""
    err.print(f"[bold red]error:[/] {escape(line)}{tail}", highlight=False, markup=True, soft_wrap=True)


def notice(message: str) -> None:
    if not _quiet:
        err.print(message, highlight=False, markup=False)


def print_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, indent=2, sort_keys=False) + "\n")
    sys.stdout.flush()


def print_table(title: str, columns: list[str], rows: list[list[Any]]) -> None:
    table = Table(title=title)
    for c in columns:
        table.add_column(c)
    for r in rows:
        table.add_row(*[str(x) for x in r])
    out.print(table)


class _Reporter:
    """Progress callback handed to lower layers: ``report(done, total)``."""

    def __init__(self, progress: Progress | None, task: Any, label: str) -> None:
        self._progress, self._task, self._label = progress, task, label
        self._last_pct = -1

    def __call__(self, done: int, total: int) -> None:
        if self._progress is not None:
            self._progress.update(self._task, completed=done, total=total)
        elif not _quiet and total:
            pct = int(100 * done / total)
            if pct // 25 != self._last_pct // 25 or done == total:
                self._last_pct = pct
                err.print(f"{self._label}: {pct}%", highlight=False)


@contextlib.contextmanager
def progress(label: str) -> Iterator[_Reporter]:
    """A progress bar on a TTY, plain lines otherwise, nothing under --quiet."""
    if _quiet or not err.is_terminal:
        yield _Reporter(None, None, label)
        return
    with Progress(
        TextColumn("{task.description}"), BarColumn(), TimeRemainingColumn(), console=err, transient=True
    ) as bar:
        task = bar.add_task(label, total=None)
        yield _Reporter(bar, task, label)


def size(nbytes: float) -> str:
    """Bytes as every message shows them: decimal GB (MB below 0.1 GB), as the planner says."""
    return f"{nbytes / 1e9:.2f} GB" if nbytes >= 1e8 else f"{nbytes / 1e6:.1f} MB"


def short(peer: str | None) -> str:
    """A peer ID as every table and ring line shows it."""
    return "-" if not peer else (peer if len(peer) <= 16 else peer[:14] + "…")


def print_receipt_summary(receipt: dict[str, Any]) -> None:
    """The end-of-run summary on stderr: peers and blocks, ring with per-hop RTT, speed."""
    if _quiet:
        return
    peers = {p["id"]: p for p in receipt.get("peers", [])}
    rtt = receipt.get("rtt_ms", {})
    coord = receipt.get("coordinator", "")
    ring = list(receipt.get("ring", []))
    # each machine once, as `status` shows it: the coordinator starts the path unless it holds
    # the first block itself (then it is one machine, "coordinator+stage", not two)
    path = [*([] if ring[:1] == [coord] else [coord]), *ring, coord]

    def hop_ms(a: str, b: str) -> str:
        if a == b:
            return "local"
        v = rtt.get(a, {}).get(b, rtt.get(b, {}).get(a))
        return f"{v:.2f} ms RTT" if isinstance(v, int | float) else "?"

    table = Table(title="swarm")
    for c in ("peer", "role", "block", "device", "ms/layer"):
        table.add_column(c)
    for pid, p in peers.items():
        block = p.get("block")
        ms = p.get("ms_per_layer")
        role = "coordinator+stage" if pid == coord and block else p.get("role", "")
        table.add_row(short(pid), role, f"[{block[0]}, {block[1]})" if block else "-",
                      p.get("device", ""), f"{ms:.2f}" if isinstance(ms, int | float) else "?")
    err.print(table)
    hops = "".join(f" -> {short(b)} ({hop_ms(a, b)})" for a, b in zip(path[:-1], path[1:], strict=True))
    err.print(f"ring: {short(path[0])}{hops}", highlight=False, markup=False)
    tps = receipt.get("tokens_per_s") or 0.0
    trav = receipt.get("traversal_ms")
    acc = receipt.get("accepted_per_traversal")
    err.print(
        f"{len(receipt.get('output_token_ids', []))} tokens, {tps:.1f} tok/s, traversal "
        + (f"{trav:.1f} ms" if isinstance(trav, int | float) else "?")
        + ", tokens per traversal "
        + (f"{acc:.2f}" if isinstance(acc, int | float) else "?")
        + f", output sha256 {receipt.get('output_sha256', '')[:16]}…",
        highlight=False, markup=False,
    )


def stdout_is_tty() -> bool:
    return bool(out.is_terminal)


@contextlib.contextmanager
def live_status() -> Iterator[Any]:
    """A live view on stdout for ``shard-swarm status``: yields ``show(headline, columns, rows)``,
    which replaces the frame (headline lines above a table)."""
    from rich.console import Group
    from rich.live import Live
    from rich.text import Text

    def frame(lines: list[str], columns: list[str], rows: list[list[str]]) -> Group:
        table = Table(box=None, pad_edge=False)
        for c in columns:
            table.add_column(c)
        for r in rows:
            table.add_row(*[escape(str(x)) for x in r])
        return Group(*[Text(line, style="bold" if i == 0 else "") for i, line in enumerate(lines)], table)

    with Live(console=out, auto_refresh=False, transient=False) as live:

        def show(lines: list[str], columns: list[str], rows: list[list[str]]) -> None:
            live.update(frame(lines, columns, rows), refresh=True)

        yield show
