"""The NAT lab: a bootstrap/relay on a public network, two homes behind MASQUERADE routers.

Everything runs through the real stack in separate processes inside namespaces this test builds
(swarm.testing.netlab): `python -m swarm.cli.bootstrap` as the relay, and
tests/net/lab_scripts/nat_peer.py as the home nodes (SwarmHost with admission, circuit relay v2,
DCUtR, dial-back). Proves: admission with the relay and between the homes through it, a relayed
connection, a hole-punched direct connection across both NATs, the dial-back verdicts, and that
a symmetric NAT (--random-fully) leaves the peers relayed. Skipped with a reason where
namespaces or iptables are unavailable.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from swarm.manifest.identity import Identity, save_identity
from swarm.manifest.manifest import new_manifest, sign_manifest, write_manifest
from swarm.net.dialback import DialbackResult, NatKind, Reachability, classify, nat_kind
from swarm.net.nat import Diagnosis, _advice
from swarm.testing.netlab import Lab, LabProcess, lab_unavailable_reason, nat_lab

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "net" / "lab_scripts" / "nat_peer.py"
PY = sys.executable
RELAY_PORT = 4001

_reason = lab_unavailable_reason(need_nat=True)
lab_test = pytest.mark.skipif(_reason is not None, reason=f"NAT lab unavailable: {_reason}")


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _line(proc: LabProcess, key: str, timeout: float) -> object:
    return json.loads(proc.wait_for_line(key + " ", timeout=timeout))


class Swarm:
    def __init__(self, tmp: Path) -> None:
        issuer = Identity.generate()
        m = sign_manifest(new_manifest(swarm_name="lab", issuer=issuer.public_key), issuer)
        self.manifest = tmp / "invite.json"
        write_manifest(m, self.manifest)
        self.secret = m.secret.value.hex()
        self.swarm_id = m.swarm_id
        self.key = tmp / "bootstrap.key"
        relay_identity = Identity.generate()
        save_identity(relay_identity, self.key)
        self.relay_peer = relay_identity.peer_id


def _start_relay(lab: Lab, swarm: Swarm) -> tuple[LabProcess, str]:
    """Start the bootstrap node; its address is known in advance (its key file is ours)."""
    relay_ns = lab["relay"]
    proc = relay_ns.spawn(
        [PY, "-m", "swarm.cli.bootstrap", "--listen", f"/ip4/0.0.0.0/tcp/{RELAY_PORT}",
         "--manifest", str(swarm.manifest), "--key", str(swarm.key)], env=_env(),
    )  # fmt: skip
    return proc, f"/ip4/{relay_ns.addr}/tcp/{RELAY_PORT}/p2p/{swarm.relay_peer}"


def _start_peer(
    lab: Lab, role: str, swarm: Swarm, relay: str, *extra: str, port: int = 4101
) -> tuple[LabProcess, str]:
    """Start a lab node in namespace ``role``; returns it and its peer ID (from its seed)."""
    ns = lab[role]
    assert ns.addr is not None
    seed = os.urandom(32)
    proc = ns.spawn(
        [PY, str(SCRIPT), "--seed", seed.hex(), "--secret", swarm.secret,
         "--swarm-id", swarm.swarm_id, "--listen", f"/ip4/0.0.0.0/tcp/{port}", "--relay", relay,
         "--local-ip", ns.addr, *extra], env=_env(),
    )  # fmt: skip
    return proc, Identity(seed).peer_id


@pytest.fixture
def swarm(tmp_path: Path) -> Iterator[Swarm]:
    yield Swarm(tmp_path)


@pytest.mark.netns
@pytest.mark.slow
@lab_test
def test_relay_admission_and_hole_punch(swarm: Swarm) -> None:
    """Relay + admission, a relayed connection, a hole punch through both NATs, dial-back."""
    t_start = time.monotonic()
    with nat_lab() as lab:
        # Every process starts at once; the nodes retry until the relay (and the other) is up.
        relay, relay_addr = _start_relay(lab, swarm)
        a, a_peer = _start_peer(lab, "home0", swarm, relay_addr, "--diagnose")
        circuit = f"{relay_addr}/p2p-circuit/p2p/{a_peer}"
        b, b_peer = _start_peer(lab, "home1", swarm, relay_addr, "--dial", circuit)
        # A node on the public network beside the relay: the dial-back must call it public.
        pub, _ = _start_peer(lab, "relay", swarm, relay_addr, "--diagnose", "--wait", "0",
                             port=4201)  # fmt: skip

        printed = relay.wait_for_line(f"/ip4/{lab['relay'].addr}/", timeout=40)
        assert printed == f"tcp/{RELAY_PORT}/p2p/{swarm.relay_peer}"

        assert _line(a, "PEER", 40) == a_peer
        got = _line(a, "RESERVED", 40)
        assert isinstance(got, dict) and got["relay_admitted"] is True
        assert got["circuit"] == circuit

        # Home 1 cannot reach home 0 directly: home 0's router drops unsolicited packets.
        probe = lab["home1"].run(
            PY, "-c", "import socket,sys; s=socket.socket(); s.settimeout(1.5); "
            f"sys.exit(s.connect_ex(('{lab['router0'].addr}', 4101)) == 0)", check=False,
        )  # fmt: skip
        assert probe.returncode == 0, "home0 is reachable without punching: the NAT lab is open"

        relayed = _line(b, "RELAYED", 40)
        assert isinstance(relayed, dict)
        assert relayed["peer"] == a_peer and relayed["admitted"] is True
        assert relayed["path"] == "relayed"
        assert relayed["addrs"] and all("/p2p-circuit" in x for x in relayed["addrs"])
        assert relayed["rtt_ms"] > 0

        inbound = _line(a, "INBOUND", 20)  # path: relayed, or already upgraded by DCUtR
        assert isinstance(inbound, dict) and inbound["peer"] == b_peer

        punched = _line(b, "PUNCH", 40)
        assert isinstance(punched, dict)
        assert punched["ok"] is True and punched["path"] == "direct", punched
        # The direct connection goes to home 0's router's public address: through both NATs.
        assert any(f"/ip4/{lab['router0'].addr}/tcp/" in x for x in punched["direct_addrs"])
        assert punched["rtt_ms"] > 0
        assert _line(b, "PEERS", 30) == [{"peer": a_peer, "path": "hole-punched"}]
        direct_at_a = _line(a, "INBOUND_DIRECT", 20)
        assert isinstance(direct_at_a, dict) and direct_at_a["label"] == "hole-punched"
        assert any(f"/ip4/{lab['router1'].addr}/tcp/" in x for x in direct_at_a["addrs"])

        diag = _line(a, "DIAGNOSIS", 5)
        assert isinstance(diag, dict)
        assert diag["reachability"] == "behind NAT, reachable via relay"
        assert diag["nat"] == "port-preserving NAT"
        assert diag["observed_addr"].startswith(f"/ip4/{lab['router0'].addr}/tcp/")
        assert diag["dialback_ok_ports"] == [] and diag["dialback_failed"][0]["port"] == 4101
        assert diag["relay_addrs"] == [circuit]
        assert diag["bootstrap"][0]["ok"] is True

        pub_diag = _line(pub, "DIAGNOSIS", 20)
        assert isinstance(pub_diag, dict)
        assert pub_diag["reachability"] == "public", pub_diag
        assert pub_diag["dialback_ok_ports"] == [4201] and pub_diag["nat"] == "no NAT"
    assert time.monotonic() - t_start < 60


@pytest.mark.netns
@pytest.mark.slow
@lab_test
def test_symmetric_nat_stays_relayed(swarm: Swarm) -> None:
    """With --random-fully (symmetric) NATs, DCUtR fails and the relayed connection still works."""
    with nat_lab(symmetric=True) as lab:
        _relay, relay_addr = _start_relay(lab, swarm)
        a, a_peer = _start_peer(lab, "home0", swarm, relay_addr, "--diagnose")
        circuit = f"{relay_addr}/p2p-circuit/p2p/{a_peer}"
        b, _ = _start_peer(lab, "home1", swarm, relay_addr, "--dial", circuit,
                           "--punch-timeout", "8")  # fmt: skip
        relayed = _line(b, "RELAYED", 40)
        assert isinstance(relayed, dict) and relayed["peer"] == a_peer
        assert relayed["admitted"] is True
        punched = _line(b, "PUNCH", 30)
        assert isinstance(punched, dict)
        assert punched["ok"] is False and punched["path"] == "relayed", punched
        assert punched["rtt_ms"] > 0  # still talking, through the relay
        diag = _line(a, "DIAGNOSIS", 10)
        assert isinstance(diag, dict) and diag["nat"] == "NAT that changes ports"


@pytest.mark.netns
@lab_test
def test_lab_teardown_kills_processes_and_removes_namespaces_even_on_failure() -> None:
    names: list[str] = []
    pids: list[int] = []
    with pytest.raises(RuntimeError, match="boom"), nat_lab() as lab:
        names = [ns.name for ns in lab.namespaces.values()]
        proc = lab["home0"].spawn(["sleep", "60"])
        pids.append(proc.popen.pid)
        # The routers really forward and masquerade.
        assert lab["router0"].run("cat", "/proc/sys/net/ipv4/ip_forward").stdout.strip() == "1"
        assert "MASQUERADE" in lab["router0"].run("iptables", "-t", "nat", "-S").stdout
        # No lab interface leaked into the machine's own namespace.
        assert (
            "br0" not in subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
        )
        raise RuntimeError("boom")
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert names and not any(n in listed for n in names)
    with pytest.raises(ProcessLookupError):
        os.kill(pids[0], 0)


def _diag(**kw: object) -> Diagnosis:
    base: dict[str, object] = dict(
        peer_id="P", listen_addrs=["/ip4/0.0.0.0/tcp/4101/p2p/P"],
        bootstrap=[{"addr": "/ip4/198.51.100.2/tcp/4001/p2p/R", "ok": True, "ms": 3.0}],
        observed_addr="/ip4/198.51.100.11/tcp/40000", dialback_ok_ports=[],
        dialback_failed=[{"port": 4101, "error": "no answer within 4s"}],
        nat=NatKind.PORT_PRESERVING, relay_addrs=["/ip4/198.51.100.2/tcp/4001/p2p/R/p2p-circuit/p2p/P"],
        reachability=Reachability.NAT_RELAYED,
    )  # fmt: skip
    base.update(kw)
    d = Diagnosis(**base)  # type: ignore[arg-type]
    d.advice = _advice(d)
    return d


def test_classification_never_calls_a_dead_address_public() -> None:
    dead = DialbackResult("R", "/ip4/198.51.100.11/tcp/40000", 40000, (), ((4101, "timeout"),))
    live = DialbackResult("R", "/ip4/198.51.100.11/tcp/40000", 40000, (4101,), ())
    assert classify(dead, relayed=True, bootstrap_ok=True) is Reachability.NAT_RELAYED
    assert classify(dead, relayed=False, bootstrap_ok=True) is Reachability.NAT_UNREACHABLE
    assert classify(live, relayed=False, bootstrap_ok=True) is Reachability.PUBLIC
    assert classify(None, relayed=False, bootstrap_ok=False) is Reachability.OFFLINE
    assert nat_kind(dead, ["192.168.101.2"]) is NatKind.PORT_PRESERVING
    assert nat_kind(dead, ["198.51.100.11"]) is NatKind.NONE
    moved = DialbackResult("R", "/ip4/198.51.100.11/tcp/51234", 40000, (), ())
    assert nat_kind(moved, ["192.168.101.2"]) is NatKind.PORT_CHANGING
    assert nat_kind(DialbackResult("R", "garbage", 1, (), ()), []) is NatKind.UNKNOWN


def test_diagnosis_report_and_advice() -> None:
    d = _diag()
    text = "\n".join(d.lines())
    assert "behind NAT, reachable via relay" in text
    assert "port 4101 NOT reachable" in text and "forward TCP port(s) 4101" in text
    assert "hole punching" in text and "should work" in text
    assert d.to_dict()["reachability"] == "behind NAT, reachable via relay"
    json.dumps(d.to_dict())  # the --json form serialises
    sym = _diag(nat=NatKind.PORT_CHANGING)
    assert any("will likely fail" in a for a in sym.advice)
    off = _diag(bootstrap=[], reachability=Reachability.OFFLINE, relay_addrs=[])
    assert any("no bootstrap node is configured" in a for a in off.advice)
    pub = _diag(reachability=Reachability.PUBLIC, dialback_ok_ports=[4101], dialback_failed=[])
    assert pub.advice == ["peers can dial you directly; nothing to do"]
    relayed_peer = _diag(peers=[{"peer": "Q", "path": "relayed"}])
    assert any("higher latency" in a for a in relayed_peer.advice)
    assert all("secret" not in line.lower() for line in d.lines())
