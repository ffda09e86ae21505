"""OpenAI-compatible HTTP endpoint: a thin translator onto ``swarm.node``.

Files:
    server.py    Starlette routes on Hypercorn's trio worker; ``serve_api(backend, bind, token=)``
                 (start it with ``nursery.start``), SSE streaming, the disconnect watch, bearer auth
    requests.py  OpenAI request bodies -> ``GenSpec`` (the swarm's one request type, ``Gen``, plus
                 stops and streaming); ``ApiError`` (the OpenAI error object)
    backend.py   how requests reach the swarm: ``NodeBackend`` (inside a node: its generation
                 service, called directly), ``ClientBackend`` (a libp2p client of one peer);
                 ``open_generation`` (leaving early cancels it); ``api_error`` (typed errors ->
                 OpenAI errors)
    stops.py     ``TextAssembler``: token ids -> text pieces, cut at stop sequences
    console.py   the web console at ``/`` and the chat at ``/chat``: the live feed (SSE of the
                 coordinator's status, as ring, speed, sessions and a timeline of events) and the
                 routes of the pages in static/ (plain HTML, CSS and JS shipped in the package)
"""

from swarm.api.backend import ClientBackend, NodeBackend
from swarm.api.server import DEFAULT_BIND, build_app, serve_api

__all__ = ["DEFAULT_BIND", "ClientBackend", "NodeBackend", "build_app", "serve_api"]
