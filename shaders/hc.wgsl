// Hyper-connections (DeepSeek-V4, model.py `Block.hc_pre` / `hc_post`, `ParallelHead.hc_head`).
// The hidden state is HC copies per token, x[t][i][d] (packed rows of HC·n_embd). Wrapper and
// shapes: src/gpu/hc.rs; CPU reference: src/cpu/hc.rs.
//
// Entry points (one per flag):
//   PRE   one workgroup per token: r = rsqrt(mean(x²) + eps) over the flattened copies (no
//         weight); m = mixes · r (mixes = fn · x, a matmul before this kernel);
//         pre = σ(m·s0 + b) + hc_eps, post = 2σ(m·s1 + b), comb = softmax_rows(m·s2 + b) + hc_eps,
//         columns normalised once then iters−1 rounds of rows and columns (Sinkhorn);
//         h = rmsnorm(Σ_j pre[j]·x[j]) · w (the block's weighted norm, fused).
//         Writes h [n, n_embd] and pc [n, HC + HC·HC] = (post, comb).
//   HEAD  the same fold with the head's gate only (m has HC entries, pre = σ(m·s0 + b) +
//         hc_eps), then the final weighted norm: h = rmsnorm(Σ_j pre[j]·x[j]) · w.
//   POST  one thread per (token, d): x'[j][d] = post[j]·blk[d] + Σ_i comb[i][j]·x[i][d], in place.
//
// Sums are f32 (per-thread partials, then a tree). HC is a define (array sizes).
// Grid: linear workgroup id = wid.x + wid.y * nwg.x (see gpu::grid).

const WG = 256u;

struct Params {
    n_tok: u32,
    n_embd: u32,
    iters: u32,     // Sinkhorn iterations (PRE)
    _pad0: u32,
    eps: f32,       // RMS epsilon
    hc_eps: f32,    // hyper-connection epsilon
    _pad1: u32,
    _pad2: u32,
}

@group(0) @binding(0) var<uniform> p: Params;

fn sigmoid(v: f32) -> f32 { return 1.0 / (1.0 + exp(-v)); }

#if POST
@group(0) @binding(1) var<storage, read_write> x: array<f32>;
@group(0) @binding(2) var<storage, read> blk: array<f32>;
@group(0) @binding(3) var<storage, read> pc: array<f32>;

@compute @workgroup_size(WG)
fn post(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
    let i = (wid.x + wid.y * nwg.x) * WG + lid;
    let e = p.n_embd;
    if (i >= p.n_tok * e) { return; }
    let t = i / e;
    let d = i - t * e;
    let xo = t * HC * e + d;
    let po = t * (HC + HC * HC);
    var xi: array<f32, HC>;
    for (var k = 0u; k < HC; k++) { xi[k] = x[xo + k * e]; }
    let b = blk[t * e + d];
    for (var j = 0u; j < HC; j++) {
        var acc = pc[po + j] * b;
        for (var k = 0u; k < HC; k++) { acc += pc[po + HC + k * HC + j] * xi[k]; }
        x[xo + j * e] = acc;
    }
}
#else
// PRE / HEAD
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read> mixes: array<f32>;
@group(0) @binding(3) var<storage, read> base: array<f32>;
@group(0) @binding(4) var<storage, read> scale: array<f32>;
@group(0) @binding(5) var<storage, read> w: array<f32>;
@group(0) @binding(6) var<storage, read_write> h: array<f32>;
#if PRE
@group(0) @binding(7) var<storage, read_write> pc: array<f32>;
const N_MIX = (2u + HC) * HC;
#else
const N_MIX = HC;
#endif

var<workgroup> red: array<f32, WG>;
var<workgroup> pre_w: array<f32, HC>;

// Sum of `v` over the workgroup (every thread gets it).
fn wg_sum(v: f32, lid: u32) -> f32 {
    red[lid] = v;
    workgroupBarrier();
    for (var s = WG / 2u; s > 0u; s >>= 1u) {
        if (lid < s) { red[lid] += red[lid + s]; }
        workgroupBarrier();
    }
    let r = red[0];
    workgroupBarrier();
    return r;
}

#if PRE
// Sinkhorn split of one token's mixes (already scaled by the RMS): pre into pre_w, post and
// comb into pc. Runs on one thread: HC·HC is tiny.
fn split(t: u32, r: f32) {
    let mo = t * N_MIX;
    let po = t * (HC + HC * HC);
    for (var j = 0u; j < HC; j++) {
        pre_w[j] = sigmoid(mixes[mo + j] * r * scale[0] + base[j]) + p.hc_eps;
        pc[po + j] = 2.0 * sigmoid(mixes[mo + HC + j] * r * scale[1] + base[HC + j]);
    }
    var c: array<f32, HC * HC>;
    for (var i = 0u; i < HC; i++) {
        var mx = -3.0e38;
        for (var j = 0u; j < HC; j++) {
            let k = i * HC + j;
            c[k] = mixes[mo + 2u * HC + k] * r * scale[2] + base[2u * HC + k];
            mx = max(mx, c[k]);
        }
        var s = 0.0;
        for (var j = 0u; j < HC; j++) {
            c[i * HC + j] = exp(c[i * HC + j] - mx);
            s += c[i * HC + j];
        }
        for (var j = 0u; j < HC; j++) { c[i * HC + j] = c[i * HC + j] / s + p.hc_eps; }
    }
    for (var it = 0u; it < p.iters; it++) {
        if (it > 0u) {
            for (var i = 0u; i < HC; i++) {
                var s = p.hc_eps;
                for (var j = 0u; j < HC; j++) { s += c[i * HC + j]; }
                for (var j = 0u; j < HC; j++) { c[i * HC + j] /= s; }
            }
        }
        for (var j = 0u; j < HC; j++) {
            var s = p.hc_eps;
            for (var i = 0u; i < HC; i++) { s += c[i * HC + j]; }
            for (var i = 0u; i < HC; i++) { c[i * HC + j] /= s; }
        }
    }
    for (var k = 0u; k < HC * HC; k++) { pc[po + HC + k] = c[k]; }
}
#endif

@compute @workgroup_size(WG)
fn fold(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
    let t = wid.x + wid.y * nwg.x;
    if (t >= p.n_tok) { return; }
    let e = p.n_embd;
    let xo = t * HC * e;
    // 1. RMS of the flattened copies.
    var s = 0.0;
    for (var i = lid; i < HC * e; i += WG) {
        let v = x[xo + i];
        s += v * v;
    }
    let r = inverseSqrt(wg_sum(s, lid) / f32(HC * e) + p.eps);
    // 2. The mixes (one thread), shared through pre_w.
    if (lid == 0u) {
#if PRE
        split(t, r);
#else
        let mo = t * N_MIX;
        for (var j = 0u; j < HC; j++) {
            pre_w[j] = sigmoid(mixes[mo + j] * r * scale[0] + base[j]) + p.hc_eps;
        }
#endif
    }
    workgroupBarrier();
    // 3. Fold, then the weighted RMSNorm of the folded row (each thread rescales its own
    // elements, so no barrier between the write and the re-read).
    var s2 = 0.0;
    for (var d = lid; d < e; d += WG) {
        var y = 0.0;
        for (var j = 0u; j < HC; j++) { y += pre_w[j] * x[xo + j * e + d]; }
        h[t * e + d] = y;
        s2 += y * y;
    }
    let r2 = inverseSqrt(wg_sum(s2, lid) / f32(e) + p.eps);
    for (var d = lid; d < e; d += WG) {
        h[t * e + d] = h[t * e + d] * r2 * w[d];
    }
}
#endif
