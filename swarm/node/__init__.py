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
    authority.py   the finer rules behind the roles (plans in a catch-up, epoch ends, fault reports,
                   strikes, draft claims), pure
    bench.py       the leader's one bench: strikes and bad activations leave a member out of plans
    service.py     the generation service (in-process for the API, and /shard-swarm/gen/1):
                   requests, relaying, the coordinator's run
    genwire.py     a gen/1 stream's messages, however long: sent as their frames, received whole
    memory.py      running out of memory: what it fails (a request, never the peer), its test hooks
    resume.py      a generation outliving its ring: wait for the next epoch, resume by replay
    report.py      receipts and status
    ringview.py    build_view: a status dict -> the ring as a person reads it (status command, web console)
    stage_worker.py  a layer block serving verify chunks from upstream to downstream, the
                   sessions waiting for it batched into one forward, compute off the trio loop;
                   a resumed run's replay chunks computed several at a time
    gathering.py   which sessions a stage's next forward waits for, so that they share it
    coordinator.py the coordinator's side of a ring: drives the speculative decoder, replays a
                   run on a new ring after a failure
    drafting.py    the coordinator's draft model (load, advert, auto's choice by measured cost) and
                   drafting off the trio loop, ahead of the chunks in flight
    headbatch.py   the coordinator's LM head, shared by the sessions whose results arrive together
    capacity.py    how many sessions a ring holds, and the queue in front of it
    client.py      talking to a swarm as a client (status, wait until ready, one generation)
    launch.py      a local swarm of node processes on loopback (demo, tests, benchmarks);
                   __main__.py is the node process
    discovery.py   relays and mDNS: finding and reaching peers beyond the bootstrap list
    links.py       the Link interface of a hop, and the in-process LocalLink
    fastlink.py    a hop over a fast-path channel
    probe.py       RTTs on the path hops take: a short echoed probe of the fast path to each member
    activation.py  the activation codec: tensors <-> CHUNK/RESULT messages, with every check
    failure.py     FailureDetector: alive -> suspect -> lost (and rejoin as a new incarnation);
                   pure, every call takes ``now``
    heartbeat.py   Liveness (the detector on the trio clock, RTT estimates); the ctl link that sends
                   heartbeats/adverts and measures RTT from echoes; the inbound ctl server
    membership.py  Membership: the signed-advert view and the planner's peers-file export
    gossip.py      MembershipService: membership on a host (links, gossip, dialing)
    errors_util.py unwrapping trio's exception groups at the node's boundaries
    loopwatch.py   how long the trio loop is held (longest task step, timer lateness), for status

Not part of a running peer, so outside node/: ``swarm/client.py`` (talking to a swarm as a
client) and ``swarm/launch.py`` (a local swarm of node processes on loopback).
"""
