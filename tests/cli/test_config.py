"""The configuration file: defaults, the file, flags over both, clear errors, ``config show``."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from swarm.cli import config as config_cmd
from swarm.cli.settings import TEMPLATE, config_path, load_config, write_template
from swarm.errors import UsageError
from swarm.node.settings import NodeSettings


def app() -> typer.Typer:
    a = typer.Typer()

    @a.callback()
    def root() -> None:
        pass

    config_cmd.register(a)
    return a


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "config.toml"
    p.write_text(text)
    return p


def test_defaults_when_there_is_no_file(tmp_path: Path) -> None:
    cfg = load_config(env={"SHARD_SWARM_CONFIG": str(tmp_path)})
    assert cfg.path == tmp_path / "config.toml" and not cfg.loaded
    assert cfg.get("node.memory") == "auto" and cfg.get("api.address") == "" and cfg.source("node.memory") == "default"
    assert config_path({"XDG_CONFIG_HOME": "/x"}) == Path("/x/shard-swarm/config.toml")


def test_file_then_flags(tmp_path: Path) -> None:
    p = write(tmp_path, '[node]\nmemory = "24G"\ndevice = "cuda:1"\nlisten = ["/ip4/0.0.0.0/tcp/4001"]\n'
                        '[api]\naddress = "0.0.0.0:8000"\ntoken = "hunter2"\n[model]\npath = "/models/m"\n')  # fmt: skip
    cfg = load_config(p)
    assert (cfg.get("node.memory"), cfg.get("node.device"), cfg.get("model.path")) == ("24G", "cuda:1", "/models/m")
    assert cfg.source("node.device") == "file" and cfg.source("node.threads") == "default"
    over = cfg.with_flags({"node.memory": "8G", "node.device": None, "node.listen": ("/ip4/127.0.0.1/tcp/0",)})
    assert over.get("node.memory") == "8G" and over.source("node.memory") == "flag"
    assert over.get("node.device") == "cuda:1" and over.source("node.device") == "file"
    assert over.get("node.listen") == ["/ip4/127.0.0.1/tcp/0"]
    assert "hunter2" not in repr(over)
    with pytest.raises(UsageError, match="--memory"):
        cfg.with_flags({"node.memory": "lots"})


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ('[node]\nmemroy = "1G"\n', "unknown key 'memroy' in \\[node\\]"),
        ('[nodes]\nmemory = "1G"\n', "unknown section \\[nodes\\]"),
        ('[node]\nmemory = 24\n', "memory = 24: expected a size"),
        ('[node]\ndevice = "gpu"\n', "device = 'gpu': expected auto, cpu, mps, cuda"),
        ('[node]\nthreads = true\n', "threads = True: expected a int"),
        ('[node]\nsessions = 0\n', "sessions = 0: expected a whole number of sessions from 1 to 64"),
        ('[node]\nsessions = 65\n', "sessions = 65: expected a whole number"),
        ('[node]\nlisten = "/ip4/0.0.0.0/tcp/1"\n', "expected a list of multiaddrs"),
        ('[api]\naddress = "8000"\n', "expected HOST:PORT"),
        ('[api]\ntoken = 5\n', "token = \\*\\*\\*"),
        ("[node\n", "not valid TOML"),
    ],
)
def test_bad_files_name_the_file_and_key(tmp_path: Path, text: str, match: str) -> None:
    p = write(tmp_path, text)
    with pytest.raises(UsageError, match=match) as info:
        load_config(p)
    assert str(p) in str(info.value)


def test_template_is_valid_and_private(tmp_path: Path) -> None:
    p = write_template(tmp_path / "sub" / "config.toml")
    assert stat.S_IMODE(p.stat().st_mode) == 0o600 and p.read_text() == TEMPLATE
    assert load_config(p).loaded and all(s == "default" for s in load_config(p).sources.values())
    with pytest.raises(UsageError, match="already exists"):
        write_template(p)


def test_config_show(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHARD_SWARM_CONFIG", str(tmp_path))
    write(tmp_path, '[node]\nmemory = "2G"\n[api]\ntoken = "hunter2"\n')
    r = CliRunner().invoke(app(), ["config", "show", "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    rows = {row["key"]: row for row in out["settings"]}
    assert out["exists"] and rows["node.memory"]["value"] == "2G" and rows["node.memory"]["source"] == "file"
    assert rows["api.token"]["value"] == "(set)" and "hunter2" not in r.output
    table = CliRunner().invoke(app(), ["config", "show"])
    assert table.exit_code == 0 and "node.memory" in table.stdout and "2G" in table.stdout
    assert "hunter2" not in table.output
    init = CliRunner().invoke(app(), ["config", "init", "--file", str(tmp_path / "new.toml")])
    assert init.exit_code == 0 and (tmp_path / "new.toml").read_text() == TEMPLATE


def test_config_show_defaults_are_what_join_uses_and_says(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``config show``'s defaults, ``join --help`` and what ``join`` runs with agree, and a value
    in the file is what join uses when no flag is given."""
    import re

    from swarm.cli import join as join_cli
    from swarm.cli.settings import KEYS
    from swarm.manifest.identity import Identity
    from swarm.manifest.manifest import new_manifest, sign_manifest, write_manifest

    monkeypatch.setenv("SHARD_SWARM_CONFIG", str(tmp_path))
    monkeypatch.setenv("COLUMNS", "400")
    shown = {r["key"]: r for r in json.loads(CliRunner().invoke(app(), ["config", "show", "--json"]).stdout)["settings"]}
    assert {k: r["value"] for k, r in shown.items() if k != "api.token"} == {k.name: k.default for k in KEYS if not k.secret}
    flags = {"node.memory": "--memory", "node.dtype": "--dtype", "node.threads": "--threads", "node.listen": "--listen",
             "node.sessions": "--sessions"}  # fmt: skip
    ja = typer.Typer()
    join_cli.register(ja)
    ja.command("other")(lambda: None)
    text = re.sub(r"[\s│|]+", " ", CliRunner().invoke(ja, ["join", "--help"]).output)
    for key, flag in flags.items():
        default = shown[key]["value"]
        said = f"{shown[key]['help'][1:]} (default: {key} in the config file, else {' '.join(default) if isinstance(default, list) else default})"
        assert flag in text and said in text, (flag, said, text)

    ran: dict[str, object] = {}

    real_settings = join_cli.node_settings_of

    def spy_settings(manifest, seed, listen, memory, model_dir, **kw):  # type: ignore[no-untyped-def]
        ran.update(listen=listen, memory=memory, dtype=kw["dtype"], threads=kw["threads"], sessions=kw["sessions"])
        ran["built"] = real_settings(manifest, seed, listen, memory, model_dir, **kw).sessions
        return real_settings(manifest, seed, listen, memory, model_dir, **kw)

    async def no_peer(settings, manifest, **kw):  # type: ignore[no-untyped-def]
        return None

    monkeypatch.setattr(join_cli, "node_settings_of", spy_settings)  # what join builds the node from
    monkeypatch.setattr(join_cli, "_run_peer", no_peer)
    ident = Identity(bytes([3]) * 32)
    invite = tmp_path / "invite.json"
    write_manifest(sign_manifest(new_manifest(swarm_name="lab", issuer=ident.public_key), ident), invite)
    base = ["--manifest", str(invite), "--key", str(tmp_path / "k"), "--no-serve", "--no-mdns"]
    assert join_cli.main(base) == 0
    assert ran["listen"] == KEYS[[k.name for k in KEYS].index("node.listen")].default
    assert (ran["dtype"], ran["threads"], ran["sessions"]) == ("auto", 0, NodeSettings.sessions)
    write(tmp_path, '[node]\nmemory = "2G"\ndtype = "fp32"\nthreads = 3\nsessions = 2\nlisten = ["/ip4/127.0.0.1/tcp/0"]\n')
    assert join_cli.main(base) == 0
    assert ran == {"listen": ["/ip4/127.0.0.1/tcp/0"], "memory": 2 * 10**9, "dtype": "fp32", "threads": 3,
                   "sessions": 2, "built": 2}  # fmt: skip
    assert join_cli.main([*base, "--threads", "1", "--memory", "1GiB", "--sessions", "5"]) == 0  # flags win
    assert (ran["threads"], ran["memory"], ran["built"]) == (1, 1 << 30, 5)


def test_sessions_bound_is_the_stage_workers() -> None:
    from swarm.cli.settings import MAX_SESSIONS
    from swarm.node.ring.capacity import MAX_SESSIONS as STAGE_MAX

    assert MAX_SESSIONS == STAGE_MAX
