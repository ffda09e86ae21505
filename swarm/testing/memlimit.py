"""A memory limit around test processes: a child of this process's own memory cgroup.

The proof that ``--memory`` is a peer's whole budget (planner/budget.py) runs each node process
inside a cgroup whose limit is what that node offered: the kernel kills a process that goes over
(there is no swap to hide in: ``memsw`` is capped too where cgroup v1 has it). Both cgroup
versions: v2's ``memory.max`` / ``memory.peak`` / ``memory.events``, v1's
``memory.limit_in_bytes`` / ``memory.max_usage_in_bytes`` / ``memory.oom_control``. Charges a
process made before it joined move with it (v1 ``move_charge_at_immigrate``; v2 does not move
them, so join a process early). :func:`memlimit_unavailable_reason` says why none can be made
here (no writable memory cgroup, not root), so a test can skip naming it.
:meth:`MemoryCgroup.sample` and :func:`process_memory` read what a benchmark samples every second
(issue 26: a node killed inside its offer is explained by its own series).
"""

from __future__ import annotations

import contextlib
import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

ROOT = Path("/sys/fs/cgroup")


def _own_cgroup() -> tuple[Path, int] | None:
    """(this process's memory cgroup directory, cgroup version), or None."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:  # v1: "4:memory:/path"
        _, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if "memory" in controllers.split(",") and (ROOT / "memory").is_dir():
            return ROOT / "memory" / path.lstrip("/"), 1
    for line in lines:  # v2: "0::/path"
        if line.startswith("0::") and (ROOT / "cgroup.controllers").is_file():
            return ROOT / line[3:].lstrip("/"), 2
    return None


class MemoryCgroup:
    """One child cgroup with a memory limit; processes join it by PID."""

    def __init__(self, path: Path, version: int, limit_bytes: int) -> None:
        self.path, self.version, self.limit_bytes = path, version, limit_bytes

    def _write(self, name: str, value: str) -> None:
        (self.path / name).write_text(value)

    def _read(self, name: str) -> str:
        return (self.path / name).read_text()

    def _setup(self) -> None:
        if self.version == 1:
            self._write("memory.limit_in_bytes", str(self.limit_bytes))
            with contextlib.suppress(OSError):  # no swap accounting: nothing to cap
                self._write("memory.memsw.limit_in_bytes", str(self.limit_bytes))
            with contextlib.suppress(OSError):  # deprecated, and refused by some kernels
                self._write("memory.move_charge_at_immigrate", "3")  # anonymous and file pages move along
        else:
            self._write("memory.max", str(self.limit_bytes))
            with contextlib.suppress(OSError):
                self._write("memory.swap.max", "0")

    def add(self, pid: int) -> None:
        self._write("cgroup.procs", str(pid))

    def peak_bytes(self) -> int:
        """The most this cgroup's processes held at once (RSS and page cache they caused)."""
        name = "memory.max_usage_in_bytes" if self.version == 1 else "memory.peak"
        return int(self._read(name).split()[0])

    def oom_kills(self) -> int:
        """Processes the kernel killed here for going over the limit."""
        name = "memory.oom_control" if self.version == 1 else "memory.events"
        for line in self._read(name).splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
        return 0

    def sample(self) -> dict[str, int]:
        """Now, in bytes and counts: the cgroup's charge (``usage``), of it anonymous memory
        (``anon``) and page cache (``file``), and the kernel's ``oom`` (v2: times at the limit and
        out of room; v1: ``failcnt``, charges refused at the limit, each a reclaim) and
        ``oom_kill`` events, in either cgroup version."""
        v1 = self.version == 1
        stat = dict(line.split() for line in self._read("memory.stat").splitlines())
        events = dict(line.split() for line in self._read("memory.oom_control" if v1 else "memory.events").splitlines())
        return {"usage": int(self._read("memory.usage_in_bytes" if v1 else "memory.current").split()[0]),
                "anon": int(stat.get("total_rss" if v1 else "anon", 0)),
                "file": int(stat.get("total_cache" if v1 else "file", 0)),
                "oom": int(self._read("memory.failcnt")) if v1 else int(events.get("oom", 0)),
                "oom_kill": int(events.get("oom_kill", 0))}  # fmt: skip

    def _remove(self) -> None:
        for _ in range(50):  # the processes must have left (exited) before the directory goes
            try:
                self.path.rmdir()
                return
            except OSError:
                time.sleep(0.1)


PROC_FIELDS = {"VmRSS": "rss", "RssAnon": "anon", "RssFile": "file", "VmHWM": "hwm"}


def process_memory(pid: int) -> dict[str, int]:
    """A live process's resident memory now (``rss``, of it ``anon`` and ``file``) and its peak
    (``hwm``), in bytes from /proc/PID/status; {} once it is gone."""
    found: dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in PROC_FIELDS:
                    found[PROC_FIELDS[key]] = int(rest.split()[0]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        return {}
    return found


def memlimit_unavailable_reason() -> str | None:
    """Why no memory-limited cgroup can be made here, or None when one can."""
    own = _own_cgroup()
    if own is None:
        return "no memory cgroup (neither v1's memory controller nor v2's unified hierarchy is mounted)"
    path, version = own
    if not os.access(path, os.W_OK):
        return f"memory cgroup {path} is not writable (cgroup v{version}; root or a delegated cgroup needed)"
    if version == 2 and "memory" not in (path / "cgroup.subtree_control").read_text().split():
        return f"cgroup v2 at {path} does not delegate the memory controller to its children"
    return None


@contextlib.contextmanager
def memory_cgroup(limit_bytes: int, name: str = "swarm-test") -> Iterator[MemoryCgroup]:
    """A child of this process's memory cgroup limited to ``limit_bytes``; removed on exit (its
    processes must have exited by then). Check :func:`memlimit_unavailable_reason` first."""
    own = _own_cgroup()
    if own is None:
        raise RuntimeError("no memory cgroup here")
    path = own[0] / f"{name}-{uuid.uuid4().hex[:8]}"
    path.mkdir()
    cg = MemoryCgroup(path, own[1], limit_bytes)
    try:
        cg._setup()
        yield cg
    finally:
        cg._remove()
