"""A prompt of more than 6,000 tokens through the OpenAI endpoint on the bundled model, a swarm
of three node processes with a context of 8192: the answer equals one box's (fp32, the same
64-token prefill chunks and one token per step: exactly the same computations)."""

from __future__ import annotations

import pytest
import torch
import trio

from swarm import client
from swarm.api.backend import ClientBackend
from swarm.api.server import serve_api
from swarm.launch import start_local_swarm
from swarm.model.generate import LocalModel, generate
from swarm.model.packaged import resolve_model
from swarm.model.tokenizer import Tokenizer

# a 6.4k-token prefill twice (the ring, then one box) on a shared 2-core machine takes minutes
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]
openai = pytest.importorskip("openai")
TEXT = "\n".join(f"Entry {i}: peer {i % 7} holds layers {i % 30} to {i % 30 + 3}; its round trip is {i % 50} ms."
                 for i in range(230))  # fmt: skip


async def test_a_6k_token_prompt_through_the_api_matches_one_box() -> None:
    model_dir = resolve_model(None)
    tok = Tokenizer.load(model_dir)
    messages = [{"role": "user", "content": TEXT + "\nWhich peer holds layer 12?"}]
    ids = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True), add_special_tokens=False)
    assert 6000 <= len(ids) <= 8192 - 16, len(ids)
    with start_local_swarm(3, model_dir, dtype="fp32", context_tokens=8192, draft="none") as swarm:
        async with client.open_client(swarm.addrs[0], secret=swarm.secret, swarm_id=swarm.swarm_id) as (h, peer):
            st = await client.wait_ready(h, peer, timeout=300)
            assert st["context_tokens"] == 8192
            backend = ClientBackend(h, peer, model_dir, context_tokens=st["context_tokens"])
            async with trio.open_nursery() as nursery:
                url = await nursery.start(lambda task_status: serve_api(backend, "127.0.0.1:0", task_status=task_status))
                api = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=900)
                answer = await trio.to_thread.run_sync(lambda: api.chat.completions.create(
                    model=model_dir.name, messages=messages, max_tokens=8, temperature=0))  # type: ignore[arg-type]
                nursery.cancel_scope.cancel()
    assert answer.usage is not None and answer.usage.prompt_tokens == len(ids)

    def one_box() -> list[int]:
        torch.set_num_threads(1)
        model = LocalModel.load(model_dir, stages=1, dtype=torch.float32)
        return generate(model, ids, max_new_tokens=8).output_token_ids

    want = await trio.to_thread.run_sync(one_box)
    assert answer.choices[0].message.content == tok.decode(want)
