"""The delaying proxy adds its one-way delay in each direction and keeps bytes in order."""

from __future__ import annotations

from pathlib import Path

import trio

from swarm.testing.delayproxy import open_delay_proxy


async def _echo_server(task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
    async def echo(stream: trio.SocketStream) -> None:
        async with stream:
            async for data in stream:
                await stream.send_all(data)

    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    task_status.started(listeners[0].socket.getsockname()[1])
    await trio.serve_listeners(echo, listeners)


async def _rtt(port: int, payload: bytes) -> float:
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        t0 = trio.current_time()
        await stream.send_all(payload)
        got = b""
        while len(got) < len(payload):
            got += await stream.receive_some(65536)
        assert got == payload
        return trio.current_time() - t0


async def test_round_trip_is_twice_the_delay_and_ordered() -> None:
    async with trio.open_nursery() as nursery:
        port = await nursery.start(_echo_server)
        direct = await _rtt(port, b"x" * 100)
        async with open_delay_proxy(port, delay=0.03) as proxy:
            payload = bytes(range(256)) * 400  # 100 KiB, arrives in several segments
            rtt = await _rtt(proxy.port, payload)
            assert proxy.stats.connections == 1
        assert 0.06 <= rtt < 0.06 + 0.25, rtt
        assert direct < 0.05
        nursery.cancel_scope.cancel()


async def test_jitter_never_reorders() -> None:
    async with trio.open_nursery() as nursery:
        port = await nursery.start(_echo_server)
        async with open_delay_proxy(port, delay=0.01, jitter=0.009, seed=7) as proxy:
            stream = await trio.open_tcp_stream("127.0.0.1", proxy.port)
            async with stream:
                for i in range(50):
                    await stream.send_all(i.to_bytes(2, "big"))
                    await trio.sleep(0.001)
                got = b""
                with trio.fail_after(5):
                    while len(got) < 100:
                        got += await stream.receive_some(65536)
            assert [int.from_bytes(got[i:i + 2], "big") for i in range(0, 100, 2)] == list(range(50))
        nursery.cancel_scope.cancel()


async def test_the_proxy_process_binds_its_own_ports_and_says_which(tmp_path: Path) -> None:
    """start_local_swarm's proxy process picks its public ports itself (no port freed by the parent
    for another process to take first) and returns only once they listen."""
    from swarm.launch import _start_delay_proxy

    async with trio.open_nursery() as nursery:
        target = await nursery.start(_echo_server)
        proc, ports = await trio.to_thread.run_sync(_start_delay_proxy, 20.0, [target, target], tmp_path)
        try:
            assert len(ports) == 2 and len(set(ports)) == 2 and target not in ports
            for port in ports:
                assert await _rtt(port, b"x" * 1000) >= 0.035  # 20 ms each way, through this port
        finally:
            proc.kill()
            proc.wait(timeout=5)
        nursery.cancel_scope.cancel()
