"""What a relay counts reservations by (issue 27): one IPv4 address, one IPv6 /64, one unknown."""

from __future__ import annotations

from swarm.net.libp2p_patches import address_key


def test_an_ipv6_64_is_one_party_and_unknown_addresses_share_one_key() -> None:
    assert address_key("192.0.2.7") == "192.0.2.7"
    assert address_key("2001:db8:1:2::1") == address_key("2001:db8:1:2:ffff:ffff:ffff:ffff") == "2001:db8:1:2::/64"
    assert address_key("2001:db8:1:3::1") != address_key("2001:db8:1:2::1")
    assert address_key("::ffff:192.0.2.7") == "192.0.2.7"  # IPv4-mapped: the IPv4 address
    assert address_key("fe80::1%eth0") == "fe80::/64"
    assert address_key("") == address_key("not an address") == "unknown"
