"""Fixtures of the adversarial tests (defined in swarmkit.py, shared by every test module here)."""

from .swarmkit import live, security_ckpt

__all__ = ["live", "security_ckpt"]
