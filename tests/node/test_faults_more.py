"""A fault only a real network shows: (as root) a silent link cut inside a network-namespace lab,
through real node processes and real libp2p; the output is compared with the uninterrupted run
on the same swarm (greedy, token-identical). The other faults (two peers lost one after the
other, a peer lost during prefill, a frozen stage or leader that comes back, survivors too small
to hold the model, ...) are in-memory swarm tests now (tests/node/test_swarm_mem.py), and one
stage killed through ``join`` processes is tests/cli/test_recovery_join.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import trio

from swarm import client
from swarm.launch import offer_for
from swarm.manifest.identity import Identity
from swarm.manifest.manifest import new_manifest, sign_manifest, write_manifest
from swarm.testing.checkpoints import TinySpec, write_checkpoint
from swarm.testing.netlab import Lab, lab_unavailable_reason, lan_lab

pytestmark = pytest.mark.slow
PROMPT = [5, 17, 99, 3, 42, 7, 5, 17, 99, 3, 42]
N_NEW = 120


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    spec = TinySpec(n_layers=8, row_gain_spread=1.0, max_position_embeddings=1024)
    return write_checkpoint(tmp_path_factory.mktemp("tiny"), spec, seed=5)


def memory_for(ckpt: Path, layers_each: int) -> int:
    """Bytes a bf16 node offers so that it holds ``layers_each`` layers or coordinates plus a few."""
    return offer_for(ckpt, layers_each, dtype="bf16")


# -- silent link cut inside a network-namespace lab -------------------------------------------------

LAB_PORT, LAB_FAST = 4101, 4102


def start_lab_swarm(
    lab: Lab, n: int, ckpt: Path, memory: int, workdir: Path
) -> tuple[list[str], list[str], bytes, str]:
    """Node i in namespace peer{i}, listening on its eth0 address; returns (peer ids, addrs,
    secret, swarm id). The lab kills the processes on teardown."""
    seeds = [os.urandom(32) for _ in range(n)]
    ids = [Identity(s).peer_id for s in seeds]
    ips = [lab[f"peer{i}"].addr for i in range(n)]
    addrs = [f"/ip4/{ips[i]}/tcp/{LAB_PORT}/p2p/{ids[i]}" for i in range(n)]
    issuer = Identity(os.urandom(32))
    manifest = sign_manifest(
        new_manifest(
            swarm_name="lab", issuer=issuer.public_key, bootstrap=(addrs[0],), lifetime_s=3600, context=1024
        ),
        issuer,
    )
    write_manifest(manifest, workdir / "invite.json")
    for i in range(n):
        (workdir / f"node{i}.seed").write_text(seeds[i].hex())
        cfg = {"seed_file": str(workdir / f"node{i}.seed"), "manifest": str(workdir / "invite.json"),
               "model_dir": str(ckpt), "listen": [f"/ip4/{ips[i]}/tcp/{LAB_PORT}"], "fastpath": True,
               "fastpath_port": LAB_FAST, "fastpath_advertise": [f"{ips[i]}:{LAB_FAST}"], "memory_bytes": memory,
               "dtype": "bf16", "threads": 1, "expect_peers": n, "draft": "ngram",
               "chunk_timeout": 3.0}  # fmt: skip
        (workdir / f"node{i}.json").write_text(json.dumps(cfg))
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        lab[f"peer{i}"].spawn(
            [sys.executable, "-m", "swarm.node", str(workdir / f"node{i}.json")], env=env
        )
    return ids, addrs, manifest.secret.value, manifest.swarm_id


async def _lab_client(
    addr: str, secret: bytes, swarm_id: str, plan_only: bool, at: int, lab_prefix: str, victim: int
) -> dict[str, Any]:
    async with client.open_client(addr, secret=secret, swarm_id=swarm_id, timeout=60) as (h, peer):
        st = await client.wait_ready(h, peer, timeout=120)
        if plan_only:
            return {"plan": st["plan"]}
        cut: list[float] = []

        def on_tokens(ids: list[int], text: str) -> None:
            if not cut and len(seen) < at <= len(seen) + len(ids):
                cut.append(time.time())
                subprocess.run(
                    ["ip", "netns", "exec", f"{lab_prefix}-peer{victim}", "nft", "-f", "-"],
                    check=True,
                    input=_CUT_RULES,
                    text=True,
                    timeout=10,
                )
            seen.extend(ids)

        seen: list[int] = []
        ref = await client.generate(
            h, peer, prompt_ids=PROMPT, max_new_tokens=N_NEW, draft="ngram", timeout=60
        )
        if at <= 0:
            return {"reference": ref}
        got = await client.generate(
            h,
            peer,
            prompt_ids=PROMPT,
            max_new_tokens=N_NEW,
            draft="ngram",
            timeout=150,
            on_tokens=on_tokens,
        )
        return {"reference": ref, "got": got, "streamed": seen, "cut_unix": cut[0] if cut else None}


_CUT_RULES = """table inet cut {
  chain input { type filter hook input priority 0; iifname "eth0" drop; }
  chain output { type filter hook output priority 0; oifname "eth0" drop; }
}
"""


def lab_client_main(argv: list[str]) -> None:
    """Child entry point, run inside the client namespace: prints one JSON line."""
    addr, secret, swarm_id, mode, at, prefix, victim = argv
    out = trio.run(
        _lab_client,
        addr,
        bytes.fromhex(secret),
        swarm_id,
        mode == "plan",
        int(at),
        prefix,
        int(victim),
    )
    print(json.dumps(out), flush=True)


def run_lab_client(
    lab: Lab,
    addr: str,
    secret: bytes,
    swarm_id: str,
    *,
    mode: str,
    at: int = 0,
    victim: int = -1,
    timeout: float = 300,
) -> dict[str, Any]:
    argv = [
        "ip",
        "netns",
        "exec",
        lab["client"].name,
        sys.executable,
        str(Path(__file__).resolve()),
        "--lab-client",
        addr,
        secret.hex(),
        swarm_id,
        mode,
        str(at),
        lab.prefix,
        str(victim),
    ]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        raise AssertionError(f"lab client failed ({r.returncode}): {r.stderr[-3000:]}")
    out: dict[str, Any] = json.loads(r.stdout.strip().splitlines()[-1])
    return out


@pytest.mark.skipif(
    lab_unavailable_reason(tools=["nft"]) is not None, reason=f"no network lab: {lab_unavailable_reason(tools=['nft'])}"
)
def test_silent_link_cut_in_netns_lab(ckpt: Path, tmp_path: Path) -> None:
    """Four nodes in four namespaces on one bridge, the client in a fifth. A middle stage's
    interface starts dropping every packet (no RST, no FIN: a vanished Wi-Fi) at token 30: it is
    declared lost by silence, and the output equals the uninterrupted run's."""
    if sys.platform != "linux":
        pytest.skip("network namespaces need Linux")
    with lan_lab(5) as lab:
        lab.namespaces["client"] = lab.namespaces.pop("peer4")
        ids, addrs, secret, swarm_id = start_lab_swarm(lab, 4, ckpt, memory_for(ckpt, 4), tmp_path)
        plan = run_lab_client(lab, addrs[0], secret, swarm_id, mode="plan", timeout=150)["plan"]
        stages = [ids.index(p) for p in plan["ring"] if p != plan["coordinator"]]
        coord = ids.index(plan["coordinator"])
        victim = stages[len(stages) // 2]
        out = run_lab_client(lab, addrs[coord], secret, swarm_id, mode="cut", at=30, victim=victim)
        got, ref = out["got"], out["reference"]
        assert out["streamed"] == got["output_token_ids"]
        assert got["output_token_ids"] == ref["output_token_ids"]
        assert len(got["replans"]) == 1 and ids[victim] in got["replans"][0]["lost"], got["replans"]
        detect = got["replans"][0]["detected_unix"] - out["cut_unix"]
        assert 0 <= detect <= 6.0, f"a silent cut took {detect:.2f} s to detect"


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "--lab-client":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    lab_client_main(sys.argv[2:])
