"""The endpoint against a real swarm of node processes: the official ``openai`` client (sync and
async, streaming and not) and plain HTTP. The reference for every answer is the swarm's own
generation service (``client.generate``) on the same prompt ids: the endpoint must be a faithful
translator, token for token."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import trio

from swarm import client
from swarm.launch import LocalSwarm
from swarm.model.tokenizer import Tokenizer

pytestmark = pytest.mark.slow
MODEL = "tiny-chat"
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say something."}]


async def _reference(swarm: LocalSwarm, prompt_ids: list[int], **kw: Any) -> list[int]:
    async with client.open_client(swarm.addrs[0], secret=swarm.secret, swarm_id=swarm.swarm_id) as (h, p):
        r = await client.generate(h, p, prompt_ids=prompt_ids, timeout=60, **kw)
    return list(r["output_token_ids"])


def _chat_ids(tok: Tokenizer) -> list[int]:
    return tok.encode(tok.apply_chat_template(MESSAGES, add_generation_prompt=True))


async def test_openai_client_sync_and_async_match_the_swarm(api, swarm: LocalSwarm, tiny_chat_dir: Path) -> None:  # type: ignore[no-untyped-def]
    tok = Tokenizer.from_dir(tiny_chat_dir)
    async with api() as (url, _):
        sync = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        models = await trio.to_thread.run_sync(lambda: sync.models.list())
        assert [m.id for m in models.data] == [MODEL]

        chat = await trio.to_thread.run_sync(lambda: sync.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=16, temperature=0))  # type: ignore[arg-type]
        want_ids = await _reference(swarm, _chat_ids(tok), max_new_tokens=16, temperature=0.0)
        assert chat.choices[0].message.content == tok.decode(want_ids)
        assert chat.choices[0].finish_reason == "length"
        assert chat.usage is not None
        assert (chat.usage.prompt_tokens, chat.usage.completion_tokens) == (len(_chat_ids(tok)), 16)

        def stream_sync() -> tuple[str, list[str | None]]:
            parts, reasons = [], []
            for ch in sync.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=16,  # type: ignore[arg-type]
                                                   temperature=0, stream=True):  # fmt: skip
                parts.append(ch.choices[0].delta.content or "")
                reasons.append(ch.choices[0].finish_reason)
            return "".join(parts), reasons

        text, reasons = await trio.to_thread.run_sync(stream_sync)
        assert text == chat.choices[0].message.content
        assert reasons[-1] == "length" and all(r is None for r in reasons[:-1])

        aio = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        prompt = "The ring says"
        done = await aio.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
        want = tok.decode(await _reference(swarm, tok.encode(prompt), max_new_tokens=12, temperature=0.0))
        assert done.choices[0].text == want
        pieces, usage = [], None
        stream = await aio.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stream=True,
                                              stream_options={"include_usage": True})  # fmt: skip
        async for ch in stream:
            pieces += [c.text for c in ch.choices]
            usage = ch.usage or usage
        assert "".join(pieces) == want
        assert usage is not None and (usage.prompt_tokens, usage.completion_tokens) == (len(tok.encode(prompt)), 12)

        # sampling: the seed reaches the swarm unchanged
        sampled = await aio.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12,  # type: ignore[arg-type]
                                                    temperature=0.9, top_p=0.8, seed=7)  # fmt: skip
        want_ids = await _reference(swarm, _chat_ids(tok), max_new_tokens=12, temperature=0.9, top_p=0.8, seed=7)
        assert sampled.choices[0].message.content == tok.decode(want_ids)
        await aio.close()


async def test_stop_sequences_cut_the_text_and_end_the_generation(api, tiny_chat_dir: Path) -> None:  # type: ignore[no-untyped-def]
    async with api() as (url, _), httpx.AsyncClient(base_url=url, timeout=60) as http:
        base = {"model": MODEL, "prompt": "Once upon", "max_tokens": 40, "temperature": 0}
        full = (await http.post("/v1/completions", json=base)).json()["choices"][0]["text"]
        assert len(full) == 40  # one character per token with this tokenizer
        stop = full[12:15]
        cut = full.index(stop)
        r = (await http.post("/v1/completions", json={**base, "stop": [stop, "never-seen"]})).json()
        assert r["choices"][0]["text"] == full[:cut]
        assert r["choices"][0]["finish_reason"] == "stop"
        assert r["usage"]["completion_tokens"] == cut + len(stop)
        # streamed: the same cut, and no piece of the stop sequence ever leaves the server
        chunks: list[str] = []
        async with http.stream("POST", "/v1/completions", json={**base, "stop": stop, "stream": True}) as resp:
            assert resp.headers["content-type"].startswith("text/event-stream")
            async for line in resp.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunks.append(line)
        import json

        events = [json.loads(c[6:]) for c in chunks]
        assert not [e for e in events if "error" in e], events  # an error event names its cause
        assert "".join(e["choices"][0]["text"] for e in events) == full[:cut]
        assert events[-1]["choices"][0]["finish_reason"] == "stop"


async def _hang_up_and_wait(api, swarm: LocalSwarm, *, relay: bool, max_tokens: int) -> None:  # type: ignore[no-untyped-def]
    async with api(relay=relay) as (url, st), httpx.AsyncClient(base_url=url, timeout=60) as http:
        coord = swarm.peer_ids.index(st["plan"]["coordinator"])
        before = swarm.log(coord).count(" failed: ")
        body = {"model": MODEL, "prompt": "Tell a long story", "max_tokens": max_tokens, "temperature": 0, "stream": True}
        seen = 0
        async with http.stream("POST", "/v1/completions", json=body) as resp:
            async for line in resp.aiter_lines():
                seen += line.startswith("data: ")
                if seen >= 3:
                    break  # leaving the block closes the connection mid-stream
        hung_up = time.monotonic()
        # the coordinator logs the failed request only when its next write fails (a reset stream):
        # a freed session shows within a second or two; one left running never does
        while swarm.log(coord).count(" failed: ") == before:
            assert time.monotonic() - hung_up < 4.0, swarm.log(coord)[-3000:]
            await trio.sleep(0.1)
        ok = await http.post("/v1/completions", json={**body, "stream": False, "max_tokens": 4})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4


async def test_client_hanging_up_frees_the_session(api, swarm: LocalSwarm) -> None:  # type: ignore[no-untyped-def]
    await _hang_up_and_wait(api, swarm, relay=False, max_tokens=1400)


async def test_hanging_up_on_a_relaying_peer_frees_the_session(api, swarm: LocalSwarm) -> None:  # type: ignore[no-untyped-def]
    await _hang_up_and_wait(api, swarm, relay=True, max_tokens=300)  # the zombie wastes less


async def test_any_peer_serves_concurrent_requests(api, swarm: LocalSwarm, tiny_chat_dir: Path) -> None:  # type: ignore[no-untyped-def]
    tok = Tokenizer.from_dir(tiny_chat_dir)
    prompts = ["First question?", "A second, different question."]
    wants = {}
    for p in prompts:
        ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True))
        wants[p] = tok.decode(await _reference(swarm, ids, max_new_tokens=20, temperature=0.0))
    got: dict[str, str] = {}
    async with api(relay=True) as (url, st), httpx.AsyncClient(base_url=url, timeout=60) as http:

        async def ask(p: str) -> None:
            r = await http.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 20, "temperature": 0,
                                                              "messages": [{"role": "user", "content": p}]})  # fmt: skip
            assert r.status_code == 200, r.text
            got[p] = r.json()["choices"][0]["message"]["content"]

        async with trio.open_nursery() as nursery:
            for p in prompts:
                nursery.start_soon(ask, p)
    assert got == wants and wants[prompts[0]] != wants[prompts[1]]
