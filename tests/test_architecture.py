"""ARCHITECTURE.md is a map a newcomer trusts: every file, folder and name it gives exists."""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOC = (REPO / "ARCHITECTURE.md").read_text()


def _defined(path: Path) -> set[str]:
    """Top-level names of a module, and Class.member for its classes' members."""
    names: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ClassDef):
            names.add(node.name)
            for sub in node.body:
                if isinstance(sub, ast.FunctionDef | ast.AsyncFunctionDef):
                    names.add(f"{node.name}.{sub.name}")
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return names


def test_every_path_named_exists() -> None:
    paths = [p for p in re.findall(r"`([^`\s]+)`", DOC) if "/" in p or p.endswith(".py")]
    assert len(paths) > 30, "the map names too few files to be checked"
    for p in paths:
        if p.endswith(".py") and "/" not in p:
            assert list((REPO / "swarm").rglob(p)), f"ARCHITECTURE.md names {p}, which is nowhere under swarm/"
        elif "*" in p:
            assert list(REPO.glob(p)), f"ARCHITECTURE.md names {p}, which matches nothing"
        else:
            assert (REPO / p).exists() or (REPO / "swarm" / p).exists(), f"ARCHITECTURE.md names {p}, which does not exist"


def test_every_name_in_the_concept_table_is_defined_in_its_file() -> None:
    rows = [line.split("|")[1:-1] for line in DOC.splitlines() if line.startswith("| ") and ".py`" in line]
    assert len(rows) >= 25
    for _concept, files, names in rows:
        defined: set[str] = set()
        for f in re.findall(r"`([^`]+\.py)`", files):
            defined |= _defined(REPO / f)
        for name in re.findall(r"`([^`]+)`", names):
            assert name in defined, f"ARCHITECTURE.md: {name} is not defined in {files.strip()}"


def test_every_class_in_the_planes_drawing_exists() -> None:
    section = DOC.split("## node/")[1].split("## One home")[0]
    drawing = section[section.index("    generation/   GenService"):].split("\n\n")[0]
    classes = set(re.findall(r"\b[A-Z][A-Za-z]+\b", drawing))
    defined: set[str] = set()
    for path in (REPO / "swarm" / "node").rglob("*.py"):
        defined |= _defined(path)
    assert {"Coordinator", "StageWorker", "MembershipService", "Leader"} <= classes
    for name in classes:
        assert name in defined, f"ARCHITECTURE.md's drawing names {name}, which no module of node/ defines"
