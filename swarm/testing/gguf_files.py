"""Tiny GGUF files of the supported families, written by the ``gguf`` package as llama.cpp would.

``write_family_gguf(hf_dir, out)`` turns a tiny Hugging Face checkpoint (hf_checkpoints.py) into
the GGUF llama.cpp's converter would make of it, independently of swarm.model.gguf_archs: tensor
names come from the ``gguf`` package's own map (``gguf.get_tensor_name_map``, what
convert_hf_to_gguf.py uses), MoE experts are stacked into one 3-D tensor per projection, Q/K rows
of the Llama family are permuted for llama.cpp's interleaved RoPE, Gemma's norms are stored as
``1 + w``, and the metadata keys are the ones its converter writes for each family.
``split=N`` writes the model as N files (``out-00001-of-0000N.gguf`` ...) with the ``gguf``
package's own splitter. Tensors are F32 unless ``qtype`` says otherwise (2-D weights only, as
llama.cpp keeps norms in F32).

The vocabulary is byte-level BPE ("gpt2") over the model's 256 token ids: every byte a token, no
merges, ids 0-2 marked as control tokens (tests of tokenizers use their own files).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

# transformers model_type -> (GGUF architecture, gguf.MODEL_ARCH member)
GGUF_ARCH = {
    "llama": ("llama", "LLAMA"),
    "mistral": ("llama", "LLAMA"),
    "mixtral": ("llama", "LLAMA"),
    "qwen2": ("qwen2", "QWEN2"),
    "qwen3": ("qwen3", "QWEN3"),
    "qwen3_moe": ("qwen3moe", "QWEN3MOE"),
    "gemma2": ("gemma2", "GEMMA2"),
    "gemma3_text": ("gemma3", "GEMMA3"),
    "phi3": ("phi3", "PHI3"),
}
_EXPERT = re.compile(r"^(model\.layers\.\d+\.(?:mlp|block_sparse_moe)\.experts)\.(\d+)\.(\w+)\.weight$")


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's converter does to Q/K rows of the Llama family (from its description)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _hf_tensors(hf_dir: Path) -> dict[str, np.ndarray]:
    from safetensors import safe_open

    out = {}
    with safe_open(str(hf_dir / "model.safetensors"), "pt") as f:
        for k in f.keys():  # noqa: SIM118 (not a dict)
            out[k] = f.get_tensor(k).to(torch.float32).numpy()
    experts: dict[str, dict[str, dict[int, np.ndarray]]] = {}
    for k in [k for k in out if _EXPERT.match(k)]:
        m = _EXPERT.match(k)
        assert m is not None
        experts.setdefault(m[1], {}).setdefault(m[3], {})[int(m[2])] = out.pop(k)
    for prefix, projs in experts.items():  # stacked as llama.cpp's converter stacks them
        for proj, by_e in projs.items():
            out[f"{prefix}.{proj}.weight"] = np.stack([by_e[e] for e in sorted(by_e)])
    return out


def write_family_gguf(
    hf_dir: str | Path, out: str | Path, *, split: int = 1, qtype: Any = None, name: str = "tiny"
) -> Path:
    """Write ``hf_dir``'s model as a GGUF at ``out`` (or N splits beside it); returns the path to
    open (``out`` itself, or its first split)."""
    import gguf

    hf = Path(hf_dir)
    cfg = json.loads((hf / "config.json").read_text())
    arch, member = GGUF_ARCH[cfg["model_type"]]
    n_layers = cfg["num_hidden_layers"]
    tmap = gguf.get_tensor_name_map(getattr(gguf.MODEL_ARCH, member), n_layers)
    tensors = _hf_tensors(hf)
    n_split = max(1, -(-len(tensors) // split)) if split > 1 else 0
    w = gguf.GGUFWriter(str(out), arch=arch, split_max_tensors=n_split)
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    w.add_name(name)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(n_layers)
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(cfg.get("rms_norm_eps", 1e-6))
    rope = cfg.get("rope_parameters") or {}
    rope = rope.get("full_attention", rope)  # Gemma 3: the global layers' base (llama.cpp's freq_base)
    w.add_rope_freq_base(float(cfg.get("rope_theta") or rope.get("rope_theta", 10000.0)))
    if cfg["model_type"] == "mixtral":
        w.add_expert_count(cfg["num_local_experts"])
        w.add_expert_used_count(cfg["num_experts_per_tok"])
    if cfg["model_type"] == "qwen3_moe":
        w.add_expert_count(cfg.get("num_experts") or cfg["num_local_experts"])
        w.add_expert_used_count(cfg["num_experts_per_tok"])
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    if cfg["model_type"] in ("gemma2", "gemma3_text", "phi3") and cfg.get("sliding_window"):
        w.add_sliding_window(cfg["sliding_window"])
    if cfg["model_type"] == "gemma2":
        w.add_attn_logit_softcapping(cfg["attn_logit_softcapping"])
        w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
    _byte_vocab(w, cfg["vocab_size"])
    permuted = arch == "llama"
    for hf_name, arr in tensors.items():
        gname = tmap.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if gname is None:
            raise ValueError(f"the gguf package has no name for {hf_name} ({arch})")
        if permuted and ".q_proj." in hf_name:
            arr = llama_cpp_permute(arr, heads)
        elif permuted and ".k_proj." in hf_name:
            arr = llama_cpp_permute(arr, kv)
        if arch.startswith("gemma") and hf_name.endswith("norm.weight"):
            arr = arr + 1.0
        if qtype is not None and arr.ndim >= 2 and arr.shape[-1] % 32 == 0:
            w.add_tensor(gname, gguf.quants.quantize(arr.astype(np.float32), qtype), raw_dtype=qtype)
        else:
            w.add_tensor(gname, np.ascontiguousarray(arr, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    p = Path(out)
    return p if split <= 1 else p.with_name(f"{p.stem}-00001-of-{split:05d}.gguf")


def _byte_vocab(w: Any, vocab: int) -> None:
    from tokenizers import pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokens = (alphabet + [f"<extra_{i}>" for i in range(max(0, vocab - len(alphabet)))])[:vocab]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3, 3, 3] + [1] * (vocab - 3))
    w.add_token_merges([])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
