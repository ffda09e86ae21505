"""``--draft`` as the commands take it: ``join`` (what this peer drafts with when it coordinates),
``generate``/``demo`` (per request) and ``invite create`` (the swarm's draft model, hashed)."""

from __future__ import annotations

from pathlib import Path

from swarm.cli import ui
from swarm.errors import UsageError
from swarm.manifest.schema import Manifest, ModelSpec

JOIN_HELP = (
    "What this peer drafts with when it coordinates: ngram (prompt lookup, the default), none, self "
    "(layer-skipped model), int8 or int4 (a compact copy of the model), a draft checkpoint PATH (the "
    "invite's draft, checked against its hashes), or auto[:MODEL] (per request, by measured cost; "
    "MODEL defaults to int4)."
)
REQUEST_HELP = "Drafter for this request: none, ngram, model (the coordinator's draft model) or auto (default: the coordinator's)."


def check_join_draft(text: str, manifest: Manifest) -> str:
    """The ``join --draft`` value, checked: a usage error names a bad one; a checkpoint must match
    the invite's ``draft`` when it names one (hashes, like ``--model``)."""
    from swarm.model.draftload import parse_draft

    spec = parse_draft(text)
    if spec.path is not None:
        if manifest.draft is not None:
            from swarm.manifest.modelcheck import check_model

            with ui.progress(f"checking draft {spec.path.name}") as report:
                check_model(manifest.draft, spec.path, report)
        else:
            ui.notice(f"the invite names no draft model: {spec.path} is this peer's own choice")
    return str(spec)


def describe_draft(path: Path | None) -> ModelSpec | None:
    """``invite create --draft PATH``: the draft's name and hashes for the invite."""
    if path is None:
        return None
    if not path.exists():
        raise UsageError(f"--draft {path}: no such checkpoint")
    from swarm.manifest.modelcheck import describe_model

    with ui.progress(f"hashing draft {path.name}") as report:
        return describe_model(path, progress=report)
