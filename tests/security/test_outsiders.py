"""Outsiders: peers without the swarm secret, plaintext dialers, impersonators, revoked peers.

Each multi-process attack runs against the shared 3-node swarm (see swarmkit.py) and ends by
checking that an honest generation still equals the in-process reference.
"""

from __future__ import annotations

import contextlib
import os

import pytest
import trio
from libp2p import new_host
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.crypto.keys import KeyPair, PublicKey
from libp2p.crypto.x25519 import create_new_key_pair as create_x25519_key_pair
from libp2p.custom_types import TProtocol
from libp2p.network.config import ConnectionConfig
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import info_from_p2p_addr
from libp2p.security.insecure.transport import PLAINTEXT_PROTOCOL_ID, InsecureTransport
from libp2p.security.noise.messages import NoiseHandshakePayload
from libp2p.security.noise.patterns import IPattern
from libp2p.security.noise.transport import PROTOCOL_ID as NOISE_PROTOCOL_ID
from libp2p.security.noise.transport import Transport as NoiseTransport
from libp2p.stream_muxer.yamux.yamux import PROTOCOL_ID as YAMUX_PROTOCOL_ID
from libp2p.stream_muxer.yamux.yamux import Yamux
from multiaddr import Multiaddr

from swarm.errors import AdmissionError, PeerError
from swarm.manifest.identity import Identity
from swarm.net.host import open_host
from swarm.proto.control import Status
from swarm.proto.frame import encode_frame
from swarm.proto.limits import PROTO_GEN

from .swarmkit import LiveSwarm, assert_still_serving, outsider

pytestmark = pytest.mark.slow

LISTEN = Multiaddr("/ip4/127.0.0.1/tcp/0")


class ImpersonatingNoise(NoiseTransport):
    """Noise whose handshake payload names ``claimed`` (another peer's public key) while the
    signature over our Noise static key is made with our own private key: all an impersonator
    without the victim's private key can do."""

    def __init__(self, key_pair: KeyPair, claimed: PublicKey) -> None:
        super().__init__(key_pair, noise_privkey=create_x25519_key_pair().private_key)
        self.claimed = claimed

    def get_pattern(self) -> IPattern:
        pattern = super().get_pattern()
        honest = pattern.make_handshake_payload  # type: ignore[attr-defined]

        def forged(extensions: object = None) -> NoiseHandshakePayload:
            real = honest(extensions)
            return NoiseHandshakePayload(self.claimed, real.id_sig, extensions=real.extensions)

        pattern.make_handshake_payload = forged  # type: ignore[attr-defined]
        return pattern


def _raw_host(key_pair: KeyPair, security: str, claimed: PublicKey | None = None) -> object:
    """A bare py-libp2p host speaking only ``security`` ("noise" or "plaintext") and yamux."""
    sec: dict[TProtocol, object]
    if claimed is not None:
        sec = {TProtocol(NOISE_PROTOCOL_ID): ImpersonatingNoise(key_pair, claimed)}
    elif security == "noise":
        sec = {
            TProtocol(NOISE_PROTOCOL_ID): NoiseTransport(
                key_pair, noise_privkey=create_x25519_key_pair().private_key
            )
        }
    else:
        sec = {TProtocol(PLAINTEXT_PROTOCOL_ID): InsecureTransport(key_pair)}
    return new_host(
        key_pair=key_pair, sec_opt=sec, muxer_opt={TProtocol(YAMUX_PROTOCOL_ID): Yamux},  # type: ignore[arg-type]
        listen_addrs=[LISTEN], connection_config=ConnectionConfig(max_connections_per_peer=1, min_connections=0,
                                                                  low_watermark=0),
        enable_mDNS=False,
    )  # fmt: skip


async def _try_connect(host: object, addr: str) -> BaseException | None:
    """Connect ``host`` to ``addr``; the exception it failed with, or None if it connected."""
    async with host.run([LISTEN]):  # type: ignore[attr-defined]
        try:
            with trio.fail_after(10):
                await host.connect(info_from_p2p_addr(Multiaddr(addr)))  # type: ignore[attr-defined]
            connected = [str(p) for p in host.get_connected_peers()]  # type: ignore[attr-defined]
            failure: BaseException | None = (
                None if connected else RuntimeError("no connection after connect()")
            )
        except Exception as exc:
            failure = exc
        finally:
            with trio.move_on_after(3):
                await host.close()  # type: ignore[attr-defined]
    return failure


async def test_peer_without_the_secret_is_refused_and_the_swarm_keeps_serving(
    live: LiveSwarm,
) -> None:
    async with outsider(swarm_id=live.swarm.swarm_id) as h:
        with pytest.raises(AdmissionError):
            await h.dial(live.swarm.addrs[0])
        assert not h.is_admitted(live.swarm.peer_ids[0])
        # Skipping admission does not help: a raw stream on a swarm protocol is reset unanswered.
        target = live.swarm.peer_ids[2]
        with trio.fail_after(10):
            await h.libp2p.connect(info_from_p2p_addr(Multiaddr(live.swarm.addrs[2])))
        answered = b""
        with trio.move_on_after(8):
            try:
                raw = await h.libp2p.new_stream(ID.from_base58(target), [TProtocol(PROTO_GEN)])
                await raw.write(encode_frame(Status().to_frame()))
                answered = await raw.read(4096)
            except Exception:
                answered = b""
        assert answered == b"", (
            "a node answered a swarm request from a peer that never proved the secret"
        )
        pid = h.peer_id
    await trio.sleep(0.5)
    assert f"refused peer {pid}" in live.swarm.log(0)
    assert f"INFO admitted peer {pid}" not in live.logs()
    await assert_still_serving(live)


async def test_plaintext_only_dialer_is_refused(live: LiveSwarm) -> None:
    plain = _raw_host(create_new_key_pair(os.urandom(32)), "plaintext")
    failure = await _try_connect(plain, live.swarm.addrs[0])
    assert failure is not None, "a node accepted a /plaintext/2.0.0 connection"
    # Control: the same bare host speaking Noise does get a transport connection (then admission
    # would drop it), so the refusal above is about plaintext, not about the test's dialer.
    noisy = _raw_host(create_new_key_pair(os.urandom(32)), "noise")
    assert await _try_connect(noisy, live.swarm.addrs[0]) is None
    await assert_still_serving(live)


async def test_claiming_another_peers_id_is_stopped_by_noise(live: LiveSwarm) -> None:
    victim = live.swarm.peer_ids[1]
    victim_pub = ID.from_base58(victim).extract_public_key()
    mine = create_new_key_pair(os.urandom(32))
    # The impersonator announces the victim's public key (so its peer ID is the victim's) but can
    # only sign the Noise static key with its own private key.
    imp = _raw_host(mine, "noise", claimed=victim_pub)
    before = live.swarm.log(0).count(f"refused peer {victim}")
    failure = await _try_connect(imp, live.swarm.addrs[0])
    assert failure is not None, "node 0 accepted a Noise handshake signed by the wrong key"
    # Control: the same patched transport naming its *own* key connects, so what failed above is
    # the signature check on the claimed key, not the patching.
    own = create_new_key_pair(os.urandom(32))
    assert (
        await _try_connect(_raw_host(own, "noise", claimed=own.public_key), live.swarm.addrs[0])
        is None
    )
    await trio.sleep(1.0)
    # Node 0 never took the impersonator for the victim: it never refused (and so never
    # disconnected) the real victim, and the ring that goes through the victim still serves.
    assert live.swarm.log(0).count(f"refused peer {victim}") == before
    await assert_still_serving(live)


async def test_revoked_peer_is_refused_by_a_listener() -> None:
    secret, swarm_id = os.urandom(32), "revocation"
    bad_seed = os.urandom(32)
    revoked = frozenset({Identity(bad_seed).peer_id})
    async with (
        open_host(bad_seed, secret=secret, swarm_id=swarm_id) as bad,
        open_host(os.urandom(32), secret=secret, swarm_id=swarm_id, revoked=revoked) as issuer,
        open_host(os.urandom(32), secret=secret, swarm_id=swarm_id) as good,
    ):
        assert await good.dial(issuer.addrs()[0]) == issuer.peer_id  # control: the secret works
        with pytest.raises(AdmissionError):
            await bad.dial(issuer.addrs()[0])
        assert not issuer.is_admitted(bad.peer_id)


async def test_revoked_peer_is_refused_when_we_dial_it() -> None:
    secret, swarm_id = os.urandom(32), "revocation"
    bad_seed = os.urandom(32)
    revoked = frozenset({Identity(bad_seed).peer_id})
    async with (
        open_host(bad_seed, secret=secret, swarm_id=swarm_id) as bad,
        open_host(os.urandom(32), secret=secret, swarm_id=swarm_id, revoked=revoked) as issuer,
    ):
        with contextlib.suppress(PeerError):
            await issuer.dial(bad.addrs()[0])
        assert not issuer.is_admitted(bad.peer_id), "a node admitted a revoked peer it dialed"
