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
    "cli": {"model", "proto", "manifest", "planner", "net", "node", "api", "testing", "fetch"},
}
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
    for name in _imports(path):
        top = name.split(".")[0]
        if top in CONFINED:
            where = CONFINED[top]
            assert str(rel).startswith(where), f"{rel} imports {top}; only swarm/{where} may"
        if sub in FORBIDDEN_IN:
            assert top not in FORBIDDEN_IN[sub], f"{rel} imports {top}, which {sub}/ must not"
        if top == "swarm" and sub is not None:
            parts = name.split(".")
            if len(parts) < 2 or parts[1] in ("errors", "peerid", sub):
                continue
            assert parts[1] in ALLOWED[sub], f"{rel} imports {name}: {sub}/ may not import {parts[1]}/"


def test_every_subpackage_documents_its_files() -> None:
    for sub in ALLOWED:
        init = ROOT / sub / "__init__.py"
        assert init.exists(), f"swarm/{sub}/__init__.py missing"
        assert ast.get_docstring(ast.parse(init.read_text())), f"swarm/{sub}/__init__.py has no docstring"
