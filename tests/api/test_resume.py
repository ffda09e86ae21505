"""A lost coordinator through the official ``openai`` client: the API server holds the committed
tokens and resumes on the next coordinator, or answers with an OpenAI error object (503).

Four node processes (fp32, any two hold the model); the endpoint is a client of a peer that is
not the coordinator. The coordinator is SIGKILLed mid-stream: the stream completes, its text
identical to an uninterrupted run's, and the raw event stream carries the notice. Then
``shard-swarm generate`` loses its coordinator the same way and resumes. Then one more peer goes:
the one survivor cannot hold the model, and the client gets an APIError naming why, never a
bare connection error.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import openai
import pytest
import trio

from swarm import client
from swarm.launch import offer_for, start_local_swarm
from swarm.model.tokenizer import Tokenizer
from tests.api.conftest import MODEL_NAME, api_on

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
N = 120
BODY = {"model": MODEL_NAME, "prompt": "Once upon a time", "max_tokens": N, "temperature": 0}


async def _coordinator(swarm, peer_index: int) -> str:  # type: ignore[no-untyped-def]
    async with client.open_client(swarm.addrs[peer_index], secret=swarm.secret, swarm_id=swarm.swarm_id) as (h, p):
        st = await client.wait_ready(h, p, timeout=120)
    return str(st["plan"]["coordinator"])


def _generate_cli(swarm, peer: int, ids: list[int], receipt: Path, kill_after: int, victim: int) -> str:  # type: ignore[no-untyped-def]
    """``shard-swarm generate`` as a user runs it, its coordinator SIGKILLed once it has printed
    ``kill_after`` characters; returns its stderr."""
    cmd = [sys.executable, "-m", "swarm.cli.main", "generate", "--manifest", str(swarm.workdir / "invite.json"),
           "--peer", swarm.addrs[peer], "--prompt-ids", ",".join(map(str, ids)), "--max-new-tokens", str(N),
           "--receipt", str(receipt), "--timeout", "90"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})  # fmt: skip
    err: list[str] = []
    threading.Thread(target=lambda: err.extend(proc.stderr), daemon=True).start()  # type: ignore[arg-type]
    seen = 0
    assert proc.stdout is not None
    while proc.stdout.read(1):
        seen += 1
        if seen == kill_after:
            swarm.kill(victim, signal.SIGKILL)
    assert proc.wait(timeout=150) == 0, "".join(err)
    return "".join(err)


async def test_coordinator_killed_mid_stream_resumes_then_503_when_none_can_serve(tiny_chat_dir: Path) -> None:
    two_layers = offer_for(tiny_chat_dir, 2, context_tokens=1536)  # 4 layers: any two peers hold them
    with start_local_swarm(4, tiny_chat_dir, dtype="fp32", context_tokens=1536, memory_bytes=[two_layers] * 4) as swarm:
        async with api_on(swarm, tiny_chat_dir, relay=True) as (url, st):
            coord = swarm.peer_ids.index(st["plan"]["coordinator"])
            aio = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
            want = (await aio.completions.create(**BODY)).choices[0].text  # type: ignore[call-overload]
            assert len(want) == N  # one character per token with this tokenizer
            ids = Tokenizer.from_dir(tiny_chat_dir).encode("Tell me a story")
            async with client.open_client(swarm.addrs[0], secret=swarm.secret, swarm_id=swarm.swarm_id) as (h, p):
                ref = (await client.generate(h, p, prompt_ids=ids, max_new_tokens=N, timeout=60))["output_token_ids"]

            # 1. killed mid-stream: the stream completes, identical, with a notice in it
            pieces: list[str] = []
            raw: list[str] = []
            async with (
                httpx.AsyncClient(base_url=url, timeout=120) as http,
                http.stream("POST", "/v1/completions", json={**BODY, "stream": True}) as resp,
            ):
                async for line in resp.aiter_lines():
                    raw.append(line)
                    if line.startswith("data: {"):
                        ev = json.loads(line[6:])
                        assert "error" not in ev, ev
                        pieces.append(ev["choices"][0]["text"])
                        if len("".join(pieces)) >= 30 and swarm.alive()[coord]:
                            swarm.kill(coord, signal.SIGKILL)
            assert not swarm.alive()[coord]
            assert "".join(pieces) == want
            notes = [line for line in raw if line.startswith(": ")]
            assert any("resuming on the next coordinator" in n for n in notes), raw[-20:]
            assert raw[-2:] == ["data: [DONE]", ""] or raw[-1] == "data: [DONE]", raw[-5:]

            # the same through the openai client: the survivors serve the same text
            stream = await aio.completions.create(**BODY, stream=True)  # type: ignore[call-overload]
            assert "".join([c.choices[0].text async for c in stream]) == want

            # 2. `generate` from the command line, its coordinator killed mid-stream: it resumes too
            api_peer = next(i for i, p in enumerate(swarm.peer_ids) if p != st["plan"]["coordinator"])
            coord2 = swarm.peer_ids.index(await _coordinator(swarm, api_peer))
            asked = next(i for i in range(4) if swarm.alive()[i] and i != coord2)
            receipt = swarm.workdir / "receipt.json"
            err = await trio.to_thread.run_sync(lambda: _generate_cli(swarm, asked, ids, receipt, 25, coord2))
            got = json.loads(receipt.read_text())
            assert got["output_token_ids"] == ref and got["resumed_at_tokens"], got
            assert "resuming on the next coordinator" in err, err

            await aio.close()

        # 3. one of the two survivors is killed mid-stream (the coordinator, unless it is the peer
        # the endpoint talks to): one peer cannot hold the model; the client is told so. Step 2
        # may have killed the endpoint's own peer (when it had become the coordinator): the
        # endpoint then talks to a survivor.
        survivors = [i for i in range(4) if swarm.alive()[i]]
        assert len(survivors) == 2, swarm.alive()
        ep_peer = api_peer if api_peer in survivors else survivors[0]
        async with api_on(swarm, tiny_chat_dir, peer=ep_peer) as (url, st):
            aio = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
            victim = next(i for i in survivors if i != ep_peer)
            seen: list[str] = []
            with pytest.raises(openai.APIError) as info:
                with trio.fail_after(150):
                    stream = await aio.completions.create(**BODY, stream=True)  # type: ignore[call-overload]
                    async for c in stream:
                        seen.append(c.choices[0].text)
                        if len("".join(seen)) >= 10 and swarm.alive()[victim]:
                            swarm.kill(victim, signal.SIGKILL)
            assert "cannot" in str(info.value.message) and "memory" in str(info.value.message), info.value.message
            # not streamed: an HTTP 503 with the error object
            with pytest.raises(openai.APIStatusError) as status:
                await aio.completions.create(**BODY)  # type: ignore[call-overload]
            assert status.value.status_code == 503 and "memory" in status.value.message, status.value
            await aio.close()
