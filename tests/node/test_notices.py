"""What a node tells its user (node/notices.py): a notice goes to the UI once and to the log at a
level that does not print it twice; life events reach ``join --json`` as one dict each."""

from __future__ import annotations

import logging

import pytest

from swarm.node.notices import Hooks, Notices


def test_a_notice_with_a_ui_is_shown_once_and_only_debug_logged(caplog: pytest.LogCaptureFixture) -> None:
    shown: list[str] = []
    notices = Notices(Hooks(on_event=shown.append))
    with caplog.at_level(logging.DEBUG, logger="swarm.node"):
        notices.notice("epoch 3: serving")
        notices.event("a line for the UI only")
    assert shown == ["epoch 3: serving", "a line for the UI only"]
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [(logging.DEBUG, "epoch 3: serving")]


def test_without_a_ui_a_notice_is_logged_and_events_go_nowhere(caplog: pytest.LogCaptureFixture) -> None:
    notices = Notices(Hooks())
    with caplog.at_level(logging.INFO, logger="swarm.node"):
        notices.notice("peer B is lost")
        notices.event("dropped")
        notices.life("plan", epoch=3)
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [(logging.INFO, "peer B is lost")]


def test_life_events_carry_their_name_and_fields() -> None:
    life: list[dict[str, object]] = []
    notices = Notices(Hooks(on_life=life.append))
    notices.life("replan", ended_epoch=4, cause="lost B")
    notices.life("serving")
    assert life == [{"event": "replan", "ended_epoch": 4, "cause": "lost B"}, {"event": "serving"}]
