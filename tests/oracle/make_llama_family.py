"""Tiny random-weight fixtures of the plain transformer family (Llama, Mistral-style, Qwen2,
Qwen3, Qwen3-MoE), made as ../shared/oracle's build_models.py and make_fixtures.py make theirs:
Hugging Face transformers (5.24, f32 on CPU) builds and runs each model, constant norms and
biases get N(0, 0.1) noise, llama.cpp's own converter (through ../shared/oracle/convert.py's
vocab-less wrapper) writes the f32 GGUF, llama-quantize the q8_0 / q4_0 files, and llama.cpp
itself (dump_logits) gives its logits and the exact reference of each quantized file (llama.cpp
on an f32 copy with every tensor dequantized).

usage: python make_llama_family.py OUT_DIR LLAMA_CPP_SRC [LLAMA_QUANTIZE DUMP_LOGITS]

Without the last two only the HF checkpoints, references and f32 GGUFs are written.
OUT_DIR/llama-family.json records llama.cpp's errors (the bar "RMS <= max(llama.cpp's, 1e-3)").
"""
import json, os, shutil, subprocess, sys, warnings

warnings.filterwarnings("ignore")
import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
# ../shared/oracle beside the checkout (the project's layout), or $ORACLE_DIR
ORACLE = os.environ.get("ORACLE_DIR", os.path.join(HERE, "../../../shared/oracle"))

COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
              initializer_range=0.08, rms_norm_eps=1e-6)


def llama(c):
    from transformers import LlamaConfig, LlamaForCausalLM
    # Mistral-style head size (head_dim 32, not hidden / heads = 16) and Llama 3.1's rope
    # scaling, with a short original context so that all three of its bands hold frequencies
    return LlamaForCausalLM(LlamaConfig(**{**COMMON, "head_dim": 32, "tie_word_embeddings": False},
                                        rope_parameters={"rope_type": "llama3", "factor": 8.0,
                                                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                         "original_max_position_embeddings": 64,
                                                         "rope_theta": 10000.0}))


def mistral(c):
    from transformers import MistralConfig, MistralForCausalLM
    # a window of 8 over 24 tokens: most keys fall outside it
    return MistralForCausalLM(MistralConfig(**{**COMMON, "head_dim": 32}, sliding_window=8,
                                            tie_word_embeddings=False,
                                            rope_parameters={"rope_type": "default", "rope_theta": 1e6}))


def qwen2(c):
    from transformers import Qwen2Config, Qwen2ForCausalLM
    return Qwen2ForCausalLM(Qwen2Config(**COMMON, tie_word_embeddings=False,
                                        rope_parameters={"rope_type": "default", "rope_theta": 1e6}))


def qwen3(c):
    from transformers import Qwen3Config, Qwen3ForCausalLM
    return Qwen3ForCausalLM(Qwen3Config(**{**COMMON, "head_dim": 32}, tie_word_embeddings=True,
                                        rope_parameters={"rope_type": "default", "rope_theta": 1e6}))


def qwen3moe(c):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(
        **{**COMMON, "head_dim": 16}, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        norm_topk_prob=True, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6}))


SPECS = [("llama-tiny", llama, 100), ("qwen2-tiny", qwen2, 110), ("qwen3-tiny", qwen3, 120),
         ("qwen3moe-tiny", qwen3moe, 130), ("mistral-tiny", mistral, 140)]
# HF checkpoint only: llama.cpp's converter writes no sliding window for MistralForCausalLM (its
# `llama` graph attends to every key), so a GGUF of it answers differently from transformers
HF_ONLY = {"mistral-tiny"}
N_TOKENS = 24


def perturb(model, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in list(model.named_parameters()):
            if p.numel() == 1 or torch.all(p == p.flatten()[0]):
                p.add_(torch.randn(p.shape, generator=g) * 0.1)


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


def run(cmd, log):
    with open(log, "a") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        return subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT).returncode == 0


def err(a, b):
    return {"max_abs": float(np.abs(a - b).max()), "rms": float(np.sqrt(((a - b) ** 2).mean())),
            "top1_agree": float((a.argmax(-1) == b.argmax(-1)).mean())}


def llama_logits(dump, gguf, toks, vocab, mode, log):
    out = gguf + ".logits.f32"
    if not run([dump, gguf, out, mode, ",".join(map(str, toks))], log):
        return None
    a = np.fromfile(out, dtype=np.float32).reshape(len(toks), vocab)
    os.remove(out)
    return a


def main():
    out, src = sys.argv[1], sys.argv[2]
    quantize, dump = (sys.argv[3], sys.argv[4]) if len(sys.argv) > 4 else (None, None)
    py = sys.executable
    manifest = {}
    for name, make, seed in SPECS:
        d = os.path.join(out, name)
        shutil.rmtree(d, ignore_errors=True)
        torch.manual_seed(seed)
        model = make(None).eval()
        perturb(model, seed + 1)
        model.save_pretrained(d)
        model = type(model).from_pretrained(d, dtype=torch.float32).eval()
        toks = [int(x) for x in np.random.default_rng(seed + 3).integers(0, COMMON["vocab_size"], N_TOKENS)]
        full, incr = logits_of(model, toks)
        assert np.abs(full - incr).max() < 1e-3, f"{name}: incremental reference disagrees"
        np.save(f"{d}/tokens.npy", np.array(toks, dtype=np.int32))
        np.save(f"{d}/logits.npy", full)
        np.save(f"{d}/logits_incremental.npy", incr)
        json.dump({"hf_class": type(model).__name__, "seed": seed, "n_tokens": N_TOKENS,
                   "vocab": COMMON["vocab_size"], "logits_std": float(full.std()),
                   "incremental_vs_full_max_abs": float(np.abs(full - incr).max())},
                  open(f"{d}/oracle.json", "w"), indent=1)
        if name in HF_ONLY:
            print(name, "HF checkpoint only")
            continue
        log = os.path.join(d, "convert.log")
        base = os.path.join(d, "model-f32.gguf")
        assert run([py, os.path.join(ORACLE, "convert.py"), src, d, "f32", base], log), log
        files = {"f32": base}
        entry = {}
        if quantize:
            for q in ["q8_0", "q4_0"]:
                p = os.path.join(d, f"model-{q}.gguf")
                if run([quantize, base, p, q.upper()], log):
                    files[q] = p
        for q, path in files.items():
            e = {"file": os.path.basename(path), "bytes": os.path.getsize(path)}
            if dump:
                got = llama_logits(dump, path, toks, COMMON["vocab_size"], "full", log)
                if got is not None:
                    e["llamacpp_vs_hf"] = err(got, full)
                    if q != "f32":
                        deq = os.path.join(d, f"tmp-deq-{q}.gguf")
                        if run([py, os.path.join(ORACLE, "dequant_gguf.py"), src, path, deq], log):
                            r = llama_logits(dump, deq, toks, COMMON["vocab_size"], "full", log)
                            os.remove(deq)
                            if r is not None:
                                np.save(os.path.join(d, f"ref-{q}.npy"), r)
                                e["llamacpp_vs_dequant_ref"] = err(got, r)
            entry[q] = e
        manifest[name] = {"gguf": entry}
        os.remove(log)
        print(name, json.dumps(manifest[name]))
    json.dump(manifest, open(os.path.join(out, "llama-family.json"), "w"), indent=1)


if __name__ == "__main__":
    main()
