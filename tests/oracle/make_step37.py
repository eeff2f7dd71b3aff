"""Tiny random-weight Step-3.7-Flash fixture (transformers 5.24's Step3p7ForConditionalGeneration)
for lathe's tests, in the release's own checkpoint layout.

usage: python make_step37.py OUT_DIR LLAMA_CPP_SRC ORACLE_DIR LLAMA_QUANTIZE DUMP_LOGITS

(ORACLE_DIR: ../shared/oracle beside the checkout, for convert.py and dequant_gguf.py.)

The checkpoint is written as the release is (`config.json` in the hub's remote-code form under
`text_config`: `num_attention_groups`, `attention_other_setting`, `moe_layers_enum`, per-layer
`rope_theta` / `partial_rotary_factors` / `layer_types` padded with the MTP block's entries;
tensors `model.layers.N.{self_attn.g_proj, moe.gate_proj [E, I, H], moe.router_bias,
share_expert.*}`): transformers reads that layout through its `step3p7` conversion mapping and
writes it back on save, and llama.cpp's converter (`conversion/step3.py`, `Step35Model`) reads
only that layout. Geometry varies per layer as in the release: full-attention layers have 2
query heads rotating half their head (llama3-scaled, so `rope_freqs` matters), sliding layers 3
heads rotating all of it; two leading dense blocks, then MoE blocks with a shared expert and a
sigmoid router with selection bias. One MTP block (block 5, sliding, dense: the release's
blocks 45-47 are) is appended past the trunk as the release appends its three; transformers
ignores it, llama.cpp's converter writes it to its own GGUF with `--mtp` (the trunk GGUF comes
from `--no-mtp`, so the two files disagree on `block_count` and on the per-layer arrays).

Made as ../shared/oracle/build_models.py makes the others: zero-initialised norms (the release
computes `x̂·(1+w)`) and the router bias get N(0, 0.1) noise; reference logits for the whole
sequence and incrementally (all but the last 4 tokens, then one at a time); the q8_0 file's
reference is llama.cpp on its dequantized f32 copy (ref-q8_0.npy). The sequence (24) is longer
than the window (8). SwiGLU clamps (`swiglu_limits`, `swiglu_limits_shared`) are set on blocks
1, 3 and 4 at limits the activations exceed: without them the logits move by
`unclamped_vs_clamped_rms` (oracle.json), far past the bar. mtp-logits.npy: the MTP block's
logits over the sequence (`mtp_logits`).
"""
import json, os, shutil, subprocess, sys, warnings

warnings.filterwarnings("ignore")
import numpy as np
import torch

N_TRUNK = 5
TYPES = ["full_attention", "sliding_attention", "sliding_attention", "full_attention",
         "sliding_attention", "sliding_attention"]
# SwiGLU clamps as the release sets them (its last MoE blocks, 43-44: routed experts at 7, the
# shared expert at 16), scaled to this model's activations so they bite; one dense block too,
# since the dense FFN reads `swiglu_limits_shared` as the shared expert does (transformers'
# Step3p7MLP, llama.cpp's build_ffn). The MTP block (5) is unclamped, as the converter pads it.
LIMITS = [0.0, 0.0, 0.0, 0.6, 0.6, 0.0]
LIMITS_SHARED = [0.0, 0.5, 0.0, 0.0, 0.5, 0.0]
TEXT = dict(
    hidden_size=64, intermediate_size=64, num_hidden_layers=N_TRUNK, num_attention_heads=2,
    num_attention_groups=1, head_dim=16, vocab_size=256, rms_norm_eps=1e-5,
    max_position_embeddings=4096, sliding_window=8, layer_types=TYPES,
    rope_theta=[5e6 if t == "full_attention" else 1e4 for t in TYPES],
    partial_rotary_factors=[0.5 if t == "full_attention" else 1.0 for t in TYPES],
    attention_other_setting={"attention_type": "sliding_attention", "num_attention_heads": 3,
                             "num_attention_groups": 1, "head_dim": 16, "true_head_dim": 16},
    moe_num_experts=4, moe_top_k=2, moe_intermediate_size=16, share_expert_dim=16,
    moe_layers_enum="2,3,4", moe_router_activation="sigmoid", moe_router_scaling_factor=3.0,
    norm_expert_weight=True, use_moe_router_bias=True, need_fp32_gate=True,
    use_head_wise_attn_gate=True, swiglu_limits=LIMITS, swiglu_limits_shared=LIMITS_SHARED,
    num_nextn_predict_layers=1, tie_word_embeddings=False, initializer_range=0.08,
    rope_scaling={"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
)
VISION = dict(width=16, layers=1, heads=2, image_size=28, patch_size=14)
NAME, SEED, N_TOKENS = "step37-tiny", 0, 24


def perturb(model, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in list(model.named_parameters()) + list(model.named_buffers()):
            if not p.is_floating_point() or p.numel() == 0 or "inv_freq" in n:
                continue
            if p.numel() == 1 or torch.all(p == p.flatten()[0]):
                p.add_(torch.randn(p.shape, generator=g).to(p.dtype) * 0.1)


def add_mtp(d, seed):
    """The MTP block's tensors (hub names, as vLLM's step3p5_mtp reads them) appended to the
    checkpoint: a sliding dense decoder layer plus `eh_proj`, `enorm`, `hnorm` and its own
    shared head."""
    from safetensors.torch import load_file, save_file
    path = f"{d}/model.safetensors"
    w = load_file(path)
    g = torch.Generator().manual_seed(seed)
    e, hd, nh, ff, v = 64, 16, 3, TEXT["intermediate_size"], TEXT["vocab_size"]
    r = lambda *s, std=0.08: torch.randn(*s, generator=g) * std
    b = f"model.layers.{N_TRUNK}"
    for k, t in {
        "eh_proj.weight": r(e, 2 * e), "enorm.weight": r(e, std=0.1), "hnorm.weight": r(e, std=0.1),
        "transformer.shared_head.norm.weight": r(e, std=0.1),
        "transformer.shared_head.output.weight": r(v, e),
        "input_layernorm.weight": r(e, std=0.1), "post_attention_layernorm.weight": r(e, std=0.1),
        "self_attn.q_proj.weight": r(nh * hd, e), "self_attn.k_proj.weight": r(hd, e),
        "self_attn.v_proj.weight": r(hd, e), "self_attn.o_proj.weight": r(e, nh * hd),
        "self_attn.g_proj.weight": r(nh, e), "self_attn.q_norm.weight": r(hd, std=0.1),
        "self_attn.k_norm.weight": r(hd, std=0.1), "mlp.gate_proj.weight": r(ff, e),
        "mlp.up_proj.weight": r(ff, e), "mlp.down_proj.weight": r(e, ff),
    }.items():
        w[f"{b}.{k}"] = t.contiguous()
    save_file(w, path, metadata={"format": "pt"})


def mtp_logits(model, d, toks):
    """The MTP block's logits over the sequence: row `p` reads the trunk's residual stream
    after its last block (before the final norm) at `p` and token `p + 1` (the last row token
    0), at position `p`, as llama.cpp's `graph_mtp` and vLLM's `step3p5_mtp` wire it:
    `eh_proj([enorm(embed) | hnorm(h)])`, one decoder block, `shared_head.norm`, then
    `shared_head.output`. The block is transformers' own decoder layer built for trunk
    block 1 (sliding, dense, 3 heads: the MTP block's geometry) with the MTP weights and no
    clamp (the converter pads the MTP block's limits with 0), fed the mask and rotary
    tables the trunk's block 1 gets."""
    from safetensors.torch import load_file
    from transformers.models.step3p7.modeling_step3p7 import Step3p7DecoderLayer, Step3p7RMSNorm
    lm = model.model.language_model
    cfg = lm.config
    got = {}
    h1 = lm.layers[1].register_forward_pre_hook(
        lambda m, a, kw: got.update(kw=dict(kw)), with_kwargs=True)
    h2 = lm.layers[N_TRUNK - 1].register_forward_hook(lambda m, a, o: got.update(h=o))
    with torch.no_grad():
        model(input_ids=torch.tensor([toks]), use_cache=False)
    h1.remove(); h2.remove()
    assert TEXT["layer_types"][1] == TEXT["layer_types"][N_TRUNK] == "sliding_attention"
    assert "1" not in TEXT["moe_layers_enum"].split(",")
    w = load_file(f"{d}/model.safetensors")
    b = f"model.layers.{N_TRUNK}."
    blk = Step3p7DecoderLayer(cfg, 1).eval()
    blk.mlp.limit = float("inf")
    blk.load_state_dict({k[len(b):]: v for k, v in w.items()
                         if k.startswith(b) and k[len(b):].split(".")[0] in
                         ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm")})
    norm = lambda name: Step3p7RMSNorm(TEXT["hidden_size"], eps=TEXT["rms_norm_eps"])
    en, hn, hdn = norm("e"), norm("h"), norm("head")
    en.weight.data, hn.weight.data = w[b + "enorm.weight"], w[b + "hnorm.weight"]
    hdn.weight.data = w[b + "transformer.shared_head.norm.weight"]
    nxt = torch.tensor([toks[1:] + [0]])
    with torch.no_grad():
        e = model.get_input_embeddings()(nxt)
        x = torch.cat([en(e), hn(got["h"])], dim=-1) @ w[b + "eh_proj.weight"].T
        kw = {k: v for k, v in got["kw"].items() if k in ("attention_mask", "position_ids",
                                                         "position_embeddings")}
        out = blk(x, **kw)
        out = out[0] if isinstance(out, tuple) else out
        return (hdn(out) @ w[b + "transformer.shared_head.output.weight"].T)[0].numpy()


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


# llama.cpp's `Step35Model` reads the release's raw config (`num_attention_groups`,
# `partial_rotary_factors`, `attention_other_setting`, MTP-padded per-layer lists). Its
# `load_hparams` asks transformers' AutoConfig first, and transformers 5.24 knows `step3p7`: it
# canonicalises those fields away (`rope_parameters` per layer type, `per_layer_config`, lists
# cut to the trunk) and the converter then fails (StopIteration in `generate_extra_tensors`).
# With AutoConfig refused it falls back to config.json as written, which is what it was made for.
RAW_CONFIG = """
import runpy, sys, transformers
def refuse(*a, **k):
    raise ValueError("raw config.json wanted")
transformers.AutoConfig.from_pretrained = refuse
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def convert(src, convert_py, d, out, flag):
    r = subprocess.run([sys.executable, "-c", RAW_CONFIG, convert_py, src, d, "f32", out, flag],
                       capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"conversion {flag} failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")


def build(out, src, oracle, quantize, dump):
    from transformers import AutoConfig, Step3p7ForConditionalGeneration
    d = os.path.join(out, NAME)
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d)
    cfg = {"architectures": ["Step3p7ForConditionalGeneration"], "model_type": "step3p7",
           "text_config": TEXT, "vision_config": VISION}
    json.dump(cfg, open(f"{d}/config.json", "w"), indent=1)
    torch.manual_seed(SEED)
    model = Step3p7ForConditionalGeneration(AutoConfig.from_pretrained(d)).eval()
    perturb(model, SEED + 1)
    model.save_pretrained(d)
    # The release's own config.json (transformers rewrote it in its canonical form).
    json.dump(cfg, open(f"{d}/config.json", "w"), indent=1)
    add_mtp(d, SEED + 2)
    model = Step3p7ForConditionalGeneration.from_pretrained(d, dtype=torch.float32).eval()
    g = np.random.default_rng(SEED + 3)
    toks = [int(x) for x in g.integers(0, TEXT["vocab_size"], size=N_TOKENS)]
    full, incr = logits_of(model, toks)
    if np.abs(full - incr).max() > 1e-3:
        raise SystemExit("incremental logits differ from the full pass")
    # The clamps must matter: without them the logits move well past the fixtures' bar.
    limited = [m for m in model.modules() if hasattr(m, "limit")]
    kept = [m.limit for m in limited]
    for m in limited:
        m.limit = float("inf")
    unclamped, _ = logits_of(model, toks)
    for m, x in zip(limited, kept):
        m.limit = x
    clamp_rms = float(np.sqrt(((unclamped - full) ** 2).mean()))
    if clamp_rms < 0.05:
        raise SystemExit(f"the SwiGLU clamps move the logits by only {clamp_rms} RMS")
    np.save(f"{d}/tokens.npy", np.array(toks, dtype=np.int32))
    np.save(f"{d}/logits.npy", full)
    mtp = mtp_logits(model, d, toks)
    np.save(f"{d}/mtp-logits.npy", mtp)
    v = TEXT["vocab_size"]
    info = {"family": "step37", "hf_class": type(model).__name__, "seed": SEED,
            "weights": "f32", "n_tokens": len(toks), "vocab": v,
            "logits_std": float(full.std()),
            "incremental_vs_full_max_abs": float(np.abs(full - incr).max()),
            "unclamped_vs_clamped_rms": clamp_rms,
            "mtp_logits_std": float(mtp.std()),
            "argmax": full.argmax(-1).tolist()}
    json.dump(info, open(f"{d}/oracle.json", "w"), indent=1)
    convert_py = os.path.join(oracle, "convert.py")
    base, q8, mtp = f"{d}/model-f32.gguf", f"{d}/model-q8_0.gguf", f"{d}/mtp-f32.gguf"
    convert(src, convert_py, d, base, "--no-mtp")
    convert(src, convert_py, d, mtp, "--mtp")
    for f in ("generation_config.json",):
        if os.path.exists(f"{d}/{f}"):
            os.remove(f"{d}/{f}")
    print(NAME, json.dumps({k: x for k, x in info.items() if k != "argmax"}))
    subprocess.run([quantize, base, q8, "Q8_0"], check=True, capture_output=True)
    entry = {"family": "step37", "n_tokens": len(toks), "vocab": v, "hf_weights": "f32",
             "gguf": {}}
    for q, path in (("f32", base), ("q8_0", q8)):
        lfull = llama_logits(dump, path, toks, v, "full")
        lincr = llama_logits(dump, path, toks, v, f"incr:{len(toks) - 4}")
        e = {"file": os.path.basename(path), "bytes": os.path.getsize(path),
             "llamacpp_vs_hf": err(lfull, full), "llamacpp_incremental_vs_full": err(lincr, lfull)}
        if q != "f32":
            deq = f"{d}/tmp-deq-{q}.gguf"
            subprocess.run([sys.executable, os.path.join(oracle, "dequant_gguf.py"), src, path,
                            deq], check=True, capture_output=True)
            r = llama_logits(dump, deq, toks, v, "full")
            os.remove(deq)
            np.save(f"{d}/ref-{q}.npy", r)
            e["llamacpp_vs_dequant_ref"] = err(lfull, r)
        entry["gguf"][q] = e
        print(NAME, q, json.dumps({k: x for k, x in e.items() if k != "file"}))
    mp = os.path.join(out, "manifest.json")
    manifest = json.load(open(mp)) if os.path.exists(mp) else {}
    manifest[NAME] = entry
    json.dump(manifest, open(mp, "w"), indent=1)


if __name__ == "__main__":
    build(*sys.argv[1:6])
