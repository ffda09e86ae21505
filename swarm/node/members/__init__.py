"""Who is in the swarm: signed adverts, heartbeats, the failure detector, this node's view.

    membership.py  Membership: the signed-advert view and the planner's peers-file export
    gossip.py      MembershipService: membership on a host (ctl links, gossip, dialing)
    heartbeat.py   Liveness (the detector on the trio clock, RTT estimates); the ctl link that
                   sends heartbeats/adverts and measures RTT from echoes; the inbound ctl server
    failure.py     FailureDetector: alive -> suspect -> lost (and rejoin as a new incarnation);
                   pure, every call takes ``now``
    view.py        this node's view: members, the leader, who may be planned
    discovery.py   relays and mDNS: finding and reaching peers beyond the bootstrap list
    probe.py       RTTs on the path hops take: a short echoed probe of the fast path to each member

Imports ring/ (probe.py opens a fast link as a hop would) and node/'s shared modules.
"""
