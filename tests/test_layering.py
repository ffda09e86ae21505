"""The import direction between subpackages (see swarm/__init__.py and STYLE.md).

Parses every module under swarm/ and checks what it imports, so a stray import fails CI.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "swarm"

# subpackage -> swarm subpackages it may import (besides itself and swarm.errors)
ALLOWED: dict[str, set[str]] = {
    "model": set(),
    "proto": set(),
    "manifest": set(),
    "planner": set(),
    "net": {"proto", "manifest"},
    "fetch": {"manifest"},
    "node": {"model", "proto", "manifest", "planner", "net", "fetch"},
    "api": {"node", "model", "proto", "manifest", "planner", "net"},
    "testing": {"model", "proto", "manifest", "planner", "net", "node", "fetch"},
    "cli": {"model", "proto", "manifest", "planner", "net", "node", "api", "testing", "fetch", "client", "launch"},
}
# leaf modules every layer may import (they import nothing of swarm)
LEAVES = ("errors", "peerid", "strictjson")
# the top-level modules that are not a layer of their own: who they may import
TOP_MODULES: dict[str, set[str]] = {
    "client": {"proto", "net", "node"},  # talking to a swarm from outside it
    "launch": {"model", "manifest", "node"},  # a local swarm of node processes
}
# who may import them
ALLOWED["api"] |= {"client"}
ALLOWED["testing"] |= {"client", "launch"}

# node/'s planes (swarm/node/__init__.py), lowest first: each may import the ones before it and
# node/'s shared top-level modules; the composition root (peer, serving, __main__) imports all.
NODE_PLANES = ["compute", "ring", "members", "plan", "generation"]
NODE_SHARED = {"settings", "notices", "hosting", "dispatch", "errors_util", "loopwatch"}
NODE_ROOT = {"peer", "serving", "__main__"}
# third-party packages confined to one place
CONFINED: dict[str, str | tuple[str, ...]] = {
    "libp2p": "net", "zeroconf": "net", "multiaddr": "net", "rich": "cli/ui.py",
    # transformers' decoder layers are the runtime, reached through one module (and test fakes)
    "transformers": ("model/families.py", "testing/hf_checkpoints.py"),
}
FORBIDDEN_IN = {
    "proto": {"trio", "torch", "libp2p", "numpy"},
    "planner": {"trio", "torch", "libp2p"},
    "manifest": {"trio", "torch", "libp2p"},
    "fetch": {"trio", "torch", "libp2p"},
    "model": {"trio", "libp2p"},
}


def _modules() -> list[Path]:
    return sorted(p for p in ROOT.rglob("*.py"))


def _imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
    return names


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_import_direction(path: Path) -> None:
    rel = path.relative_to(ROOT)
    sub = rel.parts[0] if len(rel.parts) > 1 else None
    if sub is None and path.stem in TOP_MODULES:
        for name in _imports(path):
            parts = name.split(".")
            if parts[0] == "swarm" and len(parts) > 1 and parts[1] not in LEAVES:
                assert parts[1] in TOP_MODULES[path.stem], f"{rel} imports {name}"
    for name in _imports(path):
        top = name.split(".")[0]
        if top in CONFINED:
            where = CONFINED[top]
            assert str(rel).startswith(where), f"{rel} imports {top}; only swarm/{where} may"
        if sub in FORBIDDEN_IN:
            assert top not in FORBIDDEN_IN[sub], f"{rel} imports {top}, which {sub}/ must not"
        if top == "swarm" and sub is not None:
            parts = name.split(".")
            if len(parts) < 2 or parts[1] in (*LEAVES, sub):
                continue
            assert parts[1] in ALLOWED[sub], f"{rel} imports {name}: {sub}/ may not import {parts[1]}/"


def _node_part(path: Path) -> str:
    """The plane (sub-package) a module of node/ is in, else its own name (shared or root)."""
    rel = path.relative_to(ROOT / "node")
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


@pytest.mark.parametrize("path", sorted((ROOT / "node").rglob("*.py")), ids=lambda p: str(p.relative_to(ROOT)))
def test_node_planes_one_way(path: Path) -> None:
    part = _node_part(path)
    if part in NODE_ROOT or part == "__init__":
        return
    for name in _imports(path):
        parts = name.split(".")
        if parts[:2] != ["swarm", "node"] or len(parts) < 3:
            continue
        target = parts[2]
        if part in NODE_SHARED:
            assert target in NODE_SHARED, f"node/{part}.py imports {name}: the shared modules import no plane"
        elif target not in NODE_SHARED and target != part:
            assert target in NODE_PLANES[: NODE_PLANES.index(part)], (
                f"{path.relative_to(ROOT)} imports {name}: node/{part}/ may import only "
                f"{NODE_PLANES[: NODE_PLANES.index(part)]} and node/'s shared modules")


def test_node_has_no_stray_modules() -> None:
    """Every module at node/'s top is the root or shared; every folder is a plane."""
    for path in (ROOT / "node").iterdir():
        if path.is_dir() and path.name != "__pycache__":
            assert path.name in NODE_PLANES, f"node/{path.name}/ is not a plane in NODE_PLANES"
        elif path.suffix == ".py" and path.stem != "__init__":
            assert path.stem in NODE_ROOT | NODE_SHARED, f"node/{path.name}: a plane's module at node/'s top"


def test_every_subpackage_documents_its_files() -> None:
    for sub in [*ALLOWED, *(f"node/{p}" for p in NODE_PLANES)]:
        init = ROOT / sub / "__init__.py"
        assert init.exists(), f"swarm/{sub}/__init__.py missing"
        assert ast.get_docstring(ast.parse(init.read_text())), f"swarm/{sub}/__init__.py has no docstring"


@pytest.mark.parametrize("sub", ["node", *(f"node/{p}" for p in NODE_PLANES)])
def test_node_package_docs_name_every_file(sub: str) -> None:
    """A package's docstring is its map: each of its files is named there."""
    doc = ast.get_docstring(ast.parse((ROOT / sub / "__init__.py").read_text())) or ""
    for path in (ROOT / sub).glob("*.py"):
        if path.stem != "__init__":
            assert path.name in doc, f"swarm/{sub}/__init__.py does not say what {path.name} holds"


# Issue 24: above the link layer, code sends and receives typed messages. A message becomes a
# frame and back in one place, swarm.proto.messages (MessageIO, which every link and stream mixes
# in); node/, api/, cli/ and the client never build, encode, decode or parse a frame themselves.
# The one exception is a link that lives in node/: the fast path's hop (bytes <-> frames).
FRAME_CODEC = {
    "parse_message", "to_frame", "from_frame", "decode_message", "expect_message",
    "encode_frame", "decode_frame", "FrameDecoder", "frames_of", "MsgType",
}
TYPED_ONLY = ["node", "api", "cli", "client.py"]
LINKS_IN_NODE = {"node/ring/fastlink.py"}


def _frame_codec_uses(path: Path) -> list[str]:
    """Where ``path`` names the frame codec (a call, an attribute, an import) or builds a Frame."""
    found: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        name = None
        if isinstance(node, ast.Name):
            name = node.id
        elif isinstance(node, ast.Attribute):
            name = node.attr
        elif isinstance(node, ast.ImportFrom):
            found += [f"line {node.lineno}: imports {a.name}" for a in node.names if a.name in FRAME_CODEC]
        if name in FRAME_CODEC:
            found.append(f"line {node.lineno}: {name}")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "Frame":
            found.append(f"line {node.lineno}: builds a Frame")
    return sorted(found, key=lambda f: int(f.split(":")[0].removeprefix("line ")))


def _typed_only_modules() -> list[Path]:
    paths = [ROOT / where for where in TYPED_ONLY]
    return sorted(q for p in paths for q in ([p] if p.suffix == ".py" else p.rglob("*.py")))


@pytest.mark.parametrize("path", _typed_only_modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_above_the_links_code_handles_messages_not_frames(path: Path) -> None:
    if str(path.relative_to(ROOT)) in LINKS_IN_NODE:
        return
    uses = _frame_codec_uses(path)
    assert not uses, (
        f"swarm/{path.relative_to(ROOT)} handles frames ({'; '.join(uses)}): send and receive typed "
        "messages (send_message / receive_message(expect=...), swarm.proto.messages.MessageIO)"
    )


def test_the_frame_check_sees_a_frame_handled(tmp_path: Path) -> None:
    """The check above can fail: each way of handling a frame is caught."""
    code = (
        "from swarm.proto.messages import parse_message\n"
        "async def f(fs, msg):\n"
        "    await fs.send(msg.to_frame())\n"
        "    await fs.send(Frame(1))\n"
        "    return parse_message(await fs.receive())\n"
    )
    (tmp_path / "bad.py").write_text(code)
    uses = _frame_codec_uses(tmp_path / "bad.py")
    assert uses == ["line 1: imports parse_message", "line 3: to_frame", "line 4: builds a Frame",
                    "line 5: parse_message"], uses
    (tmp_path / "good.py").write_text("async def f(fs, msg):\n    await fs.send_message(msg)\n")
    assert _frame_codec_uses(tmp_path / "good.py") == []
