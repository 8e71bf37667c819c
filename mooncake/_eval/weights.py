"""Tiny models with seeded random weights of a real scale, written as safetensors (no download).

vLLM's ``load_format="dummy"`` fills every tensor with U(-1e-3, 1e-3): greedy decoding then
cycles between two tokens whatever the prompt, so "outputs equal" can hardly fail. These
weights follow the usual initialisation scales instead (embeddings N(0, 1), each linear layer
N(0, 1/fan_in), norms 1, biases N(0, 0.02); q/k projections times ``ATTN_GAIN``), so attention
is far from uniform and the output depends on every prompt token (the evaluation checks that
with a control prompt).

Shapes (``SHAPES``): ``llama`` (LlamaForCausalLM, 4 heads over 2 KV heads) and ``qwen2``
(Qwen2ForCausalLM with GQA: hidden 256, 8 heads over 2 KV heads, q/k/v biases). ``python -m
mooncake._eval.weights SHAPE DIR [--seed N]`` writes ``DIR/config.json`` and
``DIR/model.safetensors`` (needs torch and safetensors: run it with vLLM's python) and prints
the directory; the same seed writes the same bytes.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

__all__ = ["SHAPES", "config_for", "kv_bytes_per_token", "main", "write_model"]

_COMMON: dict[str, Any] = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "vocab_size": 1024,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
    "bos_token_id": 1,
    "eos_token_id": 2,
}

SHAPES: dict[str, dict[str, Any]] = {
    "llama": {
        **_COMMON,
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
    },
    "qwen2": {  # head_dim 32: vLLM's CPU attention has no kernel for 16
        **_COMMON,
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "use_sliding_window": False,
    },
}


#: q/k projection gain per shape: sharper attention, so the first prompt token still moves
#: the last position's output (qwen2 at gain 1 answered the control prompt like the original)
ATTN_GAIN: dict[str, float] = {"llama": 1.0, "qwen2": 3.0}


def config_for(shape: str) -> dict[str, Any]:
    """The HF ``config.json`` of a shape (a copy)."""
    try:
        return dict(SHAPES[shape])
    except KeyError:
        raise SystemExit(f"unknown model shape {shape!r}; known: {', '.join(SHAPES)}") from None


def kv_bytes_per_token(cfg: dict[str, Any], dtype_bytes: int = 4) -> int:
    """K and V of every layer for one token."""
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return int(2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * dtype_bytes)


def _tensors(cfg: dict[str, Any], seed: int) -> dict[str, Any]:
    import torch

    gen = torch.Generator().manual_seed(seed)
    h, inter, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or h // heads
    bias = cfg["model_type"] == "qwen2"
    gain = ATTN_GAIN.get(cfg["model_type"], 1.0)

    def lin(out: int, inp: int) -> Any:
        return torch.randn(out, inp, generator=gen) / inp**0.5

    t: dict[str, Any] = {"model.embed_tokens.weight": torch.randn(vocab, h, generator=gen)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = torch.ones(h)
        t[p + "post_attention_layernorm.weight"] = torch.ones(h)
        for name, out in (("q", heads * hd), ("k", kv * hd), ("v", kv * hd)):
            t[p + f"self_attn.{name}_proj.weight"] = lin(out, h) * (gain if name != "v" else 1.0)
            if bias:
                t[p + f"self_attn.{name}_proj.bias"] = 0.02 * torch.randn(out, generator=gen)
        t[p + "self_attn.o_proj.weight"] = lin(h, heads * hd)
        t[p + "mlp.gate_proj.weight"] = lin(inter, h)
        t[p + "mlp.up_proj.weight"] = lin(inter, h)
        t[p + "mlp.down_proj.weight"] = lin(h, inter)
    t["model.norm.weight"] = torch.ones(h)
    t["lm_head.weight"] = lin(vocab, h)
    return {k: v.contiguous() for k, v in t.items()}


def write_model(shape: str, out: Path, seed: int = 0) -> Path:
    """Writes ``out/config.json`` and ``out/model.safetensors``; returns ``out``."""
    from safetensors.torch import save_file

    cfg = config_for(shape)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    save_file(_tensors(cfg, seed), str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mooncake._eval.weights")
    ap.add_argument("shape", choices=sorted(SHAPES))
    ap.add_argument("out", type=Path)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    print(write_model(args.shape, args.out, args.seed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
