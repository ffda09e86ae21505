"""Fakes and labs shipped with the package (imported by tests and benchmarks, never by swarm/).

- ``checkpoints.py`` seeded random tiny checkpoints of each supported family, as real HF dirs
- ``memnet.py``     an in-memory network: hosts (the node's host interface) with admission,
                    framed streams, kill, freeze, partition; single links with delay and failure
- ``memswarm.py``   a swarm of real nodes (join's composition root) on memnet, one trio run
- ``ring.py``       a whole ring (coordinator + stage workers) over memnet, in one task tree
- ``delayproxy.py`` a delaying TCP proxy on loopback (WAN latency without tc netem)
- ``netlab.py``     network-namespace labs: bridges, MASQUERADE routers, processes inside
- ``origin_server.py`` a real HTTP origin: Debian nginx on loopback serving a directory (Range on/off,
                  a bearer token, a worker to kill mid-transfer, bytes sent from its access log)
- ``hardware.py``   faked CUDA GPUs and MPS (torch's answers only) for device-choice tests
- ``memlimit.py``   a memory cgroup (v1 or v2) around test processes: the kernel enforces an offer
"""
