"""What the web console costs a node: CPU with the page open vs closed while a generation runs.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_console.py [--repeats 5] [--new-tokens 64] [--shots docs]

One local swarm of 4 node processes on the bundled SmolLM2-135M-Instruct (each offers 11 of its 30
layers, node 0 the head too: a ring of three stages, one node standing by), one endpoint with the
console in this process (a thread, a libp2p client of node 0, as the demo's), and Debian's
headless chromium. Each round runs the same greedy chat generation (POST /v1/chat/completions)
twice, in alternating order: once with the console open in the browser (its feed streaming, the
node answering a status every second), once with the browser on about:blank (no feed). For each
run it reads the CPU time (utime + stime, /proc) of every node process and of the endpoint's
thread, before and after. The browser's own CPU is not the node's and is not counted.

Written to benchmarks/results/console.json: the median CPU seconds per run of each, ``ratio`` =
open / closed (the issue's target: "at most a few per cent" more), ``paired_ratio_median`` (the
median of each round's open / closed), the same for the coordinator's process alone and for 10 s
of idling (no generation) with the page open vs closed. ``--shots DIR`` also saves the README's
screenshots there: the ring, a chat answer, and a re-plan after a stage is killed (SIGKILL).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import secrets
import signal
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from swarm.api.thread import ThreadedApi  # noqa: E402
from swarm.launch import start_local_swarm  # noqa: E402
from swarm.model.devices import resolve_device  # noqa: E402
from swarm.model.dtypes import resolve_dtype  # noqa: E402
from swarm.model.weights import open_checkpoint  # noqa: E402
from swarm.node.compute.drafting import draft_bytes  # noqa: E402
from swarm.node.settings import model_spec  # noqa: E402
from tests.api.browser import console_errors, open_browser, wait_for  # noqa: E402

OUT = Path(__file__).resolve().parent / "results" / "console.json"
MESSAGES = [{"role": "user", "content": "Explain how a binary search works, step by step."}]
TICKS = os.sysconf("SC_CLK_TCK")


def cpu_s(stat: Path) -> float:
    """utime + stime of a process or thread, in seconds (fields 14 and 15 of /proc/.../stat)."""
    fields = stat.read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def sample(pids: list[int], tid: int) -> dict[str, float]:
    out = {str(p): cpu_s(Path(f"/proc/{p}/stat")) for p in pids}
    out["api"] = cpu_s(Path(f"/proc/self/task/{tid}/stat"))
    return out


def memories(model_dir: Path, dtype: str, context: int) -> list[int]:
    """Node 0 can hold 11 layers and the head, the others 11 layers: a ring of three stages that
    node 0 coordinates, and after any other stage is lost the rest still hold the model."""
    args = open_checkpoint(model_dir).args
    dt = resolve_dtype(dtype, resolve_device("cpu"))
    spec = model_spec(args, dt, context)
    layers = int(1.02 * 11 * spec.bytes_per_layer)
    return [layers + spec.coordinator_bytes + draft_bytes("ngram", args, dt, context)] + [layers] * 3


def generate(url: str, token: str, model: str, n: int) -> float:
    t0 = time.perf_counter()
    r = httpx.post(url + "/v1/chat/completions", headers={"Authorization": f"Bearer {token}"}, timeout=300,
                   json={"model": model, "messages": MESSAGES, "max_tokens": n, "temperature": 0})  # fmt: skip
    r.raise_for_status()
    assert r.json()["usage"]["completion_tokens"] == n, r.json()["usage"]
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--dtype", default="fp32", choices=["bf16", "fp32"])
    ap.add_argument("--idle-s", type=float, default=10.0)
    ap.add_argument("--shots", type=Path, default=None)
    ap.add_argument("--shots-only", action="store_true", help="Only the screenshots (a few generations first): no CPU rounds, no results file.")
    args = ap.parse_args()
    from swarm.model.bundled import default_model_dir

    model_dir = default_model_dir()
    context = 1024
    token = secrets.token_hex(12)
    with start_local_swarm(4, model_dir, dtype=args.dtype, context_tokens=context, memory_bytes=memories(model_dir, args.dtype, context),
                           device_names=["alice's laptop", "bob's desktop", "carol's mini", "dave's spare"]) as swarm:  # fmt: skip
        api = ThreadedApi(swarm.addrs[0], swarm.secret, swarm.swarm_id, model_dir, token=token, context_tokens=context)
        url = api.start()
        assert api.native_id is not None
        auth = {"Authorization": f"Bearer {token}"}

        def state() -> dict[str, Any]:
            return dict(httpx.get(url + "/console/feed/state", headers=auth, timeout=60).json())

        st = wait_for("a serving ring of 3 stages", lambda: (s := state())["view"] and s["view"]["serving"] and
                      len([r for r in s["view"]["ring"] if r["block"]]) == 3 and s, 300, step=1.0)  # fmt: skip
        model = httpx.get(url + "/v1/models", headers=auth, timeout=30).json()["data"][0]["id"]
        coord = swarm.peer_ids.index(st["view"]["coordinator"])
        pids = [p.pid for p in swarm.procs]
        with open_browser() as browser:
            generate(url, token, model, 8)  # warm
            if args.shots_only:
                for _ in range(4):  # a short speed history for the picture
                    generate(url, token, model, 24)
                shots(browser, url, token, swarm, args.shots or Path("docs"))
                api.stop()
                return
            rows: list[dict[str, Any]] = []
            for i in range(args.repeats):
                for page in (("open", "closed") if i % 2 == 0 else ("closed", "open")):
                    if page == "open":
                        browser.get(url + "/#token=" + token)
                        wait_for("the console live", lambda: browser.find_element("id", "conn").text == "live", 30)
                        time.sleep(1.5)  # its first states have arrived
                    else:
                        browser.get("about:blank")
                        time.sleep(1.5)  # the feed has closed
                    before = sample(pids, api.native_id)
                    wall = generate(url, token, model, args.new_tokens)
                    after = sample(pids, api.native_id)
                    d = {k: after[k] - before[k] for k in before}
                    rows.append({"page": page, "round": i, "wall_s": wall, "cpu_s": sum(d.values()),
                                 "coordinator_cpu_s": d[str(pids[coord])], "api_thread_cpu_s": d["api"]})  # fmt: skip
            idle: dict[str, float] = {}
            for page in ("closed", "open"):
                browser.get(url + "/#token=" + token if page == "open" else "about:blank")
                time.sleep(2.0)
                before = sample(pids, api.native_id)
                time.sleep(args.idle_s)
                after = sample(pids, api.native_id)
                idle[page] = sum(after[k] - before[k] for k in before)
            if args.shots is not None:
                shots(browser, url, token, swarm, args.shots)
            errors = console_errors(browser)
        api.stop()

    def med(page: str, key: str) -> float:
        return float(statistics.median(r[key] for r in rows if r["page"] == page))

    def paired(key: str) -> float:
        ratios = []
        for i in range(args.repeats):
            o = next(r[key] for r in rows if r["round"] == i and r["page"] == "open")
            c = next(r[key] for r in rows if r["round"] == i and r["page"] == "closed")
            ratios.append(o / c if c > 0 else math.nan)
        return float(statistics.median(ratios))

    result = {
        "what": "node CPU (4 node processes + the endpoint's thread) per greedy generation, console open / closed",
        "model": model_dir.name, "dtype": args.dtype, "nodes": 4, "ring_stages": 3, "new_tokens": args.new_tokens,
        "repeats": args.repeats, "feed_interval_s": 1.0,
        "cpu_s_open_median": med("open", "cpu_s"), "cpu_s_closed_median": med("closed", "cpu_s"),
        "ratio": med("open", "cpu_s") / med("closed", "cpu_s"), "paired_ratio_median": paired("cpu_s"),
        "coordinator_ratio": med("open", "coordinator_cpu_s") / med("closed", "coordinator_cpu_s"),
        "wall_s_open_median": med("open", "wall_s"), "wall_s_closed_median": med("closed", "wall_s"),
        "idle_cpu_s": idle, "idle_s": args.idle_s, "browser_console_errors": errors, "runs": rows,
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count(), "load_avg": os.getloadavg()},
        "note": "CPU cores shared with other work at the time (load_avg): CPU times are noisy; "
                "the browser's own CPU is not counted (it is the viewer's, not the node's)",
    }  # fmt: skip
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(result, indent=2) + "\n")
    keys = ("cpu_s_open_median", "cpu_s_closed_median", "ratio", "paired_ratio_median", "coordinator_ratio")
    print(json.dumps({**{k: round(result[k], 4) for k in keys}, "idle_cpu_s": idle}))


def shots(browser: Any, url: str, token: str, swarm: Any, out: Path) -> None:
    """The README's pictures: a chat answer, the ring, and a re-plan after a stage is killed."""
    out.mkdir(parents=True, exist_ok=True)
    browser.get(url + "/chat#token=" + token)
    wait_for("the chat's model", lambda: browser.find_element("id", "model").text not in ("", "-"), 30)
    for field, value in (("temperature", "0"), ("max-tokens", "60")):
        el = browser.find_element("id", field)
        el.clear()
        el.send_keys(value)
    browser.find_element("id", "prompt").send_keys("What is a peer-to-peer network? Two sentences.")
    browser.find_element("id", "send").click()
    wait_for("the answer", lambda: browser.find_elements("css selector", ".msg.assistant[data-finish]"), 300)
    browser.save_screenshot(str(out / "console-chat.png"))
    browser.get(url + "/#token=" + token)
    wait_for("the ring", lambda: len(browser.find_elements("css selector", "#ring g.peer")) >= 3, 30)
    time.sleep(2.5)
    browser.set_window_size(1400, 1500)
    browser.save_screenshot(str(out / "console-ring.png"))
    st = httpx.get(url + "/console/feed/state", headers={"Authorization": f"Bearer {token}"}, timeout=60).json()
    coord = st["view"]["coordinator"]
    victim = next(r["peer"] for r in st["view"]["ring"] if r["block"] and r["peer"] not in (coord, swarm.peer_ids[0]))
    swarm.kill(swarm.peer_ids.index(victim), signal.SIGKILL)
    wait_for("the new ring serving", lambda: browser.find_elements("css selector", "#timeline li.event.replan") and
             "serving again" in browser.find_elements("css selector", "#timeline li.event.replan")[0].text, 300)  # fmt: skip
    time.sleep(1.5)
    browser.save_screenshot(str(out / "console-replan.png"))
    browser.set_window_size(1400, 1000)


if __name__ == "__main__":
    main()
