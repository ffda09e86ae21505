"""The ring's tok/s with one relayed hop ÷ the same ring with every hop direct.

Run as root (network namespaces): ``PYTHONPATH=. .venv/bin/python benchmarks/bench_nat_ring.py``.
One NAT lab (swarm.testing.netlab, symmetric NATs: ``--random-fully`` defeats hole punching)
with a `shard-swarm bootstrap` on the "internet", three public hosts and two homes. Through the
real CLIs (`id`, `invite create`, `bootstrap`, `join`, `generate`), two swarms of three peers
each, run in turn (direct, relayed, direct, relayed, ...):

- direct: public0, public1, public2: every hop a direct connection (the fast path's socket);
- relayed: public0, home0, home1: the home-to-home hop stays relayed through the bootstrap
  (the symmetric NATs leave no other way); the hops to and from public0 are direct.

Every peer offers 250 MB, so all three are needed (fp32 bundled SmolLM2-135M), and generates
with ``--draft none`` (one token per traversal: each token crosses the relayed hop once), 1
thread per process. ``relayed_vs_direct`` = median decode tok/s relayed ÷ direct (receipts'
``decode_tokens_per_s``); the receipts' hop paths are kept to show which hop was relayed. The
lab has no link delay: the ratio is the relay's own cost on this machine, not a WAN's.
Results go to benchmarks/results/nat_ring.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from swarm.testing.netlab import Lab, LabProcess, lab_unavailable_reason, nat_lab  # noqa: E402

PY = sys.executable
BOOT_PORT = 4001
PEER_PORT = 4101
MEMORY = "1090M"  # as tests/net/test_nat_join.py: --memory is the whole budget (planner/budget.py), 10 layers each
PROMPT_IDS = "1,9690,314,253,4226,1744,30,2"
SWARMS = {"direct": ("public0", "public1", "public2"), "relayed": ("public0", "home0", "home1")}


def _env(config: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["PYTHONUNBUFFERED"] = "1"
    env["SHARD_SWARM_CONFIG"] = str(config)
    return env


def _cli(*args: str) -> list[str]:
    return [PY, "-m", "swarm.cli.main", *args]


def _one_swarm(lab: Lab, tmp: Path, kind: str, *, generations: int, new_tokens: int) -> dict[str, Any]:
    relay = lab["relay"]
    boot_env = _env(tmp / "boot")
    boot_id = relay.run(*_cli("id"), env=boot_env, timeout=60).stdout.split()[0]
    boot_addr = f"/ip4/{relay.addr}/tcp/{BOOT_PORT}/p2p/{boot_id}"
    invite = tmp / f"invite-{kind}.json"
    relay.run(*_cli("invite", "create", "--swarm", f"bench-{kind}", "--bootstrap", boot_addr, "--context", "2048",
                    "-o", str(invite), "--force"), env=boot_env, timeout=60)  # fmt: skip
    procs: dict[str, LabProcess] = {}
    try:
        procs["boot"] = relay.spawn(_cli("bootstrap", "--listen", f"/ip4/0.0.0.0/tcp/{BOOT_PORT}",
                                         "--manifest", str(invite)), env=boot_env)  # fmt: skip
        procs["boot"].wait_for_line(boot_addr, timeout=60)
        t0 = time.monotonic()
        for role in SWARMS[kind]:
            procs[role] = lab[role].spawn(
                _cli("join", "--manifest", str(invite), "--no-mdns", "--memory", MEMORY, "--dtype", "fp32",
                     "--threads", "1", "--listen", f"/ip4/0.0.0.0/tcp/{PEER_PORT}"),
                env=_env(tmp / f"{kind}-{role}"),
            )  # fmt: skip
        client_env = _env(tmp / "client")
        while True:
            st = relay.run(*_cli("status", "--manifest", str(invite), "--json", "--timeout", "10"),
                           check=False, env=client_env, timeout=60)  # fmt: skip
            if st.returncode == 0 and json.loads(st.stdout).get("serving"):
                break
            if time.monotonic() - t0 > 420:
                raise RuntimeError(f"{kind}: no ring within 420 s")
            time.sleep(3)
        serving_s = time.monotonic() - t0
        receipts = []
        for _ in range(generations):
            gen = relay.run(*_cli("generate", "--manifest", str(invite), "--prompt-ids", PROMPT_IDS,
                                  "--max-new-tokens", str(new_tokens), "--draft", "none", "--json",
                                  "--timeout", "120"), env=client_env, timeout=300, check=False)  # fmt: skip
            if gen.returncode != 0:
                raise RuntimeError(f"{kind}: generate failed: {gen.stderr[-2000:]}")
            receipts.append(json.loads(gen.stdout))
        return {
            "serving_s": round(serving_s, 1),
            "decode_tokens_per_s": [r["decode_tokens_per_s"] for r in receipts],
            "traversal_ms": [r["traversal_ms"] for r in receipts],
            "hops": [h["path"] for h in receipts[-1]["hops"] if h["from"] != h["to"]],
            "output_sha256": receipts[-1]["output_sha256"],
        }
    finally:
        for p in procs.values():
            p.kill()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2, help="direct/relayed pairs, interleaved")
    ap.add_argument("--generations", type=int, default=3, help="generations per swarm")
    ap.add_argument("--new-tokens", type=int, default=48)
    args = ap.parse_args()
    reason = lab_unavailable_reason(need_nat=True)
    if reason:
        print(f"NAT lab unavailable: {reason}")
        return
    runs: dict[str, list[dict[str, Any]]] = {"direct": [], "relayed": []}
    with tempfile.TemporaryDirectory() as tmp, nat_lab(symmetric=True, public=3) as lab:
        for r in range(args.rounds):
            for kind in ("direct", "relayed"):
                run = _one_swarm(lab, Path(tmp) / f"{kind}{r}", kind, generations=args.generations,
                                 new_tokens=args.new_tokens)  # fmt: skip
                print(f"{kind} round {r}: {run}", flush=True)
                runs[kind].append(run)
    med = {k: statistics.median(t for run in v for t in run["decode_tokens_per_s"]) for k, v in runs.items()}
    trav = {k: statistics.median(t for run in v for t in run["traversal_ms"]) for k, v in runs.items()}
    out = {
        "relayed_vs_direct": round(med["relayed"] / med["direct"], 3),
        "decode_tokens_per_s": med,
        "traversal_ms": trav,
        "same_output": len({run["output_sha256"] for v in runs.values() for run in v}) == 1,
        "runs": runs,
        "settings": {"rounds": args.rounds, "generations": args.generations, "new_tokens": args.new_tokens,
                     "dtype": "fp32", "threads": 1, "draft": "none", "load_avg": os.getloadavg()},
    }  # fmt: skip
    path = ROOT / "benchmarks" / "results" / "nat_ring.json"
    path.write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps({k: out[k] for k in ("relayed_vs_direct", "decode_tokens_per_s", "traversal_ms", "same_output")}))


if __name__ == "__main__":
    main()
