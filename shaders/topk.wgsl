// Top-k per row with ties to the lower index, argmax (k = 1), the log-sum-exp of a row, and
// the fused MoE router (softmax → top-k → renormalise). CPU references: cpu::ops::{topk,
// argmax, router_softmax_topk}, sample::log_sum_exp.
//
// Ranking: larger value first, equal values by lower index (a strict total order over a
// row's elements, so every element has one rank); NaNs never rank (they load as the
// sentinel (−inf, NONE), which also pads results with fewer than K selectable elements).
//
// `main`: one workgroup owns a chunk of CHUNK = WG·PER elements of a row and writes its K
// best, best first, with few barriers (a round of workgroup reductions per selected element
// costs K·log2(WG) barriers: ~1.4 ms for k = 40 of a 248,320 vocabulary on an H200; this
// way: 136 ms → 4.9 ms on lavapipe, examples/topk_bench.rs):
//  1. every thread finds the best of its PER elements (strided slots: coalesced loads);
//  2. T = the K-th best of those WG thread bests (each thread counts the bests that beat
//     its own). The chunk holds K elements at least as good as T, so nothing ranked after T
//     can be in its top K; and only the K threads whose best ranks at or before T hold any
//     element that good, so at most K·PER elements survive (fewer than K valid thread bests:
//     no threshold, every valid element survives, still < K·PER);
//  3. the survivors go to workgroup memory (an atomic counter), and each finds its rank
//     among them by counting the survivors that beat it; ranks below K are written in
//     place. Logit rows leave ~K survivors; ties or adversarial rows at most K·PER.
// Rows longer than one chunk take several stages: chunks write their K candidates (value
// bits, index) to a scratch buffer and the next stage ranks those candidates the same way
// (src/gpu/topk.rs chains the stages).
//
// Defines: K; PAIRS (input is candidate pairs, else f32 values); FINAL (write ids and,
// with HAS_VALS, values; else candidate pairs); PACKED (FINAL: the values go into the ids
// buffer as f32 bits at val_off, so one readback brings both); ROUTER (the `router` entry's
// bindings); LSE (the `lse` entry's bindings).
// Bindings (main): 1 input, 2 ids or candidates out, 3 values (FINAL + HAS_VALS).
// Bindings (router): 1 logits, 2 ids, 3 weights. Bindings (lse): 1 values, 2 out.

const WG = 256u;
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

fn neg_inf() -> f32 { return bitcast<f32>(0xff800000u); }

// NaN test on the bits: WGSL lets compilers assume NaNs away, so `v != v` may fold to false.
fn is_nan(v: f32) -> bool { return (bitcast<u32>(v) & 0x7fffffffu) > 0x7f800000u; }

// (av, ai) ranks before (bv, bi).
fn better(av: f32, ai: u32, bv: f32, bi: u32) -> bool {
    return av > bv || (av == bv && ai < bi);
}

#if LSE
// Log-sum-exp of each row of n values (NaNs skipped): one workgroup per row; every thread
// keeps a running (max, sum of exp(x − max)) over its strided elements, rescaling the sum
// when the max grows, and a tree combines the pairs. −inf elements add nothing; a row
// without a finite or +inf element gives −inf.
var<workgroup> rv: array<f32, WG>;
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
const RPER = 8u; // the router's elements per thread: rows of up to WG · RPER = 2048 experts
var<workgroup> rv: array<f32, WG>;
var<workgroup> ri: array<u32, WG>;
var<workgroup> win_v: array<f32, K>;
var<workgroup> win_i: array<u32, K>;

// The K best of the elements held in v/ix across the workgroup, best first, into win_v/win_i,
// in K rounds: every thread picks its best element ranking strictly after the previous
// winner (so nothing needs marking) and a tree over the workgroup picks the round's winner.
// K·log2(WG) barriers: fine for a router's k ≤ 16. Called in uniform control flow.
fn select_k(lid: u32, v: ptr<function, array<f32, RPER>>, ix: ptr<function, array<u32, RPER>>) {
    var pv = 0.0;
    var pi = NONE;
    for (var r = 0u; r < K; r++) {
        var bv = neg_inf();
        var bi = NONE;
        for (var q = 0u; q < RPER; q++) {
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

// The K best of n ≤ WG elements, one per thread (thread e holds element e, NONE where none),
// into win_v/win_i best first: each element's rank is how many elements beat it, counted
// over the row in workgroup memory (stopping at K), and an element ranked below K writes its
// own slot. Two barriers instead of select_k's K·log2(WG) (19 µs a call at n = 128, k = 8 on
// an H200, 2026-12-03); the same order, so the same winners. Slots without an element keep
// (−inf, NONE), as select_k leaves them. Called in uniform control flow.
var<workgroup> all_v: array<f32, WG>;
var<workgroup> all_i: array<u32, WG>;

fn select_k_rank(lid: u32, cv: f32, ci: u32) {
    all_v[lid] = cv;
    all_i[lid] = ci;
    if (lid < K) {
        win_v[lid] = neg_inf();
        win_i[lid] = NONE;
    }
    workgroupBarrier();
    if (ci != NONE) {
        var r = 0u;
        for (var j = 0u; j < p.n && r < K; j++) {
            if (better(all_v[j], all_i[j], cv, ci)) { r++; }
        }
        if (r < K) {
            win_v[r] = cv;
            win_i[r] = ci;
        }
    }
    workgroupBarrier();
}

// One workgroup per row of n ≤ WG · RPER expert logits: top-K on the logits (softmax is
// monotonic), then the winners' softmax probabilities over all n, renormalised if asked.
@compute @workgroup_size(WG)
fn router(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
          @builtin(local_invocation_index) lid: u32) {
    let row = wid.x + wid.y * nwg.x;
    if (row >= p.n_rows) { return; }
    let base = p.in_off + row * p.in_stride;
    var v: array<f32, RPER>;
    var ix: array<u32, RPER>;
    for (var q = 0u; q < RPER; q++) {
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
    if (p.n <= WG) {
        select_k_rank(lid, v[0], ix[0]);
    } else {
        select_k(lid, &v, &ix);
    }
    let m = win_v[0];
    var s = 0.0;
    for (var q = 0u; q < RPER; q++) {
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
// Elements per thread and per workgroup of `main`. 16 loads in flight per thread; a
// 248,320 vocabulary is 61 chunks, whose 61·K candidates (≤ 3,904) fit the second stage's
// one chunk.
const PER = 16u;
const CHUNK = 4096u; // WG · PER
// Most survivors of step 3 (see the top): 8 KiB of values and ids at K = 64.
const SURV = K * PER;

// One element: its value and index (NONE: nothing).
struct Cand {
    v: f32,
    i: u32,
}

fn beats(a: Cand, b: Cand) -> bool {
    return better(a.v, a.i, b.v, b.i);
}

// (value bits, index) pairs: one 8-byte load per comparison in the counting loops.
var<workgroup> best: array<vec2<u32>, WG>; // each thread's best
var<workgroup> surv: array<vec2<u32>, SURV>; // survivors, unordered
var<workgroup> n_surv: atomic<u32>;
var<workgroup> thr_v: f32; // the threshold T
var<workgroup> thr_i: u32;

// How many thread bests beat c, counting no further than K (ranks past K only need to be
// known as such: threads of low-ranked elements stop early).
fn rank_in_best(c: Cand) -> u32 {
    var r = 0u;
    for (var j = 0u; j < WG && r < K; j++) {
        let o = best[j];
        if (better(bitcast<f32>(o.x), o.y, c.v, c.i)) { r++; }
    }
    return r;
}

// Slot q of thread lid in a chunk: strided (coalesced). Candidate pairs come as sorted
// runs of K, and with K dividing WG a plain stride would hand each thread one position of 16
// runs (thread bests of position j only): T falls low and ~550 of 3,904 candidates
// survive at K = 64 (a simulation of normal logits); rotating each stride by an odd step
// mixes positions, and ~K survive.
fn slot(q: u32, lid: u32) -> u32 {
#if PAIRS
    return q * WG + ((lid + q * 37u) & (WG - 1u));
#else
    return q * WG + lid;
#endif
}

// Element e (< p.n) of the row starting at `base`; NaNs and padded candidates as nothing.
fn load(base: u32, e: u32) -> Cand {
#if PAIRS
    let v = bitcast<f32>(cand_in[base + 2u * e]);
    let i = cand_in[base + 2u * e + 1u];
#else
    let v = xs[base + e];
    let i = e;
#endif
    if (is_nan(v) || i == NONE) {
        return Cand(neg_inf(), NONE);
    }
    return Cand(v, i);
}

// Result r (< K) of this chunk: the final ids / values, or the chunk's candidate pairs.
fn put(row: u32, chunk: u32, r: u32, c: Cand) {
#if FINAL
    out_ids[p.out_off + row * p.out_stride + r] = c.i;
#if HAS_VALS
    out_vals[p.val_off + row * p.val_stride + r] = c.v;
#endif
#if PACKED
    out_ids[p.val_off + row * p.val_stride + r] = bitcast<u32>(c.v);
#endif
#else
    let o = p.out_off + 2u * ((row * p.n_chunks + chunk) * K + r);
    cand_out[o] = bitcast<u32>(c.v);
    cand_out[o + 1u] = c.i;
#endif
}

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
    let g = wid.x + wid.y * nwg.x;
    let row = g / p.n_chunks;
    if (row >= p.n_rows) { return; }
    let chunk = g - row * p.n_chunks;
    let base = p.in_off + row * p.in_stride;
    let first = chunk * CHUNK;
    // 1. This thread's best.
    var b = Cand(neg_inf(), NONE);
    for (var q = 0u; q < PER; q++) {
        let e = first + slot(q, lid);
        if (e < p.n) {
            let c = load(base, e);
            if (beats(c, b)) { b = c; }
        }
    }
    best[lid] = vec2<u32>(bitcast<u32>(b.v), b.i);
    if (lid == 0u) {
        atomicStore(&n_surv, 0u);
        thr_v = neg_inf();
        thr_i = NONE; // no threshold: (−inf, NONE) ranks after every valid element
    }
    workgroupBarrier();
    // 2. T: the thread best with exactly K − 1 better ones (ranks are distinct).
    if (b.i != NONE) {
        if (rank_in_best(b) == K - 1u) {
            thr_v = b.v;
            thr_i = b.i;
        }
    }
    workgroupBarrier();
    // 3. Survivors: the elements ranked at or before T (re-read: the chunk is in cache).
    let t = Cand(thr_v, thr_i);
    if (b.i != NONE && !beats(t, b)) {
        for (var q = 0u; q < PER; q++) {
            let e = first + slot(q, lid);
            if (e < p.n) {
                let c = load(base, e);
                if (c.i != NONE && !beats(t, c)) {
                    let s = atomicAdd(&n_surv, 1u);
                    surv[s] = vec2<u32>(bitcast<u32>(c.v), c.i);
                }
            }
        }
    }
    workgroupBarrier();
    let m = atomicLoad(&n_surv);
    for (var s = lid; s < m; s += WG) {
        let c = Cand(bitcast<f32>(surv[s].x), surv[s].y);
        var r = 0u;
        for (var j = 0u; j < m && r < K; j++) {
            let o = surv[j];
            if (better(bitcast<f32>(o.x), o.y, c.v, c.i)) { r++; }
        }
        if (r < K) { put(row, chunk, r, c); }
    }
    // Fewer than K survivors: every valid element of the chunk survived; pad the rest.
    if (lid >= m && lid < K) { put(row, chunk, lid, Cand(neg_inf(), NONE)); }
}
#endif
#endif
