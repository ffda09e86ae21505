"""``shard-swarm run``: one generation with the model split into N stages in this process.

This is the one-box reference: a ring's receipt for the same model, prompt and settings must
match its ``output_token_ids`` / ``output_sha256``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from swarm.cli import ui
from swarm.errors import ModelError, TokenizerError, UsageError
from swarm.manifest.schema import KV_CACHES, QUANTS

if TYPE_CHECKING:  # torch and the model load in the command, so other commands start fast
    import torch

    from swarm.model.generate import LocalModel
    from swarm.model.speculative import DraftSource
    from swarm.model.tokenizer import Tokenizer


def output_sha256(ids: Sequence[int]) -> str:
    from swarm.model.driver import output_sha256 as checksum

    return checksum(ids)


def parse_prompt_ids(text: str) -> list[int]:
    try:
        ids = [int(x) for x in text.replace(" ", "").split(",") if x != ""]
    except ValueError:
        raise UsageError(f"--prompt-ids must be comma-separated integers, got {text!r}") from None
    if not ids:
        raise UsageError("--prompt-ids is empty")
    return ids


def _load_tokenizer(model_dir: Path) -> Tokenizer | None:
    from swarm.model.tokenizer import Tokenizer

    if model_dir.is_dir() and (model_dir / "tokenizer.json").is_file():
        return Tokenizer.from_dir(model_dir)
    if model_dir.is_file() and model_dir.suffix.lower() == ".gguf":  # a GGUF carries its own
        return Tokenizer.load(model_dir)
    return None


def _make_drafter(spec: str, model: LocalModel, dtype: torch.dtype, device: str, max_len: int,
                  tok: Tokenizer | None) -> tuple[DraftSource | None, str | None]:
    from swarm.model.drafters import NgramDrafter
    from swarm.model.draftload import load_draft_model, parse_draft

    parsed = parse_draft(spec)
    if parsed.auto:
        raise UsageError(
            f"--draft {spec}: auto chooses per request on a ring; here name the drafter "
            "(a ring's receipt says which one ran: --receipt replays it)"
        )
    if parsed.kind == "none":
        return None, None
    if parsed.kind == "ngram":
        return NgramDrafter(), "ngram"
    dm = load_draft_model(parsed, head=model.head, target=model.ckpt, dtype=dtype, device=device, target_tokenizer=tok)
    return dm.drafter(min(max_len, dm.args.max_seq_len)), dm.name


def _replay_draft(dr: dict[str, Any], given: str | None) -> tuple[str, dict[str, Any] | None]:
    """The drafter and policy constants a ring's receipt ran with (``draft.ran``; older receipts:
    ``draft.name``). A checkpoint draft is named by its directory: give ``--draft PATH``."""
    ran = str(dr.get("ran", dr.get("name", "ngram")))
    policy = dr.get("policy") if isinstance(dr.get("policy"), dict) else None
    if given is not None:
        return given, policy
    if ran not in ("none", "ngram", "self", "int8", "int4"):
        raise UsageError(f"the receipt's draft model {ran!r} is a checkpoint: give --draft PATH to replay it")
    return ran, policy


class _Streamer:
    """Prints text as tokens are committed (decoding the whole output keeps multi-byte
    characters split across tokens intact)."""

    def __init__(self, tok: Tokenizer) -> None:
        self.tok, self.shown = tok, ""
        self.ids: list[int] = []

    def __call__(self, tokens: Sequence[int]) -> None:
        self.ids.extend(tokens)
        text = self.tok.decode(self.ids)
        if text.endswith("\ufffd"):
            return  # an incomplete UTF-8 sequence: wait for the next token
        if text.startswith(self.shown):
            sys.stdout.write(text[len(self.shown):])
            sys.stdout.flush()
            self.shown = text


def run_command(
    model: str | None = typer.Option(None, "--model", help="Model directory, .gguf, or packaged model: smollm2 (the default, SmolLM2-135M-Instruct) or gemma3-270m."),
    stages: int = typer.Option(1, "--stages", help="Split the model into N in-process stages."),
    prompt: str | None = typer.Option(None, "--prompt", help="Prompt text."),
    prompt_ids: str | None = typer.Option(None, "--prompt-ids", help="Prompt as token IDs, e.g. 1,2,3."),
    max_new_tokens: int = typer.Option(64, "--max-new-tokens", help="Stop after this many new tokens."),
    temperature: float = typer.Option(0.0, "--temperature", help="0 = greedy."),
    top_k: int = typer.Option(0, "--top-k", help="0 = off."),
    top_p: float = typer.Option(1.0, "--top-p", help="1.0 = off."),
    seed: int = typer.Option(0, "--seed", help="Seed of the sampling generators."),
    draft: str | None = typer.Option(None, "--draft", help="Drafter: ngram (the default, as a ring's), none, self (layer-skipped target), int8 or int4 (a compact copy of the target) or a draft checkpoint PATH."),
    draft_k: int | None = typer.Option(None, "--draft-k", help="Fixed draft length (default: adaptive)."),
    depth: int = typer.Option(2, "--depth", min=1, max=8, help="Verify chunks in flight. A ring picks its own (1-4, from its predicted traversal) and records it in the receipt as draft.max_depth: --receipt replays it."),
    receipt: Path | None = typer.Option(None, "--receipt", help="Replay a ring's run receipt (generate --json / demo --json): its prompt ids, length, sampling, drafter and depth; then say whether the output matches."),
    dtype: str = typer.Option("auto", "--dtype", help="auto (bf16 where the hardware has it, else fp32), bf16 or fp32."),
    quant: str = typer.Option("auto", "--quant", help="Decoder layers held as auto (the checkpoint's own int4/int8 format where this device has a packed kernel for it at the dtype, else the dtype: a Q4 GGUF in bf16 runs int4; its LM head likewise int8 where stored in 5-8 bits, as both bundled models are: JSON head_quant), none (the dtype; the head dense too), int8, int4 or mxfp4 (MoE experts only) (a ring receipt's quant reproduces it)."),
    kv_cache: str = typer.Option("auto", "--kv-cache", help="The KV cache held as auto (the dtype), int8 or fp8 (fp8 on CUDA sm89+ or a CPU) (a ring receipt's kv_cache reproduces it)."),
    device: str | None = typer.Option(None, "--device", help="auto (CUDA, then MPS, else CPU), cpu, cuda, cuda:N or mps (default: node.device, else auto)."),
    threads: int | None = typer.Option(None, "--threads", help="torch threads (default: all cores, or measured with --tune)."),
    tune: bool = typer.Option(False, "--tune/--no-tune", help="On a CPU, choose --dtype auto, the threads and the quantized kernels by a start-up measurement cached per machine (opt-in: a measurement taken under load is cached as it is; default: auto = bf16 where native, all cores)."),
    compile_: bool = typer.Option(False, "--compile/--no-compile", help="Run decode steps and drafted verify chunks (up to 8 rows) as compiled static-shape graphs (torch.compile on a CPU; hand-written Llama-family layers, dense or int8/int4; compiled before the first token). fp32 gives eager's tokens; bf16 may differ at near-ties."),
    chat: bool = typer.Option(True, "--chat/--no-chat", help="Wrap --prompt in the chat template."),
    as_json: bool = typer.Option(False, "--json", help="Print a JSON result instead of streaming text."),
) -> None:
    """Generate with the model split into N stages in this process (the one-box reference)."""
    import torch

    from swarm.cli.settings import chosen_device
    from swarm.model.bundled import BUNDLED_NAME, default_model_dir
    from swarm.model.devices import describe_device, device_label
    from swarm.model.drafters import ModelDrafter
    from swarm.model.dtypes import dtype_name, resolve_dtype
    from swarm.model.generate import LocalModel, generate
    from swarm.model.sampling import SamplingParams
    from swarm.model.speculative import KPolicy

    replay: dict[str, Any] | None = None
    ring_policy: dict[str, Any] | None = None
    head_quant = "none"
    if receipt is not None:
        replay = _read_receipt(receipt)
        prompt, prompt_ids = None, ",".join(map(str, replay["prompt_token_ids"]))
        max_new_tokens = len(replay["output_token_ids"])
        samp, dr = replay.get("sampling") or {}, replay.get("draft") or {}
        temperature, top_k = float(samp.get("temperature", 0.0)), int(samp.get("top_k", 0))
        top_p, seed = float(samp.get("top_p", 1.0)), int(samp.get("seed", 0))
        draft, ring_policy = _replay_draft(dr, draft)
        depth, draft_k = int(dr.get("max_depth", 1)), dr.get("draft_k")
        quant = str(replay.get("quant", "none"))  # how the ring held its layers
        head_quant = str(replay.get("head_quant", "none"))  # and its LM head (capability.swarm_head_quant)
        kv_cache = str(replay.get("kv_cache", "auto"))  # and its KV cache
    if (prompt is None) == (prompt_ids is None):
        raise UsageError("give exactly one of --prompt TEXT or --prompt-ids 1,2,3")
    if quant != "auto" and quant not in QUANTS:
        raise UsageError(f"--quant {quant!r}: choose one of auto, {', '.join(QUANTS)}")
    if kv_cache not in KV_CACHES:
        raise UsageError(f"--kv-cache {kv_cache!r}: choose one of {', '.join(KV_CACHES)}")
    dev = chosen_device(device)
    torch_dtype = resolve_dtype(dtype, dev)  # by name; checked before anything is loaded
    if threads is not None and threads < 1:
        raise UsageError(f"--threads must be >= 1, got {threads}")
    if max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)

    if model is None:
        with ui.progress("converting the bundled model (first use only)") as report:
            model_path = default_model_dir(report)
        name = BUNDLED_NAME
    else:
        from swarm.model.packaged import resolve_model

        with ui.progress("preparing the model (first use only)") as report:
            model_path = resolve_model(model, report)  # a path, or a packaged model's name
        name = model_path.name
    if dtype == "auto":  # the model is known now: auto never picks fp16 for one that overflows it
        from swarm.node.settings import model_type

        torch_dtype = resolve_dtype("auto", dev, model_type(model_path))
    stored = None
    auto = quant == "auto"
    if auto:  # resolved here, once: the JSON (a receipt) names the concrete quant
        quant, stored = _auto_quant(model_path, dev, torch_dtype)
    tuned, kernel_dtype = None, None
    # a receipt is replayed as the ring computed it (dtype by name, kernels in the serving dtype);
    # an explicit --dtype keeps its kernels too (the numbers a ring's stages compute), so only the
    # threads are measured there, and nothing when they are given as well
    if tune and dev.type == "cpu" and receipt is None and (dtype == "auto" or threads is None):
        from swarm.model.autotune import tune as autotune
        from swarm.model.weights import open_checkpoint

        allowed = ("fp32", "bf16") if dtype == "auto" else (dtype_name(torch_dtype),)
        with ui.progress("measuring this CPU (first use of this model shape only)"):
            tuned = autotune(open_checkpoint(model_path).args, quant, dtypes=allowed,
                             threads=[threads] if threads else None, casts=dtype == "auto")
        torch_dtype, kernel_dtype = tuned.best.torch_dtype(), tuned.best.kernel_dtype()
        threads = tuned.best.threads
    if receipt is None:  # auto keeps a head stored in 5-8 bits int8 where that is faster; else dense
        head_quant = _auto_head_quant(model_path, dev, torch_dtype) if auto else "none"
    dtype = dtype_name(torch_dtype)
    torch.set_num_threads(threads or os.cpu_count() or 1)
    with ui.progress(f"loading {name} in {stages} stage(s)") as report:
        lm = LocalModel.load(model_path, stages=stages, dtype=torch_dtype, device=dev, progress=report, quant=quant,
                             kernel_dtype=kernel_dtype, kv_cache=kv_cache, head_quant=head_quant)
    tok = _load_tokenizer(model_path)

    if prompt_ids is not None:
        ids = parse_prompt_ids(prompt_ids)
    else:
        assert prompt is not None
        if tok is None:
            raise TokenizerError(f"{model_path}: no tokenizer.json; give the prompt as --prompt-ids")
        text = prompt
        chat = chat and tok.chat_template is not None
        if chat:
            text = tok.apply_chat_template([{"role": "user", "content": prompt}])
        ids = tok.encode(text, add_special_tokens=not chat)  # plain text: the BOS its tokenizer asks for
        if not ids:
            raise UsageError("the prompt encodes to no tokens")
    eos = tok.eos_token_ids if tok is not None and tok.eos_token_ids else None

    max_len = len(ids) + max_new_tokens
    compiled = _compile_stages(lm, max_len) if compile_ else None
    drafter, draft_name = _make_drafter(draft or "ngram", lm, torch_dtype, device_label(dev), max_len + 16, tok)
    if ring_policy is not None:  # the ring's measured constants: the same K/depth schedule
        policy = _policy_from(ring_policy)
    else:  # drafting cost steers the adaptive K: a model draft costs what its weights cost to read
        cost = drafter.relative_cost(lm.args) if isinstance(drafter, ModelDrafter) else 0.0
        policy = KPolicy(fixed_k=draft_k, draft_cost=cost, max_depth=depth)
    streamer = _Streamer(tok) if (tok is not None and not as_json) else None
    result = generate(lm, ids, params=params, max_new_tokens=max_new_tokens, drafter=drafter,
                      policy=policy, eos_token_ids=eos, on_tokens=streamer)
    out_ids = result.output_token_ids
    out_text = tok.decode(out_ids) if tok is not None else None
    matches = None if replay is None else out_ids == list(replay["output_token_ids"])
    # what the ring said a replay must know (stages compiled in bf16: node/generation/report.py)
    note = replay.get("replay_note") if replay is not None and isinstance(replay.get("replay_note"), str) else None
    if matches is not None and not as_json:
        ui.notice(f"the receipt's output ({len(replay['output_token_ids'])} tokens) "  # type: ignore[index]
                  + ("is reproduced exactly" if matches else f"differs: {note}" if note else "differs: see README, \"What is promised\""))  # fmt: skip
    if not as_json:
        if streamer is None:
            sys.stdout.write(",".join(map(str, out_ids)))
        sys.stdout.write("\n")
        sys.stdout.flush()
        line = (f"{len(out_ids)} tokens, {result.tokens_per_s:.1f} tok/s "
                f"({result.decode_tokens_per_s:.1f} decode), {stages} stage(s) {lm.blocks}")
        if result.accepted_per_round is not None:
            line += f", {result.accepted_per_round:.2f} drafted tokens accepted per round"
        ui.notice(line)
        return
    obj: dict[str, Any] = {
        "model": {"name": name, "path": str(model_path), "config_sha256": lm.ckpt.config_sha256},
        "dtype": dtype,
        "quant": quant,
        "quant_auto": None if stored is None else {"stored": stored, "chose": quant},
        "head_quant": lm.head.head_quant,
        "head_kernel": lm.head.head_kernel,
        "kv_cache": kv_cache,
        "device": dict(zip(("kind", "name"), describe_device(dev), strict=True)),
        "threads": torch.get_num_threads(),
        "kernel": "same" if kernel_dtype is None else dtype_name(kernel_dtype),
        "tuned": None if tuned is None else {"chosen": tuned.best.key, "ms_per_layer_step": tuned.ms},
        "stages": len(lm.stages),
        "compiled": compiled,
        "blocks": [list(b) for b in lm.blocks],
        "sampling": params.to_dict(),
        "draft": draft_name,
        "depth": depth,
        "prompt_token_ids": ids,
        "output_token_ids": out_ids,
        "output_text": out_text,
        "output_sha256": output_sha256(out_ids),
        "finish_reason": result.finish_reason,
        "tokens_per_s": round(result.tokens_per_s, 3),
        "decode_tokens_per_s": round(result.decode_tokens_per_s, 3),
        "prefill_s": round(result.prefill_s, 4),
        "decode_s": round(result.decode_s, 4),
    }
    if drafter is not None:
        obj["accepted_per_round"] = (round(result.accepted_per_round, 3)
                                     if result.accepted_per_round is not None else 0.0)
        obj["acceptance_rate"] = (round(result.acceptance_rate, 3)
                                  if result.acceptance_rate is not None else 0.0)
        obj["rounds"] = result.rounds
    if matches is not None:
        obj["matches_receipt"] = matches
        obj["receipt_replay_note"] = note
    ui.print_json(obj)


def _auto_quant(model_path: Path, dev: torch.device, dtype: torch.dtype) -> tuple[str, str]:
    """(the quant ``--quant auto`` holds this model in on ``dev`` at ``dtype``, the format it is
    stored in): capability.choose_quant's rule on the checkpoint's own format."""
    from swarm.model.capability import choose_quant
    from swarm.model.packaged import stored_quant
    from swarm.model.weights import open_checkpoint

    stored = stored_quant(model_path)
    if stored == "none":
        return "none", stored
    shapes = sorted({(n, k) for layer in open_checkpoint(model_path).args.quantizable_shapes() for _, n, k in layer})
    return choose_quant(stored, dev, dtype, shapes), stored


def _auto_head_quant(model_path: Path, dev: torch.device, dtype: torch.dtype) -> str:
    """How ``--quant auto`` holds the LM head on ``dev`` at ``dtype``: capability.choose_head_quant's
    rule on the format the checkpoint stores it in."""
    from swarm.model.capability import choose_head_quant
    from swarm.model.packaged import stored_head_quant

    stored = stored_head_quant(model_path)
    return "none" if stored == "none" else choose_head_quant(stored, dev, dtype)


def _compile_stages(lm: LocalModel, max_len: int) -> dict[str, Any]:
    """Compile every stage's decode step (one token, and verify chunks at compiled.ROWS rows) for
    sessions of ``max_len`` tokens and warm it, so the first token pays no compile time (ModelError naming why where a stage cannot)."""
    import time

    from swarm.model.compiled import warm_compiled

    capacity = 1
    while capacity < max_len:  # a power of two: its spans are all powers of two
        capacity *= 2
    capacity = min(capacity, lm.args.max_seq_len)
    t0 = time.perf_counter()
    with ui.progress("compiling the decode step (cached after the first run)"):
        for st in lm.stages:
            try:
                st.enable_compiled(capacity)
            except ModelError as exc:
                raise ModelError(f"--compile: {exc} (run without --compile)") from None
            spans = warm_compiled(st)
    rows = list(lm.stages[0].compiled.rows) if lm.stages[0].compiled is not None else []
    return {"capacity": capacity, "spans": spans, "rows": rows, "warm_s": round(time.perf_counter() - t0, 2)}


def _policy_from(settings: dict[str, Any]) -> Any:
    import dataclasses

    from swarm.model.speculative import KPolicy

    known = {f.name for f in dataclasses.fields(KPolicy)}
    try:
        return KPolicy(**{k: v for k, v in settings.items() if k in known})
    except TypeError as exc:
        raise UsageError(f"the receipt's draft.policy is malformed: {exc}") from None


def _read_receipt(path: Path) -> dict[str, Any]:
    import json

    try:
        data = json.loads(path.read_text())
        ids = data["prompt_token_ids"]
        out = data["output_token_ids"]
        if not (isinstance(ids, list) and isinstance(out, list) and all(isinstance(i, int) for i in ids + out) and out):
            raise TypeError("prompt_token_ids and output_token_ids must be non-empty lists of token ids")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise UsageError(f"--receipt {path}: not a run receipt ({exc})") from None
    return dict(data)


def register(app: typer.Typer) -> None:
    app.command("run")(run_command)
