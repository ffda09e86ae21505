"""``--compile-span N`` on ``join`` and ``demo`` (and a node settings file's ``compile_span``): the
value reaches the node's settings, nonsense is a one-line usage error (exit 2) that names the flag
and a value to give, before anything starts, and ``--help`` says the trade."""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from swarm.cli import join as join_cli
from swarm.cli.main import app, main
from swarm.errors import UsageError
from swarm.manifest.identity import Identity
from swarm.manifest.manifest import new_manifest, sign_manifest, write_manifest
from swarm.node.settings import (
    MIN_COMPILE_SPAN,
    NodeSettings,
    check_compile_span,
    settings_from_mapping,
)
from swarm.testing.checkpoints import TinySpec, write_checkpoint


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("span"), TinySpec(family="llama", n_layers=2), seed=3)


@pytest.fixture
def invite(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("SHARD_SWARM_CONFIG", str(tmp_path / "cfg"))
    issuer = Identity(os.urandom(32))
    path = tmp_path / "invite.json"
    write_manifest(sign_manifest(new_manifest(swarm_name="t", issuer=issuer.public_key, bootstrap=(), lifetime_s=600), issuer), path)
    return path


def test_the_smallest_span_is_the_compiled_steps() -> None:
    from swarm.model.compiled import LONGEST_SPAN, MIN_SPAN

    assert MIN_COMPILE_SPAN == MIN_SPAN and NodeSettings.compile_span == LONGEST_SPAN


@pytest.mark.parametrize(("span", "near"), [(1000, 512), (48, 64), (0, 64), (-128, 64), (1 << 21, 1 << 20)])
def test_a_span_that_is_no_power_of_two_from_64_is_refused_with_one_to_give(span: int, near: int) -> None:
    with pytest.raises(UsageError, match=rf"--compile-span {span}: expected a power of two from 64 to .* such as {near}$"):
        check_compile_span(span, compile=True)
    with pytest.raises(UsageError, match="add --compile, or drop --compile-span"):
        check_compile_span(256, compile=False)
    assert check_compile_span(256, compile=True) == 256


def test_join_passes_the_span_to_its_node_and_refuses_nonsense(
    invite: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    got: list[NodeSettings] = []

    async def fake_run_peer(settings: NodeSettings, *a: Any, **kw: Any) -> None:
        got.append(settings)

    monkeypatch.setattr(join_cli, "_run_peer", fake_run_peer)
    base = ["--manifest", str(invite), "--no-mdns", "--no-serve"]
    assert join_cli.main([*base, "--compile", "--compile-span", "256"]) == 0
    assert join_cli.main([*base, "--compile"]) == 0
    assert [(s.compile, s.compile_span) for s in got] == [(True, 256), (True, 1024)]
    capsys.readouterr()
    for bad in (["--compile", "--compile-span", "1000"], ["--compile", "--compile-span", "32"], ["--compile-span", "256"]):
        assert join_cli.main([*base, *bad]) == 2, bad
        err = capsys.readouterr().err
        assert err.count("--compile-span") >= 1 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert len(got) == 2  # no node was started for any of them


def test_demo_passes_the_span_to_every_node_and_refuses_nonsense_before_starting_any(
    tiny: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    started: list[dict[str, Any]] = []

    @contextlib.contextmanager
    def fake_swarm(*a: Any, **kw: Any) -> Iterator[None]:
        started.append(kw)
        raise UsageError("stop here: the test only reads what demo would start")
        yield

    monkeypatch.setattr("swarm.launch.start_local_swarm", fake_swarm)
    assert main(["demo", "--model", str(tiny), "--compile", "--compile-span", "128"]) == 2
    assert main(["demo", "--model", str(tiny), "--compile"]) == 2
    assert main(["demo", "--model", str(tiny)]) == 2  # an eager demo's nodes get no span: their settings refuse one
    assert [(kw["compile"], kw["compile_span"]) for kw in started] == [(True, 128), (True, 256), (False, None)]
    capsys.readouterr()
    assert main(["demo", "--model", str(tiny), "--compile", "--compile-span", "100"]) == 2
    assert "--compile-span 100: expected a power of two from 64" in capsys.readouterr().err
    assert len(started) == 3


def test_a_settings_file_span_is_checked_like_the_flag(tiny: Path) -> None:
    class Invite:
        swarm_id, revoked, quant, bootstrap, context_tokens, kv_cache = "s" * 32, (), "none", (), 512, "auto"

        class secret:  # noqa: N801
            value = b"k" * 32

    cfg = {"model_dir": str(tiny), "device": "cpu", "dtype": "fp32", "compile": True}
    assert settings_from_mapping({**cfg, "compile_span": 128}, seed=b"x" * 32, manifest=Invite).compile_span == 128
    with pytest.raises(UsageError, match="node settings: compile_span 96: expected a power of two"):
        settings_from_mapping({**cfg, "compile_span": 96}, seed=b"x" * 32, manifest=Invite)


def test_help_says_the_trade() -> None:
    for cmd, default in (("join", "1024: 5 graphs"), ("demo", "256: 3 graphs")):
        text = re.sub(r"[\s│|]+", " ", CliRunner().invoke(app, [cmd, "--help"], terminal_width=400).output)
        assert "--compile-span" in text and f"(default {default}" in text, text
        assert "A longer span compiles more graphs before the node serves" in text and "fewer decode steps eager" in text
