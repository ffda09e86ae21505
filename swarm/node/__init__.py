"""A running peer: the trio nursery tree of membership, heartbeats, the ring, recovery.

Where things live:

    runtime.py     Node: host + membership + the leader's planning (epochs, leave, faults)
    epoch.py       one plan epoch at a peer: accept the plan, load the block, wire the hops, serve
    stage_worker.py  a layer block serving verify chunks from upstream to downstream, the
                   sessions waiting for it batched into one forward, compute off the trio loop
    coordinator.py the coordinator's side of a ring: drives the speculative decoder, replays a
                   run on a new ring after a failure
    control.py     the control plane's dispatch: which role may send each request (ROLES), the check
    authority.py   the finer rules behind the roles (fault reports, epoch bounds), pure
    service.py     the generation service (in-process for the API, and /shard-swarm/gen/1):
                   requests, relaying, recovery loop, receipts, status
    client.py      talking to a swarm as a client (status, wait until ready, one generation)
    launch.py      a local swarm of node processes on loopback (demo, tests, benchmarks);
                   __main__.py is the node process
    links.py       the Link interface of a hop, and the in-process LocalLink
    fastlink.py    a hop over a fast-path channel
    activation.py  the activation codec: tensors <-> CHUNK/RESULT messages, with every check
    failure.py     FailureDetector: alive -> suspect -> lost (and rejoin as a new incarnation);
                   pure, every call takes ``now``
    heartbeat.py   Liveness (the detector on the trio clock, RTT estimates); the ctl link that sends
                   heartbeats/adverts and measures RTT from echoes; the inbound ctl server
    membership.py  Membership (signed adverts, the view, the planner's peers-file export) and
                   MembershipService (runs it all on a SwarmHost: links, gossip, dialing)
    errors_util.py unwrapping trio's exception groups at the node's boundaries
    loopwatch.py   how long the trio loop is held (longest task step, timer lateness), for status
"""
