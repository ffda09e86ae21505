"""``--draft`` on the commands: the invite names a draft, ``join --draft PATH`` is checked against it."""

from __future__ import annotations

from pathlib import Path

import pytest

from swarm.cli.draftflag import check_join_draft
from swarm.cli.main import main
from swarm.errors import UsageError, WeightsError
from swarm.manifest.manifest import read_manifest
from swarm.testing.checkpoints import TinySpec, write_checkpoint


@pytest.fixture(autouse=True)
def _config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHARD_SWARM_CONFIG", str(tmp_path / "cfg"))


def test_the_invite_names_the_draft_and_join_checks_it(tmp_path: Path) -> None:
    draft = write_checkpoint(tmp_path / "draft", TinySpec(n_layers=1), seed=1)
    out = tmp_path / "lab.invite"
    assert main(["invite", "create", "--swarm", "lab", "--draft", str(draft), "-o", str(out)]) == 0
    m = read_manifest(out)
    assert m.draft is not None and m.draft.name == "draft" and "model.safetensors" in m.draft.files
    assert check_join_draft(str(draft), m) == str(draft)
    again = tmp_path / "again.invite"
    assert main(["invite", "create", "--from", str(out), "-o", str(again)]) == 0
    assert read_manifest(again).draft == m.draft  # --from keeps it
    other = write_checkpoint(tmp_path / "other", TinySpec(n_layers=1), seed=2)
    with pytest.raises(WeightsError, match="model.safetensors .* the invite expects"):
        check_join_draft(str(other), m)
    assert check_join_draft("auto", m) == "auto:int4" and check_join_draft("ngram", m) == "ngram"
    with pytest.raises(UsageError, match="--draft 'bogus'"):
        check_join_draft("bogus", m)
