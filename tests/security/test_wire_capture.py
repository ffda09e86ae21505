"""On the wire: a loopback capture during a generation shows neither the prompt nor the token IDs.

tshark (Debian/Ubuntu package ``tshark``) captures loopback while an honest client asks the
shared swarm for a generation: once by token IDs (which travel as int32 in CONTROL frames, and as
JSON text in the receipt), once by text (the request's text crosses two hops on its way to the
coordinator). The same encodings are then sent over a plaintext TCP connection on loopback, inside
the same capture: that control must be found, so a capture that saw nothing cannot pass.
Needs root (capturing) and tshark; skipped with the reason otherwise.
"""

from __future__ import annotations

import functools
import os
import subprocess
import time
from pathlib import Path

import pytest
import trio

from swarm import client
from swarm.errors import BadRequest
from swarm.testing.netlab import missing_tools_reason

from .swarmkit import MAX_NEW, PROMPT, LiveSwarm, honest_client

pytestmark = pytest.mark.slow


def _encodings(ids: list[int]) -> list[bytes]:
    """How a run of token IDs could appear in clear: int32 LE (CONTROL payload) and JSON text."""
    return [
        b"".join(i.to_bytes(4, "little", signed=True) for i in ids),
        ",".join(map(str, ids)).encode(),
        ", ".join(map(str, ids)).encode(),
    ]


def _start_capture(path: Path) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(
        ["tshark", "-i", "lo", "-f", "tcp", "-w", str(path), "-q"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:  # tshark creates the file once it captures
        if proc.poll() is not None:
            raise RuntimeError(
                f"tshark exited: {proc.stderr.read().decode(errors='replace') if proc.stderr else ''}"
            )
        if path.exists() and path.stat().st_size > 0:
            return proc
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError("tshark did not start capturing within 15 s")


async def _plaintext_control(payload: bytes) -> None:
    """Send ``payload`` over plain TCP on loopback (the capture must see this)."""
    got = bytearray()

    async def serve(stream: trio.SocketStream) -> None:
        while data := await stream.receive_some(65536):
            got.extend(data)

    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(
            functools.partial(trio.serve_tcp, serve, 0, host="127.0.0.1")
        )
        port = listeners[0].socket.getsockname()[1]
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        await stream.send_all(payload)
        await stream.aclose()
        with trio.move_on_after(2):
            while len(got) < len(payload):
                await trio.sleep(0.01)
        nursery.cancel_scope.cancel()


@pytest.mark.skipif(os.geteuid() != 0, reason="capturing on loopback needs root")
@pytest.mark.skipif(
    missing_tools_reason("tshark") is not None, reason=str(missing_tools_reason("tshark"))
)
async def test_capture_shows_no_prompt_or_token_ids(live: LiveSwarm, tmp_path: Path) -> None:
    marker = f"MARKER-{os.urandom(6).hex()}-prompt text"
    pcap = tmp_path / "lo.pcapng"
    proc = _start_capture(pcap)
    try:
        async with honest_client(live, 1) as (h, peer):
            await client.wait_ready(h, peer, timeout=60)
            got = await client.generate(
                h, peer, prompt_ids=PROMPT, max_new_tokens=MAX_NEW, timeout=60
            )
            try:  # the tiny checkpoint has no tokenizer: the coordinator refuses (a bad request), but the text travels
                await client.generate(h, peer, text=marker, max_new_tokens=4, timeout=30)
            except BadRequest as exc:
                assert "tokenizer" in str(exc)
        assert got["output_token_ids"] == live.reference
        output = got["output_token_ids"]
        secrets = [marker.encode(), *_encodings(PROMPT), *_encodings(output[:6])]
        await trio.sleep(0.5)
        control = b"CONTROL-" + marker.encode()[::-1] + b"|" + b"|".join(_encodings(PROMPT[::-1]))
        await _plaintext_control(control)
        await trio.sleep(1.0)
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    data = pcap.read_bytes()
    assert control in data, "the capture missed a plaintext loopback connection: it proves nothing"
    found = [s for s in secrets if s in data]
    assert not found, f"found in clear on the wire: {found!r}"
