"""Fakes shipped with the package: tiny checkpoints, in-memory network, scenarios."""
