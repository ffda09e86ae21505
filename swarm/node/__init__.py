"""A running peer: the trio nursery tree of membership, heartbeats, stage worker, coordinator.

Where things live:

    failure.py     FailureDetector: alive -> suspect -> lost (and rejoin as a new incarnation);
                   pure, every call takes ``now``
    heartbeat.py   Liveness (the detector on the trio clock, RTT estimates); the ctl link that sends
                   heartbeats/adverts and measures RTT from echoes; the inbound ctl server
    membership.py  Membership (signed adverts, the view, the planner's peers-file export) and
                   MembershipService (runs it all on a SwarmHost: links, gossip, dialing)
    (stage worker, coordinator, recovery: see their own modules)
"""
