"""Start a swarm of local node processes on loopback (the demo, multi-process tests, benchmarks).

Each node is a real ``python -m swarm.node`` process with its own identity, libp2p host and
torch threads; they find each other through node 0 (the bootstrap address) and form the ring
through the real stack. Nothing multicasts: discovery is by the bootstrap address only.

Memory: to show a ring on one machine, each node offers just over 1/N of the model (so the
planner must use every node) plus its fixed overhead (``sized_offers``), unless ``memory_bytes``
says otherwise. WAN: with ``delay_ms``, a
delaying proxy process sits in front of every node and each node advertises the proxy's port,
so every hop costs ``delay_ms`` one way.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from swarm.manifest.identity import Identity
from swarm.manifest.manifest import new_manifest, sign_manifest, write_manifest
from swarm.model.devices import resolve_device
from swarm.model.dtypes import resolve_dtype
from swarm.model.weights import open_checkpoint
from swarm.node.compute.drafting import draft_bytes
from swarm.node.ring.capacity import MIN_SESSIONS
from swarm.node.settings import model_spec, overhead_bytes, peak_bytes, plan_memory, planned_part

LOG_TAIL = 6000  # characters of each node's log printed when the code using a LocalSwarm fails


def free_ports(n: int) -> list[int]:
    socks, ports = [], []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
        ports.append(s.getsockname()[1])
    for s in socks:
        s.close()
    return ports


PROXY_START_S = 30.0  # a delay proxy's start-up, to its listeners bound (python and trio imported)


@dataclass
class LocalSwarm:
    workdir: Path
    swarm_id: str  # the invite is workdir / "invite.json"
    secret: bytes
    peer_ids: list[str]
    addrs: list[str]  # dialable multiaddr of each node (through its proxy when delayed)
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    proxy: subprocess.Popen[bytes] | None = None
    _base_cfg: dict[str, object] = field(default_factory=dict)
    node_env: dict[int, dict[str, str]] = field(default_factory=dict)  # extra environment of node i (test hooks)
    _tmp: tempfile.TemporaryDirectory[str] | None = None

    def log(self, i: int) -> str:
        return (self.workdir / f"node{i}.log").read_text(errors="replace")

    def alive(self) -> list[bool]:
        return [p.poll() is None for p in self.procs]

    def kill(self, i: int, sig: int = signal.SIGKILL) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.procs[i].send_signal(sig)

    def stop(self, grace: float = 5.0, *, keep_files: bool = False) -> None:
        """SIGTERM every node (they leave cleanly), SIGKILL what is left after ``grace`` s; then
        the work directory goes (if it was made here), unless ``keep_files``."""
        for p in self.procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    p.send_signal(signal.SIGCONT)
                    p.terminate()
        deadline = time.monotonic() + grace
        for p in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            if p.poll() is None:
                p.kill()
                p.wait(timeout=5)
        if self.proxy is not None and self.proxy.poll() is None:
            self.proxy.kill()
            self.proxy.wait(timeout=5)
        if not keep_files:
            self._cleanup()

    def _cleanup(self) -> None:
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def restart(self, i: int) -> None:
        """Start node ``i`` again from its settings file (same key, same port), as a user
        restarts ``shard-swarm join`` after stopping it; the log goes on in the same file."""
        self._spawn(i, json.loads((self.workdir / f"node{i}.json").read_text()), append_log=True)

    def _spawn(self, i: int, cfg: dict[str, object], *, append_log: bool = False) -> None:
        cfg_file = self.workdir / f"node{i}.json"
        cfg_file.write_text(json.dumps(cfg, indent=2))
        self._base_cfg = cfg
        env = {**os.environ, "OMP_NUM_THREADS": str(cfg["threads"]), "PYTHONUNBUFFERED": "1", **self.node_env.get(i, {})}
        fd = _log_file(self.workdir / f"node{i}.log", append=append_log)
        try:
            proc = subprocess.Popen(
                [sys.executable, "-m", "swarm.node", str(cfg_file)],
                stdout=subprocess.DEVNULL, stderr=fd, env=env, start_new_session=True,
            )  # fmt: skip
        finally:
            os.close(fd)  # the child has its own copy
        if i < len(self.procs):
            self.procs[i] = proc
        else:
            self.procs.append(proc)

    def add_node(self, memory_bytes: int | None = None) -> int:
        """Start one more node (loopback, no delay proxy) that joins through node 0; its index."""
        if self.proxy is not None:
            raise ValueError("add_node does not support delayed swarms")
        i = len(self.procs)
        seed = os.urandom(32)
        self.peer_ids.append(Identity(seed).peer_id)
        listen, fast = free_ports(2)
        self.addrs.append(f"/ip4/127.0.0.1/tcp/{listen}/p2p/{self.peer_ids[i]}")
        seed_file = self.workdir / f"node{i}.seed"
        _write_private(seed_file, seed.hex())
        cfg = {
            **self._base_cfg, "seed_file": str(seed_file), "listen": [f"/ip4/127.0.0.1/tcp/{listen}"],
            "announce": [], "fastpath_port": fast, "fastpath_advertise": [f"127.0.0.1:{fast}"],
        }  # fmt: skip
        if memory_bytes is not None:
            cfg["memory_bytes"] = memory_bytes
        self._spawn(i, cfg)
        return i

    def __enter__(self) -> LocalSwarm:
        return self

    def __exit__(self, typ: type[BaseException] | None, *exc: object) -> None:
        self.stop(keep_files=True)  # first: a node's last words (its leaving) are in its log
        if typ is not None:  # the caller failed: what each node said goes with the failure (CI keeps no files)
            for i in range(len(self.procs)):
                with contextlib.suppress(OSError):
                    print(f"--- node{i}.log, its end ---\n{_log_tail(self.log(i))}", file=sys.stderr)
        self._cleanup()


def start_local_swarm(
    n: int,
    model_dir: Path,
    *,
    dtype: str | list[str] = "auto",
    device: str = "auto",
    threads: int = 1,
    memory_bytes: list[int] | None = None,
    delay_ms: float = 0.0,
    draft: str = "ngram",
    context_tokens: int = 1024,
    chunk_timeout: float = 30.0,
    fastpath: bool = True,
    workdir: Path | None = None,
    compute_delay_s: float = 0.0,
    quant: str = "none",
    kv_cache: str = "auto",
    device_names: list[str] | None = None,
    node_env: dict[int, dict[str, str]] | None = None,
    sessions: int = MIN_SESSIONS,
    compile: bool = False,
    compile_span: int | None = None,
) -> LocalSwarm:
    """``n`` node processes (module doc); ``device_names``: what each node's advert calls its
    machine (NodeSettings.device_name), e.g. a hostile name for the console's escaping test.
    ``compile``: every node runs its stage's decode steps compiled (join --compile), spans up to
    ``compile_span`` (None: NodeSettings' default)."""
    if n < 1:
        raise ValueError("a swarm needs at least one node")
    tmp = None
    if workdir is None:
        tmp = tempfile.TemporaryDirectory(prefix="shard-swarm-")
        workdir = Path(tmp.name)
    workdir.mkdir(parents=True, exist_ok=True)
    seeds = [os.urandom(32) for _ in range(n)]
    peer_ids = [Identity(s).peer_id for s in seeds]
    dtypes = [dtype] * n if isinstance(dtype, str) else list(dtype)  # a mixed ring: one per node
    if len(dtypes) != n:
        raise ValueError(f"{len(dtypes)} dtypes for {n} nodes")
    if memory_bytes is None:
        memory_bytes = sized_offers(n, model_dir, dtypes, device=device, context_tokens=context_tokens, quant=quant,
                                    kv_cache=kv_cache, draft=draft, sessions=sessions)  # fmt: skip
    ports = free_ports(2 * n)
    listen_ports, fast_ports = ports[:n], ports[n:]
    public_ports, fast_public = listen_ports, fast_ports
    proxy = None
    if delay_ms > 0:  # the proxy picks its own public ports: none freed here for another process to take
        proxy, public = _start_delay_proxy(delay_ms, ports, workdir)
        public_ports, fast_public = public[:n], public[n:]
    addrs = [f"/ip4/127.0.0.1/tcp/{public_ports[i]}/p2p/{peer_ids[i]}" for i in range(n)]
    # an invite made on the spot: node 0 is the bootstrap, a throwaway issuer signs it
    issuer = Identity(os.urandom(32))
    manifest = sign_manifest(
        new_manifest(swarm_name="demo", issuer=issuer.public_key, bootstrap=(addrs[0],), lifetime_s=86400,
                     quant=quant, context=context_tokens, kv_cache=kv_cache),
        issuer,
    )
    manifest_file = workdir / "invite.json"
    write_manifest(manifest, manifest_file)
    secret, swarm_id = manifest.secret.value, manifest.swarm_id
    swarm = LocalSwarm(workdir, swarm_id, secret, peer_ids, addrs, _tmp=tmp, node_env=dict(node_env or {}))
    swarm.proxy = proxy
    try:
        for i in range(n):
            seed_file = workdir / f"node{i}.seed"
            _write_private(seed_file, seeds[i].hex())
            cfg = {
                "seed_file": str(seed_file),
                "manifest": str(manifest_file),
                "model_dir": str(model_dir),
                "listen": [f"/ip4/127.0.0.1/tcp/{listen_ports[i]}"],
                "announce": [addrs[i]] if delay_ms > 0 else [],
                "fastpath": fastpath,
                "fastpath_port": fast_ports[i],
                "fastpath_advertise": [f"127.0.0.1:{fast_public[i]}"],
                "memory_bytes": memory_bytes[i],
                "dtype": dtypes[i],
                "device": device,
                "threads": threads,
                "expect_peers": n,
                "draft": draft,
                "chunk_timeout": chunk_timeout,
                "compute_delay_s": compute_delay_s,
                "sessions": sessions,
                "compile": compile,
            }
            if compile_span is not None:
                cfg["compile_span"] = compile_span
            if device_names is not None and device_names[i]:
                cfg["device_name"] = device_names[i]
            swarm._spawn(i, cfg)
    except BaseException:
        swarm.stop()
        raise
    return swarm


def sized_offers(n: int, model_dir: Path, dtypes: list[str], *, device: str = "auto", context_tokens: int = 1024,
                 quant: str = "none", kv_cache: str = "auto", draft: str = "ngram",
                 sessions: int = MIN_SESSIONS) -> list[int]:
    """Each node's ``--memory`` when ``n`` nodes must share the model (module doc): just over 1/n of
    the planned part (a 2% margin, on that part only), plus the node's fixed overhead
    (planner/budget.py), so the planner must use every node and each holds ``sessions`` sessions."""
    import torch

    args = open_checkpoint(model_dir).args  # a directory or a .gguf
    dev = resolve_device(device)
    offers = []
    for dt in dtypes:
        dtype = resolve_dtype(dt, dev)
        spec = model_spec(args, torch.bfloat16, context_tokens, quant, kv_cache, sessions)  # the planner's unit
        extra = plan_memory(draft_bytes(draft, args, dtype, context_tokens), dtype)
        offers.append(peak_bytes(args, dtype, str(dev), spec, (0, math.ceil(args.n_layers / n)), coordinator=True,
                                 draft_bytes=extra, margin=1.02, quant=quant))  # fmt: skip
    return offers


def planned_bytes(model_dir: Path, layers: float, *, context_tokens: int = 1024, quant: str = "none",
                  kv_cache: str = "auto", sessions: int = MIN_SESSIONS, coordinator: bool = True,
                  dtype_bytes: int = 2) -> int:
    """The planned part (planner/budget.py, in the planner's 2-byte unit: what a node advertises)
    of holding ``layers`` of the model's largest layers (a fraction adds that much of a layer as
    slack) and, with ``coordinator``, the head (no draft model), for a node serving values
    ``dtype_bytes`` wide (its quantized layers stated at that width: ModelSpec.at_width)."""
    import torch

    args = open_checkpoint(model_dir).args
    spec = model_spec(args, torch.bfloat16, context_tokens, quant, kv_cache, sessions).at_width(dtype_bytes)
    return planned_part(spec, layers, coordinator=coordinator)


def offer_for(model_dir: Path, layers: float, *, dtype: str = "fp32", device: str = "cpu", context_tokens: int = 1024,
              quant: str = "none", kv_cache: str = "auto", sessions: int = MIN_SESSIONS, coordinator: bool = True) -> int:
    """The ``--memory`` under which a local ``dtype`` node advertises ``planned_bytes`` (hand-sized
    offers in tests): that part at the dtype's width, plus the node's fixed overhead."""
    args = open_checkpoint(model_dir).args
    dt = resolve_dtype(dtype, resolve_device(device))
    planned = planned_bytes(model_dir, layers, context_tokens=context_tokens, quant=quant, kv_cache=kv_cache,
                            sessions=sessions, coordinator=coordinator, dtype_bytes=dt.itemsize)  # fmt: skip
    return planned * dt.itemsize // 2 + overhead_bytes(args, dt, str(resolve_device(device)), quant=quant)


def _start_delay_proxy(delay_ms: float, targets: list[int], workdir: Path) -> tuple[subprocess.Popen[bytes], list[int]]:
    """A delaying proxy process in front of each target port; returns it once every one of its
    listeners is bound, with their ports (in ``targets``' order), or raises naming its log."""
    fd = _log_file(workdir / "proxy.log")
    proc = subprocess.Popen(
        [sys.executable, "-m", "swarm.testing.delayproxy", str(delay_ms), *(f"0:{t}" for t in targets)],
        stdout=subprocess.PIPE, stderr=fd,
    )  # fmt: skip
    os.close(fd)
    assert proc.stdout is not None
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        ready = sel.select(timeout=PROXY_START_S)
    line = proc.stdout.readline().decode() if ready else ""
    proc.stdout.close()
    parts = line.split()
    if len(parts) != len(targets) + 1 or parts[0] != "ports":
        proc.kill()
        proc.wait(timeout=5)
        log = (workdir / "proxy.log").read_text(errors="replace")[-2000:]
        raise RuntimeError(f"the delay proxy did not start within {PROXY_START_S:.0f} s (its log: {log!r})")
    return proc, [int(p) for p in parts[1:]]


def _log_tail(text: str) -> str:
    """The last LOG_TAIL characters of a node's log with runs of one repeated line (a dial that
    keeps failing) folded into one."""
    lines: list[str] = []
    repeats = 0
    for line in text.splitlines():
        if lines and line == lines[-1]:
            repeats += 1
            continue
        if repeats:
            lines.append(f"  (the line above {repeats} more times)")
            repeats = 0
        lines.append(line)
    if repeats:
        lines.append(f"  (the line above {repeats} more times)")
    return "\n".join(lines)[-LOG_TAIL:]


def _log_file(path: Path, *, append: bool = False) -> int:
    """A file descriptor for a child's stderr (the child keeps it; we close ours after Popen)."""
    return os.open(path, os.O_WRONLY | os.O_CREAT | (os.O_APPEND if append else os.O_TRUNC), 0o600)


def _write_private(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
