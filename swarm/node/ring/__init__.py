"""The ring's data plane: hidden states from the coordinator through every stage and back.

    links.py         the Link interface of a hop (typed messages in and out), and the in-process LocalLink
    fastlink.py      a hop over a fast-path channel (swarm/net/fastpath.py)
    codec.py         the activation codec: tensors <-> CHUNK/RESULT messages, with every check
    stage_worker.py  a layer block serving verify chunks from upstream to downstream, the
                     sessions waiting for it batched into one forward, compute off the trio loop;
                     a resumed run's replay chunks computed several at a time
    gathering.py     which sessions a stage's next forward waits for, so that they share it
    coordinator.py   the coordinator's side of a ring: drives the speculative decoder, replays a
                     run on a new ring after a failure
    capacity.py      how many sessions a ring holds, and the queue in front of it (``SlotQueue``)

Imports compute/ (the draft model, the shared head) and node/'s shared modules, nothing else.
"""
