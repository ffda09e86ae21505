"""Signed adverts and plans; peer IDs agree with py-libp2p and with swarm.manifest."""

from __future__ import annotations

import dataclasses
import hashlib

import pytest

from swarm.errors import ProtocolError
from swarm.manifest.identity import Identity, peer_id_from_public_key
from swarm.proto.limits import DEFAULT_LIMITS
from swarm.proto.messages import Advert, Plan, decode_message
from swarm.proto.signed import AdvertBook, sign_advert, sign_plan, verify_advert, verify_plan
from swarm.proto.signing import canonical_json, peer_id_of

SWARM = "00112233445566778899aabbccddeeff"
ALICE = Identity(hashlib.sha256(b"alice").digest())
MALLORY = Identity(hashlib.sha256(b"mallory").digest())


def _advert(who: Identity = ALICE, seq: int = 1, **kw: object) -> Advert:
    base = Advert(
        "", b"", SWARM, seq, ("/ip4/127.0.0.1/tcp/4001",), "cpu", "test box", 1 << 30, 600, {}
    )
    return sign_advert(dataclasses.replace(base, **kw), who)  # type: ignore[arg-type]


def test_peer_id_matches_libp2p_and_manifest() -> None:
    from libp2p.crypto.ed25519 import create_new_key_pair
    from libp2p.peer.id import ID

    kp = create_new_key_pair(ALICE.seed)
    assert kp.public_key.to_bytes() == ALICE.public_key
    expected = ID.from_pubkey(kp.public_key).to_base58()
    assert (
        peer_id_of(ALICE.public_key)
        == expected
        == peer_id_from_public_key(ALICE.public_key)
        == ALICE.peer_id
    )
    assert ID(ALICE.peer_id_bytes).to_base58() == expected
    assert expected.startswith("12D3KooW")


def test_signed_advert_round_trips_and_verifies() -> None:
    adv = _advert()
    assert adv.peer_id == ALICE.peer_id and adv.public_key == ALICE.public_key
    got = decode_message(adv.encode())
    assert isinstance(got, Advert) and got == adv
    verify_advert(got, SWARM)


@pytest.mark.parametrize(
    "change",
    [
        {"memory_bytes": 2 << 30},
        {"addrs": ("/ip4/6.6.6.6/tcp/1",)},
        {"rtt_us": {"x": 1}},
        {"device_name": "other"},
        {"seq": 99},
        {"layer_us": 1},
    ],
)
def test_tampered_advert_is_rejected(change: dict[str, object]) -> None:
    forged = dataclasses.replace(_advert(), **change)  # type: ignore[arg-type]
    with pytest.raises(ProtocolError, match="forged or corrupted signature"):
        verify_advert(decode_message(forged.encode()), SWARM)  # type: ignore[arg-type]


def test_advert_under_another_peers_name_is_rejected() -> None:
    forged = dataclasses.replace(_advert(MALLORY), peer_id=ALICE.peer_id)
    with pytest.raises(ProtocolError, match="carries another peer's key"):
        verify_advert(forged, SWARM)
    resigned = dataclasses.replace(
        _advert(MALLORY), public_key=ALICE.public_key, peer_id=ALICE.peer_id
    )
    with pytest.raises(ProtocolError, match="forged"):
        verify_advert(resigned, SWARM)


def test_advert_for_another_swarm_is_rejected() -> None:
    with pytest.raises(ProtocolError, match="another swarm"):
        verify_advert(_advert(), "ff" * 16)


def test_book_ignores_stale_and_repeated_seq() -> None:
    book = AdvertBook(SWARM)
    assert book.offer(_advert(seq=5))
    assert not book.offer(_advert(seq=5))
    assert not book.offer(_advert(seq=4, memory_bytes=7))
    assert book.get(ALICE.peer_id).seq == 5  # type: ignore[union-attr]
    assert book.offer(_advert(seq=6))
    assert set(book.peers()) == {ALICE.peer_id}
    book.forget(ALICE.peer_id)
    assert book.get(ALICE.peer_id) is None


def test_book_refuses_forged_and_revoked() -> None:
    book = AdvertBook(SWARM, revoked=frozenset({MALLORY.peer_id}))
    with pytest.raises(ProtocolError, match="revoked"):
        book.offer(_advert(MALLORY))
    with pytest.raises(ProtocolError, match="forged"):
        book.offer(dataclasses.replace(_advert(), signature=bytes(64)))
    assert book.peers() == {}


def test_plan_signing() -> None:
    plan = sign_plan(Plan(2, {"ring": [ALICE.peer_id], "blocks": [[0, 30]]}), ALICE, "friends")
    got = decode_message(plan.encode())
    assert isinstance(got, Plan)
    verify_plan(got, ALICE.public_key, "friends")
    with pytest.raises(ProtocolError, match="not the expected peer"):
        verify_plan(got, MALLORY.public_key, "friends")
    with pytest.raises(ProtocolError, match="forged"):
        verify_plan(dataclasses.replace(got, epoch=3), ALICE.public_key, "friends")
    with pytest.raises(ProtocolError, match="forged"):  # the same key's plan in another swarm
        verify_plan(got, ALICE.public_key, "other-swarm")
    with pytest.raises(ProtocolError, match="unsigned"):
        verify_plan(Plan(2, {}), ALICE.public_key, "friends")


def test_canonical_json_is_deterministic_and_integer_only() -> None:
    assert (
        canonical_json({"b": 1, "a": [2, {"d": "é", "c": None}]})
        == '{"a":[2,{"c":null,"d":"é"}],"b":1}'.encode()
    )
    with pytest.raises(ProtocolError, match="integers only"):
        canonical_json({"a": 1.5})


def test_book_is_bounded_against_made_up_identities() -> None:
    book = AdvertBook(SWARM, max_peers=2)
    assert book.offer(_advert(ALICE)) and book.offer(_advert(MALLORY))
    stranger = Identity(hashlib.sha256(b"stranger").digest())
    with pytest.raises(ProtocolError, match="limit max_peers"):
        book.offer(_advert(stranger), connected=False)  # made up: it never connected here
    assert book.offer(_advert(ALICE, seq=2))  # news about a known peer is still taken
    assert sorted(book.peers()) == sorted([ALICE.peer_id, MALLORY.peer_id])


def test_an_advert_names_the_draft_model_its_peer_runs() -> None:
    adv = _advert(draft_name="int4", draft_bytes=95_000_000, draft_us=19_250)
    got = decode_message(adv.encode())
    assert isinstance(got, Advert) and got == adv and got.draft_name == "int4"
    verify_advert(got, SWARM)
    assert "draft" not in _advert().body()  # none: the body (and the signature) is as before
    forged = dataclasses.replace(adv, draft_us=1)  # a peer claiming a faster draft
    with pytest.raises(ProtocolError, match="forged or corrupted signature"):
        verify_advert(decode_message(forged.encode()), SWARM)  # type: ignore[arg-type]
    frame = adv.to_frame()
    frame.meta["draft"] = {"name": "int4", "bytes": -1, "us": 5}
    with pytest.raises(ProtocolError, match="draft"):
        Advert.from_frame(frame, DEFAULT_LIMITS)


def test_an_advert_says_which_layers_its_peer_holds_and_serves() -> None:
    adv = _advert(held={"0": 3, "10": 12}, held_head=True)
    got = decode_message(adv.encode())
    assert isinstance(got, Advert) and got == adv and got.held_layers() == [0, 1, 2, 10, 11]
    verify_advert(got, SWARM)
    assert "held" not in _advert().body() and _advert().held_layers() == []  # none: the body is as before
    with pytest.raises(ProtocolError, match="forged or corrupted signature"):
        verify_advert(decode_message(dataclasses.replace(adv, held={"0": 40}).encode()), SWARM)  # type: ignore[arg-type]
    for bad in ({"3": 3}, {"03": 5}, {"-1": 2}, {"x": 2}, {"0": 1 << 17}, {str(i): i + 1 for i in range(65)}):
        frame = adv.to_frame()
        frame.meta["held"] = bad
        with pytest.raises(ProtocolError, match="held"):
            Advert.from_frame(frame, DEFAULT_LIMITS)


def test_an_advert_may_say_how_much_disk_its_peer_has_left() -> None:
    adv = _advert(disk=40 << 30)
    got = decode_message(adv.encode())
    assert isinstance(got, Advert) and got.disk == 40 << 30
    verify_advert(got, SWARM)
    assert "disk" not in _advert().body()  # absent: unbounded, and an old advert signs the same bytes
    with pytest.raises(ProtocolError, match="forged or corrupted signature"):
        verify_advert(decode_message(dataclasses.replace(adv, disk=1).encode()), SWARM)  # type: ignore[arg-type]
    for bad in (-1, 1 << 57, "lots", True):
        frame = adv.to_frame()
        frame.meta["disk"] = bad
        with pytest.raises(ProtocolError, match="disk"):
            Advert.from_frame(frame, DEFAULT_LIMITS)


def test_an_advert_may_say_how_many_sessions_its_stage_reserves() -> None:
    adv = _advert(sessions=2)
    got = decode_message(adv.encode())
    assert isinstance(got, Advert) and got.sessions == 2
    verify_advert(got, SWARM)
    old = decode_message(_advert().encode())  # absent: the leader's own count, and an old advert signs the same bytes
    assert isinstance(old, Advert) and old.sessions is None and "sessions" not in _advert().body()
    verify_advert(old, SWARM)
    with pytest.raises(ProtocolError, match="forged or corrupted signature"):
        verify_advert(decode_message(dataclasses.replace(adv, sessions=8).encode()), SWARM)  # type: ignore[arg-type]
    for bad in (0, 65, "8", True):
        frame = adv.to_frame()
        frame.meta["sessions"] = bad
        with pytest.raises(ProtocolError, match="sessions"):
            Advert.from_frame(frame, DEFAULT_LIMITS)


def test_an_advert_may_say_the_width_its_peer_serves_in() -> None:
    adv = _advert(dtype_bytes=4)
    got = decode_message(adv.encode())
    assert isinstance(got, Advert) and got.dtype_bytes == 4
    verify_advert(got, SWARM)
    old = decode_message(_advert().encode())  # absent: the planner's 2-byte unit, and an old advert signs the same bytes
    assert isinstance(old, Advert) and old.dtype_bytes is None and "dtype_bytes" not in _advert().body()
    with pytest.raises(ProtocolError, match="forged or corrupted signature"):
        verify_advert(decode_message(dataclasses.replace(adv, dtype_bytes=2).encode()), SWARM)  # type: ignore[arg-type]
    for bad in (0, 3, 9, "4", True):
        frame = adv.to_frame()
        frame.meta["dtype_bytes"] = bad
        with pytest.raises(ProtocolError, match="dtype_bytes"):
            Advert.from_frame(frame, DEFAULT_LIMITS)


def test_a_newer_peers_advert_fields_are_kept_signed_and_passed_on_as_they_came() -> None:
    """A field this version does not know (a newer peer's) is kept in ``extra``: the advert
    verifies (its signature covers it), encodes to the same bytes when passed on, and a relay that
    drops or changes it breaks the signature. Bounded: count, names and bytes."""
    newer = _advert(extra={"gpu_graphs": True, "link_mbps": {"a": 900}})
    got = decode_message(newer.encode())
    assert isinstance(got, Advert) and got.extra == {"gpu_graphs": True, "link_mbps": {"a": 900}}
    verify_advert(got, SWARM)
    assert got.encode() == newer.encode()  # gossiped on intact
    with pytest.raises(ProtocolError, match="forged or corrupted signature"):
        verify_advert(dataclasses.replace(got, extra={}), SWARM)
    with pytest.raises(ProtocolError, match="forged or corrupted signature"):
        verify_advert(dataclasses.replace(got, extra={"gpu_graphs": False, "link_mbps": {"a": 900}}), SWARM)
    plain = decode_message(_advert().encode())
    assert isinstance(plain, Advert) and plain.extra == {}  # an advert with none signs as before
    frame = _advert().to_frame()
    for bad, why in (({f"f{i}": 1 for i in range(9)}, "over 8"), ({"Bad-Name": 1}, "not named as a field can be"),
                     ({"blob": "x" * 3000}, "over 2048 bytes")):  # fmt: skip
        with pytest.raises(ProtocolError, match=why):
            Advert.from_frame(dataclasses.replace(frame, meta={**frame.meta, **bad}), DEFAULT_LIMITS)
    with pytest.raises(ProtocolError, match="device"):  # a known field still reads strictly
        Advert.from_frame(dataclasses.replace(frame, meta={**frame.meta, "device": {"kind": "cpu"}}), DEFAULT_LIMITS)


def test_made_up_identities_expire_and_never_lock_a_newcomer_out() -> None:
    """A member gossips adverts of identities it made up: they stay unconfirmed (they never
    connect), a newcomer that connects evicts the oldest of them from a full book, and the rest
    expire after the TTL while connected peers stay."""
    book = AdvertBook(SWARM, max_peers=4, unconfirmed_ttl=60.0)
    assert book.offer(_advert(ALICE), now=0.0, connected=True)
    fakes = [Identity(hashlib.sha256(b"fake %d" % i).digest()) for i in range(5)]
    for i, f in enumerate(fakes):
        assert book.offer(_advert(f), now=1.0 + i, connected=False)  # a full book evicts the oldest fake
    assert len(book.peers()) == 4 and fakes[0].peer_id not in book.peers() and fakes[1].peer_id not in book.peers()
    newcomer = Identity(hashlib.sha256(b"newcomer").digest())
    assert book.offer(_advert(newcomer), now=10.0, connected=True)
    assert newcomer.peer_id in book.peers() and ALICE.peer_id in book.peers()
    assert book.expire(30.0) == []  # not yet
    assert sorted(book.expire(70.0)) == sorted([fakes[3].peer_id, fakes[4].peer_id])  # fake 2 made room for the newcomer
    assert sorted(book.peers()) == sorted([ALICE.peer_id, newcomer.peer_id])
    # a gossiped advert whose peer then connects is confirmed and stays
    late = Identity(hashlib.sha256(b"late").digest())
    assert book.offer(_advert(late), now=71.0, connected=False)
    book.confirm(late.peer_id)
    assert book.expire(1000.0) == [] and late.peer_id in book.peers()
    # a book full of connected peers still refuses a stranger
    full = AdvertBook(SWARM, max_peers=1)
    assert full.offer(_advert(ALICE), connected=True)
    with pytest.raises(ProtocolError, match="limit max_peers"):
        full.offer(_advert(newcomer), connected=False)


def test_a_connected_newcomer_gets_into_a_book_full_of_connected_identities() -> None:
    """Issue 27: a member holding the secret connected 256 real identities, filled the book and
    locked every newcomer out. Now a connected newcomer evicts the connected entry heard from
    least recently that is not pinned (the plan's members, the leader); an advert whose peer is
    not connected here still evicts no connected entry."""
    ids = [Identity(hashlib.sha256(b"real %d" % i).digest()) for i in range(DEFAULT_LIMITS.max_peers)]
    plan = {ids[0].peer_id, ids[1].peer_id}  # ids[0] was heard from first of all: still kept
    book = AdvertBook(SWARM, pinned=lambda: plan)
    for i, who in enumerate(ids):
        assert book.offer(_advert(who), now=float(i), connected=True)
    book.offer(_advert(ids[2]), now=500.0, connected=True)  # heard again: no longer the stalest
    stranger = Identity(hashlib.sha256(b"made up").digest())
    with pytest.raises(ProtocolError, match="not connected here"):
        book.offer(_advert(stranger), now=600.0, connected=False)
    assert len(book.peers()) == DEFAULT_LIMITS.max_peers and stranger.peer_id not in book.peers()
    newcomer = Identity(hashlib.sha256(b"newcomer").digest())
    assert book.offer(_advert(newcomer), now=600.0, connected=True)
    assert newcomer.peer_id in book.peers() and ids[3].peer_id not in book.peers()  # the stalest unpinned
    assert plan <= set(book.peers()) and ids[2].peer_id in book.peers()
    assert len(book.peers()) == DEFAULT_LIMITS.max_peers
    # the failure detector's clock, when the owner gives it, says who was heard from last
    heard = {p.peer_id: 1000.0 for p in [*ids, newcomer]} | {ids[7].peer_id: 10.0}
    book.last_heard = heard.get
    late = Identity(hashlib.sha256(b"late").digest())
    assert book.offer(_advert(late), now=700.0, connected=True)
    assert ids[7].peer_id not in book.peers() and {late.peer_id, newcomer.peer_id, ids[4].peer_id} <= set(book.peers())
    # a book of pinned peers only makes room for nobody
    small = AdvertBook(SWARM, max_peers=2, pinned=lambda: {ALICE.peer_id, MALLORY.peer_id})
    assert small.offer(_advert(ALICE), connected=True) and small.offer(_advert(MALLORY), connected=True)
    with pytest.raises(ProtocolError, match="pinned"):
        small.offer(_advert(newcomer), connected=True)
