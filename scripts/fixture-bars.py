#!/usr/bin/env python3
"""The fixture bars on one product path, for paths CI's lavapipe cannot run (the matrix path).

usage: scripts/fixture-bars.py LATHE FIXTURES [--matmul auto|coop|coop-split|tiled] [--activations ...]

For every model file under FIXTURES (a copy of ../shared/fixtures/models or tests/fixtures/models:
`<model>/model-<type>.gguf` with `tokens.npy`, `logits.npy`, `ref-<type>.npy` and the
`manifest.json` beside the model folders), runs `lathe logits` over the whole sequence and
compares with the reference for that file (`ref-<type>.npy` for quantized files, `logits.npy`
for f32/bf16 ones) by the fixtures' README: RMS error <= 0.02, top-1 agreement >= 95%, and RMS
no larger than max(llama.cpp's own on that file, 1e-3). Prints one line per file and exits 1
if any misses its bar. Needs numpy.
"""
import json
import os
import subprocess
import sys
import tempfile

import numpy as np


def main():
    if len(sys.argv) < 3:
        print(__doc__, file=sys.stderr)
        return 2
    lathe, root = sys.argv[1], sys.argv[2]
    extra = sys.argv[3:]
    manifest = json.load(open(os.path.join(root, "manifest.json")))
    failed = 0
    checked = 0
    for model in sorted(os.listdir(root)):
        d = os.path.join(root, model)
        if not os.path.isdir(d) or not os.path.exists(os.path.join(d, "tokens.npy")):
            continue
        for f in sorted(os.listdir(d)):
            if not (f.startswith("model-") and f.endswith(".gguf")):
                continue
            ty = f[len("model-"):-len(".gguf")]
            entry = manifest.get(model, {}).get("gguf", {}).get(ty, {})
            if ty in ("f32", "bf16", "f16"):
                ref = os.path.join(d, "logits.npy")
                ll = entry.get("llamacpp_vs_hf", {}).get("rms")
            else:
                ref = os.path.join(d, f"ref-{ty}.npy")
                ll = entry.get("llamacpp_vs_dequant_ref", {}).get("rms")
            if not os.path.exists(ref):
                continue
            with tempfile.TemporaryDirectory() as tmp:
                out = os.path.join(tmp, "out.npy")
                r = subprocess.run(
                    [lathe, "logits", "-m", os.path.join(d, f), "--tokens",
                     os.path.join(d, "tokens.npy"), "--out", out, *extra],
                    capture_output=True, text=True)
                if r.returncode != 0:
                    print(f"FAIL {model}/{f}: lathe logits: {r.stderr.strip()[-300:]}")
                    failed += 1
                    continue
                got = np.load(out).astype(np.float64)
            want = np.load(ref).astype(np.float64).reshape(got.shape)
            rms = float(np.sqrt(np.mean((got - want) ** 2)))
            top1 = float(np.mean(got.argmax(-1) == want.argmax(-1)))
            bar = max(ll if ll is not None else 0.0, 1e-3)
            ok = rms <= 0.02 and top1 >= 0.95 and rms <= bar and np.isfinite(got).all()
            checked += 1
            failed += not ok
            print(f"{'ok  ' if ok else 'FAIL'} {model}/{f}: rms {rms:.2e} (bar {min(bar, 0.02):.2e}, "
                  f"llama.cpp {ll if ll is not None else float('nan'):.2e}), top-1 {top1:.3f}, "
                  f"{got.shape[0]} tokens")
    print(f"{checked - failed} passed, {failed} failed")
    return 1 if failed or checked == 0 else 0


if __name__ == "__main__":
    sys.exit(main())
