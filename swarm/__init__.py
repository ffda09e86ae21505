"""shard-swarm: one large language model split into layer blocks across a ring of peers.

Subpackages, lowest layer first (dependencies point one way, see tests/test_layering.py):

- ``model``    torch only: config, layers, stages, KV cache, weights, tokenizer, sampling, drafting
- ``proto``    sans-IO wire protocol: frames, messages, limits
- ``manifest`` swarm invite manifests: canonical bytes, signing, verification
- ``planner``  pure placement: coordinator, ring order, layer blocks
- ``net``      the only importer of libp2p and zeroconf
- ``node``     the trio nursery tree that runs a peer, in planes: compute, ring, members, plan,
               generation (see swarm/node/__init__.py)
- ``client``   (client.py) talking to a running swarm as a client
- ``launch``   (launch.py) a local swarm of node processes on loopback
- ``api``      OpenAI-compatible HTTP on top of ``node``
- ``cli``      typer commands; ``cli/ui.py`` is the only importer of rich
- ``testing``  fakes shipped with the package
"""

__version__ = "0.1.0"
