"""Networking: the only subpackage that imports libp2p and zeroconf."""
