"""shard-swarm: one large language model split into layer blocks across a ring of peers.

Subpackages, lowest layer first (dependencies point one way, see tests/test_layering.py):

- ``model``    torch only: config, layers, stages, KV cache, weights, tokenizer, sampling, drafting
- ``proto``    sans-IO wire protocol: frames, messages, limits
- ``manifest`` swarm invite manifests: canonical bytes, signing, verification
- ``planner``  pure placement: coordinator, ring order, layer blocks
- ``net``      the only importer of libp2p and zeroconf
- ``node``     the trio nursery tree that runs a peer
- ``api``      OpenAI-compatible HTTP on top of ``node``
- ``cli``      typer commands; ``cli/ui.py`` is the only importer of rich
- ``testing``  fakes shipped with the package
"""

__version__ = "0.1.0"
