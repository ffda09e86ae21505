"""Fixtures for the endpoint tests: a tiny checkpoint with a real (byte-level BPE) tokenizer and
a ChatML chat template, one multi-process swarm shared by the module, and an API server on it."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import trio
from tokenizers import Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from swarm import client
from swarm.api.backend import ClientBackend
from swarm.api.server import serve_api
from swarm.launch import LocalSwarm, start_local_swarm
from swarm.testing.checkpoints import TinySpec, write_checkpoint

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
MODEL_NAME = "tiny-chat"


def write_tiny_tokenizer(model_dir: Path) -> int:
    """One token per printable ASCII character (and newline), ChatML specials and <unk>, so any
    output decodes to readable text; returns the vocabulary size, which the checkpoint matches."""
    chars = ["\n", *(chr(c) for c in range(32, 127))]
    vocab = {"<unk>": 0, **{ch: i + 1 for i, ch in enumerate(chars)}}
    tok = HFTokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(SPECIALS)
    tok.save(str(model_dir / "tokenizer.json"))
    config = {"bos_token": None, "eos_token": "<|im_end|>", "unk_token": "<unk>", "pad_token": "<|endoftext|>",
              "chat_template": CHATML}
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config))
    return int(tok.get_vocab_size(with_added_tokens=True))


def tiny_chat_checkpoint(out: Path, *, max_positions: int = 2048) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    vocab = write_tiny_tokenizer(out)
    spec = TinySpec(n_layers=4, vocab_size=vocab, max_position_embeddings=max_positions, row_gain_spread=1.0)
    write_checkpoint(out, spec, seed=3)
    return out


@pytest.fixture(scope="session")
def tiny_chat_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_chat_checkpoint(tmp_path_factory.mktemp("tiny") / MODEL_NAME)


@pytest.fixture(scope="session")
def swarm(tiny_chat_dir: Path) -> Iterator[LocalSwarm]:
    with start_local_swarm(2, tiny_chat_dir, dtype="fp32", context_tokens=1536) as s:
        yield s


@contextlib.asynccontextmanager
async def api_on(swarm: LocalSwarm, model_dir: Path, *, relay: bool = False, token: str | None = None,
                 bind: str = "127.0.0.1:0", peer: int | None = None) -> AsyncIterator[tuple[str, dict]]:  # type: ignore[type-arg]
    """An API server in this trio.run, a client of the coordinator (``relay``: of another peer,
    which relays to the coordinator; ``peer``: of that peer, whatever its role). Yields (base
    URL, status as that peer sees it)."""
    ask = 0 if peer is None else peer
    async with client.open_client(swarm.addrs[ask], secret=swarm.secret, swarm_id=swarm.swarm_id) as (h, p):
        st = await client.wait_ready(h, p, timeout=90)
        coord = st["plan"]["coordinator"]
        idx = peer if peer is not None else next(i for i, p in enumerate(swarm.peer_ids) if (p != coord) == relay)
        async with client.open_client(swarm.addrs[idx], secret=swarm.secret, swarm_id=swarm.swarm_id) as (h2, p2):
            backend = ClientBackend(h2, p2, model_dir, context_tokens=1536)
            async with trio.open_nursery() as nursery:
                url = await nursery.start(lambda task_status: serve_api(backend, bind, token=token, task_status=task_status))
                yield url, st
                nursery.cancel_scope.cancel()


@pytest.fixture
def api(swarm: LocalSwarm, tiny_chat_dir: Path):  # type: ignore[no-untyped-def]
    """``async with api() as (url, status)``: see :func:`api_on`."""
    return lambda **kw: api_on(swarm, tiny_chat_dir, **kw)
