#!/usr/bin/env python3
"""Reference of the Qwen3.5 / Qwen3-Next multi-token prediction (MTP) block in numpy, f64.

Written from the published model math, independently of lathe's Rust: Hugging Face's
Qwen3-Next decoder layer (full attention) and vLLM's `Qwen3NextMultiTokenPredictor`:

    e = RMSNorm_emb(embed(t));  h' = RMSNorm_hid(h)
    x = fc([e | h'])
    x = x + o_proj(attn(RMSNorm_in(x)) * sigmoid(gate))
    x = x + mlp(RMSNorm_post(x))
    logits = lm_head(RMSNorm_mtp(x))

Qwen3-Next norms multiply by (1 + w). Attention: q_proj gives per head [q | gate]; q and k
get a per-head (1 + w) RMSNorm, then NeoX RoPE on the first `partial_rotary_factor` of each
head; grouped-query, causal, scale 1/sqrt(head_dim). MoE: softmax over all experts, top-k,
renormalised, plus sigmoid(shared_expert_gate x) * shared_expert(x).

usage: mtp_ref.py MODEL_DIR HIDDEN.npy TOKENS.npy POS0 OUT.npy
  HIDDEN [n, hidden] are the hidden states row j reads, TOKENS [n] the tokens it embeds,
  row j sits at position POS0 + j. Writes logits [n, vocab] (f32).
"""
import json
import struct
import sys

import numpy as np


def load_safetensors(path):
    with open(path, "rb") as f:
        data = f.read()
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8 : 8 + n])
    base = 8 + n
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] != "F32":
            raise SystemExit(f"{name}: dtype {info['dtype']} (this reference reads F32)")
        lo, hi = info["data_offsets"]
        out[name] = np.frombuffer(data[base + lo : base + hi], dtype="<f4").reshape(info["shape"]).astype(np.float64)
    return out


def rms(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * (1.0 + w)


def silu(x):
    return x / (1.0 + np.exp(-x))


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def rope(x, pos, rot, theta):
    # x [n, heads, d]; NeoX halves on the first `rot` dims.
    inv = theta ** (-np.arange(0, rot, 2, dtype=np.float64) / rot)
    ang = pos[:, None] * inv[None, :]
    cos = np.concatenate([np.cos(ang), np.cos(ang)], axis=-1)[:, None, :]
    sin = np.concatenate([np.sin(ang), np.sin(ang)], axis=-1)[:, None, :]
    r = x[..., :rot]
    half = rot // 2
    rotated = np.concatenate([-r[..., half:], r[..., :half]], axis=-1)
    return np.concatenate([r * cos + rotated * sin, x[..., rot:]], axis=-1)


def mlp(W, p, x, cfg):
    lin = lambda name, v: v @ W[p + name].T
    if p + "mlp.gate.weight" not in W:
        return lin("mlp.down_proj.weight", silu(lin("mlp.gate_proj.weight", x)) * lin("mlp.up_proj.weight", x))
    logits = lin("mlp.gate.weight", x)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    k = cfg["num_experts_per_tok"]
    out = np.zeros_like(x)
    for i in range(x.shape[0]):
        top = np.argsort(-probs[i], kind="stable")[:k]
        w = probs[i, top]
        if cfg.get("norm_topk_prob", True):
            w = w / w.sum()
        for e, we in zip(top, w):
            q = f"mlp.experts.{e}."
            y = silu(x[i] @ W[p + q + "gate_proj.weight"].T) * (x[i] @ W[p + q + "up_proj.weight"].T)
            out[i] += we * (y @ W[p + q + "down_proj.weight"].T)
    if p + "mlp.shared_expert.gate_proj.weight" in W:
        s = "mlp.shared_expert."
        y = lin(s + "down_proj.weight", silu(lin(s + "gate_proj.weight", x)) * lin(s + "up_proj.weight", x))
        out += sigmoid(lin("mlp.shared_expert_gate.weight", x)) * y
    return out


def main():
    model_dir, hidden_path, tokens_path, pos0, out_path = sys.argv[1:6]
    cfg = json.load(open(f"{model_dir}/config.json"))
    W = load_safetensors(f"{model_dir}/model.safetensors")
    hidden = np.load(hidden_path).astype(np.float64)
    tokens = np.load(tokens_path).astype(np.int64)
    n = len(tokens)
    pos = np.arange(n, dtype=np.float64) + float(pos0)
    eps = cfg.get("rms_norm_eps", 1e-6)
    H, Hkv, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    rp = cfg.get("rope_parameters", {})
    theta = rp.get("rope_theta", cfg.get("rope_theta", 1e7))
    rot = int(round(d * rp.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25))))

    e = rms(W["model.embed_tokens.weight"][tokens], W["mtp.pre_fc_norm_embedding.weight"], eps)
    h = rms(hidden, W["mtp.pre_fc_norm_hidden.weight"], eps)
    x = np.concatenate([e, h], axis=-1) @ W["mtp.fc.weight"].T

    p = "mtp.layers.0."
    a = rms(x, W[p + "input_layernorm.weight"], eps)
    qg = (a @ W[p + "self_attn.q_proj.weight"].T).reshape(n, H, 2 * d)
    q, gate = qg[..., :d], qg[..., d:]
    k = (a @ W[p + "self_attn.k_proj.weight"].T).reshape(n, Hkv, d)
    v = (a @ W[p + "self_attn.v_proj.weight"].T).reshape(n, Hkv, d)
    q = rope(rms(q, W[p + "self_attn.q_norm.weight"], eps), pos, rot, theta)
    k = rope(rms(k, W[p + "self_attn.k_norm.weight"], eps), pos, rot, theta)
    att = np.zeros((n, H, d))
    for hh in range(H):
        kv = hh // (H // Hkv)
        s = q[:, hh, :] @ k[:, kv, :].T / np.sqrt(d)
        s = np.where(np.tril(np.ones((n, n), dtype=bool)), s, -np.inf)
        s = np.exp(s - s.max(-1, keepdims=True))
        s /= s.sum(-1, keepdims=True)
        att[:, hh, :] = s @ v[:, kv, :]
    att = (att * sigmoid(gate)).reshape(n, H * d)
    x = x + att @ W[p + "self_attn.o_proj.weight"].T
    x = x + mlp(W, p, rms(x, W[p + "post_attention_layernorm.weight"], eps), cfg)
    head = W.get("lm_head.weight", W["model.embed_tokens.weight"])
    logits = rms(x, W["mtp.norm.weight"], eps) @ head.T
    np.save(out_path, logits.astype(np.float32))


if __name__ == "__main__":
    main()
