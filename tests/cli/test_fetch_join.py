"""Join with the invite alone: ``join`` processes with no model on disk; only an HTTP origin
(nginx on loopback) has the files. Each fetches only its block (the coordinator also the head),
the ring serves with one box's greedy tokens, and after a peer is killed the survivors fetch
only the layers they newly hold. With one member holding its own copy, the others fetch their
blocks from it (/shard-swarm/tensors/1), the origin only the headers read before a node starts."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import trio

from swarm import client
from swarm.fetch.slices import CONFIG_FILES
from swarm.launch import offer_for
from swarm.manifest.identity import Identity, save_identity
from swarm.manifest.manifest import new_manifest, read_manifest, sign_manifest, write_manifest
from swarm.manifest.model_manifest import ModelManifest, manifest_of_path
from swarm.manifest.schema import ModelSpec
from swarm.model.generate import LocalModel, generate
from swarm.testing.checkpoints import TinySpec, write_checkpoint
from swarm.testing.origin_server import SKIP_REASON, OriginServer, have_nginx, origin_server
from tests.cli.joinkit import ROOT, JoinProc, free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600), pytest.mark.skipif(not have_nginx(), reason=SKIP_REASON)]
SPEC = TinySpec(n_layers=6, dim=256, n_heads=4, n_kv_heads=2, intermediate_size=768, vocab_size=512)
PROMPT = [5, 17, 99, 3, 42, 7, 5, 17, 99, 3, 42]
N_NEW = 40
START_S = 300.0


class FetchLab:
    """n join processes, each with its own empty cache, and an invite naming the model by its
    manifest hash with the nginx origin."""

    def __init__(self, tmp: Path, srv: OriginServer, served: Path, m: ModelManifest, n: int, layers_each: int,
                 model: Path | None = None, own_copy: frozenset[int] = frozenset(), origin: bool = True,
                 proc: type[JoinProc] = JoinProc, start_s: float = START_S, context: int = 2048) -> None:  # fmt: skip
        """``proc``: what runs each join (a benchmark's subclass stamps its events); ``start_s``: how
        long a wait may take; ``context``: the invite's context, which the offers are sized for.
        Each node listens on its own port, so ``addrs[i]`` reaches node i itself (its status)."""
        self.tmp, self.m, self.served, self.start_s = tmp, m, served, start_s
        self.ids = sorted((Identity(bytes([i + 31]) * 32) for i in range(n)), key=lambda ident: ident.peer_id)
        ports = [free_port() for _ in range(n)]
        self.addrs = [f"/ip4/127.0.0.1/tcp/{pt}/p2p/{ident.peer_id}" for pt, ident in zip(ports, self.ids, strict=True)]
        boot = self.addrs[0]
        cfg = m.files["config.json"].sha256 if "config.json" in m.files else None
        spec = ModelSpec("tiny", cfg, {}, m.digest(), (srv.url,) if origin else (), f"{srv.url}/model-manifest.json")
        self.invite = tmp / "invite.json"
        write_manifest(sign_manifest(new_manifest(swarm_name="fetchlab", issuer=self.ids[0].public_key,
                                                  bootstrap=(boot,), model=spec, context=context), self.ids[0]), self.invite)  # fmt: skip
        mem = offer_for(model or served, layers_each, context_tokens=context)  # the checkpoint sizes the offers
        self.offer = mem
        self.procs: list[JoinProc] = []
        for i in range(n):
            key = tmp / f"n{i}.key"
            save_identity(self.ids[i], key)
            env = {**os.environ, "SHARD_SWARM_CONFIG": str(tmp / f"cfg{i}"), "PYTHONPATH": str(ROOT),
                   "SHARD_SWARM_CACHE": str(tmp / f"cache{i}")}  # fmt: skip
            env.pop("HF_TOKEN", None)
            listen = f"/ip4/127.0.0.1/tcp/{ports[i]}"
            args = ["--manifest", str(self.invite), "--key", str(key), "--listen", listen, "--dtype", "fp32",
                    "--threads", "1", "--memory", str(mem), "--no-mdns", "--no-relay", "--json"]  # fmt: skip
            if i in own_copy:  # the user's own copy of the model (checked in place, served to members)
                args += ["--model", str(served)]
            self.procs.append(proc(f"n{i}", args, env))

    def state(self, i: int) -> dict[str, Any]:
        return json.loads((self.tmp / f"cache{i}" / "models" / self.m.digest()[:16] / ".fetch-state.json").read_text())

    def coordinator(self) -> dict[str, Any] | None:
        for p in self.procs:
            if p.proc.poll() is None and p.of("plan") and p.of("plan")[-1]["role"].startswith("coordinator"):
                return p.of("plan")[-1]
        return None

    def wait(self, pred: Callable[[], bool], what: str) -> None:
        t0 = time.monotonic()
        while not pred():
            stuck = any("not enough memory" in e.get("reason", "") for p in self.procs for e in p.of("waiting"))
            if time.monotonic() - t0 > self.start_s or stuck:
                raise AssertionError(f"waiting for {what}\n" + "\n".join(p.tail() for p in self.procs))
            time.sleep(0.1)

    async def generate(self, prompt: list[int] = PROMPT) -> dict[str, Any]:
        inv = read_manifest(self.invite)
        async with client.open_client(list(inv.bootstrap), secret=inv.secret.value, swarm_id=inv.swarm_id) as (h, peer):
            got = await client.generate(h, peer, prompt_ids=prompt, max_new_tokens=N_NEW, draft="ngram", timeout=150)
        return dict(got)

    def close(self) -> None:
        for p in self.procs:
            if p.proc.poll() is None:
                p.proc.kill()
                p.proc.wait(timeout=10)


def _one_box(served: Path, prompt: list[int] = PROMPT, eos: tuple[int, ...] = ()) -> list[int]:
    torch.set_num_threads(1)
    return generate(LocalModel.load(served, stages=1, dtype=torch.float32), prompt, eos_token_ids=eos,
                    max_new_tokens=N_NEW).output_token_ids  # fmt: skip


def _origin(tmp: Path) -> tuple[Path, ModelManifest]:
    served = write_checkpoint(tmp / "origin", SPEC, seed=5, shards=3)
    m = manifest_of_path(served, name="tiny")
    (served / "model-manifest.json").write_bytes(m.canonical_bytes())
    return served, m


async def test_three_peers_with_no_model_fetch_only_their_blocks_and_serve(tmp_path: Path) -> None:
    served, m = _origin(tmp_path)
    with origin_server(served, tmp_path / "nginx") as srv:
        lab = FetchLab(tmp_path, srv, served, m, 3, layers_each=2)  # the ring needs all three
        try:
            await trio.to_thread.run_sync(lambda: lab.wait(
                lambda: sum(1 for p in lab.procs if p.of("serving")) == 3 and lab.coordinator() is not None, "serving"))
            got = await lab.generate()
            assert got["output_token_ids"] == _one_box(served)
            assert got["fetched"]["bytes"] > 0 and got["fetched"]["sources"] == [srv.url]  # the receipt says it
            head = sum(t.nbytes for t in m.head())
            manifest_size = len(m.canonical_bytes())
            total = 0
            for i, p in enumerate(lab.procs):
                plan = p.of("plan")[-1]
                fetched = lab.state(i)["fetched_total"] + manifest_size  # the manifest and headers included
                total += fetched
                a, b = plan["block"] or (0, 0)
                mine = m.block_bytes(a, b) + (head if plan["role"].startswith("coordinator") else 0)
                assert mine > 0, plan
                ratio = fetched / mine
                print(f"peer {i} {plan['role']} block [{a}, {b}): fetched {fetched} B for {mine} B: ratio {ratio:.4f}")
                assert ratio <= 1.05, (i, plan, fetched, mine)
                assert sum(e["bytes"] for e in p.of("fetched")) <= lab.state(i)["fetched_total"]
            assert srv.bytes_sent() == total  # the origin's own count: every byte it sent is accounted for
            assert total < 1.1 * sum(t.nbytes for t in m.tensors.values())  # the model crossed the wire about once
        finally:
            lab.close()


async def test_peers_fetch_their_blocks_from_a_member_with_its_own_copy(tmp_path: Path) -> None:
    served, m = _origin(tmp_path)
    with origin_server(served, tmp_path / "nginx") as srv:
        lab = FetchLab(tmp_path, srv, served, m, 3, layers_each=2, own_copy=frozenset({0}))
        try:
            await trio.to_thread.run_sync(lambda: lab.wait(
                lambda: sum(1 for p in lab.procs if p.of("serving")) == 3 and lab.coordinator() is not None, "serving"))
            got = await lab.generate()
            assert got["output_token_ids"] == _one_box(served)
            owner = lab.ids[0].peer_id
            headers = sum(f.header_end for f in m.weight_files()) + sum(m.files[p].size for p in CONFIG_FILES if p in m.files)
            # the origin sent the manifest to each and the headers and config to the two without a
            # copy (join reads them before its node starts), and not one tensor
            assert srv.bytes_sent() == 3 * len(m.canonical_bytes()) + 2 * headers, srv.requests()
            for i in (1, 2):
                plan = lab.procs[i].of("plan")[-1]
                a, b = plan["block"] or (0, 0)
                mine = m.block_bytes(a, b) + (sum(t.nbytes for t in m.head()) if plan["role"].startswith("coordinator") else 0)
                fetched = [e for e in lab.procs[i].of("fetched") if e["bytes"]]
                print(f"peer {i} {plan['role']} [{a}, {b}): {[e['sources'] for e in fetched]}, {[e['paths'] for e in fetched]}")
                assert fetched and all(set(e["sources"]) == {owner} for e in fetched), fetched
                # over the fast path's direct sealed socket, every byte (join --json says which path)
                assert all(e["paths"] == {owner: {"direct": e["bytes"]}} for e in fetched), fetched
                assert lab.state(i)["fetched_total"] == headers + mine, (i, plan)
        finally:
            lab.close()


async def test_with_no_origin_the_others_fetch_everything_from_the_member_with_a_copy(tmp_path: Path) -> None:
    served, m = _origin(tmp_path)
    only_manifest = tmp_path / "manifest-only"
    only_manifest.mkdir()
    (only_manifest / "model-manifest.json").write_bytes(m.canonical_bytes())
    with origin_server(only_manifest, tmp_path / "nginx") as srv:  # the invite's manifest_url; no origin
        lab = FetchLab(tmp_path, srv, served, m, 3, layers_each=2, own_copy=frozenset({0}), origin=False)
        try:
            await trio.to_thread.run_sync(lambda: lab.wait(
                lambda: sum(1 for p in lab.procs if p.of("serving")) == 3 and lab.coordinator() is not None, "serving"))
            got = await lab.generate()
            assert got["output_token_ids"] == _one_box(served)
            assert srv.bytes_sent() == 3 * len(m.canonical_bytes())  # the manifest, nothing else
            owner = lab.ids[0].peer_id
            headers = sum(f.header_end for f in m.weight_files()) + sum(m.files[p].size for p in CONFIG_FILES if p in m.files)
            for i in (1, 2):
                plan = lab.procs[i].of("plan")[-1]
                a, b = plan["block"] or (0, 0)
                coord = plan["role"].startswith("coordinator")
                mine = m.block_bytes(a, b) + (sum(t.nbytes for t in m.head()) if coord else 0)
                small = sum(f.size for f in m.small_files() if f.path not in CONFIG_FILES) if coord else 0
                fetched = [e for e in lab.procs[i].of("fetched") if e["bytes"]]
                assert fetched and all(set(e["sources"]) == {owner} for e in fetched), fetched
                assert all(e["paths"] == {owner: {"direct": e["bytes"]}} for e in fetched), fetched
                assert lab.state(i)["fetched_total"] == headers + mine + small, (i, plan)
        finally:
            lab.close()


async def test_after_a_peer_is_killed_survivors_fetch_only_their_new_layers(tmp_path: Path) -> None:
    served, m = _origin(tmp_path)
    with origin_server(served, tmp_path / "nginx") as srv:
        lab = FetchLab(tmp_path, srv, served, m, 3, layers_each=3)  # two peers can hold the model
        try:
            await trio.to_thread.run_sync(lambda: lab.wait(
                lambda: lab.coordinator() is not None and sum(1 for p in lab.procs if p.of("serving")) >= 2, "serving"))
            plan = lab.coordinator()
            assert plan is not None
            ids = [i.peer_id for i in lab.ids]
            victims = [p for p in plan["ring"] if p not in (plan["coordinator"], ids[0])]
            if not victims:
                pytest.skip(f"the plan used two peers ({plan['ring']}): no stage to kill but the bootstrap")
            v = ids.index(victims[0])
            held = {i: set(range(*p.of("plan")[-1]["block"])) for i, p in enumerate(lab.procs)
                    if p.of("plan") and p.of("plan")[-1]["block"]}  # fmt: skip
            before = {i: lab.state(i)["fetched_total"] for i in range(len(lab.procs))}  # headers fetched at join
            lab.procs[v].proc.send_signal(signal.SIGKILL)
            epoch = plan["epoch"]
            await trio.to_thread.run_sync(lambda: lab.wait(lambda: (c := lab.coordinator()) is not None
                                                           and c["epoch"] > epoch and ids[v] not in c["ring"],
                                                           "the re-plan"))  # fmt: skip
            await trio.to_thread.run_sync(lambda: lab.wait(lambda: (c := lab.coordinator()) is not None and all(
                any(e.get("epoch") == c["epoch"] for e in lab.procs[ids.index(peer)].of("serving")) for peer in c["ring"]
            ), "the survivors serving"))  # fmt: skip
            assert (await lab.generate())["output_token_ids"] == _one_box(served)
            moved_any = False
            for i, p in enumerate(lab.procs):
                if i == v or not p.of("plan")[-1]["block"]:
                    continue
                new = set(range(*p.of("plan")[-1]["block"]))
                gained = new - held.get(i, set())
                want = sum(m.block_bytes(k, k + 1) for k in gained)
                got = lab.state(i)["fetched_total"] - before[i]
                print(f"peer {i}: held {sorted(held.get(i, ()))}, now {sorted(new)}: fetched {got} B, new layers {want} B")
                assert got == want, (i, sorted(held.get(i, ())), sorted(new), got, want)
                moved_any |= bool(gained)
            assert moved_any  # someone took over the dead peer's layers, fetching only those
        finally:
            lab.close()


async def test_the_bundled_gguf_fetched_by_three_peers_serves_like_one_box(tmp_path: Path) -> None:
    from swarm.model.bundled import bundled_gguf_path
    from swarm.model.weights import open_checkpoint

    gguf = bundled_gguf_path()
    served = tmp_path / "origin"
    served.mkdir()
    (served / gguf.name).symlink_to(gguf)
    m = manifest_of_path(served / gguf.name, name="smollm2")
    (served / "model-manifest.json").write_bytes(m.canonical_bytes())
    args = open_checkpoint(gguf).args
    with origin_server(served, tmp_path / "nginx") as srv:
        lab = FetchLab(tmp_path, srv, served, m, 3, layers_each=10, model=gguf)  # 30 layers: all three hold 10
        try:
            await trio.to_thread.run_sync(lambda: lab.wait(
                lambda: sum(1 for p in lab.procs if p.of("serving")) == 3 and lab.coordinator() is not None, "serving"))
            from swarm.model.tokenizer import Tokenizer

            prompt = Tokenizer.load(gguf).encode("The three primary colors are", add_special_tokens=True)
            got = await lab.generate(prompt)
            want = _one_box(served / gguf.name, prompt, args.eos_token_ids)
            assert got["output_token_ids"] == want and len(want) > 10
            header = m.files[gguf.name].header_end
            for i, p in enumerate(lab.procs):
                plan = p.of("plan")[-1]
                a, b = plan["block"] or (0, 0)
                mine = m.block_bytes(a, b) + (sum(t.nbytes for t in m.head()) if plan["role"].startswith("coordinator") else 0)
                fetched = lab.state(i)["fetched_total"] + len(m.canonical_bytes())
                print(f"peer {i} {plan['role']} [{a}, {b}): fetched {fetched} B for {mine} B (header {header} B): "
                      f"ratio {fetched / mine:.4f}")  # fmt: skip
                # every byte beyond the block is the GGUF header (its tokenizer), the manifest, and the
                # alignment padding (< 32 bytes) between the tensors of one request
                base = mine + header + len(m.canonical_bytes())
                assert base <= fetched <= base + 32 * len(m.tensors)
        finally:
            lab.close()
