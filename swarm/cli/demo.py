"""``shard-swarm demo`` and ``shard-swarm generate``: the ring's main job from the command line.

``demo`` starts N local node processes on loopback with the bundled model (an invite made on the
spot; discovery by the bootstrap address only, never multicast), waits for the ring, streams one
generation to stdout and ends with a summary (or the run receipt with ``--json``).
``generate`` runs one generation on a swarm that is already running.
"""

from __future__ import annotations

import functools
import json
import logging
import signal
import sys
from pathlib import Path
from typing import Any

import trio
import typer

from swarm.cli import ui
from swarm.cli.draftflag import REQUEST_HELP
from swarm.errors import UsageError
from swarm.manifest.manifest import read_manifest
from swarm.manifest.schema import DEFAULT_CONTEXT, KV_CACHES, MAX_CONTEXT, MIN_CONTEXT, QUANTS
from swarm.node.settings import check_compile_span, compile_span_help

DEFAULT_PROMPT = "Explain in two sentences why the sky is blue."
# a demo's one generation fits in 256 positions: 3 graphs per node (64, 128, 256) instead of join's 5,
# so three nodes compiling at once on a small machine are serving well within --timeout
DEMO_COMPILE_SPAN = 256
COMPILE_HELP = ("Every node runs its stage's one-token decode steps and drafted verify chunks (up to 8 rows) as compiled graphs (as join --compile): "
                "compiled before the ring serves (spans up to --compile-span, later steps eager); a stage that cannot compile serves eagerly.")


def register(app: typer.Typer) -> None:
    app.command("demo")(demo)
    app.command("generate")(generate)


def demo(
    nodes: int = typer.Option(3, "--nodes", "-n", min=1, max=8, help="Local node processes to start."),
    prompt: str = typer.Option(DEFAULT_PROMPT, "--prompt", "-p"),
    max_new_tokens: int = typer.Option(64, "--max-new-tokens", min=1, max=4096),
    context: int = typer.Option(DEFAULT_CONTEXT, "--context", min=MIN_CONTEXT, max=MAX_CONTEXT,
                                help="The swarm's context in tokens (written into its invite; at most the model's own)."),
    kv_cache: str = typer.Option("auto", "--kv-cache", help="How every node holds its KV cache: auto (the serving dtype), int8 or fp8 (about half the bytes; fp8 on CUDA sm89+ or a CPU) (written into its invite)."),
    model: str | None = typer.Option(None, "--model", help="Model directory, .gguf file, or packaged model: smollm2 (the default) or gemma3-270m."),
    dtype: str = typer.Option("auto", "--dtype", help="auto (bf16 where the hardware has it, else fp32), bf16, fp16 or fp32."),
    device: str | None = typer.Option(None, "--device", help="auto (CUDA, then MPS, else CPU), cpu, cuda, cuda:N or mps, for every node (default: node.device, else auto)."),
    quant: str = typer.Option("none", "--quant", help="How every node holds its layers: none, int8, int4 or mxfp4 (MoE experts only) (written into the invite)."),
    draft: str = typer.Option("ngram", "--draft", help="What the nodes draft with (as join --draft): ngram, none, self, int8, int4, a checkpoint PATH or auto."),
    chat: bool = typer.Option(True, "--chat/--no-chat", help="Wrap the prompt in the model's chat template."),
    temperature: float = typer.Option(0.0, "--temperature", help="0 = greedy (the default); at most 2, as the API."),
    top_p: float = typer.Option(1.0, "--top-p"),
    seed: int | None = typer.Option(None, "--seed"),
    delay_ms: float = typer.Option(0.0, "--delay-ms", help="Emulated one-way latency per hop (a WAN)."),
    json_out: bool = typer.Option(False, "--json", help="Print the run receipt as JSON."),
    receipt: Path | None = typer.Option(None, "--receipt", help="Also write the receipt here."),
    timeout: float = typer.Option(300.0, "--timeout", help="Seconds to wait for the ring to form."),
    api: str | None = typer.Option(None, "--api", help="After the run, keep the swarm up and serve the OpenAI-compatible endpoint here (Ctrl-C stops)."),
    compile_: bool = typer.Option(False, "--compile/--no-compile", help=COMPILE_HELP),
    compile_span: int | None = typer.Option(None, "--compile-span", help=compile_span_help(DEMO_COMPILE_SPAN)),
) -> None:
    """Start a local swarm of NODES processes on the bundled model and run one generation."""
    from swarm.cli.settings import chosen_device
    from swarm.launch import start_local_swarm
    from swarm.model.devices import device_label
    from swarm.model.dtypes import dtype_name, resolve_dtype

    if quant not in QUANTS:
        raise UsageError(f"--quant {quant!r}: choose one of {', '.join(QUANTS)}")
    span = check_compile_span(compile_span, compile=compile_) if compile_span is not None else (
        DEMO_COMPILE_SPAN if compile_ else None)  # an eager node takes no span (settings refuse one)
    if kv_cache not in KV_CACHES:
        raise UsageError(f"--kv-cache {kv_cache!r}: choose one of {', '.join(KV_CACHES)}")
    dev = device_label(chosen_device(device))  # refuse a bad name or a missing device
    torch_dtype = resolve_dtype(dtype, dev)  # ... before starting anything
    from swarm.model.packaged import resolve_model

    with ui.progress("preparing the model (first run only)") as report:
        model_dir = resolve_model(model, progress=report)
    from swarm.model.draftload import parse_draft

    spec = parse_draft(draft)  # a bad --draft: exit 2 before anything starts
    asked = "auto" if spec.auto else ("model" if spec.model else spec.kind)  # what the request names
    held = dtype_name(torch_dtype) + ("" if quant == "none" else f", {quant} weights")
    held += "" if kv_cache == "auto" else f", {kv_cache} KV cache"
    ui.notice(f"starting {nodes} node processes on loopback ({model_dir.name}, {held} on {dev})")
    from swarm.model.weights import open_checkpoint

    context = min(context, open_checkpoint(model_dir).args.max_seq_len)  # the model's own maximum caps it
    with start_local_swarm(nodes, model_dir, dtype=dtype, device=dev, draft=draft, delay_ms=delay_ms,
                           quant=quant, context_tokens=context, kv_cache=kv_cache, compile=compile_,
                           compile_span=span) as swarm:  # fmt: skip
        try:
            result = trio.run(
                _run_one, swarm.addrs[-1], swarm.secret, swarm.swarm_id, timeout,
                dict(text=prompt, chat=chat, max_new_tokens=max_new_tokens, temperature=temperature,
                     top_p=top_p, seed=seed, draft=asked),
                json_out,
            )  # fmt: skip
            if api is not None:
                _finish(result, json_out, receipt)
                trio.run(_serve_api, swarm.addrs[-1], swarm.secret, swarm.swarm_id, model_dir, api, context)
                return
        except BaseException:
            for i in range(nodes):
                tail = swarm.log(i).strip().splitlines()[-5:]
                ui.notice(f"--- node {i} log (last lines):\n" + "\n".join(tail))
            raise
    _finish(result, json_out, receipt)


def generate(
    prompt: str | None = typer.Option(None, "--prompt", "-p"),
    prompt_ids: str | None = typer.Option(None, "--prompt-ids", help="Comma-separated token ids instead of text."),
    manifest: Path | None = typer.Option(None, "--manifest", help="Invite of the swarm (secret, bootstrap)."),
    peer: str | None = typer.Option(None, "--peer", help="Multiaddr of a peer (default: the invite's bootstrap)."),
    max_new_tokens: int = typer.Option(64, "--max-new-tokens", min=1, max=4096),
    chat: bool = typer.Option(True, "--chat/--no-chat"),
    temperature: float = typer.Option(0.0, "--temperature", help="0 = greedy (the default); at most 2, as the API."),
    top_k: int = typer.Option(0, "--top-k"),
    top_p: float = typer.Option(1.0, "--top-p"),
    seed: int | None = typer.Option(None, "--seed"),
    draft: str | None = typer.Option(None, "--draft", help=REQUEST_HELP),
    json_out: bool = typer.Option(False, "--json"),
    receipt: Path | None = typer.Option(None, "--receipt"),
    timeout: float = typer.Option(
        60.0, "--timeout", min=1.0,
        help="Seconds to reach the swarm, and the longest silence from it during the generation (any news ends one: a re-plan says every 2 s that it waits, and gives up by itself after 120 s).",
    ),
) -> None:
    """Run one generation on a running swarm."""
    if manifest is None:
        raise UsageError("give --manifest (the swarm's invite: it holds the secret admission needs)")
    if (prompt is None) == (prompt_ids is None):
        raise UsageError("give exactly one of --prompt TEXT or --prompt-ids 1,2,3")
    ids: list[int] | None = None
    if prompt_ids is not None:
        try:
            ids = [int(t) for t in prompt_ids.split(",") if t.strip()]
        except ValueError:
            raise UsageError(f"--prompt-ids must be comma-separated integers, got {prompt_ids!r}") from None
    m = read_manifest(manifest)
    addr: list[str] = [peer] if peer else list(m.bootstrap)  # every bootstrap address in turn
    if not addr:
        raise UsageError("the invite names no bootstrap peer: give --peer MULTIADDR")
    from swarm.client import client_credential

    secret, role, mkey = client_credential(m.secret.value, m.role, m.member_key)  # a member invite acts as a client
    result = trio.run(functools.partial(
        _run_one, addr, secret, m.swarm_id, timeout,
        dict(text=prompt, prompt_ids=ids, chat=chat and ids is None, max_new_tokens=max_new_tokens,
             temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, draft=draft),
        json_out, role=role, member_key=mkey,
    ))  # fmt: skip
    _finish(result, json_out, receipt)


async def _run_one(addr: str | list[str], secret: bytes, swarm_id: str, timeout: float, req: dict[str, Any], quiet_stream: bool,
                   *, role: str = "member", member_key: bytes = b"") -> dict[str, Any]:  # fmt: skip
    from swarm import client

    net_log = logging.getLogger("swarm.net")
    if net_log.getEffectiveLevel() > logging.DEBUG:
        net_log.setLevel(logging.WARNING)  # our client's connection chatter is not the user's news
    async with client.open_client(addr, secret=secret, swarm_id=swarm_id, timeout=timeout, role=role,
                                  member_key=member_key) as (host, peer):  # fmt: skip
        await client.wait_ready(host, peer, timeout=timeout)

        pieces: list[str] = []

        def show(ids: list[int], text: str) -> None:
            pieces.append(text)
            if not quiet_stream:
                sys.stdout.write(text)
                sys.stdout.flush()

        def notice(text: str) -> None:
            if not quiet_stream:
                sys.stdout.write("\n")
            ui.notice(text)

        receipt = await client.generate(host, peer, on_tokens=show, on_notice=notice, timeout=timeout, resume=True,
                                        **req)  # fmt: skip
        if not quiet_stream:
            sys.stdout.write("\n")
        return {"text": "".join(pieces), **receipt}


async def _serve_api(addr: str, secret: bytes, swarm_id: str, model_dir: Path, bind: str, context: int) -> None:
    from swarm import client
    from swarm.api.backend import ClientBackend
    from swarm.api.server import serve_api

    async with client.open_client(addr, secret=secret, swarm_id=swarm_id) as (host, peer), trio.open_nursery() as nursery:
        url = await nursery.start(functools.partial(serve_api, ClientBackend(host, peer, model_dir, context_tokens=context), bind))
        ui.notice(f"OpenAI-compatible endpoint on {url}/v1 (model {model_dir.name}); Ctrl-C stops the swarm")
        ui.notice(f"web console on {url}/ and chat on {url}/chat")
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async for _ in signals:
                nursery.cancel_scope.cancel()
                return


def _finish(receipt: dict[str, Any], json_out: bool, path: Path | None) -> None:
    if path is not None:
        path.write_text(json.dumps(receipt, indent=2) + "\n")
    if json_out:
        ui.print_json(receipt)
        return
    ui.print_receipt_summary(receipt)
