#!/usr/bin/env bash
# Issue 32's kernel lab in one call on the device machine (an H200): the bare cooperative-matrix
# tiles (`bench_kernels --lab all`: f16 x f16 -> f32 out of workgroup memory and streamed from
# global memory, 4096^3, against the device's peak) and the 12288x4096 x 512-token products of
# Q4_K, Q6_K, Q8_0 and MXFP4 on every product path (tiled, int8, int8x2, coop, coop-split,
# coop-splitx; coop also without bounds checks and without the weight decode), then one
# markdown table of each (also in $OUT/tile-lab.md; the full log in $OUT/tile-lab.log). With a
# lathe binary, `lathe selftest` first (the coop-split and coop-xsplit lines and any failure).
#
# usage: scripts/tile-lab.sh [BENCH_KERNELS [LATHE]]
#   BENCH_KERNELS  a release bench_kernels binary (default: .dev/bench_kernels.gz of the
#                  checkout, unpacked into $OUT)
#   LATHE          a release lathe binary (default: .dev/lathe.gz when there is one)
# env: OUT (where the results go; default /tmp/tile-lab), LAB (the --lab list, default all),
#      PEAK (the device's dense f16 TFLOP/s, default 790), TYPES (default q4_k,q6_k,q8_0,mxfp4)
#
# The Vulkan loader comes as in scripts/bench-device.sh: .gl/*.deb unpacked when carried, the
# NVIDIA ICD named when the loader finds no GPU.
set -euo pipefail

OUT=${OUT:-/tmp/tile-lab}
mkdir -p "$OUT"
LOG=$OUT/tile-lab.log
: >"$LOG"
BK=${1:-}
if [ -z "$BK" ]; then
    [ -f .dev/bench_kernels.gz ] || { echo "tile-lab: no .dev/bench_kernels.gz (carry .dev)" >&2; exit 1; }
    BK=$OUT/bench_kernels
    gunzip -c .dev/bench_kernels.gz >"$BK"
    chmod +x "$BK"
fi
[ -x "$BK" ] || { echo "tile-lab: $BK is not an executable bench_kernels" >&2; exit 1; }
LATHE=${2:-}
if [ -z "$LATHE" ] && [ -f .dev/lathe.gz ]; then
    LATHE=$OUT/lathe
    gunzip -c .dev/lathe.gz >"$LATHE"
    chmod +x "$LATHE"
fi

# --- Vulkan (as bench-device.sh) ---------------------------------------------------------
if compgen -G ".gl/*.deb" >/dev/null; then
    for f in .gl/*.deb; do dpkg -x "$f" /; done
    ldconfig
fi
if ! "$BK" --lab smem-128x128x16-2x4 --lab-size 256 --passes 1 2>>"$LOG" | grep -q "^lab smem" \
    && [ -f /usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json ]; then
    export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
    export __EGL_VENDOR_LIBRARY_FILENAMES=/usr/local/nvidia/share/glvnd/egl_vendor.d/10_nvidia.json
fi

# --- runs --------------------------------------------------------------------------------
if [ -n "$LATHE" ]; then
    echo "== selftest" | tee -a "$LOG"
    "$LATHE" selftest >"$OUT/selftest.txt" 2>>"$LOG" || true
    grep -E "^FAIL|coop-x?split|passed" "$OUT/selftest.txt" | tee -a "$LOG" || true
fi
echo "== lab" | tee -a "$LOG"
"$BK" --lab "${LAB:-all}" --peak "${PEAK:-790}" 2>&1 | tee -a "$LOG"
echo "== products" | tee -a "$LOG"
"$BK" --types "${TYPES:-q4_k,q6_k,q8_0,mxfp4}" --shapes 12288x4096 --prefill 512 --no-matvec \
    --variant - --variant LAB_UNCHECKED --variant LAB_NODECODE --variant LAB_XSPLIT 2>&1 | tee -a "$LOG"

# --- tables ------------------------------------------------------------------------------
python3 - "$LOG" "${PEAK:-790}" <<'PY' | tee "$OUT/tile-lab.md"
import re, sys
log = open(sys.argv[1]).read().splitlines()
peak = float(sys.argv[2])
print("| bare tile (4096^3) | ms | TFLOP/s | of peak | workgroup B | check |")
print("| --- | ---: | ---: | ---: | ---: | --- |")
for l in log:
    m = re.match(r"lab (\S+)\s+([\d.]+) ms\s+([\d.]+) TFLOP/s\s+([\d.]+)% of peak\s+\((\d+) B workgroup memory\)(.*)", l)
    if m:
        chk = m.group(6).strip(", ") or "-"
        print(f"| {m.group(1)} | {m.group(2)} | {m.group(3)} | {m.group(4)}% | {m.group(5)} | {chk} |")
    elif l.startswith("lab ") and "skipped" in l:
        print(f"| {l.split()[1]} | skipped | | | | {l.split('skipped:')[1].strip()} |")
print()
print("| type | 12288x4096 x 512 | variant | ms | TFLOP/s |")
print("| --- | --- | --- | ---: | ---: |")
for l in log:
    m = re.match(r"(\S+)\s+12288x4096 prefill 512 tokens\s+(\S+) (\S*): +([\d.]+) ms\s+([\d.]+) GFLOP/s", l)
    if m:
        print(f"| {m.group(1)} | {m.group(2)} | {m.group(3) or '-'} | {m.group(4)} | {float(m.group(5))/1000:.1f} |")
PY
