#!/usr/bin/env bash
# Several GPUs (#18), in one call on the device machine (nvidia-h200-x2: two H200s, 128 GiB
# disk). Per model: synthesize it with `lathe synth`, then
#   - `lathe bench` on one GPU and on both (default split): prefill, decode, and the hops
#     (count, bytes and µs per hop, per prefill and per decode step);
#   - the same with `--gpu-mem` per device at MEM_SHARE (default 60%) of the file's bytes, so
#     one GPU alone cannot hold the model (its cold experts run on the CPU) and two can;
#   - `lathe serve --parallel STREAMS` aggregate decode throughput with STREAMS concurrent
#     streams (default 16) on one GPU, on both, and on both with --micro-batches 2;
# then delete the file (make, measure and delete one file at a time). The files carry
# DeepSeek-V4's tokenizer (`lathe serve` needs one), so their vocabulary is its 129k. Run it
# from the checkout's root (assets/). Results: a markdown
# table in $OUT/multi.md, every bench JSON object in $OUT/multi.jsonl, the log in
# $OUT/multi.log.
#
# usage: scripts/bench-multi.sh [LATHE] [--quick]
#   LATHE    the lathe binary (default ./lathe)
#   --quick  the demo model on one adapter made twice (--devices 0,0), tiny tests: checks
#            the script on lavapipe
# env: MULTI_ONLY (35b, dsv4; default both), DEVICES (default 0,1), BENCH_REPS (default 3),
#      STREAMS (default 16), MEM_SHARE (percent, default 60), BENCH_WORK, OUT.
set -euo pipefail

LATHE=./lathe
QUICK=0
while [ $# -gt 0 ]; do
    case $1 in
    --quick) QUICK=1 ;;
    *) LATHE=$1 ;;
    esac
    shift
done
ONLY=${MULTI_ONLY:-35b,dsv4}
want() { [[ ",$ONLY," == *",$1,"* ]]; }
WORK=${BENCH_WORK:-/tmp/lathe-multi}
RESULTS=${OUT:-$WORK}
REPS=${BENCH_REPS:-3}
STREAMS=${STREAMS:-16}
SHARE=${MEM_SHARE:-60}
DEVS=${DEVICES:-0,1}
# --quick: one adapter, made twice.
[ "$QUICK" = 1 ] && [ -z "${DEVICES:-}" ] && DEVS=0,0
FIRST=${DEVS%%,*}
mkdir -p "$WORK" "$RESULTS"
LOG=$RESULTS/multi.log
JSONL=$RESULTS/multi.jsonl
: >"$LOG"
: >"$JSONL"
SERVER_PID=
cleanup() {
    [ -n "$SERVER_PID" ] && kill "$SERVER_PID" 2>/dev/null || true
    rm -f "$WORK"/*.gguf "$WORK"/*.json "$WORK"/*.err
}
trap cleanup EXIT
trap 'cleanup; exit 130' INT TERM
log() { echo "[$(date +%T)] $*" | tee -a "$LOG" >&2; }
field() { python3 -c "import json, sys; j = json.load(open(sys.argv[1])); print($2)" "$1" 2>/dev/null || echo n/a; }

[ -x "$LATHE" ] || { echo "bench-multi: $LATHE is not an executable lathe binary" >&2; exit 1; }

# --- Vulkan (as scripts/bench-device.sh) ---------------------------------------------------
if compgen -G ".gl/*.deb" >/dev/null; then
    for f in .gl/*.deb; do dpkg -x "$f" /; done
    ldconfig
fi
if ! "$LATHE" devices 2>/dev/null | grep -v -i -e llvmpipe -e lavapipe -e cpu | grep -q . &&
    [ -f /usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json ]; then
    export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
    export __EGL_VENDOR_LIBRARY_FILENAMES=/usr/local/nvidia/share/glvnd/egl_vendor.d/10_nvidia.json
fi
"$LATHE" devices 2>>"$LOG" | tee -a "$LOG" >&2 || true
"$LATHE" selftest --devices "$DEVS" >>"$LOG" 2>&1 && log "selftest --devices $DEVS: passed" ||
    log "selftest --devices $DEVS: FAILED (see $LOG)"

ROWS=()
# bench LABEL FILE ARGS...: one table row from `lathe bench --json`.
bench() {
    local label=$1 file=$2
    shift 2
    log "bench $label: lathe bench -m $file -p $P -n $N -r $REPS $*"
    if "$LATHE" bench -m "$file" --json -p "$P" -n "$N" -r "$REPS" "$@" >"$WORK/b.json" 2>"$WORK/b.err"; then
        python3 -c "import json, sys; j = json.load(open(sys.argv[1])); j['case'] = sys.argv[2]; print(json.dumps(j))" \
            "$WORK/b.json" "$label" >>"$JSONL"
        local j=$WORK/b.json
        ROWS+=("| $label | $(field "$j" "f\"{j['prefill']['tok_s']:.1f}\"") | $(field "$j" "f\"{j['decode']['tok_s']:.1f}\"") \
| $(field "$j" "f\"{j['placement']['hot_share']*100:.0f}%\" if j['placement'] else '-'") \
| $(field "$j" "f\"{j['hops']['decode']['hops']:.0f} x {j['hops']['decode']['bytes']/j['hops']['decode']['hops']:.0f} B, {j['hops']['decode']['us_per_hop']:.0f} µs\" if j['hops'] else '-'") \
| $(field "$j" "f\"{j['hops']['prefill']['hops']:.0f} x {j['hops']['prefill']['bytes']/j['hops']['prefill']['hops']/1e6:.1f} MB, {j['hops']['prefill']['us_per_hop']:.0f} µs\" if j['hops'] else '-'") |")
    else
        ROWS+=("| $label | failed: $(grep -h error "$WORK/b.err" | tail -1 | cut -c1-100 | tr '|' '/') | | | | |")
    fi
    cat "$WORK/b.err" >>"$LOG"
}

# serve LABEL FILE ARGS...: aggregate tokens/s of STREAMS concurrent greedy streams of N_SERVE
# tokens each (token-id prompts of 64 ids; the first round of requests warms up).
serve() {
    local label=$1 file=$2
    shift 2
    local port=18$((RANDOM % 900 + 100))
    log "serve $label: lathe serve -m $file --parallel $STREAMS --port $port $*"
    "$LATHE" serve -m "$file" --parallel "$STREAMS" --port "$port" "$@" >>"$LOG" 2>&1 &
    SERVER_PID=$!
    local r
    r=$(python3 - "$port" "$STREAMS" "$N_SERVE" <<'EOF' 2>>"$LOG" || echo "failed"
import json, sys, threading, time, urllib.request
port, streams, n = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
base = f"http://127.0.0.1:{port}"
deadline = time.time() + 900
while True:
    try:
        if json.load(urllib.request.urlopen(base + "/health", timeout=5)).get("status") == "ok":
            break
    except Exception:
        pass
    if time.time() > deadline:
        sys.exit("server never became ready")
    time.sleep(1)
def one(i, out):
    body = {"model": "x", "prompt": [(i * 131 + j * 7) % 1000 + 10 for j in range(64)],
            "max_tokens": n, "temperature": 0}
    req = urllib.request.Request(base + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    out[i] = json.load(urllib.request.urlopen(req, timeout=900))["usage"]["completion_tokens"]
for rnd in range(2):
    out = [0] * streams
    ts = [threading.Thread(target=one, args=(i, out)) for i in range(streams)]
    t0 = time.time()
    for t in ts: t.start()
    for t in ts: t.join()
    dt = time.time() - t0
print(f"{sum(out) / dt:.1f} tok/s ({sum(out)} tokens in {dt:.1f} s)")
EOF
)
    kill "$SERVER_PID" 2>/dev/null || true
    wait "$SERVER_PID" 2>/dev/null || true
    SERVER_PID=
    log "serve $label: $r"
    ROWS+=("| serve $label, $STREAMS streams | | $r | | | |")
}

# model NAME SYNTH_ARGS...: the whole set on one synthesized file, then delete it.
model() {
    local name=$1
    shift
    local f=$WORK/$name.gguf
    log "synth $name: lathe synth $*"
    # A tokenizer for `lathe serve` (the vocabulary follows it: DeepSeek-V4's 129k).
    "$LATHE" synth "$@" --tokenizer assets/deepseek-v4-tokenizer.json.gz -o "$f" --json \
        >"$WORK/s.json" 2>>"$LOG" || { log "synth $name FAILED"; return; }
    local bytes mem
    bytes=$(field "$WORK/s.json" "j['data_bytes']")
    mem=$((bytes * SHARE / 100))
    log "$name: $bytes bytes; --gpu-mem $mem per device for the memory-bound cases"
    "$LATHE" plan -m "$f" --devices "$DEVS" --gpu-mem "$mem" >>"$LOG" 2>&1 || true
    bench "$name, 1 GPU" "$f" --device "$FIRST"
    bench "$name, 2 GPUs" "$f" --devices "$DEVS"
    bench "$name, 1 GPU, --gpu-mem $SHARE%" "$f" --device "$FIRST" --gpu-mem "$mem"
    bench "$name, 2 GPUs, --gpu-mem $SHARE% each" "$f" --devices "$DEVS" --gpu-mem "$mem"
    serve "$name, 1 GPU" "$f" --device "$FIRST"
    serve "$name, 2 GPUs" "$f" --devices "$DEVS"
    serve "$name, 2 GPUs, --micro-batches 2" "$f" --devices "$DEVS" --micro-batches 2
    rm -f "$f"
}

if [ "$QUICK" = 1 ]; then
    P=16 N=4 N_SERVE=8
    model demo --preset demo
else
    P=512 N=128 N_SERVE=128
    want 35b && model qwen35-35b-a3b --preset qwen3.5-35b-a3b --type q4_k_m
    want dsv4 && model dsv4-flash-8l --preset deepseek-v4-flash --layers 8
fi

{
    echo "| case | prefill t/s | decode t/s | experts on GPU | hops per decode step | hops per prefill |"
    echo "| --- | ---: | ---: | ---: | --- | --- |"
    printf '%s\n' "${ROWS[@]}"
} | tee "$RESULTS/multi.md"
