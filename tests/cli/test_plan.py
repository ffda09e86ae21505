"""``shard-swarm plan``: table and JSON output, --model and --layers, and its exit codes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from swarm.cli.main import main
from swarm.planner import GB

EXAMPLE = Path(__file__).resolve().parents[2] / "swarm" / "planner" / "examples" / "friends.json"

LLAMA_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "num_hidden_layers": 30,
    "vocab_size": 49152,
    "rms_norm_eps": 1e-5,
    "rope_theta": 100000.0,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": True,
    "hidden_act": "silu",
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def write(tmp_path: Path, obj: object, name: str = "peers.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(obj))
    return path


def run_json(capsys: pytest.CaptureFixture[str], argv: list[str]) -> dict:
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def test_json_output_has_the_promised_fields(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "--peers", str(EXAMPLE), "--layers", "80", "--layer-gb", "0.85"]
    out = run_json(capsys, [*argv, "--coordinator-gb", "2.1", "--json"])
    for key in (
        "coordinator",
        "ring",
        "blocks",
        "standbys",
        "predicted_traversal_ms",
        "predicted_tokens_per_s",
    ):
        assert key in out
    blocks = out["blocks"]
    assert [blocks[p] for p in out["ring"]][0][0] == 0
    assert sum(e - s for s, e in blocks.values()) == 80
    assert out["predicted_tokens_per_s"] == pytest.approx(1000 / out["predicted_traversal_ms"])
    assert out["predicted_tokens_per_s_with_g"]["4"] == pytest.approx(
        4 * out["predicted_tokens_per_s"]
    )
    peers = {p["id"]: p for p in json.loads(EXAMPLE.read_text())["peers"]}
    for pid, (s, e) in blocks.items():
        used = (e - s) * 0.85 + (2.1 if pid == out["coordinator"] else 0)
        assert used <= peers[pid]["memory_gb"] + 1e-9


def test_table_output(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--peers", str(EXAMPLE), "--layers", "20", "--layer-gb", "0.5"]) == 0
    out = capsys.readouterr().out
    assert "Plan (epoch 0)" in out and "predicted traversal" in out and "tokens/s" in out


def test_held_layers_and_disk_in_the_peers_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    peers = {"peers": [{"id": "amy", "memory_gb": 11, "ms_per_layer": 1.0},
                       {"id": "bob", "memory_gb": 11, "ms_per_layer": 1.0, "held": {"0": 10}, "held_head": True}],
             "rtt_ms": {"amy": {"bob": 5.0}}}  # fmt: skip
    argv = ["plan", "--peers", str(write(tmp_path, peers)), "--layers", "20", "--layer-gb", "1", "--coordinator-gb", "1",
            "--context", "0"]  # fmt: skip
    out = run_json(capsys, [*argv, "--json"])
    assert out["coordinator"] == "bob" and out["blocks"]["bob"] == [0, 10]
    assert out["bytes_to_move"] == {"bob": 0, "amy": 10 * GB}
    assert main(argv) == 0
    table = capsys.readouterr().out
    assert "to fetch" in table and "10.00 GB" in table  # (rich wraps the words on a narrow terminal)
    peers["peers"][0]["disk_gb"] = peers["peers"][1]["disk_gb"] = 1  # type: ignore[index]
    write(tmp_path, peers)
    assert main(argv) != 0
    assert "not enough disk" in capsys.readouterr().err


def test_model_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(LLAMA_CONFIG))
    peers = {
        "peers": [
            {"id": "a", "memory_gb": 0.6, "ms_per_layer": 0.6, "coordinator_ok": True},
            {"id": "b", "memory_gb": 0.6, "ms_per_layer": 0.6, "coordinator_ok": False},
        ],
        "rtt_ms": {"a": {"b": 1.0}},
    }
    out = run_json(
        capsys, ["plan", "--peers", str(write(tmp_path, peers)), "--model", str(model), "--json"]
    )
    assert out["n_layers"] == 30 and out["coordinator"] == "a"
    assert set(out["ring"]) == {
        "a",
        "b",
    }  # 30 x (6.6 MB weights + 8 sessions x 3.1 MB KV) + 57 MB head: no 0.6 GB peer holds it alone
    assert out["sessions"] == 8 and max(out["predicted_peak_bytes"].values()) <= 0.6 * GB


def test_memory_shortfall_exit_code_and_message(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    peers = {"peers": [{"id": "a", "memory_gb": 4, "ms_per_layer": 1.0}], "rtt_ms": {}}
    code = main(
        ["plan", "--peers", str(write(tmp_path, peers)), "--layers", "10", "--layer-gb", "1"]
    )
    assert code == 5
    assert "6.00 GB short" in capsys.readouterr().err


def test_unreachable_exit_code(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    peers = {
        "peers": [
            {"id": "a", "memory_gb": 6, "ms_per_layer": 1.0},
            {"id": "b", "memory_gb": 6, "ms_per_layer": 1.0},
        ],
        "rtt_ms": {"a": {"b": None}},
    }
    code = main(
        ["plan", "--peers", str(write(tmp_path, peers)), "--layers", "10", "--layer-gb", "1"]
    )
    assert code == 5
    assert "a <-> b" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        ("{not json", "not valid JSON"),
        (json.dumps({"peers": []}), "non-empty list"),
        (json.dumps({"peers": [{"id": "a", "ms_per_layer": 1}]}), "missing 'memory_gb'"),
        (json.dumps({"peers": [{"id": "a", "memory_gb": -1, "ms_per_layer": 1}]}), "memory_gb"),
        (
            json.dumps(
                {
                    "peers": [{"id": "a", "memory_gb": 1, "ms_per_layer": 1}],
                    "rtt_ms": {"a": {"zz": 1}},
                }
            ),
            "'zz' is not a listed peer",
        ),
        (
            json.dumps(
                {"peers": [{"id": "a", "memory_gb": 1, "ms_per_layer": 1, "coordinator_ok": "yes"}]}
            ),
            "coordinator_ok",
        ),
    ],
)
def test_bad_peers_files(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str, needle: str
) -> None:
    path = tmp_path / "peers.json"
    path.write_text(content)
    assert main(["plan", "--peers", str(path), "--layers", "2", "--layer-gb", "1"]) == 2
    err = capsys.readouterr().err
    assert needle in err and "peers.json" in err


def test_flag_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--peers", str(EXAMPLE)]) == 2
    assert "--model" in capsys.readouterr().err
    assert (
        main(["plan", "--peers", str(tmp_path / "nope.json"), "--layers", "2", "--layer-gb", "1"])
        == 2
    )
    assert "not found" in capsys.readouterr().err
    assert main(["plan", "--peers", str(EXAMPLE), "--model", str(tmp_path)]) == 3  # no config.json


def test_peers_file_round_trip() -> None:
    from swarm.planner.peersfile import dump_peers_file, parse_peers_file

    pf = parse_peers_file(json.loads(EXAMPLE.read_text()))
    again = parse_peers_file(dump_peers_file(pf.peers, pf.rtt_ms))
    assert again.peers == tuple(sorted(pf.peers, key=lambda p: p.id))
    assert again.rtt_ms == pf.rtt_ms
    assert pf.peers[0].memory_bytes == 22 * GB


LLAMA_70B = {  # Llama-3.3-70B-Instruct's config.json, as published (config only, no weights)
    **LLAMA_CONFIG,
    "hidden_size": 8192, "intermediate_size": 28672, "num_attention_heads": 64, "num_key_value_heads": 8,
    "num_hidden_layers": 80, "vocab_size": 128256, "rope_theta": 500000.0, "max_position_embeddings": 131072,
    "tie_word_embeddings": False, "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009],
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
}  # fmt: skip
THREE_24GB = {
    "peers": [{"id": f"gpu-{c}", "memory_gb": 22, "ms_per_layer": 0.8} for c in "abc"],
    "rtt_ms": {"gpu-a": {"gpu-b": 20.0, "gpu-c": 30.0}, "gpu-b": {"gpu-c": 25.0}},
}


def test_llama_70b_on_three_24gb_cards_is_refused_in_bf16_and_fits_in_int4(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "m").mkdir()
    write(tmp_path / "m", LLAMA_70B, "config.json")
    argv = ["plan", "--peers", str(write(tmp_path, THREE_24GB)), "--model", str(tmp_path / "m")]
    assert main(argv) == 5
    err = capsys.readouterr().err
    assert "needs 151.84 GB" in err and "3 peers offer 66.00 GB" in err, err  # 8 sessions' KV at 4096 tokens
    assert "does not fit in bf16 across these peers; fits with --quant int4" in err, err
    assert main([*argv, "--quant", "int8"]) == 5
    assert "fits with --quant int4" in capsys.readouterr().err
    out = run_json(capsys, [*argv, "--quant", "int4", "--json"])
    assert out["quant"] == "int4" and sum(e - s for s, e in out["blocks"].values()) == 80
    assert out["layer_bytes"] < 0.32 * 2 * 855_654_400  # int4 (groups of 32) weights: 0.3125 of bf16
    assert out["kv_bytes_per_layer"] == 2 * 8 * 128 * 2 * 4096
    for pid, (s, e) in out["blocks"].items():
        used = (e - s) * (out["layer_bytes"] + out["sessions"] * out["kv_bytes_per_layer"])
        used += 128256 * 8192 * 2 * 2 + 8192 * 2 if pid == out["coordinator"] else 0
        assert used < out["predicted_peak_bytes"][pid] <= 22 * GB, pid  # + one prefill chunk's activations
    assert main([*argv, "--quant", "int4"]) == 0
    table = capsys.readouterr().out
    assert "bytes per layer" in table and "[0, " in table


def test_bad_quant_flags_are_usage_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    peers = str(write(tmp_path, THREE_24GB))
    assert main(["plan", "--peers", peers, "--layers", "8", "--layer-gb", "1", "--quant", "int3"]) == 2
    assert "choose one of none, int8, int4" in capsys.readouterr().err
    assert main(["plan", "--peers", peers, "--layers", "8", "--layer-gb", "1", "--quant", "int4"]) == 2
    assert "--quant needs --model" in capsys.readouterr().err


DEEPSEEK_V3 = json.loads((Path(__file__).parent / "deepseek_v3_config.json").read_text())


def test_deepseek_v3_is_budgeted_layer_by_layer(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Three dense layers of 0.37 GB, then 58 MoE layers of 7.2 GB (int4): a peer that holds the
    coordinator part, the dense layers and two MoE layers, and seven that hold eight MoE layers
    each, fit the model only when each layer is budgeted at its own size."""
    (tmp_path / "m").mkdir()
    write(tmp_path / "m", DEEPSEEK_V3, "config.json")
    peers = {"peers": [{"id": "home", "memory_gb": 20, "ms_per_layer": 1.0}]
             + [{"id": f"gpu-{i}", "memory_gb": 58.1, "ms_per_layer": 1.0} for i in range(7)],
             "rtt_ms": {"home": {f"gpu-{i}": 10.0 for i in range(7)}}}  # fmt: skip
    peers["rtt_ms"] |= {f"gpu-{i}": {f"gpu-{j}": 10.0 for j in range(7) if j != i} for i in range(7)}
    argv = ["plan", "--peers", str(write(tmp_path, peers)), "--model", str(tmp_path / "m"), "--quant", "int4"]
    out = run_json(capsys, [*argv, "--json"])
    each = out["layer_bytes_each"]
    assert len(each) == 61 and each[0] == each[2] < 0.06 * each[3] and len(set(each[3:])) == 1
    assert out["layer_bytes"] == each[3]
    for pid, (s, e) in out["blocks"].items():
        used = sum(each[s:e]) + (e - s) * out["sessions"] * out["kv_bytes_per_layer"]
        if pid == out["coordinator"]:
            used += 129280 * 7168 * 2 * 2 + 7168 * 2  # embedding and head, bf16
        assert used < out["predicted_peak_bytes"][pid] <= (20 if pid == "home" else 58.1) * GB, pid
    assert out["coordinator"] == "home" and out["blocks"]["home"] == [0, 5]
    assert main(argv) == 0
    table = " ".join(capsys.readouterr().out.replace("│", " ").split())
    assert "0-2: 0.365 GB; 3-60: 7.198 GB" in table, table
