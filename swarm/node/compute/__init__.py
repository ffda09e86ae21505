"""What a node holds of the model, and the torch work around it (below every other plane).

    runtime.py     the checkpoint, the loaded block/head/tokenizer, and ``Compute``: where torch
                   work runs (a worker thread, or inline under a mock clock)
    drafting.py    the coordinator's draft model (load, advert, auto's choice by measured cost) and
                   drafting off the trio loop, ahead of the chunks in flight
    headbatch.py   the coordinator's LM head, shared by the sessions whose results arrive together
    memory.py      running out of memory: what it fails (a request, never the peer), its test hooks
    fetching.py    a block's tensors fetched from the model's origin (or checked in place) before it loads
    members.py     /shard-swarm/tensors/1: serving the byte ranges this node holds verified to other
                   members, and fetching a block's tensors from several members at once (origin last)
    rangepipe.py   one member's pieces over one stream: several range requests in flight, landed
                   and checked in a worker thread; a cut gives back what did not land
"""
