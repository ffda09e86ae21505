"""The web console in a real headless browser (chromium via selenium) on a live 3-node swarm.

Three ``python -m swarm.node`` processes on loopback hold a 4-layer checkpoint, each offering two
layers' memory (so a ring needs two of them and the third stands by); the endpoint with the
console runs in this process, a libp2p client of node 0 (as the demo's). One node advertises a
device name made of HTML and script. In order: the page loads with no console error and draws
the members, the ring and blocks covering every layer; the hostile name is text; a chat message
streams the API's own greedy answer, and the stop button stops a long one; the receipt viewer
draws a ``generate --receipt`` file's ring and output hash, and refuses a file that is none; a ring stage killed
with SIGKILL shows up as a re-plan on the timeline and a new ring without it.

``SHARD_SWARM_SCREENSHOTS=DIR`` saves what the browser shows at each step there (PNG).
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from swarm.api.thread import ThreadedApi
from swarm.launch import LocalSwarm, offer_for, start_local_swarm
from tests.api.browser import console_errors, open_browser, wait_for
from tests.api.conftest import MODEL_NAME

pytestmark = pytest.mark.slow

HOSTILE = '<img src=x onerror="window.__pwned=1"><script>window.__pwned=2</script>'
TOKEN = "console-" + secrets.token_hex(8)
SHOTS = os.environ.get("SHARD_SWARM_SCREENSHOTS")


def shot(driver: Any, name: str) -> None:
    if SHOTS:
        Path(SHOTS).mkdir(parents=True, exist_ok=True)
        driver.save_screenshot(str(Path(SHOTS) / f"{name}.png"))


@pytest.fixture(scope="module")
def live(tiny_chat_dir: Path) -> Iterator[tuple[LocalSwarm, str]]:
    two_layers = offer_for(tiny_chat_dir, 2, context_tokens=1536)  # 4 layers: any two peers hold them
    with start_local_swarm(3, tiny_chat_dir, dtype="fp32", context_tokens=1536, memory_bytes=[two_layers] * 3,
                           device_names=["", HOSTILE, ""]) as swarm:  # fmt: skip
        api = ThreadedApi(swarm.addrs[0], swarm.secret, swarm.swarm_id, tiny_chat_dir, token=TOKEN, context_tokens=1536)
        url = api.start()
        try:
            yield swarm, url
        finally:
            api.stop()


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with open_browser() as driver:
        yield driver


def state(url: str) -> dict[str, Any]:
    r = httpx.get(url + "/console/feed/state", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30)
    r.raise_for_status()
    return dict(r.json())


def serving(url: str, n_members: int) -> dict[str, Any]:
    def ready() -> dict[str, Any] | None:
        st = state(url)
        ok = st["view"] and st["view"]["serving"] and st["members"] == n_members and not st["stale"]
        return st if ok else None

    return dict(wait_for(f"a serving ring with {n_members} members", ready, timeout=120, step=0.5))


def js(driver: Any, script: str, *args: Any) -> Any:
    return driver.execute_script(script, *args)


def test_console_shows_the_ring_and_keeps_member_strings_as_text(browser: Any, live: tuple[LocalSwarm, str]) -> None:
    swarm, url = live
    st = serving(url, 3)
    browser.get(url + "/#token=" + TOKEN)
    ring = [r["peer"] for r in st["view"]["ring"]]
    wait_for("the ring drawn", lambda: len(browser.find_elements("css selector", "#ring g.peer")) == len(ring), 30)
    rows = wait_for("3 peers listed", lambda: (r := browser.find_elements("css selector", "#peers tbody tr")) and
                    len(r) == 3 and r, 30)  # fmt: skip
    assert {r.get_attribute("data-peer") for r in rows} == set(swarm.peer_ids)
    # the blocks drawn over the model's layers cover each of the 4 layers exactly once
    blocks = [(int(b.get_attribute("data-start")), int(b.get_attribute("data-end")))
              for b in browser.find_elements("css selector", "#layers .block")]  # fmt: skip
    covered = sorted(i for s, e in blocks for i in range(s, e))
    assert covered == list(range(4)), blocks
    assert browser.find_element("css selector", "#conn").text == "live"
    assert "coordinator" in browser.find_element("css selector", f'#ring g.peer[data-peer="{st["view"]["coordinator"]}"]').get_attribute("data-role")
    # the hostile device name: shown as its own characters, never parsed
    devices = [d.get_attribute("textContent") for d in browser.find_elements("css selector", "#peers td.device")]
    assert f"cpu:{HOSTILE}" in devices, devices
    assert js(browser, "return window.__pwned === undefined")
    assert not browser.find_elements("css selector", "#peers img, #ring img, script:not([src])")
    assert console_errors(browser) == []
    shot(browser, "console-ring")


def test_the_feed_needs_the_token(live: tuple[LocalSwarm, str]) -> None:
    _, url = live
    assert httpx.get(url + "/console/feed/state", timeout=10).status_code == 401
    assert httpx.get(url + "/console/feed", headers={"Authorization": "Bearer wrong"}, timeout=10).status_code == 401
    page = httpx.get(url + "/", timeout=10)
    assert page.status_code == 200 and TOKEN not in page.text and "Content-Security-Policy" in page.headers


def test_chat_streams_the_apis_own_greedy_answer_and_stops(browser: Any, live: tuple[LocalSwarm, str]) -> None:
    _, url = live
    serving(url, 3)
    prompt = "Tell me about the swarm"
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": prompt}], "max_tokens": 24, "temperature": 0}
    r = httpx.post(url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=120)
    assert r.status_code == 200, r.text
    want = r.json()["choices"][0]["message"]["content"]

    browser.get(url + "/chat#token=" + TOKEN)
    wait_for("the model named", lambda: browser.find_element("id", "model").text == MODEL_NAME, 30)
    for field, value in (("temperature", "0"), ("max-tokens", "24")):
        el = browser.find_element("id", field)
        el.clear()
        el.send_keys(value)
    # count the answer's updates as they land: a streamed answer grows in several steps
    js(browser, """window.__updates = 0; new MutationObserver(() => { window.__updates += 1; })
        .observe(document.getElementById('messages'), {subtree: true, childList: true, characterData: true});""")
    browser.find_element("id", "prompt").send_keys(prompt)
    browser.find_element("id", "send").click()
    done = wait_for("the answer finished", lambda: browser.find_elements("css selector", ".msg.assistant[data-finish]"), 120)
    got = done[-1].find_element("css selector", ".content").get_attribute("textContent")
    assert got == want
    assert done[-1].get_attribute("data-finish") == "length"
    assert js(browser, "return window.__updates") >= 4  # bubbles, then the answer piece by piece, then its stats
    stats = done[-1].find_element("css selector", ".stats")
    assert float(stats.get_attribute("data-tps")) > 0 and float(stats.get_attribute("data-apt")) > 0
    assert "tok/s on the swarm" in stats.text and "tokens per traversal" in stats.text
    shot(browser, "console-chat")

    # a long answer, stopped: the page says so and sends nothing more
    el = browser.find_element("id", "max-tokens")
    el.clear()
    el.send_keys("1400")
    browser.find_element("id", "prompt").send_keys("Go on, at length")
    browser.find_element("id", "send").click()
    wait_for("the long answer streaming", lambda: len(browser.find_elements("css selector", ".msg.assistant")) == 2 and
             len(browser.find_elements("css selector", ".msg.assistant")[-1].find_element("css selector", ".content")
                 .get_attribute("textContent")) >= 10, 60)  # fmt: skip
    browser.find_element("id", "stop").click()
    last = wait_for("the stop", lambda: browser.find_elements("css selector", ".msg.assistant[data-finish]")[1:], 30)[-1]
    assert last.get_attribute("data-finish") == "stopped"
    assert len(last.find_element("css selector", ".content").get_attribute("textContent")) < 1400
    assert console_errors(browser) == []


def test_receipt_viewer_draws_a_runs_ring_and_its_output_hash(browser: Any, live: tuple[LocalSwarm, str],
                                                               tmp_path: Path) -> None:  # fmt: skip
    swarm, url = live
    serving(url, 3)
    receipt = tmp_path / "receipt.json"
    cmd = [sys.executable, "-m", "swarm.cli.main", "generate", "--manifest", str(swarm.workdir / "invite.json"),
           "--peer", swarm.addrs[0], "--prompt", "Hello", "--max-new-tokens", "12", "--receipt", str(receipt)]  # fmt: skip
    subprocess.run(cmd, check=True, capture_output=True, timeout=120)
    rc = json.loads(receipt.read_text())
    browser.get(url + "/#token=" + TOKEN)
    browser.find_element("id", "receipt-file").send_keys(str(receipt))
    sha = wait_for("the receipt's output hash", lambda: browser.find_element("css selector", '#receipt-summary [data-k="sha"] b').text, 10)
    assert sha == rc["output_sha256"]
    drawn = {g.get_attribute("data-peer") for g in browser.find_elements("css selector", "#receipt-ring g.peer")}
    assert drawn == {rc["coordinator"], *rc["ring"]}
    layers = sorted(i for b in browser.find_elements("css selector", "#receipt-layers .block")
                    for i in range(int(b.get_attribute("data-start")), int(b.get_attribute("data-end"))))  # fmt: skip
    assert layers == list(range(4))
    # not a receipt: a clear error naming the file, and the last picture is taken away
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"peers": "<b>no</b>"}))
    browser.find_element("id", "receipt-file").send_keys(str(bad))
    err = wait_for("the error", lambda: browser.find_element("id", "receipt-error").text, 10)
    assert err.startswith("bad.json: not a shard-swarm receipt")
    assert not browser.find_element("id", "receipt").is_displayed()
    assert console_errors(browser) == []


def test_a_killed_stage_shows_a_replan_and_a_new_ring(browser: Any, live: tuple[LocalSwarm, str]) -> None:
    swarm, url = live
    st = serving(url, 3)
    browser.get(url + "/#token=" + TOKEN)
    wait_for("the ring drawn", lambda: browser.find_elements("css selector", "#ring g.peer"), 30)
    plan_ring = [r["peer"] for r in st["view"]["ring"] if r["block"]]
    coord = st["view"]["coordinator"]
    # a stage that is neither node 0 (the endpoint's peer) nor, when possible, the coordinator
    victims = [p for p in plan_ring if p != swarm.peer_ids[0]]
    victim = next((p for p in victims if p != coord), victims[0])
    epoch = st["view"]["epoch"]
    t0 = time.monotonic()
    swarm.kill(swarm.peer_ids.index(victim), signal.SIGKILL)

    def replanned() -> bool:
        items = browser.find_elements("css selector", "#timeline li.event.replan")
        rings = browser.find_elements("css selector", "#timeline li.event.ring")
        drawn = {g.get_attribute("data-peer") for g in browser.find_elements("css selector", "#ring g.peer")}
        epoch_text = browser.find_element("id", "epoch").text
        return bool(items and len(rings) >= 1 and victim not in drawn and drawn and
                    f"epoch {epoch} " not in epoch_text + " " and "serving" in epoch_text and "not" not in epoch_text)  # fmt: skip

    wait_for("a re-plan on the timeline and a ring without the killed stage", replanned, 60)
    took = time.monotonic() - t0
    replan = browser.find_elements("css selector", "#timeline li.event.replan")[0].text
    assert f"epoch {epoch} ended" in replan, replan
    layers = sorted(i for b in browser.find_elements("css selector", "#layers .block")
                    for i in range(int(b.get_attribute("data-start")), int(b.get_attribute("data-end"))))  # fmt: skip
    assert layers == list(range(4))
    wait_for("the re-plan's pause", lambda: "planned after" in (t := browser.find_elements("css selector", "#timeline li.event.replan")[0].text) and
             "serving again after" in t, 30)  # fmt: skip
    shot(browser, "console-replan")
    print(json.dumps({"replan_shown_after_s": round(took, 2)}))
    assert console_errors(browser) == []
