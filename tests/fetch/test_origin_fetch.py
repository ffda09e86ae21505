"""Fetching a block's byte ranges from a real HTTP origin (nginx on loopback), verified, cached."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import pytest
import torch

from swarm.fetch.cache import DiskBudgetError, ModelCache
from swarm.fetch.origin import FetchError, Origin
from swarm.fetch.slices import fetch_block, fetch_head, local_path
from swarm.manifest.model_manifest import manifest_of_path
from swarm.model.stage import Head, Stage
from swarm.model.weights import open_checkpoint
from swarm.testing.checkpoints import TinySpec, write_checkpoint
from swarm.testing.origin_server import SKIP_REASON, have_nginx, origin_server

pytestmark = pytest.mark.skipif(not have_nginx(), reason=SKIP_REASON)
SPEC = TinySpec(n_layers=6, dim=256, n_heads=4, n_kv_heads=2, intermediate_size=512, vocab_size=512)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("origin") / "tiny", SPEC, shards=3)


def _same_stage(a: Path, b: Path, start: int, end: int) -> None:
    ca, cb = open_checkpoint(a), open_checkpoint(b)
    sa = Stage.load(ca.args, ca.source, start, end, dtype=torch.float32)
    sb = Stage.load(cb.args, cb.source, start, end, dtype=torch.float32)
    da, db = sa.state_dict(), sb.state_dict()
    assert da.keys() == db.keys() and da
    assert all(torch.equal(da[k], db[k]) for k in da)


def test_a_block_fetches_only_its_bytes_and_loads_as_the_original(model: Path, tmp_path: Path) -> None:
    m = manifest_of_path(model)
    with origin_server(model, tmp_path / "nginx") as srv:
        origin = Origin(srv.url)
        cache = ModelCache(tmp_path / "cache", m)
        t0 = time.perf_counter()
        rep = fetch_block(cache, 2, 4, [origin])
        wall = time.perf_counter() - t0
        block = m.block_bytes(2, 4)
        # the verify part of the fetch: the sha256 of what landed, timed inside the call
        assert rep.verify_s is not None and 0 < rep.verify_s <= wall, (rep.verify_s, wall)
        assert rep.fetched == srv.bytes_sent() == origin.received  # what the server sent is what landed
        assert rep.fetched / block <= 1.05, (rep.fetched, block)
        assert cache.layers_held() == [2, 3]
        _same_stage(model, local_path(cache), 2, 4)
        # the cached shards are sparse: full length, only the block's bytes on disk
        for f in m.weight_files():
            p = cache.dir / f.path
            assert p.stat().st_size == f.size
            assert p.stat().st_blocks * 512 <= f.header_end + block + 64 * 4096
        again = fetch_block(cache, 2, 4, [origin])
        assert again.fetched == 0 and srv.bytes_sent() == rep.fetched  # held: nothing moves
        assert again.verify_s == 0.0  # nothing landed, nothing hashed
        # a re-plan: layers [3, 5) fetch only layer 4
        moved = fetch_block(cache, 3, 5, [origin])
        assert moved.fetched == m.block_bytes(4, 5)
        head = fetch_head(ModelCache(tmp_path / "coord", m), [origin])
        ck = open_checkpoint(local_path(ModelCache(tmp_path / "coord", m)))
        ref = open_checkpoint(model)
        ha = Head.load(ck.args, ck.source, dtype=torch.float32).state_dict()
        hb = Head.load(ref.args, ref.source, dtype=torch.float32).state_dict()
        assert all(torch.equal(ha[k], hb[k]) for k in ha) and head.fetched > 0


def test_split_gguf_block_keeps_the_quantized_bytes(tmp_path: Path) -> None:
    import gguf

    from swarm.testing.gguf_files import write_family_gguf

    hf = write_checkpoint(tmp_path / "hf", SPEC)
    (tmp_path / "g").mkdir()
    first = write_family_gguf(hf, tmp_path / "g" / "tiny.gguf", split=3, qtype=gguf.GGMLQuantizationType.Q8_0)
    m = manifest_of_path(first)
    with origin_server(first.parent, tmp_path / "nginx") as srv:
        cache = ModelCache(tmp_path / "cache", m)
        rep = fetch_block(cache, 1, 3, [Origin(srv.url)])
        headers = sum(f.header_end for f in m.weight_files())
        assert rep.fetched <= m.block_bytes(1, 3) + headers + 32 * len(m.block(1, 3))
        _same_stage(first, local_path(cache), 1, 3)


def test_a_cut_mid_tensor_resumes_without_fetching_again(model: Path, tmp_path: Path) -> None:
    m = manifest_of_path(model)
    big = max(m.block(0, 2), key=lambda t: t.nbytes)
    with origin_server(model, tmp_path / "nginx", rate="4m") as srv:
        cache = ModelCache(tmp_path / "cache", m)
        cut = []

        def kill_once(done: int, total: int) -> None:
            if not cut and done > big.nbytes // 2:
                cut.append(done)
                srv.kill_worker()  # every connection in flight dies; the master starts a new worker

        rep = fetch_block(cache, 0, 2, [Origin(srv.url)], kill_once)
        assert cut and cache.layers_held() == [0, 1]
        assert srv.bytes_sent() <= rep.needed + (1 << 20)  # resumed where it was cut, not from the start

        class Stop(Exception):
            pass

        def stop(done: int, total: int) -> None:
            if done > m.block_bytes(2, 3) // 2:
                raise Stop

        with contextlib.closing(Origin(srv.url)) as origin, pytest.raises(Stop):
            fetch_block(cache, 2, 3, [origin], stop)
        reopened = ModelCache(tmp_path / "cache", m)  # a new process: state from the disk
        partial = sum(reopened.partial.values())
        assert partial > 0
        srv.wait_idle()  # the cut transfer is in nginx's log before we count from here
        before = srv.bytes_sent()
        with contextlib.closing(Origin(srv.url)) as origin:
            rest = fetch_block(reopened, 2, 3, [origin])
        srv.wait_idle()
        assert reopened.layers_held() == [0, 1, 2]
        assert srv.bytes_sent() - before == rest.fetched
        assert rest.fetched <= m.block_bytes(2, 3) - partial + (1 << 20) + 1  # the landed prefix was kept
        _same_stage(model, local_path(reopened), 0, 3)


def test_an_origin_that_ignores_range_still_serves_the_block(model: Path, tmp_path: Path) -> None:
    m = manifest_of_path(model)
    with origin_server(model, tmp_path / "nginx", ranges=False) as srv:
        origin = Origin(srv.url)
        cache = ModelCache(tmp_path / "cache", m)
        fetch_block(cache, 4, 6, [origin])
        assert origin.ranges_ignored > 0 and cache.layers_held() == [4, 5]
        assert all(status == 200 for req, status, _ in srv.requests() if req.startswith("GET"))
        _same_stage(model, local_path(cache), 4, 6)


def test_bearer_token_from_hf_token(model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    m = manifest_of_path(model)
    with origin_server(model, tmp_path / "nginx", token="s3cret-token") as srv:
        monkeypatch.delenv("HF_TOKEN", raising=False)
        with pytest.raises(FetchError, match="HTTP 401.*HF_TOKEN"):
            fetch_block(ModelCache(tmp_path / "a", m), 0, 1, [Origin(srv.url)])
        monkeypatch.setenv("HF_TOKEN", "s3cret-token")
        origin = Origin(srv.url)
        assert "s3cret" not in repr(origin)
        fetch_block(ModelCache(tmp_path / "b", m), 0, 1, [origin])


def test_changed_origin_bytes_name_file_and_tensor(model: Path, tmp_path: Path) -> None:
    import shutil

    served = tmp_path / "served"
    shutil.copytree(model, served)
    m = manifest_of_path(served)
    bad = m.tensors["model.layers.1.mlp.down_proj.weight"]
    with open(served / bad.file, "r+b") as f:  # one byte flipped after the manifest was made
        f.seek(bad.start + 10)
        b = f.read(1)
        f.seek(bad.start + 10)
        f.write(bytes([b[0] ^ 0x01]))
    with origin_server(served, tmp_path / "nginx") as srv:
        cache = ModelCache(tmp_path / "cache", m)
        with pytest.raises(FetchError, match=rf"{bad.file}: tensor {bad.name}.*changed"):
            fetch_block(cache, 0, 2, [Origin(srv.url)])
        assert bad.name not in cache.verified
        assert {t.name for t in m.block(0, 2)} - {bad.name} <= cache.verified  # the others are held


def test_disk_budget_refused_before_a_byte_moves(model: Path, tmp_path: Path) -> None:
    m = manifest_of_path(model)
    with origin_server(model, tmp_path / "nginx") as srv:
        cache = ModelCache(tmp_path / "cache", m, disk_budget=m.block_bytes(0, 3) // 2)
        with pytest.raises(DiskBudgetError, match=r"disk budget .* needs .* raise --disk"):
            fetch_block(cache, 0, 3, [Origin(srv.url)])
        assert srv.bytes_sent() == 0
        fetch_block(cache, 0, 1, [Origin(srv.url)])  # one layer fits


def test_a_manifest_made_from_the_origin_equals_the_local_one(model: Path, tmp_path: Path) -> None:
    from swarm.cli.model import manifest_of_url

    with origin_server(model, tmp_path / "nginx") as srv:
        remote = manifest_of_url(srv.url, name="tiny", quant="none")
    assert remote == manifest_of_path(model, name="tiny")  # same tensors, ranges, hashes, small files
    assert remote.digest() == manifest_of_path(model, name="tiny").digest()
