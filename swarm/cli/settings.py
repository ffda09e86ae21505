"""The user's configuration file: what a user sets once, with command-line flags overriding it.

The file is TOML at ``<config dir>/config.toml`` (``$SHARD_SWARM_CONFIG``, else
``$XDG_CONFIG_HOME/shard-swarm``, else ``~/.config/shard-swarm``); a missing file means all
defaults. Every key is declared in ``KEYS`` with its type, default and a check; an unknown
section or key, or a value of the wrong kind, is a UsageError naming the file and the key, so a
typo never silently falls back to a default.

Precedence: flag > file > default. Commands declare their flags with default ``None`` and call
``load_config().with_flags({"node.memory": memory_flag, ...})``; ``source(key)`` says where each
value came from (``config show`` prints it). The API token is never printed.
"""

from __future__ import annotations

import os
import re
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from swarm.errors import UsageError
from swarm.manifest.identity import config_dir

if TYPE_CHECKING:
    import torch

CONFIG_FILE = "config.toml"
_SIZE = re.compile(r"\s*\d+(\.\d+)?\s*[kmgt]?i?b?\s*", re.IGNORECASE)
_DEVICE = re.compile(r"auto|cpu|mps|cuda(:\d+)?")
DTYPES = ("auto", "bf16", "fp16", "fp32")
MAX_SESSIONS = 64  # a stage never holds more (node/ring/capacity.py: MAX_SESSIONS, held equal by a test)


def _check_memory(v: Any) -> str | None:
    ok = isinstance(v, str) and (v.strip().lower() == "auto" or _SIZE.fullmatch(v) is not None)
    return None if ok else "a size like \"24G\" or \"512M\", or \"auto\""


def _check_sessions(v: Any) -> str | None:
    ok = isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= MAX_SESSIONS
    return None if ok else f"a whole number of sessions from 1 to {MAX_SESSIONS}"


def _check_device(v: Any) -> str | None:
    return None if isinstance(v, str) and _DEVICE.fullmatch(v) else "auto, cpu, mps, cuda or cuda:N"


def _check_addrs(v: Any) -> str | None:
    ok = isinstance(v, list) and all(isinstance(a, str) and a.startswith("/") for a in v)
    return None if ok else 'a list of multiaddrs like ["/ip4/0.0.0.0/tcp/4001"]'


def _check_bind(v: Any) -> str | None:
    if v == "":
        return None  # no API
    host, sep, port = v.rpartition(":") if isinstance(v, str) else ("", "", "")
    return None if sep and host and port.isdigit() and int(port) < 65536 else 'HOST:PORT like "127.0.0.1:8000"'


def _check_type(kind: type) -> Callable[[Any], str | None]:
    def check(v: Any) -> str | None:
        ok = isinstance(v, kind) and not (kind is int and isinstance(v, bool))
        return None if ok else f"a {kind.__name__}"

    return check


@dataclass(frozen=True)
class Key:
    name: str  # "section.key"
    default: Any
    help: str
    check: Callable[[Any], str | None]
    secret: bool = False


KEYS: tuple[Key, ...] = (
    Key("node.memory", "auto", "memory offered for layers (\"auto\": half of free RAM; on a GPU its free memory "
        "less a margin)", _check_memory),
    Key("node.device", "auto", "where layers run: auto (CUDA, then MPS, else CPU), cpu, mps, cuda or cuda:N",
        _check_device),
    Key("node.threads", 0, "torch threads (0: every core)", _check_type(int)),
    Key("node.sessions", 8, "concurrent generations whose KV cache (at the swarm's context) this node "
        "reserves inside --memory; fewer leave room for more layers", _check_sessions),
    Key("node.dtype", "auto", "auto (bf16 where the hardware has it, else fp32), bf16, fp16 or fp32",
        lambda v: None if v in DTYPES else ", ".join(DTYPES)),
    Key("node.listen", ["/ip4/0.0.0.0/tcp/0"], "multiaddrs to listen on", _check_addrs),
    Key("node.key", "", "identity key file (empty: <config dir>/identity.key)", _check_type(str)),
    Key("swarm.manifest", "", "invite file (empty: <config dir>/invite.json)", _check_type(str)),
    Key("model.path", "", "model directory (empty: the bundled SmolLM2-135M-Instruct)", _check_type(str)),
    Key("model.cache_dir", "", "where converted models are kept (empty: ~/.cache/shard-swarm)", _check_type(str)),
    Key("api.address", "", "serve the OpenAI-compatible API here, e.g. 127.0.0.1:8000 (empty: off)", _check_bind),
    Key("api.token", "", "bearer token the API requires (needed when not bound to loopback)", _check_type(str),
        secret=True),
)
_BY_NAME = {k.name: k for k in KEYS}


def flag_help(name: str) -> str:
    """A flag's help text from its config key, so ``--help`` and ``config show`` say the same."""
    k = _BY_NAME[name]
    shown = " ".join(k.default) if isinstance(k.default, list) else k.default
    return f"{k.help[:1].upper()}{k.help[1:]} (default: {name} in the config file, else {shown})."


def node_settings(flags: Mapping[str, Any]) -> UserConfig:
    """The node's settings: ``flags`` (None: not given) over the config file over the defaults."""
    return load_config().with_flags(flags)

TEMPLATE = """\
# shard-swarm configuration: what you set once. Command-line flags override every value here.
# `shard-swarm config show` prints the values in force and where each came from.

[node]
# memory = "24G"                    # memory offered for layers: 24G = 24 GB (10^9 bytes), 24GiB = 24 x 2^30
                                    # ("auto": half of free RAM; on a GPU its free memory less a margin)
# device = "auto"                   # auto (CUDA, then MPS, else CPU), cpu, mps, cuda or cuda:N
# threads = 0                       # torch threads (0: every core)
# sessions = 8                      # concurrent generations whose KV cache this node reserves inside memory
# dtype = "auto"                    # auto (bf16 where the hardware has it, else fp32), bf16, fp16 or fp32
# listen = ["/ip4/0.0.0.0/tcp/0"]   # multiaddrs to listen on
# key = ""                          # identity key file

[swarm]
# manifest = ""                     # invite file (default: invite.json beside this file)

[model]
# path = ""                         # model directory (default: the bundled SmolLM2-135M-Instruct)
# cache_dir = ""                    # where converted models are kept

[api]
# address = "127.0.0.1:8000"        # serve the OpenAI-compatible API (off when empty)
# token = ""                        # bearer token; required when address is not loopback
"""


def config_path(env: Mapping[str, str] | None = None) -> Path:
    return config_dir(env) / CONFIG_FILE


@dataclass(frozen=True)
class UserConfig:
    values: dict[str, Any]
    sources: dict[str, str]  # key -> "default" | "file" | "flag"
    path: Path
    loaded: bool = False  # the file existed

    def __repr__(self) -> str:  # never show the token
        shown = {k: ("***" if _BY_NAME[k].secret and v else v) for k, v in self.values.items()}
        return f"UserConfig({shown}, path={self.path})"

    def get(self, name: str) -> Any:
        if name not in self.values:
            raise KeyError(f"no setting {name!r}; known: {', '.join(_BY_NAME)}")
        return self.values[name]

    def source(self, name: str) -> str:
        return self.sources[name]

    def with_flags(self, flags: Mapping[str, Any]) -> UserConfig:
        """Flags given on the command line (None: not given) override the file and defaults."""
        values, sources = dict(self.values), dict(self.sources)
        for name, value in flags.items():
            if name not in _BY_NAME:
                raise KeyError(f"no setting {name!r}")
            if value is None:
                continue
            value = list(value) if isinstance(value, tuple) else value
            problem = _BY_NAME[name].check(value)
            if problem:
                raise UsageError(f"--{name.split('.')[1].replace('_', '-')} {value!r}: expected {problem}")
            values[name], sources[name] = value, "flag"
        return UserConfig(values, sources, self.path, self.loaded)

    def describe(self) -> list[dict[str, Any]]:
        """Rows for ``config show``: key, value (secrets masked), source, help."""
        rows = []
        for k in KEYS:
            v = self.values[k.name]
            if k.secret:
                v = "(set)" if v else "(not set)"
            rows.append({"key": k.name, "value": v, "source": self.sources[k.name], "help": k.help})
        return rows


def load_config(path: Path | None = None, env: Mapping[str, str] | None = None) -> UserConfig:
    """Read the config file (defaults when it does not exist); UsageError on anything wrong."""
    p = path if path is not None else config_path(env)
    values = {k.name: k.default for k in KEYS}
    sources = dict.fromkeys(values, "default")
    try:
        raw = tomllib.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        if path is not None:
            raise UsageError(f"config file {p} does not exist") from None
        return UserConfig(values, sources, p, False)
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"cannot read config file {p}: {exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise UsageError(f"{p}: not valid TOML: {exc}") from None
    sections = sorted({k.name.split(".")[0] for k in KEYS})
    for section, table in raw.items():
        if section not in sections or not isinstance(table, dict):
            raise UsageError(f"{p}: unknown section [{section}]; known: {', '.join(f'[{s}]' for s in sections)}")
        for key, value in table.items():
            name = f"{section}.{key}"
            if name not in _BY_NAME:
                known = ", ".join(k.name.split(".")[1] for k in KEYS if k.name.startswith(section + "."))
                raise UsageError(f"{p}: unknown key {key!r} in [{section}]; known: {known}")
            problem = _BY_NAME[name].check(value)
            if problem:
                shown = "***" if _BY_NAME[name].secret else repr(value)
                raise UsageError(f"{p}: [{section}] {key} = {shown}: expected {problem}")
            values[name], sources[name] = value, "file"
    return UserConfig(values, sources, p, True)


def chosen_device(flag: str | None) -> torch.device:
    """The device to compute on: ``--device`` when given, else ``node.device`` from the config
    file, else ``auto``; a UsageError names the device and where it was asked for."""
    from swarm.model.devices import resolve_device  # imports torch: only commands that compute

    cfg = load_config().with_flags({"node.device": flag})
    where = f"node.device in {cfg.path}" if cfg.source("node.device") == "file" else "--device"
    return resolve_device(str(cfg.get("node.device")), where=where)


def write_template(path: Path, *, force: bool = False) -> Path:
    """Write the commented template (0600: it may come to hold the API token)."""
    if path.exists() and not force:
        raise UsageError(f"{path} already exists (use --force to overwrite it)")
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(TEMPLATE)
    return path
