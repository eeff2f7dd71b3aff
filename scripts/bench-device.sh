#!/usr/bin/env bash
# The standard speed set, in one call on the device machine (an H200: 16 cores, 64 GiB disk):
# synthesize each model with `lathe synth`, measure it with `lathe bench`, delete it, and
# print one markdown table (also written to $OUT/bench.md, with every bench JSON object in
# $OUT/bench.jsonl and the full log in $OUT/bench.log).
#
#   Qwen3.5-9B Q4_K_M                    p512 / n128
#   Qwen3.5-35B-A3B Q4_K_M               p512 / n128, then with --gpu-mem holding 75%, 50%
#                                        and 0% of the experts; a skewed-router file at 50%
#   DeepSeek-V4-Flash, 8 of 43 layers    inspect + bench ("n/a" while lathe cannot run it)
#
# usage: scripts/bench-device.sh [LATHE] [--quick] [--llbench DIR]
#   LATHE      the lathe binary (default ./lathe)
#   --quick    the demo model only, with tiny tests: checks the script on lavapipe in seconds
#   --llbench  llama.cpp's Vulkan backend driver (../shared/tools/llbench, copied into an
#              ignored folder of the checkout): each file is also measured by it, in the same
#              call, and the table gets llama.cpp's numbers and lathe's ratio to them
# env: BENCH_WORK (scratch folder, default /tmp/lathe-bench), BENCH_REPS (default 5),
#      BENCH_ONLY (comma-separated cases to run: 9b, 35b, 35b-skew, dsv4; default all),
#      BENCH_SHARES (expert shares on the GPU for the 35B offload rows, default "75 50 0"),
#      OUT (where the results go; default BENCH_WORK).
#
# The Vulkan loader comes as in the device README ("Headless rendering"): when the working
# tree carries .gl/*.deb, they are unpacked into / first; when the loader finds no GPU, the
# NVIDIA ICD is named explicitly.
set -euo pipefail

LATHE=./lathe
QUICK=0
LLBENCH=
while [ $# -gt 0 ]; do
    case $1 in
    --quick) QUICK=1 ;;
    --llbench) LLBENCH=$2; shift ;;
    *) LATHE=$1 ;;
    esac
    shift
done
ONLY=${BENCH_ONLY:-9b,35b,35b-skew,dsv4}
want() { [[ ",$ONLY," == *",$1,"* ]]; }
WORK=${BENCH_WORK:-/tmp/lathe-bench}
REPS=${BENCH_REPS:-5}
RESULTS=${OUT:-$WORK}
mkdir -p "$WORK" "$RESULTS"
LOG=$RESULTS/bench.log
JSONL=$RESULTS/bench.jsonl
: >"$LOG"
: >"$JSONL"

cleanup() { rm -f "$WORK"/*.gguf "$WORK"/*.json "$WORK"/*.err; }
trap cleanup EXIT
trap 'cleanup; exit 130' INT TERM

log() { echo "[$(date +%T)] $*" | tee -a "$LOG" >&2; }
now() { date +%s.%N; }
elapsed() { python3 -c "print(f'{$(now) - $1:.1f}')"; }

[ -x "$LATHE" ] || { echo "bench-device: $LATHE is not an executable lathe binary" >&2; exit 1; }
command -v python3 >/dev/null || { echo "bench-device: needs python3 (to read JSON)" >&2; exit 1; }

# --- Vulkan -----------------------------------------------------------------------------
if compgen -G ".gl/*.deb" >/dev/null; then
    for f in .gl/*.deb; do dpkg -x "$f" /; done
    ldconfig
fi
if ! ldconfig -p | grep -q libvulkan; then
    log "warning: no libvulkan: carry .gl (see /work/.library/device/README.md, Headless rendering)"
fi
gpu_listed() {
    local out
    out=$("$LATHE" devices 2>>"$LOG" || true)
    [ -n "$(printf '%s\n' "$out" | grep -v -i -e llvmpipe -e lavapipe -e cpu || true)" ]
}
if ! gpu_listed && [ -f /usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json ]; then
    export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
    export __EGL_VENDOR_LIBRARY_FILENAMES=/usr/local/nvidia/share/glvnd/egl_vendor.d/10_nvidia.json
fi
log "adapters:"
"$LATHE" devices 2>>"$LOG" | tee -a "$LOG" >&2 || true

# --- one model --------------------------------------------------------------------------
ROWS=()

# field FILE EXPR: a value from a JSON file (python expression over `j`), "n/a" if absent.
field() {
    python3 - "$1" "$2" <<'EOF'
import json, sys
try:
    j = json.load(open(sys.argv[1]))
    v = eval(sys.argv[2], {"j": j})
    print("n/a" if v is None else v)
except Exception:
    print("n/a")
EOF
}

# synth NAME ARGS...: writes $WORK/NAME.gguf; sets SYNTH_S, SIZE, DATA_BYTES, EXPERT_BYTES.
synth() {
    local name=$1
    shift
    local file=$WORK/$name.gguf
    local need
    need=$("$LATHE" synth "$@" -o "$file" --dry-run --json 2>/dev/null |
        python3 -c 'import json,sys; print(json.load(sys.stdin)["data_bytes"])' || echo 0)
    local avail
    avail=$(df --output=avail -B1 "$WORK" | tail -1)
    if [ "$need" -gt 0 ] && [ "$need" -gt "$avail" ]; then
        log "$name: needs $need bytes, $avail free: skipped"
        return 1
    fi
    log "synth $name: lathe synth $* (about $((need / 1000000)) MB)"
    if ! "$LATHE" synth "$@" -o "$file" --json >"$WORK/synth.json" 2>>"$LOG"; then
        log "synth $name FAILED (see $LOG)"
        return 1
    fi
    SYNTH_S=$(field "$WORK/synth.json" "f\"{j['seconds']:.1f}\"")
    DATA_BYTES=$(field "$WORK/synth.json" "j['data_bytes']")
    EXPERT_BYTES=$(field "$WORK/synth.json" "j['expert_bytes']")
    SIZE=$(du -h "$file" | cut -f1)
    log "synth $name: $SIZE in ${SYNTH_S}s ($(field "$WORK/synth.json" "f\"{j['mb_s']:.0f}\"") MB/s)"
}

# llama LABEL FILE ARGS...: llama.cpp's pp/tg on the same file (LL_PP, LL_TG; "n/a" without
# --llbench or when it fails). ARGS: its own flags (-ncmoe N -lm 0 for an expert offload).
llama() {
    local label=$1 file=$2
    shift 2
    LL_PP=n/a LL_TG=n/a
    [ -n "$LLBENCH" ] || return 0
    log "llama.cpp $label: run.sh -m $file -p $P -n $N -r $R $*"
    if "$LLBENCH/run.sh" -m "$file" -p "$P" -n "$N" -r "$R" "$@" >"$WORK/ll.json" 2>>"$LOG"; then
        LL_PP=$(ll_ts "$WORK/ll.json" "pp$P")
        LL_TG=$(ll_ts "$WORK/ll.json" "tg$N")
        cat "$WORK/ll.json" >>"$LOG"
    else
        log "llama.cpp $label: failed (see $LOG)"
    fi
}

# ll_ts FILE TEST: avg_ts of one test of llbench's JSON lines, n/a if absent.
ll_ts() {
    python3 -c "import json, sys
v = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
t = [j['avg_ts'] for j in v if j.get('test') == sys.argv[2]]
print(f'{t[0]:.1f}' if t else 'n/a')" "$1" "$2" 2>/dev/null || echo n/a
}

# ratio A B: A / B to two decimals, n/a when either is missing.
ratio() {
    python3 -c "import sys
try: print(f'{float(sys.argv[1]) / float(sys.argv[2]):.2f}x')
except Exception: print('n/a')" "$1" "$2"
}

# bench LABEL FILE ARGS...: one table row (n/a cells when bench fails); LL_ARGS: llama.cpp's
# flags for the same case ("skip": not measured by llama.cpp).
bench() {
    local label=$1 file=$2
    shift 2
    local t0
    t0=$(now)
    if [ "${LL_ARGS:-}" = skip ]; then
        LL_PP=n/a LL_TG=n/a
    else
        # shellcheck disable=SC2086
        llama "$label" "$file" ${LL_ARGS:-}
    fi
    log "bench $label: lathe bench -m $file $*"
    if "$LATHE" bench -m "$file" --json "$@" >"$WORK/bench.json" 2>"$WORK/bench.err"; then
        python3 - "$WORK/bench.json" "$label" >>"$JSONL" <<'EOF'
import json, sys
j = json.load(open(sys.argv[1]))
j["case"] = sys.argv[2]
print(json.dumps(j))
EOF
        local j=$WORK/bench.json
        local pp tg
        pp=$(field "$j" "f\"{j['prefill']['tok_s']:.1f}\"")
        tg=$(field "$j" "f\"{j['decode']['tok_s']:.1f}\"")
        ROWS+=("| $label | $SIZE | $SYNTH_S | $(field "$j" "f\"{j['load_s']:.1f}\"") \
| $(field "$j" "f\"{j['prefill']['tok_s']:.1f} ± {j['prefill']['sd']:.1f}\"") | $LL_PP | $(ratio "$pp" "$LL_PP") \
| $(field "$j" "f\"{j['decode']['tok_s']:.1f} ± {j['decode']['sd']:.1f}\"") | $LL_TG | $(ratio "$tg" "$LL_TG") \
| $(field "$j" "j['matmul']") \
| $(field "$j" "f\"{j['bytes_per_token']/1e9:.3g}\"") \
| $(field "$j" "f\"{100*j['roofline_fraction']:.0f}%\"") | |")
        log "bench $label: done in $(elapsed "$t0")s"
    else
        local why
        why=$(grep -h "error" "$WORK/bench.err" | tail -1 | cut -c1-120 | tr '|' '/' || true)
        ROWS+=("| $label | $SIZE | $SYNTH_S | n/a | n/a | $LL_PP | n/a | n/a | $LL_TG | n/a | n/a | n/a | n/a | ${why:-failed} |")
        log "bench $label: failed: ${why:-see log}"
    fi
    cat "$WORK/bench.err" >>"$LOG"
}

T_START=$(now)
if [ "$QUICK" = 1 ]; then
    P=16 N=4 R=1
    if synth demo --preset demo; then
        bench "demo Q4_K_M" "$WORK/demo.gguf" -p $P -n $N -r $R
        non_expert=$((DATA_BYTES - EXPERT_BYTES))
        bench "demo Q4_K_M, --gpu-mem all but experts" "$WORK/demo.gguf" -p $P -n $N -r $R --gpu-mem "$non_expert"
        rm -f "$WORK/demo.gguf"
    fi
    if synth demo-q8 --preset demo --type q8_0 --vocab 4096; then
        bench "demo Q8_0, vocab 4096" "$WORK/demo-q8.gguf" -p $P -n $N -r $R -d 32
        rm -f "$WORK/demo-q8.gguf"
    fi
else
    P=512 N=128 R=$REPS
    if want 9b && synth qwen35-9b --preset qwen3.5-9b --type q4_k_m; then
        LL_ARGS= bench "Qwen3.5-9B Q4_K_M" "$WORK/qwen35-9b.gguf" -p $P -n $N -r "$R"
        rm -f "$WORK/qwen35-9b.gguf"
    fi
    if want 35b && synth qwen35-35b-a3b --preset qwen3.5-35b-a3b --type q4_k_m; then
        f=$WORK/qwen35-35b-a3b.gguf
        non_expert=$((DATA_BYTES - EXPERT_BYTES))
        LL_ARGS= bench "Qwen3.5-35B-A3B Q4_K_M" "$f" -p $P -n $N -r "$R"
        # llama.cpp's side of an expert offload: the experts of whole layers on the CPU
        # (-ncmoe, mmap off); 40 layers, so 20 is half the expert bytes
        for share in ${BENCH_SHARES:-75 50 0}; do
            case $share in 75) ll="-ncmoe 10 -lm 0" ;; 50) ll="-ncmoe 20 -lm 0" ;; *) ll="-ncmoe 40 -lm 0" ;; esac
            LL_ARGS=$ll bench "Qwen3.5-35B-A3B Q4_K_M, $share% experts on GPU" "$f" -p $P -n $N -r "$R" \
                --gpu-mem "$((non_expert + EXPERT_BYTES * share / 100))"
        done
        rm -f "$f"
    fi
    # Real routers favour some experts: with a skewed file the adaptive slots should hold
    # the popular ones and beat an even spread at the same budget.
    if want 35b-skew && synth qwen35-35b-a3b-skew --preset qwen3.5-35b-a3b --type q4_k_m --skew 1.0; then
        f=$WORK/qwen35-35b-a3b-skew.gguf
        non_expert=$((DATA_BYTES - EXPERT_BYTES))
        LL_ARGS=skip bench "Qwen3.5-35B-A3B Q4_K_M skew 1.0, 50% experts on GPU" "$f" -p $P -n $N -r "$R" \
            --gpu-mem "$((non_expert + EXPERT_BYTES / 2))"
        rm -f "$f"
    fi
    if want dsv4 && synth dsv4-flash-8l --preset deepseek-v4-flash --layers 8; then
        f=$WORK/dsv4-flash-8l.gguf
        non_expert=$((DATA_BYTES - EXPERT_BYTES))
        "$LATHE" inspect "$f" >>"$LOG" 2>&1 || log "inspect dsv4-flash-8l failed"
        LL_ARGS= bench "DeepSeek-V4-Flash 8/43 layers Q8_0+MXFP4" "$f" -p $P -n $N -r "$R"
        LL_ARGS="-ncmoe 4 -lm 0" bench "DeepSeek-V4-Flash 8 layers, 50% experts on GPU" "$f" \
            -p $P -n $N -r "$R" --gpu-mem "$((non_expert + EXPERT_BYTES / 2))"
        rm -f "$f"
    fi
fi

{
    echo "| model | file | synth s | load s | prefill t/s | llama.cpp | ratio | decode t/s | llama.cpp | ratio | matmul | GB read/token | roofline | note |"
    echo "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | --- |"
    for r in "${ROWS[@]+"${ROWS[@]}"}"; do echo "$r"; done
    echo
    echo "prefill p$P and decode n$N, $R repetitions (mean ± sd); roofline = decode tok/s × bytes read per token / stream bandwidth; total $(elapsed "$T_START") s"
} | tee "$RESULTS/bench.md"
