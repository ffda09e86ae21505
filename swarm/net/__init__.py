"""Networking: the only subpackage that imports libp2p and zeroconf (and multiaddr).

Where things live:

    host.py       open_host(seed, listen, secret=, swarm_id=) -> SwarmHost: py-libp2p 0.8.1 with
                  TCP + Noise only + yamux only; admission (swarm.proto.admission) before any swarm
                  protocol; handle()/open_stream() for admitted peers; HostEvents; clean close
    libp2p_host.py  the py-libp2p host we build (Noise-only, yamux-only); libp2p_patches.py its adaptations
    streams.py    FramedStream / open_framed: swarm.proto frames over one stream, a reader task per
                  stream, a deadline on every read and write, libp2p exceptions mapped to swarm.errors
    mdns.py       LAN discovery over python-zeroconf (net-discovery)
    relay.py      circuit-relay v2 and DCUtR hole punching (net-discovery)
    paths.py      how a peer is reached now (direct / relayed / none); peer-address helpers
    dialback.py   dial-back reachability check and NAT kind (net-discovery)
    nat.py        ``join --diagnose``'s report (net-discovery)
    channel.py, sealing.py, fastpath.py (handshake), direct.py (sealed frames, FastChannel),
                  fastpath_host.py   the authenticated direct data path (fastpath)
"""
