"""OpenAI-compatible HTTP endpoint: a thin translator onto ``swarm.node``.

Files:
    server.py    Starlette routes on Hypercorn's trio worker; ``serve_api(backend, bind, token=)``
                 (start it with ``nursery.start``), SSE streaming, the disconnect watch, bearer auth
    requests.py  OpenAI request bodies -> ``GenSpec``; ``ApiError`` (the OpenAI error object)
    backend.py   how requests reach the swarm: ``ClientBackend`` (a libp2p client of one peer),
                 ``NodeBackend`` (inside a node, through its own generation service);
                 ``open_generation`` (cancel = reset the gen stream)
    stops.py     ``TextAssembler``: token ids -> text pieces, cut at stop sequences
"""

from swarm.api.backend import ClientBackend, NodeBackend
from swarm.api.server import DEFAULT_BIND, build_app, serve_api

__all__ = ["DEFAULT_BIND", "ClientBackend", "NodeBackend", "build_app", "serve_api"]
