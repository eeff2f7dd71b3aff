"""Tiny random-weight Gemma-4 fixtures (transformers 5.24's Gemma4ForCausalLM) for lathe's tests.

usage: python make_gemma4.py OUT_DIR LLAMA_CPP_SRC ORACLE_DIR LLAMA_QUANTIZE DUMP_LOGITS [NAME...]

(ORACLE_DIR: ../shared/oracle beside the checkout, for convert.py and dequant_gguf.py;
DUMP_LOGITS: tests/oracle/dump_logits.cpp built against llama.cpp, its header says how.)

Made as ../shared/oracle/build_models.py makes the others: constant-initialised norms and the
layer scalar get N(0, 0.1) noise (so w vs 1+w RMSNorm mistakes show), reference logits for the
whole sequence and incrementally (all but the last 4 tokens, then one at a time), then the HF
directory goes through llama.cpp's converter (../shared/oracle/convert.py's vocabulary-less
wrapper) to an f32 GGUF, which llama-quantize turns into q8_0. As ../shared/oracle/make_fixtures.py
does (its converter flag --no-mtp is refused for Gemma-4, hence this script): llama.cpp's logits
on every file (whole sequence and incremental) and its error against the reference go into
OUT_DIR/manifest.json; the q8_0 file's reference is llama.cpp on its dequantized f32 copy
(ref-q8_0.npy). The sequence is longer than the sliding window, so the window matters.
"""
import json, os, shutil, subprocess, sys, warnings

warnings.filterwarnings("ignore")
import numpy as np
import torch


# hidden 64, sliding heads of 32 and global heads of 64; global layers ship no v_proj
# (attention_k_eq_v) and rotate a quarter of their head (proportional RoPE).
DENSE = dict(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=5,
    layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention",
                 "full_attention"],
    num_attention_heads=2, num_key_value_heads=1, head_dim=32, global_head_dim=64,
    num_global_key_value_heads=1, attention_k_eq_v=True, sliding_window=8,
    final_logit_softcapping=30.0, hidden_size_per_layer_input=0, num_kv_shared_layers=0,
    rms_norm_eps=1e-6, max_position_embeddings=4096, tie_word_embeddings=True,
    initializer_range=0.08,
    rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                           "rope_theta": 1000000.0},
    },
)
# The MoE variant (the family's 26B-A4B layout): every block runs the dense MLP as a shared
# branch beside 4 routed GeGLU experts of 32 (top-2), gate and up stored fused.
MOE = dict(DENSE, num_hidden_layers=3, vocab_size=256, intermediate_size=64,
           layer_types=["sliding_attention", "full_attention", "sliding_attention"],
           enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32)
# The E2B/E4B layout: per-layer embeddings (a second token table of 16 columns per block, a
# projection of the embedding to the same, and a gated tail block per layer), global layers
# with their own v_proj (E4B sets no attention_k_eq_v), and the last 3 blocks sharing the KV
# of the last earlier block of their type (a sliding and a global one each). Those shared
# blocks run a double-wide MLP (E2B's use_double_wide_mlp; E4B's FFN is uniform).
E4B = dict(DENSE, num_hidden_layers=6, vocab_size=256, intermediate_size=64,
           layer_types=["sliding_attention", "sliding_attention", "full_attention",
                        "sliding_attention", "sliding_attention", "full_attention"],
           attention_k_eq_v=False, num_global_key_value_heads=None,
           hidden_size_per_layer_input=16, vocab_size_per_layer_input=256,
           num_kv_shared_layers=3, use_double_wide_mlp=True)
SPECS = {"gemma4-tiny": dict(cfg=DENSE, seed=0, n_tokens=24),
         "gemma4moe-tiny": dict(cfg=MOE, seed=4, n_tokens=24),
         "gemma4e-tiny": dict(cfg=E4B, seed=8, n_tokens=24)}


def perturb(model, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in list(model.named_parameters()) + list(model.named_buffers()):
            if not p.is_floating_point() or p.numel() == 0 or "inv_freq" in n or "embed_scale" in n:
                continue
            if p.numel() == 1 or torch.all(p == p.flatten()[0]):
                # Per-expert output scales vary more, so that a dropped one shows.
                s = 0.5 if "per_expert_scale" in n else 0.1
                p.add_(torch.randn(p.shape, generator=g).to(p.dtype) * s)


def logits_of(model, toks):
    ids = torch.tensor([toks])
    with torch.no_grad():
        full = model(input_ids=ids, use_cache=False).logits[0].float().numpy()
        n = len(toks) - 4
        o = model(input_ids=ids[:, :n], use_cache=True)
        steps, pkv = [o.logits[0].float()], o.past_key_values
        for i in range(n, len(toks)):
            o = model(input_ids=ids[:, i:i + 1], past_key_values=pkv, use_cache=True)
            pkv = o.past_key_values
            steps.append(o.logits[0].float())
    return full, torch.cat(steps).numpy()


def err(a, b):
    return {"max_abs": float(np.abs(a - b).max()), "rms": float(np.sqrt(((a - b) ** 2).mean())),
            "top1_agree": float((a.argmax(-1) == b.argmax(-1)).mean())}


def llama_logits(dump, gguf, toks, n_vocab, mode):
    out = gguf + ".logits.f32"
    subprocess.run([dump, gguf, out, mode, ",".join(map(str, toks))], check=True,
                   capture_output=True)
    a = np.fromfile(out, dtype=np.float32).reshape(len(toks), n_vocab)
    os.remove(out)
    return a


def llama_side(out, oracle, quantize, dump, name):
    d = os.path.join(out, name)
    info = json.load(open(f"{d}/oracle.json"))
    toks = np.load(f"{d}/tokens.npy").tolist()
    ref = np.load(f"{d}/logits.npy")
    v = info["vocab"]
    base = f"{d}/model-f32.gguf"
    q8 = f"{d}/model-q8_0.gguf"
    subprocess.run([quantize, base, q8, "Q8_0"], check=True, capture_output=True)
    entry = {"family": "gemma4", "n_tokens": len(toks), "vocab": v, "hf_weights": "f32", "gguf": {}}
    for q, path in (("f32", base), ("q8_0", q8)):
        full = llama_logits(dump, path, toks, v, "full")
        incr = llama_logits(dump, path, toks, v, f"incr:{len(toks) - 4}")
        e = {"file": os.path.basename(path), "bytes": os.path.getsize(path),
             "llamacpp_vs_hf": err(full, ref), "llamacpp_incremental_vs_full": err(incr, full)}
        if q != "f32":
            deq = f"{d}/tmp-deq-{q}.gguf"
            subprocess.run([sys.executable, os.path.join(oracle, "dequant_gguf.py"),
                            LLAMA_SRC, path, deq],
                           check=True, capture_output=True)
            r = llama_logits(dump, deq, toks, v, "full")
            os.remove(deq)
            np.save(f"{d}/ref-{q}.npy", r)
            e["llamacpp_vs_dequant_ref"] = err(full, r)
        entry["gguf"][q] = e
        print(name, q, json.dumps({k: x for k, x in e.items() if k != "file"}))
    mp = os.path.join(out, "manifest.json")
    manifest = json.load(open(mp)) if os.path.exists(mp) else {}
    manifest[name] = entry
    json.dump(manifest, open(mp, "w"), indent=1)


def build(out, src, convert, name, spec):
    from transformers import Gemma4TextConfig, Gemma4ForCausalLM
    d = os.path.join(out, name)
    shutil.rmtree(d, ignore_errors=True)
    torch.manual_seed(spec["seed"])
    model = Gemma4ForCausalLM(Gemma4TextConfig(**spec["cfg"])).eval()
    perturb(model, spec["seed"] + 1)
    model.save_pretrained(d)
    model = Gemma4ForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    g = np.random.default_rng(spec["seed"] + 3)
    toks = [int(x) for x in g.integers(0, model.config.vocab_size, size=spec["n_tokens"])]
    full, incr = logits_of(model, toks)
    if np.abs(full - incr).max() > 1e-3:
        raise SystemExit(f"{name}: incremental logits differ from the full pass")
    np.save(f"{d}/tokens.npy", np.array(toks, dtype=np.int32))
    np.save(f"{d}/logits.npy", full)
    info = {"family": "gemma4", "hf_class": type(model).__name__, "seed": spec["seed"],
            "weights": "f32", "n_tokens": len(toks), "vocab": model.config.vocab_size,
            "logits_std": float(full.std()),
            "incremental_vs_full_max_abs": float(np.abs(full - incr).max()),
            "argmax": full.argmax(-1).tolist()}
    json.dump(info, open(f"{d}/oracle.json", "w"), indent=1)
    # Gemma3Model.modify_tensors trims token_embd to the row count of tokenizer.json; a
    # placeholder vocabulary of vocab_size entries keeps every row (the wrapper writes none).
    stub = {"model": {"vocab": {f"t{i}": i for i in range(model.config.vocab_size)}}, "added_tokens": []}
    json.dump(stub, open(f"{d}/tokenizer.json", "w"))
    r = subprocess.run([sys.executable, convert, src, d, "f32", f"{d}/model-f32.gguf"],
                       capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"{name}: conversion failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    for f in ("generation_config.json", "tokenizer.json"):
        if os.path.exists(f"{d}/{f}"):
            os.remove(f"{d}/{f}")
    print(name, json.dumps({k: v for k, v in info.items() if k != "argmax"}))


if __name__ == "__main__":
    out, LLAMA_SRC, oracle, quantize, dump = sys.argv[1:6]
    for name, spec in SPECS.items():
        if len(sys.argv) <= 6 or name in sys.argv[6:]:
            build(out, LLAMA_SRC, os.path.join(oracle, "convert.py"), name, spec)
            llama_side(out, oracle, quantize, dump, name)
