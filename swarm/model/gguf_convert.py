"""A GGUF model written out as a Hugging Face directory (config.json, safetensors, tokenizer).

The bundled model is served this way: converted once into the cache, then loaded like any
safetensors checkpoint. The tensors stream through :class:`swarm.model.gguf.GGUFSource` one at a
time (peak memory: one tensor); the tokenizer comes from the file's own metadata through
transformers' GGUF tokenizer converter (tokenizer.tokenizer_from_gguf). The directory is built in
a temporary sibling and renamed into place, so a killed conversion never leaves a half-written
directory that looks valid.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from swarm.model.gguf import GGUFSource
from swarm.model.gguf_archs import config_from
from swarm.model.tokenizer import tokenizer_from_gguf

_ST_DTYPES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}
_TORCH_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


def _write_safetensors(
    path: Path, source: GGUFSource, names: list[str], dtype: torch.dtype, step: Callable[[], None]
) -> None:
    """Stream tensors into a safetensors file one at a time (peak memory: one tensor)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    header: dict[str, Any] = {"__metadata__": {"format": "pt", "source": source.path.name}}
    pos = 0
    for name in names:
        shape = source.shape(name)
        n = math.prod(shape) * itemsize
        header[name] = {
            "dtype": _ST_DTYPES[dtype],
            "shape": list(shape),
            "data_offsets": [pos, pos + n],
        }
        pos += n
    hbytes = json.dumps(header, separators=(",", ":")).encode()
    hbytes += b" " * (-len(hbytes) % 8)
    with open(path, "wb") as out:
        out.write(struct.pack("<Q", len(hbytes)))
        out.write(hbytes)
        for name in names:
            t = source.load(name, dtype).contiguous()  # HF shape
            out.write(t.view(torch.uint8).numpy().tobytes())
            step()
        out.flush()
        os.fsync(out.fileno())


def convert_gguf_to_hf(
    gguf_path: Path | str,
    out_dir: Path | str,
    *,
    dtype: torch.dtype = torch.bfloat16,
    progress: Callable[[int, int], None] | None = None,
) -> Path:
    """Write an HF-style directory for a GGUF model; atomic (built in a temp dir, then renamed).

    Files: config.json, model.safetensors (``dtype``), tokenizer.json, tokenizer_config.json
    (with chat_template), generation_config.json. ``progress(done, total)`` counts tensors plus one
    step for the tokenizer. An existing ``out_dir`` is replaced.
    """
    if dtype not in _ST_DTYPES:
        raise ValueError(f"dtype must be one of {list(_TORCH_NAMES.values())}, not {dtype}")
    source = GGUFSource(gguf_path)
    out = Path(out_dir)
    cfg = config_from(source.file)
    cfg["torch_dtype"] = _TORCH_NAMES[dtype]
    names = source.names()
    total, done = len(names) + 1, 0

    def step() -> None:
        nonlocal done
        done += 1
        if progress is not None:
            progress(done, total)

    if progress is not None:
        progress(0, total)
    tok, tcfg, extra_eos = tokenizer_from_gguf(source.files[0].path)
    tcfg["model_max_length"] = cfg["max_position_embeddings"]
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        (tmp / "tokenizer.json").write_text(tok.to_str(), encoding="utf-8")
        (tmp / "tokenizer_config.json").write_text(
            json.dumps(tcfg, indent=2, ensure_ascii=False) + "\n"
        )
        eos_ids = [cfg["eos_token_id"]] if "eos_token_id" in cfg else []
        eos_ids += [i for i in extra_eos if i not in eos_ids]
        if len(eos_ids) > 1:
            cfg["eos_token_id"] = eos_ids
        gen: dict[str, Any] = {"_from_model_config": True}
        if "bos_token_id" in cfg:
            gen["bos_token_id"] = cfg["bos_token_id"]
        if eos_ids:
            gen["eos_token_id"] = eos_ids if len(eos_ids) > 1 else eos_ids[0]
        if "pad_token_id" in cfg:
            gen["pad_token_id"] = cfg["pad_token_id"]
        (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        step()
        _write_safetensors(tmp / "model.safetensors", source, names, dtype, step)
        os.chmod(tmp, 0o755)
        if out.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
            os.replace(out, old / out.name)
            os.replace(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
