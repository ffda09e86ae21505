"""More faults through the real stack (real node processes, real libp2p): two peers lost one
after the other in one generation, a peer lost during prefill, a frozen stage that comes back
after being declared lost, survivors too small to hold the model, and (as root) a silent link
cut inside a network-namespace lab. Every output is compared with the uninterrupted run on the
same swarm (greedy, token-identical)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import trio

from swarm.errors import PeerError
from swarm.manifest.identity import Identity
from swarm.manifest.manifest import new_manifest, sign_manifest, write_manifest
from swarm.model.config import ModelArgs
from swarm.node import client
from swarm.node.launch import LocalSwarm, start_local_swarm
from swarm.node.settings import model_spec
from swarm.testing.checkpoints import TinySpec, write_checkpoint
from swarm.testing.netlab import Lab, lab_unavailable_reason, lan_lab

pytestmark = pytest.mark.slow
PROMPT = [5, 17, 99, 3, 42, 7, 5, 17, 99, 3, 42]
LONG_PROMPT = [(i * 37 + 11) % 251 for i in range(300)]  # 5 prefill chunks of 64
N_NEW = 120


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    spec = TinySpec(n_layers=8, row_gain_spread=1.0, max_position_embeddings=1024)
    return write_checkpoint(tmp_path_factory.mktemp("tiny"), spec, seed=5)


def memory_for(ckpt: Path, layers_each: int) -> int:
    """Bytes a node offers so that it holds ``layers_each`` layers or coordinates plus a few."""
    spec = model_spec(ModelArgs.from_dir(ckpt), torch.bfloat16, 1024)
    return layers_each * spec.bytes_per_layer + spec.coordinator_bytes + 1


async def ready_plan(swarm: LocalSwarm, i: int = 0, timeout: float = 90) -> dict[str, Any]:
    async with client.open_client(swarm.addrs[i], secret=swarm.secret, swarm_id=swarm.swarm_id) as (
        h,
        peer,
    ):
        st = await client.wait_ready(h, peer, timeout=timeout)
    plan: dict[str, Any] = st["plan"]
    return plan


def roles(swarm: LocalSwarm, plan: dict[str, Any]) -> tuple[int, list[int]]:
    coord = swarm.peer_ids.index(plan["coordinator"])
    return coord, [swarm.peer_ids.index(p) for p in plan["ring"] if p != plan["coordinator"]]


async def generate(
    swarm: LocalSwarm,
    coord: int,
    prompt: list[int],
    kills: dict[int, tuple[int, int]] | None = None,
    *,
    timeout: float = 150,
    max_new: int = N_NEW,
) -> dict[str, Any]:
    """One greedy generation on ``coord``; ``kills`` maps a token count to (node, signal) sent
    when that many tokens have streamed. Checks the stream equals the receipt's output."""
    kills = dict(kills or {})
    async with client.open_client(
        swarm.addrs[coord], secret=swarm.secret, swarm_id=swarm.swarm_id
    ) as (h, peer):
        seen: list[int] = []

        def on_tokens(ids: list[int], text: str) -> None:
            before = len(seen)
            seen.extend(ids)
            for at in sorted(kills):
                if before < at <= len(seen):
                    node, sig = kills.pop(at)
                    swarm.kill(node, sig)

        with trio.fail_after(timeout + 30):  # never hangs past its bound
            receipt = await client.generate(
                h,
                peer,
                prompt_ids=prompt,
                max_new_tokens=max_new,
                draft="ngram",
                timeout=timeout,
                on_tokens=on_tokens,
            )
        assert seen == receipt["output_token_ids"]  # streamed: nothing lost, nothing repeated
        return receipt


async def test_a_hop_gone_silent_with_every_peer_alive_is_replanned(ckpt: Path) -> None:
    """A stage stops passing activations on but stays up, answering heartbeats (SIGUSR2: the
    stall a relayed stream that died silently causes). Nobody is lost, so only the coordinator
    can tell: its run gets no result within the chunk deadline, it ends the epoch, the leader
    re-plans the same peers, and the generation resumes, identical."""
    with start_local_swarm(
        3, ckpt, dtype="bf16", memory_bytes=[memory_for(ckpt, 4)] * 3, chunk_timeout=3.0
    ) as swarm:
        coord, stages = roles(swarm, await ready_plan(swarm))
        reference = await generate(swarm, coord, PROMPT)
        got = await generate(swarm, coord, PROMPT, {20: (stages[0], signal.SIGUSR2)})
        assert got["output_token_ids"] == reference["output_token_ids"]
        assert all(swarm.alive())
        assert len(got["replans"]) == 1 and got["replans"][0]["lost"] == [], got["replans"]
        assert "no result from the ring" in got["replans"][0]["reason"], got["replans"]


async def test_two_peers_lost_one_after_the_other(ckpt: Path) -> None:
    with start_local_swarm(
        5, ckpt, dtype="bf16", memory_bytes=[memory_for(ckpt, 3)] * 5, chunk_timeout=3.0
    ) as swarm:
        coord, stages = roles(swarm, await ready_plan(swarm))
        assert len(stages) >= 2, stages
        reference = await generate(swarm, coord, PROMPT)
        first, second = stages[0], stages[-1]
        got = await generate(
            swarm, coord, PROMPT, {25: (first, signal.SIGKILL), 80: (second, signal.SIGKILL)}
        )
        assert got["output_token_ids"] == reference["output_token_ids"]
        lost = [rp["lost"] for rp in got["replans"]]
        assert len(lost) == 2, got["replans"]
        assert swarm.peer_ids[first] in lost[0] and swarm.peer_ids[second] in lost[1], lost
        assert got["replans"][0]["resumed_at_token"] <= got["replans"][1]["resumed_at_token"]
        ring_after = {got["coordinator"], *got["ring"]}
        assert not ring_after & {swarm.peer_ids[first], swarm.peer_ids[second]}


async def test_peer_frozen_while_the_new_ring_is_set_up(ckpt: Path) -> None:
    """A stage is killed and, at the same moment, another is frozen. The first re-plan still
    counts on the frozen one (it is not declared lost yet), so that epoch's set-up must fail as
    soon as the failure detector declares it lost and hangs up on it (not at the load timeout,
    minutes away); the re-plan after it resumes the run, token-identical."""
    n = 6
    with start_local_swarm(
        n, ckpt, dtype="bf16", memory_bytes=[memory_for(ckpt, 3)] * n, chunk_timeout=3.0
    ) as swarm:
        coord, stages = roles(swarm, await ready_plan(swarm))
        leader = min(range(n), key=lambda i: swarm.peer_ids[i])
        pick = [s for s in stages if s != leader]
        assert len(pick) >= 2, (stages, leader)
        killed, frozen = pick[0], pick[1]
        reference = await generate(swarm, coord, PROMPT)
        async with client.open_client(
            swarm.addrs[coord], secret=swarm.secret, swarm_id=swarm.swarm_id
        ) as (h, peer):
            seen: list[int] = []

            def on_tokens(ids: list[int], text: str) -> None:
                if len(seen) < 30 <= len(seen) + len(ids):
                    swarm.kill(frozen, signal.SIGSTOP)
                    swarm.kill(killed, signal.SIGKILL)
                seen.extend(ids)

            try:
                with trio.fail_after(60):  # the load timeout is 600 s: a stall shows here
                    got = await client.generate(
                        h, peer, prompt_ids=PROMPT, max_new_tokens=N_NEW, draft="ngram",
                        timeout=50, on_tokens=on_tokens,
                    )  # fmt: skip
            finally:
                swarm.kill(frozen, signal.SIGCONT)
        assert got["output_token_ids"] == reference["output_token_ids"]
        lost = {p for rp in got["replans"] for p in rp["lost"]}
        assert {swarm.peer_ids[killed], swarm.peer_ids[frozen]} <= lost, got["replans"]


async def test_peer_lost_during_prefill(ckpt: Path) -> None:
    """A 300-token prompt (5 prefill chunks). A ring stage is frozen just before the request, so
    the prefill chunks pile up in flight at it, then killed 0.4 s later: the run replays its
    prefill on the new ring and the output is unchanged. (Freezing first makes "during prefill"
    deterministic on a loaded machine; a delaying proxy would slow prefill too, but
    swarm/testing/delayproxy.py dies when a killed node resets its connection.)"""
    with start_local_swarm(
        4, ckpt, dtype="bf16", memory_bytes=[memory_for(ckpt, 4)] * 4, chunk_timeout=3.0
    ) as swarm:
        coord, stages = roles(swarm, await ready_plan(swarm))
        reference = await generate(swarm, coord, LONG_PROMPT, max_new=40)
        victim = stages[0]
        first_token: list[float] = []
        killed_at: list[float] = []

        async def killer() -> None:
            # by now the request reached the coordinator and prefill chunks wait at the victim
            await trio.sleep(0.4)
            killed_at.append(time.time())
            swarm.kill(victim, signal.SIGKILL)

        async with client.open_client(
            swarm.addrs[coord], secret=swarm.secret, swarm_id=swarm.swarm_id
        ) as (h, peer):

            def on_tokens(ids: list[int], text: str) -> None:
                if not first_token:
                    first_token.append(time.time())

            swarm.kill(victim, signal.SIGSTOP)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(killer)
                with trio.fail_after(120):
                    got = await client.generate(
                        h,
                        peer,
                        prompt_ids=LONG_PROMPT,
                        max_new_tokens=40,
                        draft="ngram",
                        timeout=90,
                        on_tokens=on_tokens,
                    )
        assert killed_at[0] < first_token[0]
        assert got["output_token_ids"] == reference["output_token_ids"]
        assert len(got["replans"]) == 1, got["replans"]
        rp = got["replans"][0]
        assert swarm.peer_ids[victim] in rp["lost"] and rp["resumed_at_token"] == 0, rp
        # no result had come back, so nothing is replayed: the in-flight chunks are resent
        assert rp["replayed_chunks"] == 0, rp


async def test_frozen_stage_rejoins_as_new_member(ckpt: Path) -> None:
    """SIGSTOP a stage mid-generation (it is declared lost; the run resumes without it), then
    SIGCONT it: it is admitted again as a new incarnation and later generations, including one
    where another stage is killed so the returning peer must serve, still match."""
    with start_local_swarm(
        4, ckpt, dtype="bf16", memory_bytes=[memory_for(ckpt, 4)] * 4, chunk_timeout=3.0
    ) as swarm:
        coord, stages = roles(swarm, await ready_plan(swarm))
        reference = await generate(swarm, coord, PROMPT)
        frozen = stages[0]
        got = await generate(swarm, coord, PROMPT, {30: (frozen, signal.SIGSTOP)})
        assert got["output_token_ids"] == reference["output_token_ids"]
        assert swarm.peer_ids[frozen] in got["replans"][0]["lost"]
        swarm.kill(frozen, signal.SIGCONT)
        short = swarm.peer_ids[frozen][:16]
        deadline = time.monotonic() + 30
        while f"peer {short}… rejoined" not in swarm.log(coord):
            assert time.monotonic() < deadline, (
                "the thawed peer was not admitted again within 30 s:\n" + swarm.log(coord)[-3000:]
            )
            await trio.sleep(0.25)
        again = await generate(swarm, coord, PROMPT)
        assert again["output_token_ids"] == reference["output_token_ids"]
        ring = [swarm.peer_ids.index(p) for p in again["ring"] if p != again["coordinator"]]
        others = [i for i in ring if i != frozen]
        if others:  # force a re-plan that may place the returning peer
            got2 = await generate(swarm, coord, PROMPT, {30: (others[0], signal.SIGKILL)})
            assert got2["output_token_ids"] == reference["output_token_ids"]
            assert swarm.alive()[frozen]


async def test_a_leader_back_from_a_freeze_leaves_the_serving_ring_alone(ckpt: Path) -> None:
    """SIGSTOP the leader (the smallest peer ID) until the others declare it lost and serve
    without it, then SIGCONT it in the middle of a generation. It leads again (smallest ID), but
    it knows it was stopped and takes the epoch the swarm serves instead of planning from its
    stale view: it signs no plan, the run neither pauses nor fails, and the swarm's epoch and
    coordinator stay as they were."""
    with start_local_swarm(
        4, ckpt, dtype="bf16", memory_bytes=[memory_for(ckpt, 4)] * 4, chunk_timeout=3.0
    ) as swarm:
        await ready_plan(swarm)
        leader = swarm.peer_ids.index(min(swarm.peer_ids))
        other = next(i for i in range(4) if i != leader)
        swarm.kill(leader, signal.SIGSTOP)
        short = swarm.peer_ids[leader][:16]
        deadline = time.monotonic() + 30
        while f"peer {short}… left" not in swarm.log(other):
            assert time.monotonic() < deadline, swarm.log(other)[-3000:]
            await trio.sleep(0.25)
        plan = await ready_plan(swarm, other)
        assert swarm.peer_ids[leader] not in {plan["coordinator"], *plan["ring"]}
        coord, _ = roles(swarm, plan)
        reference = await generate(swarm, coord, PROMPT)
        plans_before = swarm.log(leader).count("plan epoch")  # frozen: its log cannot change
        got = await generate(swarm, coord, PROMPT, {20: (leader, signal.SIGCONT)})
        assert got["output_token_ids"] == reference["output_token_ids"]
        deadline = time.monotonic() + 30
        while f"peer {short}… rejoined" not in swarm.log(other):
            assert time.monotonic() < deadline, "the thawed leader was not admitted again:\n" + swarm.log(other)[-3000:]
            await trio.sleep(0.25)
        await trio.sleep(5.0)  # past its settle and catch-up: any plan of its own would be out by now
        assert swarm.log(leader).count("plan epoch") == plans_before, swarm.log(leader)[-3000:]
        after = await generate(swarm, coord, PROMPT)
        assert after["output_token_ids"] == reference["output_token_ids"]
        assert (after["epoch"], after["coordinator"]) == (reference["epoch"], plan["coordinator"]), after["replans"]
        assert not got["replans"] and not after["replans"]


MISSING = re.compile(r"not enough memory.*GB short|GB short", re.S)


async def test_survivors_too_small_swarm_keeps_waiting(ckpt: Path) -> None:
    """Three nodes of 3 layers hold 8 layers; after one is lost, two cannot. The survivors stay
    up and the leader keeps saying, from the planner, how much memory is missing."""
    with start_local_swarm(
        3, ckpt, dtype="bf16", memory_bytes=[memory_for(ckpt, 3)] * 3, chunk_timeout=3.0
    ) as swarm:
        coord, stages = roles(swarm, await ready_plan(swarm))
        victim = stages[0]
        leader = min((i for i in range(3) if i != victim), key=lambda i: swarm.peer_ids[i])
        swarm.kill(victim, signal.SIGKILL)  # the leader is the smallest live peer ID after the loss
        deadline = time.monotonic() + 20
        while "cannot plan yet: not enough memory" not in swarm.log(leader):
            assert time.monotonic() < deadline, swarm.log(leader)[-3000:]
            await trio.sleep(0.25)
        log = swarm.log(leader)
        assert re.search(r"cannot plan yet: not enough memory.*GB short", log), log[-2000:]
        await trio.sleep(3.0)
        assert [alive for i, alive in enumerate(swarm.alive()) if i != victim] == [True, True]


async def test_survivors_too_small_error_says_memory_missing(ckpt: Path) -> None:
    with start_local_swarm(
        3, ckpt, dtype="bf16", memory_bytes=[memory_for(ckpt, 3)] * 3, chunk_timeout=3.0
    ) as swarm:
        coord, stages = roles(swarm, await ready_plan(swarm))
        victim = stages[0]
        async with client.open_client(
            swarm.addrs[coord], secret=swarm.secret, swarm_id=swarm.swarm_id
        ) as (h, peer):

            def on_tokens(ids: list[int], text: str) -> None:
                swarm.kill(victim, signal.SIGKILL)

            with trio.fail_after(15):  # bounded: detection + settle + a few planning attempts
                with pytest.raises(PeerError) as in_flight:
                    await client.generate(
                        h,
                        peer,
                        prompt_ids=PROMPT,
                        max_new_tokens=N_NEW,
                        draft="ngram",
                        timeout=25,
                        on_tokens=on_tokens,
                    )
            assert MISSING.search(str(in_flight.value)), in_flight.value
            with trio.fail_after(30):
                with pytest.raises(PeerError) as fresh:
                    await client.generate(
                        h, peer, prompt_ids=PROMPT, max_new_tokens=8, wait_s=5, timeout=20
                    )
            assert MISSING.search(str(fresh.value)), fresh.value


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
            swarm_name="lab", issuer=issuer.public_key, bootstrap=(addrs[0],), lifetime_s=3600
        ),
        issuer,
    )
    write_manifest(manifest, workdir / "invite.json")
    for i in range(n):
        (workdir / f"node{i}.seed").write_text(seeds[i].hex())
        cfg = {"seed_file": str(workdir / f"node{i}.seed"), "manifest": str(workdir / "invite.json"),
               "model_dir": str(ckpt), "listen": [f"/ip4/{ips[i]}/tcp/{LAB_PORT}"], "fastpath": True,
               "fastpath_port": LAB_FAST, "fastpath_advertise": [f"{ips[i]}:{LAB_FAST}"], "memory_bytes": memory,
               "dtype": "bf16", "threads": 1, "expect_peers": n, "context_tokens": 1024, "draft": "ngram",
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
