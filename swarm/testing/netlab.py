"""A network-namespace lab that tests build, use and always tear down.

Theory of operation
-------------------
Each lab owns a set of Linux network namespaces named ``<prefix>-<role>`` with a prefix unique to
the lab (pid + counter), so parallel labs never collide and a crashed lab is recognisable. Links
are veth pairs created directly inside their namespaces (``ip link add ... netns A type veth peer
... netns B``), so no interface ever appears in the machine's own namespace, and a bridge lives in
a namespace of its own ("switch"). Multicast sent inside a lab therefore cannot reach the
machine's real interfaces.

Routers are namespaces with ``ip_forward`` on and an iptables MASQUERADE rule on their WAN side:
Linux MASQUERADE keeps the source port when it can and maps endpoint-independently, which is what
a typical home router does and what TCP hole punching needs. The routers drop every unsolicited
packet from the WAN (forwarded or addressed to themselves) instead of answering with a RST, like
home routers do; a RST from the router would kill a simultaneous-open attempt.

``ip netns del`` does not kill the processes inside a namespace, so the lab keeps every process it
starts (in its own process group) and kills them before deleting namespaces; teardown also kills
anything ``ip netns pids`` still reports. Teardown never raises and runs from ``finally``.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import select
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import IO

from swarm.errors import SwarmError

_counter = itertools.count()


class LabUnavailable(SwarmError):
    """Network namespaces cannot be built here (not root, no iproute2/iptables, no netns)."""


# command -> the Debian package that provides it (the Makefile's TESTPKGS installs them all)
TOOL_PACKAGES = {"ip": "iproute2", "iptables": "iptables", "nft": "nftables", "tshark": "tshark"}


def missing_tools_reason(*tools: str) -> str | None:
    """None when every command is on PATH, else a skip reason naming the packages to install."""
    missing = [t for t in tools if shutil.which(t) is None]
    if not missing:
        return None
    pkgs = " ".join(dict.fromkeys(TOOL_PACKAGES.get(t, t) for t in missing))
    return (f"{', '.join(missing)} not installed (package {pkgs}: apt-get install {pkgs}; "
            "`make test` installs it when run as root or with sudo)")


def lab_unavailable_reason(*, need_nat: bool = False, tools: Sequence[str] = ()) -> str | None:
    """Why a lab cannot run here, or None when it can. Tests skip with this reason. ``tools``:
    further commands the test runs inside the lab (e.g. ``nft``)."""
    if os.name != "posix" or not hasattr(os, "geteuid"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespaces need root (CI runs as root)"
    missing = missing_tools_reason("ip", *(["iptables"] if need_nat else []), *tools)
    if missing is not None:
        return missing
    name = f"ssprobe{os.getpid()}"
    probe = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"cannot create a network namespace: {probe.stderr.strip()}"
    try:
        if need_nat:
            r = subprocess.run(
                ["ip", "netns", "exec", name, "iptables", "-t", "nat", "-L", "-n"],
                capture_output=True,
                text=True,
            )
            if r.returncode != 0:
                return f"iptables NAT does not work in a namespace: {r.stderr.strip()}"
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return None


def _run(
    argv: Sequence[str], *, check: bool = True, env: dict[str, str] | None = None, timeout: float = 20
) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, env=env)
    if check and result.returncode != 0:
        raise LabUnavailable(f"lab command failed: {' '.join(argv)}: {result.stderr.strip()}")
    return result


@dataclass
class Namespace:
    """One network namespace of a lab; ``addr`` is its main IPv4 address, if any."""

    lab: Lab
    name: str
    role: str
    addr: str | None = None

    def run(
        self, *argv: str, check: bool = True, env: dict[str, str] | None = None, timeout: float = 20
    ) -> subprocess.CompletedProcess[str]:
        """Run a short command inside this namespace (waits for it, at most ``timeout`` s)."""
        return _run(["ip", "netns", "exec", self.name, *argv], check=check, env=env, timeout=timeout)

    def spawn(self, argv: Sequence[str], *, env: dict[str, str] | None = None) -> LabProcess:
        """Start a long-running process inside this namespace; the lab kills it on teardown.

        stdout is a pipe read with :meth:`LabProcess.wait_for_line`; stderr goes to a temporary
        file (a chatty process can never block on a full pipe) read by :meth:`LabProcess.stderr`.
        """
        err = tempfile.TemporaryFile()  # noqa: SIM115 (closed by LabProcess.kill)
        popen = subprocess.Popen(
            ["ip", "netns", "exec", self.name, *argv],
            stdout=subprocess.PIPE,
            stderr=err,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,  # own process group: killpg reaches its children too
        )
        proc = LabProcess(popen, err, f"{argv[-1] if argv else '?'} in {self.role}")
        self.lab.processes.append(proc)
        return proc

    def interfaces(self) -> list[str]:
        """Names of the interfaces in this namespace (lo included)."""
        out = self.run("ip", "-o", "link", "show").stdout
        return [
            line.split(":")[1].strip().split("@")[0] for line in out.splitlines() if ":" in line
        ]


@dataclass
class Lab:
    """The namespaces, links and processes of one lab; ``close()`` removes all of them."""

    prefix: str
    namespaces: dict[str, Namespace] = field(default_factory=dict)
    processes: list[LabProcess] = field(default_factory=list)

    def add(self, role: str) -> Namespace:
        name = f"{self.prefix}-{role}"
        _run(["ip", "netns", "add", name])
        ns = Namespace(self, name, role)
        self.namespaces[role] = ns
        ns.run("ip", "link", "set", "lo", "up")
        return ns

    def __getitem__(self, role: str) -> Namespace:
        return self.namespaces[role]

    def veth(self, a: Namespace, a_if: str, b: Namespace, b_if: str) -> None:
        """A veth pair with one end in each namespace, both up, no address yet."""
        _run(
            ["ip", "link", "add", "name", a_if, "netns", a.name, "type", "veth",
             "peer", "name", b_if, "netns", b.name]
        )  # fmt: skip
        a.run("ip", "link", "set", a_if, "up")
        b.run("ip", "link", "set", b_if, "up")

    def close(self) -> None:
        """Kill every process the lab started, then delete its namespaces. Never raises."""
        for proc in self.processes:
            proc.kill()
        for ns in self.namespaces.values():
            # Anything started inside by other means (or a child that left its group).
            pids = subprocess.run(
                ["ip", "netns", "pids", ns.name], capture_output=True, text=True
            ).stdout.split()
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, ValueError, PermissionError):
                    os.kill(int(pid), signal.SIGKILL)
        for ns in reversed(list(self.namespaces.values())):
            subprocess.run(["ip", "netns", "del", ns.name], capture_output=True)
        self.namespaces.clear()
        self.processes.clear()


def _new_prefix() -> str:
    # Short: interface names are per namespace, but namespace names show up in `ip netns`.
    return f"ss{os.getpid() % 100000}x{next(_counter)}"


def _addr(ns: Namespace, ifname: str, cidr: str) -> None:
    ns.run("ip", "addr", "add", cidr, "dev", ifname)


@contextlib.contextmanager
def lan_lab(n_peers: int = 2, subnet: str = "10.77.0") -> Iterator[Lab]:
    """``n_peers`` namespaces ``peer0..`` on one bridge (in namespace ``switch``), ``subnet.1+i``/24.

    Each peer has one interface ``eth0`` (plus lo) and a multicast route on it, so mDNS works
    between peers and nowhere else.
    """
    reason = lab_unavailable_reason()
    if reason:
        raise LabUnavailable(reason)
    lab = Lab(_new_prefix())
    try:
        switch = lab.add("switch")
        switch.run("ip", "link", "add", "br0", "type", "bridge")
        switch.run("ip", "link", "set", "br0", "up")
        for i in range(n_peers):
            peer = lab.add(f"peer{i}")
            lab.veth(peer, "eth0", switch, f"p{i}")
            switch.run("ip", "link", "set", f"p{i}", "master", "br0")
            peer.addr = f"{subnet}.{i + 1}"
            _addr(peer, "eth0", f"{peer.addr}/24")
            peer.run("ip", "route", "add", "224.0.0.0/4", "dev", "eth0")
        yield lab
    finally:
        lab.close()


@dataclass(frozen=True)
class NatPlan:
    """Addresses of the NAT lab (documentation ranges, never routed outside the lab)."""

    wan_subnet: str = "198.51.100"  # TEST-NET-2: the lab's "internet"
    relay: str = "198.51.100.2"
    router_wan: tuple[str, str] = ("198.51.100.11", "198.51.100.12")
    home_subnets: tuple[str, str] = ("192.168.101", "192.168.102")


def _router(lab: Lab, idx: int, wan_switch: Namespace, plan: NatPlan, *, symmetric: bool) -> None:
    router = lab.add(f"router{idx}")
    home = lab.add(f"home{idx}")
    lab.veth(router, "wan", wan_switch, f"r{idx}")
    wan_switch.run("ip", "link", "set", f"r{idx}", "master", "br0")
    router.addr = plan.router_wan[idx]
    _addr(router, "wan", f"{router.addr}/24")
    lab.veth(router, "lan", home, "eth0")
    lan = plan.home_subnets[idx]
    _addr(router, "lan", f"{lan}.1/24")
    home.addr = f"{lan}.2"
    _addr(home, "eth0", f"{home.addr}/24")
    home.run("ip", "route", "add", "default", "via", f"{lan}.1")
    # Per-namespace sysctl, written directly (the sysctl binary is procps, not always installed).
    router.run("sh", "-c", "echo 1 > /proc/sys/net/ipv4/ip_forward")
    masq = ["iptables", "-t", "nat", "-A", "POSTROUTING", "-o", "wan", "-j", "MASQUERADE"]
    if symmetric:
        masq.append("--random-fully")
    router.run(*masq)
    # Home routers drop unsolicited inbound packets silently (no RST, no ICMP).
    ct_ok = ["-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED", "-j", "ACCEPT"]
    router.run("iptables", "-A", "FORWARD", "-i", "wan", *ct_ok)
    router.run("iptables", "-A", "FORWARD", "-i", "wan", "-j", "DROP")
    router.run("iptables", "-A", "INPUT", "-i", "wan", *ct_ok)
    router.run("iptables", "-A", "INPUT", "-i", "wan", "-j", "DROP")


@contextlib.contextmanager
def nat_lab(plan: NatPlan | None = None, *, symmetric: bool = False, public: int = 0) -> Iterator[Lab]:
    """A relay on a public "internet" and two homes behind their own NAT routers.

    Namespaces: ``wan`` (bridge), ``relay`` (``plan.relay``), ``public0``.. (``public`` more
    hosts on the internet, at ``plan.relay`` + 1, + 2, ...), ``router0``/``router1`` (MASQUERADE,
    ``symmetric`` adds ``--random-fully``, which defeats hole punching), ``home0``/``home1``
    (private addresses, default route through their router). Homes reach the relay; nothing on
    the WAN reaches a home unless the home opened the mapping first.
    """
    plan = plan or NatPlan()
    reason = lab_unavailable_reason(need_nat=True)
    if reason:
        raise LabUnavailable(reason)
    lab = Lab(_new_prefix())
    try:
        wan = lab.add("wan")
        wan.run("ip", "link", "add", "br0", "type", "bridge")
        wan.run("ip", "link", "set", "br0", "up")
        relay = lab.add("relay")
        lab.veth(relay, "eth0", wan, "rl")
        wan.run("ip", "link", "set", "rl", "master", "br0")
        relay.addr = plan.relay
        _addr(relay, "eth0", f"{plan.relay}/24")
        for idx in (0, 1):
            _router(lab, idx, wan, plan, symmetric=symmetric)
        base = plan.relay.rsplit(".", 1)
        for i in range(public):
            host = lab.add(f"public{i}")
            lab.veth(host, "eth0", wan, f"pub{i}")
            wan.run("ip", "link", "set", f"pub{i}", "master", "br0")
            host.addr = f"{base[0]}.{int(base[1]) + 1 + i}"
            _addr(host, "eth0", f"{host.addr}/24")
        yield lab
    finally:
        lab.close()


class LabProcess:
    """A process started in a lab namespace: line-wise stdout with deadlines, stderr in a file."""

    def __init__(self, popen: subprocess.Popen[bytes], err: IO[bytes], what: str) -> None:
        self.popen, self._err, self.what = popen, err, what
        self._buf = b""
        self.lines: list[str] = []
        self._taken: set[int] = set()

    def wait_for_line(self, prefix: str, *, timeout: float) -> str:
        """The first not yet returned stdout line starting with ``prefix``, minus the prefix.

        Lines that arrived earlier (while waiting for another prefix) count too.

        Raises TimeoutError naming the process, its last lines and its stderr tail when no such
        line arrives in time or the process exits first; never blocks past ``timeout``.
        """
        assert self.popen.stdout is not None
        fd = self.popen.stdout.fileno()
        deadline = time.monotonic() + timeout
        while True:
            while b"\n" in self._buf:
                raw, self._buf = self._buf.split(b"\n", 1)
                self.lines.append(raw.decode(errors="replace"))
            for i, line in enumerate(self.lines):
                if i not in self._taken and line.startswith(prefix):
                    self._taken.add(i)  # each line is returned once, in order of arrival
                    return line[len(prefix) :].strip()
            left = deadline - time.monotonic()
            if left <= 0:
                break
            ready, _, _ = select.select([fd], [], [], left)
            if not ready:
                continue
            chunk = os.read(fd, 65536)
            if not chunk:
                break  # EOF: the process exited
            self._buf += chunk
        raise TimeoutError(
            f"{self.what}: no line starting with {prefix!r} within {timeout:.0f}s "
            f"(exit code {self.popen.poll()}); last stdout lines: {self.lines[-8:]}; "
            f"stderr tail: {self.stderr()[-2500:]}"
        )

    def stderr(self) -> str:
        with contextlib.suppress(Exception):
            self._err.flush()
            self._err.seek(0)
            return self._err.read().decode(errors="replace")
        return ""

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError, OSError):
            os.killpg(self.popen.pid, signal.SIGKILL)
        with contextlib.suppress(Exception):
            self.popen.wait(timeout=5)
        with contextlib.suppress(Exception):
            if self.popen.stdout is not None:
                self.popen.stdout.close()
        with contextlib.suppress(Exception):
            self._err.close()
