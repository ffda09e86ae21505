"""Fetch throughput from a model's origin, side by side with curl of the same byte ranges.

    .venv/bin/python benchmarks/bench_fetch.py [--gb 2.0] [--rounds 5] [--layers 24]

Writes a sharded safetensors checkpoint of ``--gb`` GB (bf16, random bytes: the fetch does not
care what the numbers are), its model manifest, and serves it with Debian's nginx on loopback
(swarm.testing.origin_server). Each round, interleaved so background load hits both alike:

  (a) ours  ``fetch_block`` of a third of the layers into an empty cache: ranged GETs of the
            block's merged runs, written in place into sparse files, every tensor's sha256 checked
  (b) curl  one ``curl -r a-b -o FILE`` per run of the same ranges (headers included), written
            to a file on the same disk, nothing checked

Reports medians of MB/s and the ratio a/b (the issue's target: >= 0.8), and the bytes fetched
÷ the block's bytes. Writes benchmarks/results/fetch.json.

    .venv/bin/python benchmarks/bench_fetch.py --members [--gb 0.5] [--rounds 7]

From another member instead (issue 25): benchmarks/bench_fetch_members.py, which see.
Writes benchmarks/results/fetch_members.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from swarm.fetch.cache import ModelCache, _runs  # noqa: E402
from swarm.fetch.origin import Origin  # noqa: E402
from swarm.fetch.slices import fetch_block  # noqa: E402
from swarm.manifest.model_manifest import manifest_of_path  # noqa: E402
from swarm.testing.origin_server import have_nginx, origin_server  # noqa: E402


def write_model(out: Path, gb: float, layers: int) -> None:
    """config.json and ``shards`` files of ``layers`` layers of 7 bf16 matrices, ~gb GB in all."""
    dim = 2048
    per_layer = gb * 1e9 / layers
    inter = max(256, int((per_layer / 2 - 4 * dim * dim) / (3 * dim)) // 256 * 256)
    shards = 4
    out.mkdir(parents=True)
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": dim,
           "intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads": 16,
           "num_key_value_heads": 16, "vocab_size": 32000, "rms_norm_eps": 1e-5}  # fmt: skip
    (out / "config.json").write_text(json.dumps(cfg))
    weight_map: dict[str, str] = {}
    per_shard = -(-layers // shards)
    for s in range(shards):
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        tensors: dict[str, torch.Tensor] = {}
        for i in range(s * per_shard, min(layers, (s + 1) * per_shard)):
            p = f"model.layers.{i}."
            for name, shape in (("self_attn.q_proj", (dim, dim)), ("self_attn.k_proj", (dim, dim)),
                                ("self_attn.v_proj", (dim, dim)), ("self_attn.o_proj", (dim, dim)),
                                ("mlp.gate_proj", (inter, dim)), ("mlp.up_proj", (inter, dim)),
                                ("mlp.down_proj", (dim, inter))):  # fmt: skip
                tensors[p + name + ".weight"] = torch.empty(shape, dtype=torch.bfloat16).uniform_(-0.05, 0.05)
            tensors[p + "input_layernorm.weight"] = torch.ones(dim, dtype=torch.bfloat16)
        if s == 0:
            tensors["model.embed_tokens.weight"] = torch.empty(32000, dim, dtype=torch.bfloat16).uniform_()
        save_file(tensors, str(out / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in tensors})
        del tensors
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


DEFAULT_OUT = ROOT / "benchmarks" / "results" / "fetch.json"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gb", type=float, default=2.0)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--members", action="store_true", help="from another member: bench_fetch_members.py")
    a, rest = ap.parse_known_args()
    if a.members:  # benchmarks/bench_fetch_members.py, the member in its own process
        import bench_fetch_members

        bench_fetch_members.main([x for x in sys.argv[1:] if x != "--members"])
        return
    if rest:
        ap.error(f"unrecognized arguments: {' '.join(rest)}")
    if not have_nginx() or shutil.which("curl") is None:
        sys.exit("needs nginx (apt-get install nginx-light) and curl")
    work = Path(tempfile.mkdtemp(prefix="bench-fetch-"))
    try:
        model = work / "model"
        t0 = time.perf_counter()
        write_model(model, a.gb, a.layers)
        t1 = time.perf_counter()
        m = manifest_of_path(model)
        t2 = time.perf_counter()
        size = sum(f.size for f in m.weight_files())
        print(f"wrote {size / 1e9:.2f} GB in {t1 - t0:.1f} s; manifest of {len(m.tensors)} tensors in {t2 - t1:.1f} s",
              file=sys.stderr)  # fmt: skip
        lo, hi = a.layers // 3, 2 * a.layers // 3
        block = m.block_bytes(lo, hi)
        with origin_server(model, work / "nginx") as srv:
            ours, curl, ratios_bytes = [], [], []
            for r in range(a.rounds):
                cache_root = work / f"cache{r}"
                t = time.perf_counter()
                rep = fetch_block(ModelCache(cache_root, m), lo, hi, [Origin(srv.url)])
                dt = time.perf_counter() - t
                ours.append(rep.fetched / dt / 1e6)
                ratios_bytes.append(rep.fetched / block)
                shutil.rmtree(cache_root)
                ranges = [(f.path, 0, f.header_end) for f in m.weight_files()]
                todo = sorted(m.block(lo, hi), key=lambda x: (x.file, x.start))
                ranges += [(run[0].file, run[0].start, run[-1].end) for run in _runs(todo, {})]
                dest = work / "curl.out"
                t = time.perf_counter()
                for path, s, e in ranges:
                    subprocess.run(["curl", "-s", "--fail", "-r", f"{s}-{e - 1}", "-o", str(dest), f"{srv.url}/{path}"],
                                   check=True)  # fmt: skip
                dt = time.perf_counter() - t
                curl.append(sum(e - s for _, s, e in ranges) / dt / 1e6)
                dest.unlink()
                print(f"round {r}: ours {ours[-1]:.0f} MB/s, curl {curl[-1]:.0f} MB/s", file=sys.stderr)
        result = {
            "machine_note": "2 shared CPU cores, ~6 other engineers running tests at the same time: noisy",
            "command": "benchmarks/bench_fetch.py " + " ".join(sys.argv[1:]),
            "machine": platform.machine(),
            "model_bytes": size,
            "block_layers": [lo, hi],
            "block_bytes": block,
            "rounds": a.rounds,
            "ours_mb_s": [round(x, 1) for x in ours],
            "curl_mb_s": [round(x, 1) for x in curl],
            "ours_mb_s_median": round(statistics.median(ours), 1),
            "curl_mb_s_median": round(statistics.median(curl), 1),
            "ratio_ours_over_curl": round(statistics.median(ours) / statistics.median(curl), 3),
            "ratio_per_round": [round(x / y, 3) for x, y in zip(ours, curl, strict=True)],
            "ratio_per_round_median": round(statistics.median(x / y for x, y in zip(ours, curl, strict=True)), 3),
            "target_ratio": 0.8,
            "fetched_over_block_bytes": round(statistics.median(ratios_bytes), 5),
            "what": "ours: ranged GETs written in place into sparse cache files, each tensor's sha256 checked; "
                    "curl: the same ranges to a file, nothing checked; nginx on loopback",  # fmt: skip
        }
        a.out.write_text(json.dumps(result, indent=2) + "\n")
        print(json.dumps(result, indent=2))
    finally:
        shutil.rmtree(work, ignore_errors=True)
        os.sync()


if __name__ == "__main__":
    main()
