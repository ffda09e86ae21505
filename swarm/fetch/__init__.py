"""Fetching a peer's slice of the model: byte ranges of exactly its tensors, verified, cached.

Files:

- ``origin.py`` ``Origin``: ranged HTTP(S) reads of the unmodified upstream files (httpx), a 200
                without Range handled, a cut resumed, a bearer token from ``HF_TOKEN``; ``FetchError``
- ``cache.py``  ``ModelCache``: the upstream files laid out sparse in the user's cache, holding only
                fetched tensors, each checked against the model manifest; resume; the disk budget
- ``peers.py``  ``Holdings`` (what a member may serve: only verified bytes), ``Piece``/``Assignment``
                (which member is asked for which tensors, several at once; liars dropped),
                ``PieceSink`` (a piece's bytes landed and checked tensor by tensor)
- ``slices.py`` ``fetch_block``/``fetch_head``: what a stage or the coordinator needs, fetched; a
                local copy verified tensor by tensor in place (remembered once)

This package imports ``swarm.manifest`` and nothing else of swarm's (node/ and cli/ call it).
"""
