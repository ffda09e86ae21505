"""`shard-swarm run`: JSON result, streaming, errors and exit codes."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

from swarm.cli.main import main
from swarm.cli.run import output_sha256, parse_prompt_ids
from swarm.errors import UsageError
from swarm.model.quant_dynamic import fbgemm_available
from swarm.testing.checkpoints import TinySpec, write_checkpoint


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("run"), TinySpec(family="qwen2", n_layers=4),
                            seed=7)


def run_json(capsys: pytest.CaptureFixture[str], argv: list[str]) -> dict[str, object]:
    code = main(["run", *argv, "--json", "--threads", "1"])
    out = capsys.readouterr().out
    assert code == 0, out
    return json.loads(out)  # type: ignore[no-any-return]


def test_output_sha256_and_prompt_ids() -> None:
    assert output_sha256([1, 22, 333]) == hashlib.sha256(b"1,22,333").hexdigest()
    assert parse_prompt_ids("1, 2,3") == [1, 2, 3]
    for bad in ("", "1,x"):
        with pytest.raises(UsageError):
            parse_prompt_ids(bad)


def test_run_json_on_a_tiny_checkpoint(tiny: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = ["--model", str(tiny), "--prompt-ids", "3,14,15,92,65", "--max-new-tokens", "12",
            "--dtype", "fp32"]
    one = run_json(capsys, [*base, "--draft", "none"])
    ids = one["output_token_ids"]
    assert isinstance(ids, list) and len(ids) == 12
    assert one["prompt_token_ids"] == [3, 14, 15, 92, 65]
    assert one["output_sha256"] == output_sha256(ids)
    assert one["stages"] == 1 and one["blocks"] == [[0, 4]]
    assert one["model"]["config_sha256"] == hashlib.sha256((tiny / "config.json").read_bytes()).hexdigest()  # type: ignore[index]
    assert "accepted_per_round" not in one and one["output_text"] is None
    split = run_json(capsys, [*base, "--stages", "3", "--draft", "ngram"])
    assert split["output_token_ids"] == ids and split["blocks"] == [[0, 2], [2, 3], [3, 4]]
    assert "accepted_per_round" in split
    drafted = run_json(capsys, [*base, "--stages", "2", "--draft", str(tiny), "--draft-k", "3"])
    assert drafted["output_token_ids"] == ids and drafted["acceptance_rate"] == 1.0
    ringlike = run_json(capsys, base)  # the defaults are a ring's: ngram drafting, depth 2
    assert ringlike["draft"] == "ngram" and ringlike["depth"] == 2 and ringlike["output_token_ids"] == ids
    receipt = tmp_path / "receipt.json"  # a ring's receipt, as generate --json writes it
    receipt.write_text(json.dumps({"prompt_token_ids": [3, 14, 15, 92, 65], "output_token_ids": ids[:9],
                                   "sampling": {"temperature": 0.0, "top_k": 0, "top_p": 1.0, "seed": 0},
                                   "draft": {"name": "ngram", "max_depth": 3, "draft_k": None}}))  # fmt: skip
    replayed = run_json(capsys, ["--model", str(tiny), "--dtype", "fp32", "--receipt", str(receipt)])
    assert replayed["matches_receipt"] is True and replayed["depth"] == 3 and replayed["output_token_ids"] == ids[:9]
    s1 = run_json(capsys, [*base, "--temperature", "0.8", "--top-p", "0.9", "--seed", "4"])
    s2 = run_json(capsys, [*base, "--temperature", "0.8", "--top-p", "0.9", "--seed", "4"])
    assert s1["output_token_ids"] == s2["output_token_ids"]


def test_a_receipt_from_bf16_compiled_stages_says_so_when_its_replay_differs(
    tiny: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A ring's receipt whose stages ran compiled in bf16 carries a replay note (report.replay_note):
    an eager replay that differs says why instead of pointing at a bug; the JSON carries the note."""
    from swarm.node.generation.report import replay_note

    ran = {"spans": [64], "eager_from": 64, "eager": None, "dtype": "bf16"}
    assert replay_note({"A" * 52: {**ran, "dtype": "fp32"}, "B" * 52: {**ran, "spans": [], "eager": "no"}}) is None
    note = replay_note({"A" * 52: ran, "B" * 52: {**ran, "dtype": "fp32"}})
    assert note is not None and note.startswith(f"1 stage(s) ran compiled in bf16 ({'A' * 16})") and "not a bit-exact" in note
    # a run re-planned off a ring that ran compiled in bf16 onto an fp32 one: its first tokens still came from bf16
    fp32 = {"C" * 52: {**ran, "dtype": "fp32"}}
    assert replay_note(fp32) is None and replay_note(fp32, {"A" * 52: ran}) == note
    receipt = tmp_path / "receipt.json"
    receipt.write_text(json.dumps({"prompt_token_ids": [3, 14, 15], "output_token_ids": [1, 2, 3], "replay_note": note}))
    assert main(["run", "--model", str(tiny), "--dtype", "fp32", "--threads", "1", "--receipt", str(receipt)]) == 0
    assert f"the receipt's output (3 tokens) differs: {note}" in capsys.readouterr().err
    replayed = run_json(capsys, ["--model", str(tiny), "--dtype", "fp32", "--receipt", str(receipt)])
    assert replayed["matches_receipt"] is False and replayed["receipt_replay_note"] == note


def test_run_errors_have_exit_codes(tiny: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--model", str(tiny), "--prompt", "hello", "--threads", "1"]) == 3  # no tokenizer
    assert main(["run", "--model", str(tiny), "--threads", "1"]) == 2  # no prompt
    assert main(["run", "--model", str(tiny), "--prompt-ids", "1", "--dtype", "fp8"]) == 2
    assert main(["run", "--model", str(tiny), "--prompt-ids", "1", "--draft", "/no/such"]) == 2
    assert main(["run", "--model", str(tiny / "missing"), "--prompt-ids", "1"]) == 3
    assert main(["run", "--model", str(tiny), "--prompt-ids", "1", "--stages", "9"]) == 2
    err = capsys.readouterr().err
    assert "--prompt-ids" in err and "--stages" in err


@pytest.mark.slow
def test_run_on_the_bundled_model(capsys: pytest.CaptureFixture[str]) -> None:
    obj = run_json(capsys, ["--prompt", "What is 2+2?", "--max-new-tokens", "8", "--stages", "3"])
    assert obj["model"]["name"] == "SmolLM2-135M-Instruct"  # type: ignore[index]
    assert len(obj["output_token_ids"]) >= 1  # type: ignore[arg-type]
    assert isinstance(obj["output_text"], str) and obj["output_text"]
    assert obj["blocks"] == [[0, 10], [10, 20], [20, 30]]
    # Streaming mode prints the same text on stdout.
    torch.set_num_threads(1)
    assert main(["run", "--prompt", "What is 2+2?", "--max-new-tokens", "8", "--stages", "1",
                 "--threads", "1"]) == 0
    assert capsys.readouterr().out.strip() == str(obj["output_text"]).strip()


def test_quant_auto_keeps_the_bundled_ggufs_int4_where_the_packed_kernel_runs(capsys: pytest.CaptureFixture[str]) -> None:
    """The bundled model is a Q4_1 GGUF: ``--quant auto`` (the default) serves it in int4 where
    torch's packed CPU kernel runs (bf16 activations), densely in fp32 (that kernel is scalar there),
    and says in the JSON what it chose; an explicit --quant none is still dense."""
    from swarm.model.dtypes import auto_dtype

    base = ["--prompt-ids", "1,2,3", "--max-new-tokens", "2", "--draft", "none"]
    bf16 = run_json(capsys, [*base, "--dtype", "bf16"])
    assert (bf16["dtype"], bf16["quant"], bf16["quant_auto"]) == ("bf16", "int4", {"stored": "int4", "chose": "int4"})
    fp32 = run_json(capsys, [*base, "--dtype", "fp32"])
    assert (fp32["quant"], fp32["quant_auto"]) == ("none", {"stored": "int4", "chose": "none"})
    default = run_json(capsys, base)  # --dtype auto: bf16 where this CPU has it natively
    assert default["quant"] == ("int4" if auto_dtype("cpu") == torch.bfloat16 else "none")
    dense = run_json(capsys, [*base, "--dtype", "bf16", "--quant", "none"])
    assert (dense["quant"], dense["quant_auto"]) == ("none", None)
    # its LM head (the tied Q8_0 embedding) likewise: int8 where an int8 kernel runs (fbgemm's at
    # any dtype on x86-64, int8pack in bf16), dense otherwise, and dense under any explicit --quant
    fbgemm = fbgemm_available()
    assert (bf16["head_quant"], fp32["head_quant"], dense["head_quant"]) == ("int8", "int8" if fbgemm else "none", "none")
    assert bf16["head_kernel"] == ("fbgemm_dynamic" if fbgemm else "int8pack")
    assert default["head_quant"] == ("int8" if fbgemm or auto_dtype("cpu") == torch.bfloat16 else "none")
    layers = run_json(capsys, [*base, "--dtype", "bf16", "--quant", "int4"])
    assert (layers["quant"], layers["head_quant"]) == ("int4", "none")


def test_a_receipt_replays_the_heads_format(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--receipt`` holds the head as the receipt says (a ring's receipt has no head_quant: its
    nodes keep a dense head), whatever ``--quant auto`` would choose."""
    base = ["--prompt-ids", "1,2,3", "--max-new-tokens", "6", "--draft", "none", "--dtype", "bf16"]
    first = run_json(capsys, base)
    assert first["head_quant"] == "int8"
    receipt = tmp_path / "receipt.json"
    receipt.write_text(json.dumps(first))
    replayed = run_json(capsys, ["--dtype", "bf16", "--receipt", str(receipt)])
    assert (replayed["head_quant"], replayed["quant"], replayed["matches_receipt"]) == ("int8", first["quant"], True)
    ring = {k: v for k, v in first.items() if k != "head_quant"}
    receipt.write_text(json.dumps(ring))
    assert run_json(capsys, ["--dtype", "bf16", "--receipt", str(receipt)])["head_quant"] == "none"


def test_quant_flags(tiny: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--model", str(tiny), "--prompt-ids", "1", "--quant", "int3"]) == 2
    assert main(["demo", "--model", str(tiny), "--quant", "nf4"]) == 2  # refused before any node starts
    err = capsys.readouterr().err
    assert "choose one of auto, none, int8, int4" in err and "choose one of none, int8, int4" in err
    obj = run_json(capsys, ["--model", str(tiny), "--prompt-ids", "5,17,99", "--max-new-tokens", "4",
                            "--dtype", "fp32", "--quant", "int8"])  # fmt: skip
    assert obj["quant"] == "int8" and len(obj["output_token_ids"]) == 4  # type: ignore[arg-type]


def test_compile_flag_gives_eager_tokens_in_fp32(tiny: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = ["--model", str(tiny), "--prompt-ids", "3,14,15,92,65", "--max-new-tokens", "70",
            "--dtype", "fp32", "--stages", "2"]  # fmt: skip
    eager = run_json(capsys, base)
    compiled = run_json(capsys, [*base, "--compile"])
    assert eager["compiled"] is None
    assert compiled["compiled"]["capacity"] == 128 and compiled["compiled"]["spans"] == [64, 128]  # type: ignore[index]
    assert compiled["output_token_ids"] == eager["output_token_ids"]
    # a stage the compiled step does not cover is refused by name, before any token
    assert main(["run", *base, "--compile", "--kv-cache", "int8", "--threads", "1"]) == 3
    assert "--compile:" in capsys.readouterr().err


@pytest.mark.slow
def test_compile_flag_in_a_real_process(tiny: Path) -> None:
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "swarm.cli.main", "run", "--model", str(tiny), "--prompt-ids", "3,14,15",
         "--max-new-tokens", "10", "--dtype", "fp32", "--threads", "1", "--compile", "--json"],
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    obj = json.loads(out.stdout)
    assert obj["compiled"]["spans"] == [16] and len(obj["output_token_ids"]) == 10
