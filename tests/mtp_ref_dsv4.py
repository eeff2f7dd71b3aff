#!/usr/bin/env python3
"""Reference of DeepSeek-V4's multi-token prediction (MTP) block in numpy, f64.

Written from DeepSeek's published inference code (`inference/model.py`: `MTPBlock`,
`Block`, `Attention`, `Gate`, `Expert`, `ParallelHead.hc_head`, the kernel's
`hc_split_sinkhorn`), independently of lathe's Rust. Per row p (hidden copies h_p [hc, d]
of the trunk's residual stream, token t = the token after p):

    e = enorm(embed(t));  x_j = e_proj(e) + h_proj(hnorm(h_p,j))      for each copy j
    x = Block(x)  (hyper-connections around attention and MoE, below)
    logits = head(norm(hc_head(x)))

Block: for each of attention and FFN,
    mixes = (flat(x) @ fn.T) * rsqrt(mean(flat(x)^2) + eps)
    pre = sigmoid(mixes[:hc] s0 + b) + hc_eps;  post = 2 sigmoid(mixes[hc:2hc] s1 + b)
    comb = softmax_rows(mixes[2hc:] s2 + b) + hc_eps, then column / row normalisations
    y = norm(sum_j pre_j x_j);  out = sublayer(y)
    x'_j = post_j out + sum_i comb[i, j] x_i
Attention (window only, the releases' MTP block): q = wq_b(q_norm(wq_a y)) per head
rescaled by rsqrt(mean(q^2) + eps), kv = kv_norm(wkv y) (one head, K = V), RoPE on the
last qk_rope_head_dim dims as interleaved pairs (base rope_theta), keys of the window
positions max(0, p - window + 1)..p, softmax with a per-head sink in the denominator,
scale head_dim^-1/2; the output's RoPE undone; wo_a per group of heads, then wo_b.
MoE: s = sqrt(softplus(y @ gate.T)), top-k of s + bias (ties to the lower id), weights
s / sum * routed_scaling_factor; expert = w2(silu(min(w1 y, L)) * clamp(w3 y, -L, L));
plus the shared expert.

usage: mtp_ref_dsv4.py MODEL_DIR HIDDEN.npy TOKENS.npy POS0 OUT.npy
  MODEL_DIR holds the release layout (config.json, model.safetensors in F32) with `mtp.0.*`;
  HIDDEN [n, hc * hidden] the copies row j reads, TOKENS [n] the tokens it embeds, row j at
  position POS0 + j (the block's own cache holds only these rows). Writes logits [n, vocab].
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
        if name == "__metadata__" or not (name.startswith("mtp.") or name in ("embed.weight", "head.weight")):
            continue
        if info["dtype"] != "F32":
            raise SystemExit(f"{name}: dtype {info['dtype']} (this reference reads F32)")
        lo, hi = info["data_offsets"]
        out[name] = np.frombuffer(data[base + lo : base + hi], dtype="<f4").reshape(info["shape"]).astype(np.float64)
    return out


def rms(x, w, eps):
    y = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    return y if w is None else y * w


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def softmax(x, axis):
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def rope(x, pos, rd, theta, inverse=False):
    # x [n, heads, d]: the last rd dims as (re, im) pairs, angle pos * theta^(-2i/rd).
    freqs = 1.0 / theta ** (np.arange(0, rd, 2, dtype=np.float64) / rd)
    ang = pos[:, None] * freqs[None, :]
    if inverse:
        ang = -ang
    c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    t = x[..., -rd:]
    re, im = t[..., 0::2], t[..., 1::2]
    out = x.copy()
    out[..., -rd:][..., 0::2] = re * c - im * s
    out[..., -rd:][..., 1::2] = re * s + im * c
    return out


def hc_split(mixes, scale, base, hc, iters, eps):
    pre = sigmoid(mixes[:, :hc] * scale[0] + base[:hc]) + eps
    post = 2.0 * sigmoid(mixes[:, hc : 2 * hc] * scale[1] + base[hc : 2 * hc])
    comb = (mixes[:, 2 * hc :] * scale[2] + base[2 * hc :]).reshape(-1, hc, hc)
    comb = softmax(comb, -1) + eps
    comb = comb / (comb.sum(-2, keepdims=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(-1, keepdims=True) + eps)
        comb = comb / (comb.sum(-2, keepdims=True) + eps)
    return pre, post, comb


def hc_pre(x, W, p, site, cfg):
    # x [n, hc, d]
    n, hc, d = x.shape
    flat = x.reshape(n, hc * d)
    eps = cfg["rms_norm_eps"]
    mixes = (flat @ W[f"{p}hc_{site}_fn"].T) / np.sqrt(np.mean(flat * flat, -1, keepdims=True) + eps)
    pre, post, comb = hc_split(mixes, W[f"{p}hc_{site}_scale"], W[f"{p}hc_{site}_base"], hc,
                               cfg["hc_sinkhorn_iters"], cfg["hc_eps"])
    y = (pre[:, :, None] * x).sum(1)
    return y, post, comb


def hc_post(out, x, post, comb):
    # x'_j = post_j out + sum_i comb[i, j] x_i
    return post[:, :, None] * out[:, None, :] + np.einsum("nij,nid->njd", comb, x)


def attention(y, W, p, pos, cfg):
    n = y.shape[0]
    H, D, rd = cfg["num_attention_heads"], cfg["head_dim"], cfg["qk_rope_head_dim"]
    eps = cfg["rms_norm_eps"]
    theta = cfg.get("rope_theta", 10000.0)
    qr = rms(y @ W[f"{p}attn.wq_a.weight"].T, W[f"{p}attn.q_norm.weight"], eps)
    q = (qr @ W[f"{p}attn.wq_b.weight"].T).reshape(n, H, D)
    q = rms(q, None, eps)
    q = rope(q, pos, rd, theta)
    kv = rms(y @ W[f"{p}attn.wkv.weight"].T, W[f"{p}attn.kv_norm.weight"], eps)
    kv = rope(kv[:, None, :], pos, rd, theta)[:, 0, :]
    sink = W[f"{p}attn.attn_sink"]
    win = cfg["sliding_window"]
    o = np.zeros((n, H, D))
    for i in range(n):
        keys = [j for j in range(n) if pos[i] - win < pos[j] <= pos[i]]
        k = kv[keys]
        s = (q[i] @ k.T) / np.sqrt(D)  # [H, keys]
        m = np.maximum(s.max(-1, keepdims=True), sink[:, None])
        e = np.exp(s - m)
        den = e.sum(-1, keepdims=True) + np.exp(sink[:, None] - m)
        o[i] = (e @ k) / den
    o = rope(o, pos, rd, theta, inverse=True)
    G, R = cfg["o_groups"], cfg["o_lora_rank"]
    wo_a = W[f"{p}attn.wo_a.weight"].reshape(G, R, -1)
    u = np.einsum("ngd,grd->ngr", o.reshape(n, G, -1), wo_a).reshape(n, G * R)
    return u @ W[f"{p}attn.wo_b.weight"].T


def swiglu(g, u, limit):
    if limit > 0:
        g = np.minimum(g, limit)
        u = np.clip(u, -limit, limit)
    return g * sigmoid(g) * u


def moe(y, W, p, cfg):
    limit = cfg.get("swiglu_limit", 0.0) or 0.0
    k = cfg["num_experts_per_tok"]
    logits = y @ W[f"{p}ffn.gate.weight"].T
    s = np.sqrt(np.logaddexp(0.0, logits))
    out = np.zeros_like(y)
    for i in range(y.shape[0]):
        sel = s[i] + W[f"{p}ffn.gate.bias"]
        top = np.argsort(-sel, kind="stable")[:k]
        w = s[i][top]
        w = w / w.sum() * cfg.get("routed_scaling_factor", 1.0)
        for e, we in zip(top, w):
            ep = f"{p}ffn.experts.{e}."
            h = swiglu(W[ep + "w1.weight"] @ y[i], W[ep + "w3.weight"] @ y[i], limit)
            out[i] += we * (W[ep + "w2.weight"] @ h)
    sp = f"{p}ffn.shared_experts."
    h = swiglu(y @ W[sp + "w1.weight"].T, y @ W[sp + "w3.weight"].T, limit)
    return out + h @ W[sp + "w2.weight"].T


def main():
    model_dir, hidden_p, tokens_p, pos0, out_p = sys.argv[1:6]
    cfg = json.load(open(f"{model_dir}/config.json"))
    W = load_safetensors(f"{model_dir}/model.safetensors")
    hc, d = cfg["hc_mult"], cfg["hidden_size"]
    eps = cfg["rms_norm_eps"]
    hidden = np.load(hidden_p).astype(np.float64).reshape(-1, hc, d)
    tokens = np.load(tokens_p).astype(np.int64)
    n = len(tokens)
    pos = np.arange(n, dtype=np.float64) + int(pos0)
    p = "mtp.0."
    e = rms(W["embed.weight"][tokens], W[p + "enorm.weight"], eps) @ W[p + "e_proj.weight"].T
    x = rms(hidden, W[p + "hnorm.weight"], eps) @ W[p + "h_proj.weight"].T + e[:, None, :]
    y, post, comb = hc_pre(x, W, p, "attn", cfg)
    x = hc_post(attention(rms(y, W[p + "attn_norm.weight"], eps), W, p, pos, cfg), x, post, comb)
    y, post, comb = hc_pre(x, W, p, "ffn", cfg)
    x = hc_post(moe(rms(y, W[p + "ffn_norm.weight"], eps), W, p, cfg), x, post, comb)
    flat = x.reshape(n, hc * d)
    mixes = (flat @ W[p + "hc_head_fn"].T) / np.sqrt(np.mean(flat * flat, -1, keepdims=True) + eps)
    pre = sigmoid(mixes * W[p + "hc_head_scale"][0] + W[p + "hc_head_base"]) + cfg["hc_eps"]
    h = (pre[:, :, None] * x).sum(1)
    logits = rms(h, W[p + "norm.weight"], eps) @ W["head.weight"].T
    np.save(out_p, logits.astype(np.float32))


if __name__ == "__main__":
    main()
