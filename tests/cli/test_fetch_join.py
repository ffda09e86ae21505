"""Join with the invite alone: three ``join`` processes with no model on disk; only an HTTP origin
(nginx on loopback) has the files. Each fetches only its block (the coordinator also the head),
the ring serves, and the greedy tokens are one box's."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import trio

from swarm.manifest.identity import Identity, save_identity
from swarm.manifest.manifest import new_manifest, read_manifest, sign_manifest, write_manifest
from swarm.manifest.model_manifest import manifest_of_path
from swarm.manifest.schema import ModelSpec
from swarm.model.config import ModelArgs
from swarm.model.generate import LocalModel, generate
from swarm.node import client
from swarm.node.settings import model_spec
from swarm.testing.checkpoints import TinySpec, write_checkpoint
from swarm.testing.origin_server import SKIP_REASON, have_nginx, origin_server
from tests.cli.joinkit import ROOT, JoinProc, free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600), pytest.mark.skipif(not have_nginx(), reason=SKIP_REASON)]
SPEC = TinySpec(n_layers=6, dim=256, n_heads=4, n_kv_heads=2, intermediate_size=768, vocab_size=512)
PROMPT = [5, 17, 99, 3, 42, 7, 5, 17, 99, 3, 42]
N_NEW = 40
START_S = 300.0


async def test_three_peers_with_no_model_fetch_only_their_blocks_and_serve(tmp_path: Path) -> None:
    served = write_checkpoint(tmp_path / "origin", SPEC, seed=5, shards=3)
    m = manifest_of_path(served, name="tiny")
    (served / "model-manifest.json").write_bytes(m.canonical_bytes())
    with origin_server(served, tmp_path / "nginx") as srv:
        ids = sorted((Identity(bytes([i + 31]) * 32) for i in range(3)), key=lambda ident: ident.peer_id)
        port = free_port()
        boot = f"/ip4/127.0.0.1/tcp/{port}/p2p/{ids[0].peer_id}"
        cfg = m.files["config.json"].sha256
        spec = ModelSpec("tiny", cfg, {}, m.digest(), (srv.url,), f"{srv.url}/model-manifest.json")
        invite = tmp_path / "invite.json"
        write_manifest(sign_manifest(new_manifest(swarm_name="fetchlab", issuer=ids[0].public_key, bootstrap=(boot,),
                                                  model=spec), ids[0]), invite)  # fmt: skip
        head = sum(t.nbytes for t in m.head())
        planned = model_spec(ModelArgs.from_dir(served), torch.float32, 2048)
        procs = []
        for i in range(3):
            key = tmp_path / f"n{i}.key"
            save_identity(ids[i], key)
            env = {**os.environ, "SHARD_SWARM_CONFIG": str(tmp_path / f"cfg{i}"), "PYTHONPATH": str(ROOT),
                   "SHARD_SWARM_CACHE": str(tmp_path / f"cache{i}")}  # fmt: skip
            env.pop("HF_TOKEN", None)
            listen = f"/ip4/127.0.0.1/tcp/{port if i == 0 else 0}"
            # room for two layers (and the head) each: the ring needs all three peers
            mem = 2 * planned.bytes_per_layer + planned.coordinator_bytes + 1
            args = ["--manifest", str(invite), "--key", str(key), "--listen", listen, "--dtype", "fp32",
                    "--threads", "1", "--memory", str(mem), "--no-mdns", "--no-relay", "--json"]  # fmt: skip
            procs.append(JoinProc(f"n{i}", args, env))
        try:

            def serving() -> bool:
                return sum(1 for p in procs if p.of("serving")) == 3 and any(
                    p.of("plan") and p.of("plan")[-1]["role"].startswith("coordinator") for p in procs)

            await trio.to_thread.run_sync(lambda: _wait(procs, serving, START_S))
            torch.set_num_threads(1)
            want = generate(LocalModel.load(served, stages=1, dtype=torch.float32), PROMPT, eos_token_ids=(),
                            max_new_tokens=N_NEW).output_token_ids  # fmt: skip
            inv = read_manifest(invite)
            async with client.open_client(list(inv.bootstrap), secret=inv.secret.value, swarm_id=inv.swarm_id) as (h, peer):
                got = await client.generate(h, peer, prompt_ids=PROMPT, max_new_tokens=N_NEW, draft="ngram", timeout=150)
            assert got["output_token_ids"] == want
            manifest_size = len(m.canonical_bytes())
            total = 0
            for i, p in enumerate(procs):
                plan = p.of("plan")[-1]
                state = json.loads((tmp_path / f"cache{i}" / "models" / m.digest()[:16] / ".fetch-state.json").read_text())
                fetched = state["fetched_total"] + manifest_size  # the manifest and headers included
                total += fetched
                a, b = plan["block"] or (0, 0)
                mine = m.block_bytes(a, b) + (head if plan["role"].startswith("coordinator") else 0)
                assert mine > 0, plan
                ratio = fetched / mine
                print(f"peer {i} {plan['role']} block [{a}, {b}): fetched {fetched} B for {mine} B: ratio {ratio:.4f}")
                assert ratio <= 1.05, (i, plan, fetched, mine)
                assert sum(e["bytes"] for e in p.of("fetched")) <= state["fetched_total"]
            assert srv.bytes_sent() == total  # the origin's own count: every byte it sent is accounted for
            assert total < 1.1 * sum(t.nbytes for t in m.tensors.values())  # the model crossed the wire about once
        finally:
            for p in procs:
                if p.proc.poll() is None:
                    p.proc.kill()
                    p.proc.wait(timeout=10)


def _wait(procs: list[JoinProc], pred: object, timeout: float) -> None:
    import time

    t0 = time.monotonic()
    while not pred():  # type: ignore[operator]
        stuck = any("not enough memory" in e.get("reason", "") for p in procs for e in p.of("waiting"))
        if time.monotonic() - t0 > timeout or stuck or any(p.proc.poll() is not None for p in procs):
            raise AssertionError("the ring did not serve\n" + "\n".join(p.tail() for p in procs))
        time.sleep(0.1)
