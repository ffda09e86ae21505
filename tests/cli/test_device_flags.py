"""``--device`` and ``node.device`` on the commands that compute (join, run, demo): the config key is
read, the flag overrides it, and a device this machine lacks is a one-line usage error (exit 2)
that names the device and where it was asked for. CUDA is faked where a test needs it present."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from swarm.cli import join as join_cli
from swarm.cli.main import main
from swarm.manifest.identity import Identity
from swarm.manifest.manifest import new_manifest, sign_manifest, write_manifest
from swarm.testing.checkpoints import TinySpec, write_checkpoint
from swarm.testing.hardware import fake_hardware


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("dev"), TinySpec(family="llama", n_layers=2), seed=3)


def _config(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, device: str | None) -> Path:
    cfg = tmp_path / "cfg"
    cfg.mkdir(exist_ok=True)
    if device is not None:
        (cfg / "config.toml").write_text(f'[node]\ndevice = "{device}"\n')
    monkeypatch.setenv("SHARD_SWARM_CONFIG", str(cfg))
    return cfg / "config.toml"


def _run(tiny: Path, *extra: str) -> list[str]:
    return ["run", "--model", str(tiny), "--prompt-ids", "3,1,4", "--max-new-tokens", "2", "--dtype", "fp32",
            "--threads", "1", "--json", *extra]  # fmt: skip


def test_run_reads_node_device_from_the_config_file(
    tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _config(monkeypatch, tmp_path, "cuda")  # no CUDA here: the file's choice must be refused
    assert main(_run(tiny)) == 2
    err = capsys.readouterr().err
    assert f"node.device in {path} cuda: no CUDA device" in err and len(err.strip().splitlines()) == 1
    assert main(_run(tiny, "--device", "cpu")) == 0  # the flag overrides the file
    assert json.loads(capsys.readouterr().out)["device"]["kind"] == "cpu"
    # with a (faked) GPU present, auto would take it; a file saying cpu keeps the run on the CPU
    _config(monkeypatch, tmp_path, "cpu")
    fake_hardware(monkeypatch, cuda=1)
    assert main(_run(tiny)) == 0
    assert json.loads(capsys.readouterr().out)["device"]["kind"] == "cpu"


@pytest.mark.parametrize("device", ["cuda", "cuda:1", "mps"])
def test_run_and_demo_refuse_a_missing_device_with_exit_2(
    device: str, tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _config(monkeypatch, tmp_path, None)
    assert main(_run(tiny, "--device", device)) == 2
    assert main(["demo", "--model", str(tiny), "--device", device]) == 2  # before any node starts
    err = capsys.readouterr().err
    assert err.count(f"--device {device}: ") == 2 and "Traceback" not in err


def test_join_refuses_a_missing_device_named_in_the_config(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _config(monkeypatch, tmp_path, "cuda:0")
    issuer = Identity(os.urandom(32))
    invite = tmp_path / "invite.json"
    write_manifest(sign_manifest(new_manifest(swarm_name="t", issuer=issuer.public_key, bootstrap=(), lifetime_s=600), issuer), invite)
    assert join_cli.main(["--manifest", str(invite), "--no-mdns", "--exit-after", "0.1"]) == 2
    assert f"node.device in {path} cuda:0: no CUDA device" in capsys.readouterr().err
    assert join_cli.main(["--manifest", str(invite), "--no-mdns", "--device", "gpu0"]) == 2
    assert "--device 'gpu0': expected auto, cpu" in capsys.readouterr().err
