#!/usr/bin/env python3
"""Reference logits of a Llama-architecture GGUF in numpy, f32.

Written from the published model math, independently of lathe's Rust: Hugging Face's
`LlamaForCausalLM` (modeling_llama.py):

    x = embed(t)
    per layer:  x = x + o_proj(attn(RMSNorm_in(x)))
                x = x + down(silu(gate(RMSNorm_post(x))) * up(RMSNorm_post(x)))
    logits = lm_head(RMSNorm_final(x))          (lm_head = embed when the file has no output)

RMSNorm multiplies by w. Attention: grouped-query (query head h reads KV head h // (H/Hkv)),
causal, scale 1/sqrt(head_dim), RoPE by HF's `rotate_half` (halves of each head) with
inv_freq = base^(-2i/dim). llama.cpp's converter permutes Q and K rows so that its `llama`
files rotate interleaved pairs instead; this script undoes that permutation
(`convert_hf_to_gguf.py`, `LlamaModel.permute`) and rotates as HF does, so an engine that
rotates the file's rows as stored must agree with it.

Weights are dequantized by gguf-py (`gguf.quants.dequantize`), llama.cpp's own package.

usage: llama_ref.py MODEL.gguf TOKENS.npy OUT.npy [HIDDEN.npy]
  TOKENS int32 [T]; writes logits [T, vocab] (f32) of one causal pass over all of them, and
  with HIDDEN the residual stream after each layer's attention and after its FFN,
  [n_layer, 2, T, n_embd] (f32).
"""
import sys

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize


def field(r, name):
    f = r.fields[name]
    return f.contents()


def main():
    path, tokens_path, out_path = sys.argv[1:4]
    hidden_path = sys.argv[4] if len(sys.argv) > 4 else None
    r = GGUFReader(path)
    arch = field(r, "general.architecture")
    if arch != "llama":
        raise SystemExit(f"{path}: architecture {arch} (this reference reads llama)")
    hp = lambda k, d=None: field(r, f"llama.{k}") if f"llama.{k}" in r.fields else d
    n_layer = hp("block_count")
    n_embd = hp("embedding_length")
    n_head = hp("attention.head_count")
    n_kv = hp("attention.head_count_kv", n_head)
    hd = hp("attention.key_length", n_embd // n_head)
    base = hp("rope.freq_base", 10000.0)
    eps = hp("attention.layer_norm_rms_epsilon", 1e-5)

    tensors = {t.name: t for t in r.tensors}

    def w(name):
        t = tensors[name]
        a = dequantize(t.data, t.tensor_type).astype(np.float32)
        # numpy order: [rows, cols] = reversed ggml dims.
        return a.reshape([int(d) for d in reversed(t.shape)])

    def unpermute(m, heads):
        # Inverse of LlamaModel.permute: rows (head, 2, d/2) back to (head, d/2, 2)... i.e.
        # the converter's reshape(h, 2, d/2).swapaxes(1, 2) undone.
        rows = m.shape[0]
        return m.reshape(heads, rows // heads // 2, 2, -1).swapaxes(1, 2).reshape(m.shape)

    toks = np.load(tokens_path).astype(np.int64)
    T = len(toks)
    emb = w("token_embd.weight")
    head = w("output.weight") if "output.weight" in tensors else emb

    def rms(x, g):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * g

    inv = 1.0 / (base ** (np.arange(0, hd, 2, dtype=np.float32) / hd))
    if "rope_freqs.weight" in tensors:
        # Llama-3 RoPE scaling as llama.cpp's converter stores it: per-pair divisors of the
        # frequencies (`LlamaModel.generate_extra_tensors`, `rope_freqs.weight`).
        inv = inv / w("rope_freqs.weight")
    ang = np.arange(T, dtype=np.float32)[:, None] * inv[None, :]  # [T, hd/2]
    cos = np.cos(np.concatenate([ang, ang], axis=-1))[:, None, :]
    sin = np.sin(np.concatenate([ang, ang], axis=-1))[:, None, :]

    def rope(x):  # [T, heads, hd], HF rotate_half
        x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
        return x * cos + np.concatenate([-x2, x1], axis=-1) * sin

    mask = np.triu(np.full((T, T), -np.inf, dtype=np.float32), 1)
    x = emb[toks]
    hidden = []
    for l in range(n_layer):
        b = lambda s: w(f"blk.{l}.{s}")
        h = rms(x, b("attn_norm.weight"))
        q = (h @ unpermute(b("attn_q.weight"), n_head).T).reshape(T, n_head, hd)
        k = (h @ unpermute(b("attn_k.weight"), n_kv).T).reshape(T, n_kv, hd)
        v = (h @ b("attn_v.weight").T).reshape(T, n_kv, hd)
        q, k = rope(q), rope(k)
        g = n_head // n_kv
        k = np.repeat(k, g, axis=1)
        v = np.repeat(v, g, axis=1)
        s = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(hd) + mask
        s = np.exp(s - s.max(axis=-1, keepdims=True))
        s /= s.sum(axis=-1, keepdims=True)
        a = np.einsum("hqk,khd->qhd", s, v).reshape(T, n_head * hd)
        x = x + a @ b("attn_output.weight").T
        hidden.append(x)
        h = rms(x, b("ffn_norm.weight"))
        gate = h @ b("ffn_gate.weight").T
        up = h @ b("ffn_up.weight").T
        x = x + (gate / (1.0 + np.exp(-gate)) * up) @ b("ffn_down.weight").T
        hidden.append(x)
    logits = rms(x, w("output_norm.weight")) @ head.T
    np.save(out_path, logits.astype(np.float32))
    if hidden_path:
        h = np.stack(hidden).reshape(n_layer, 2, T, n_embd)
        np.save(hidden_path, h.astype(np.float32))


if __name__ == "__main__":
    main()
