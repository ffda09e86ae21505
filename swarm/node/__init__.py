"""A running peer: the trio nursery tree of membership, heartbeats, stage worker, coordinator."""
