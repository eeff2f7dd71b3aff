// Top-k per row with ties to the lower index, argmax (k = 1), the log-sum-exp of a row, and
// the fused MoE router (softmax → top-k → renormalise). CPU references: cpu::ops::{topk,
// argmax, router_softmax_topk}, sample::log_sum_exp.
//
// One workgroup owns a chunk of CHUNK = WG·PER elements of a row, PER per thread, held in
// registers. It extracts its best K in K rounds: each round every thread picks its best
// element ranking strictly after the previous winner (so nothing needs marking), and a tree
// over the workgroup picks the round's winner. Ranking: larger value first, equal values by
// lower index; NaNs never rank (they load as the sentinel (−inf, 0xffffffff), which also pads
// rows shorter than K). Rows longer than one chunk take several stages: chunks write their K
// candidates (value bits, index) to a scratch buffer and the next stage ranks those
// candidates the same way (src/gpu/topk.rs chains the stages).
//
// Defines: K; PAIRS (input is candidate pairs, else f32 values); FINAL (write ids and,
// with HAS_VALS, values; else candidate pairs); PACKED (FINAL: the values go into the ids
// buffer as f32 bits at val_off, so one readback brings both); ROUTER (the `router` entry's
// bindings); LSE (the `lse` entry's bindings).
// Bindings (main): 1 input, 2 ids or candidates out, 3 values (FINAL + HAS_VALS).
// Bindings (router): 1 logits, 2 ids, 3 weights. Bindings (lse): 1 values, 2 out.

const WG = 256u;
const PER = 8u;
const CHUNK = 2048u; // WG · PER
const NONE = 0xffffffffu;
#ifndef K
const K = 16u;
#endif

struct Params {
    n: u32,          // elements (or candidates) per row
    n_rows: u32,
    n_chunks: u32,   // workgroups per row
    in_off: u32,     // values: in elements; pairs: in u32 words
    in_stride: u32,  // per row, same unit
    out_off: u32,    // FINAL: ids offset (elements); else candidate offset (words)
    out_stride: u32, // FINAL: ids row stride (elements)
    val_off: u32,    // values / router weights offset (elements)
    val_stride: u32, // values / router weights row stride (elements)
    renorm: u32,     // router: 1 = renormalise the k weights to sum 1
    _pad0: u32,
    _pad1: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
#if LSE
@group(0) @binding(1) var<storage, read> xs: array<f32>;
@group(0) @binding(2) var<storage, read_write> out_lse: array<f32>;
#else
#if ROUTER
@group(0) @binding(1) var<storage, read> logits: array<f32>;
@group(0) @binding(2) var<storage, read_write> out_ids: array<u32>;
@group(0) @binding(3) var<storage, read_write> out_w: array<f32>;
#else
#if PAIRS
@group(0) @binding(1) var<storage, read> cand_in: array<u32>;
#else
@group(0) @binding(1) var<storage, read> xs: array<f32>;
#endif
#if FINAL
@group(0) @binding(2) var<storage, read_write> out_ids: array<u32>;
#if HAS_VALS
@group(0) @binding(3) var<storage, read_write> out_vals: array<f32>;
#endif
#else
@group(0) @binding(2) var<storage, read_write> cand_out: array<u32>;
#endif
#endif
#endif

var<workgroup> rv: array<f32, WG>;
var<workgroup> ri: array<u32, WG>;
var<workgroup> win_v: array<f32, K>;
var<workgroup> win_i: array<u32, K>;

fn neg_inf() -> f32 { return bitcast<f32>(0xff800000u); }

// NaN test on the bits: WGSL lets compilers assume NaNs away, so `v != v` may fold to false.
fn is_nan(v: f32) -> bool { return (bitcast<u32>(v) & 0x7fffffffu) > 0x7f800000u; }

// (av, ai) ranks before (bv, bi).
fn better(av: f32, ai: u32, bv: f32, bi: u32) -> bool {
    return av > bv || (av == bv && ai < bi);
}

// The K best of the elements held in v/ix across the workgroup, best first, into win_v/win_i.
// Called in uniform control flow.
fn select_k(lid: u32, v: ptr<function, array<f32, PER>>, ix: ptr<function, array<u32, PER>>) {
    var pv = 0.0;
    var pi = NONE;
    for (var r = 0u; r < K; r++) {
        var bv = neg_inf();
        var bi = NONE;
        for (var q = 0u; q < PER; q++) {
            let cv = (*v)[q];
            let ci = (*ix)[q];
            if ((r == 0u || better(pv, pi, cv, ci)) && better(cv, ci, bv, bi)) {
                bv = cv;
                bi = ci;
            }
        }
        rv[lid] = bv;
        ri[lid] = bi;
        workgroupBarrier();
        for (var s = WG / 2u; s > 0u; s >>= 1u) {
            if (lid < s && better(rv[lid + s], ri[lid + s], rv[lid], ri[lid])) {
                rv[lid] = rv[lid + s];
                ri[lid] = ri[lid + s];
            }
            workgroupBarrier();
        }
        pv = rv[0];
        pi = ri[0];
        if (lid == 0u) {
            win_v[r] = pv;
            win_i[r] = pi;
        }
        workgroupBarrier();
    }
}

#if LSE
// Log-sum-exp of each row of n values (NaNs skipped): one workgroup per row; every thread
// keeps a running (max, sum of exp(x − max)) over its strided elements, rescaling the sum
// when the max grows, and a tree combines the pairs. −inf elements add nothing; a row
// without a finite or +inf element gives −inf.
var<workgroup> rs: array<f32, WG>;

// (m, s) of two parts: the sum rescaled to the larger max. A part with m = −inf is empty.
// −inf compared on the bits, like NaN (see is_nan).
fn is_neg_inf(v: f32) -> bool { return bitcast<u32>(v) == 0xff800000u; }

fn lse_merge(m1: f32, s1: f32, m2: f32, s2: f32) -> vec2<f32> {
    if (is_neg_inf(m2)) { return vec2<f32>(m1, s1); }
    if (is_neg_inf(m1)) { return vec2<f32>(m2, s2); }
    let m = max(m1, m2);
    return vec2<f32>(m, s1 * exp(m1 - m) + s2 * exp(m2 - m));
}

@compute @workgroup_size(WG)
fn lse(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
       @builtin(local_invocation_index) lid: u32) {
    let row = wid.x + wid.y * nwg.x;
    if (row >= p.n_rows) { return; }
    let base = p.in_off + row * p.in_stride;
    var m = neg_inf();
    var s = 0.0;
    for (var e = lid; e < p.n; e += WG) {
        let x = xs[base + e];
        if (is_nan(x) || is_neg_inf(x)) { continue; }
        if (is_neg_inf(m)) {
            m = x;
            s = 1.0;
        } else if (x > m) {
            s = s * exp(m - x) + 1.0;
            m = x;
        } else {
            s += exp(x - m);
        }
    }
    rv[lid] = m;
    rs[lid] = s;
    workgroupBarrier();
    for (var st = WG / 2u; st > 0u; st >>= 1u) {
        if (lid < st) {
            let c = lse_merge(rv[lid], rs[lid], rv[lid + st], rs[lid + st]);
            rv[lid] = c.x;
            rs[lid] = c.y;
        }
        workgroupBarrier();
    }
    if (lid == 0u) {
        var r = neg_inf();
        if (!is_neg_inf(rv[0])) { r = rv[0] + log(rs[0]); }
        out_lse[p.out_off + row * p.out_stride] = r;
    }
}
#else
#if ROUTER
// One workgroup per row of n ≤ CHUNK expert logits: top-K on the logits (softmax is
// monotonic), then the winners' softmax probabilities over all n, renormalised if asked.
@compute @workgroup_size(WG)
fn router(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
          @builtin(local_invocation_index) lid: u32) {
    let row = wid.x + wid.y * nwg.x;
    if (row >= p.n_rows) { return; }
    let base = p.in_off + row * p.in_stride;
    var v: array<f32, PER>;
    var ix: array<u32, PER>;
    for (var q = 0u; q < PER; q++) {
        let e = q * WG + lid;
        v[q] = neg_inf();
        ix[q] = NONE;
        if (e < p.n) {
            let x = logits[base + e];
            if (!is_nan(x)) {
                v[q] = x;
                ix[q] = e;
            }
        }
    }
    select_k(lid, &v, &ix);
    let m = win_v[0];
    var s = 0.0;
    for (var q = 0u; q < PER; q++) {
        if (ix[q] != NONE) { s += exp(v[q] - m); }
    }
    rv[lid] = s;
    workgroupBarrier();
    for (var st = WG / 2u; st > 0u; st >>= 1u) {
        if (lid < st) { rv[lid] += rv[lid + st]; }
        workgroupBarrier();
    }
    if (lid == 0u) {
        let total = rv[0];
        var kept = 0.0;
        for (var r = 0u; r < K; r++) {
            kept += exp(win_v[r] - m) / total;
        }
        var norm = 1.0;
        if (p.renorm != 0u) { norm = kept; }
        for (var r = 0u; r < K; r++) {
            out_ids[p.out_off + row * p.out_stride + r] = win_i[r];
            out_w[p.val_off + row * p.val_stride + r] = exp(win_v[r] - m) / total / norm;
        }
    }
}
#else
@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
    let g = wid.x + wid.y * nwg.x;
    let row = g / p.n_chunks;
    if (row >= p.n_rows) { return; }
    let chunk = g - row * p.n_chunks;
    let base = p.in_off + row * p.in_stride;
    var v: array<f32, PER>;
    var ix: array<u32, PER>;
    for (var q = 0u; q < PER; q++) {
        let e = chunk * CHUNK + q * WG + lid;
        v[q] = neg_inf();
        ix[q] = NONE;
        if (e < p.n) {
#if PAIRS
            let x = bitcast<f32>(cand_in[base + 2u * e]);
            let i = cand_in[base + 2u * e + 1u];
#else
            let x = xs[base + e];
            let i = e;
#endif
            if (!is_nan(x)) {
                v[q] = x;
                ix[q] = i;
            }
        }
    }
    select_k(lid, &v, &ix);
    if (lid < K) {
#if FINAL
        out_ids[p.out_off + row * p.out_stride + lid] = win_i[lid];
#if HAS_VALS
        out_vals[p.val_off + row * p.val_stride + lid] = win_v[lid];
#endif
#if PACKED
        out_ids[p.val_off + row * p.val_stride + lid] = bitcast<u32>(win_v[lid]);
#endif
#else
        let o = p.out_off + 2u * ((row * p.n_chunks + chunk) * K + lid);
        cand_out[o] = bitcast<u32>(win_v[lid]);
        cand_out[o + 1u] = win_i[lid];
#endif
    }
}
#endif
#endif
