"""Swarm invite manifests and node identity keys: canonical bytes, signing, verification."""
