"""Tests that need system tools skip with a reason naming the package when a tool is missing
(``shutil.which`` faked: nothing is uninstalled)."""

from __future__ import annotations

import shutil

import pytest

from swarm.testing import netlab
from swarm.testing.netlab import lab_unavailable_reason, missing_tools_reason


def _without(monkeypatch: pytest.MonkeyPatch, *absent: str) -> None:
    real = shutil.which
    monkeypatch.setattr(netlab.shutil, "which", lambda cmd, *a, **k: None if cmd in absent else real(cmd, *a, **k) or f"/usr/bin/{cmd}")


def test_missing_tools_name_their_packages(monkeypatch: pytest.MonkeyPatch) -> None:
    _without(monkeypatch, "nft", "tshark")
    assert missing_tools_reason("ip", "iptables") is None
    reason = missing_tools_reason("ip", "nft", "tshark")
    assert reason is not None and reason.startswith("nft, tshark not installed")
    assert "apt-get install nftables tshark" in reason and "make test" in reason


@pytest.mark.skipif(not hasattr(netlab.os, "geteuid"), reason="POSIX only")
def test_a_lab_needing_nft_skips_naming_nftables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(netlab.os, "geteuid", lambda: 0)  # as CI: root
    _without(monkeypatch, "nft")
    assert lab_unavailable_reason(tools=["nft"]) == (
        "nft not installed (package nftables: apt-get install nftables; `make test` installs it when run as "
        "root or with sudo)"
    )
    _without(monkeypatch, "ip", "iptables")
    reason = lab_unavailable_reason(need_nat=True)
    assert reason is not None and "apt-get install iproute2 iptables" in reason
