"""A running peer: the trio nursery tree of membership, heartbeats, the ring, recovery.

The planes, each a sub-package, lowest first; a plane imports only the ones above it in this
list and the shared modules at this level (tests/test_layering.py keeps it so):

    compute/     what a node holds of the model and the torch work around it
    ring/        the ring's data plane: links, the activation codec, stage workers, the coordinator
    members/     who is in the swarm: adverts, heartbeats, the failure detector, the view, probes
    plan/        plan epochs: the leader, taking a plan, wiring its hops, recovery
    generation/  generations as a service: requests, relaying, resume, receipts and status

At this level, the composition root (imports every plane):

    peer.py        ``open_peer``/``run_peer`` build a peer from its settings (used by ``join``,
                   ``python -m swarm.node`` and the tests); ``Peer``
    serving.py     the serving half of a peer: its components wired with explicit dependencies
    __main__.py    the node process (``python -m swarm.node``; swarm/launch.py starts several)

and the shared modules every plane may import (they import no plane):

    settings.py    NodeSettings, built once (join's config and flags, or a settings file)
    notices.py     what a node tells its user (notices, membership changes, life events)
    hosting.py     Host: what node/ needs of a network (libp2p's SwarmHost, memnet's MemHost)
    dispatch.py    the control plane: which role may send each request (ROLES), the dispatcher,
                   and the ring protocol's client (requests and set-up phases)
    errors_util.py unwrapping trio's exception groups at the node's boundaries
    loopwatch.py   how long the trio loop is held (longest task step, timer lateness), for status

Not part of a running peer, so outside node/: ``swarm/client.py`` (talking to a swarm as a
client) and ``swarm/launch.py`` (a local swarm of node processes on loopback).
"""
