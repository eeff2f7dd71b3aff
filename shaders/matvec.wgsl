// Weight × activations at decode time for every stored weight type: the kernels `matvec` (any
// number of tokens, one per grid column), `matvec_multi` (TT tokens per workgroup) and
// `matvec_id` (MoE: one expert matrix per (token, slot) pair). The bindings, activation loads,
// fused prologues and block decoders are pieces (shaders/pieces/, included by name through
// src/gpu/pipeline.rs `PIECES`) that the prefill families include too.
//
// matvec grid: wid.x = token (or pair), linear row group wid.y + wid.z * nwg.y. A workgroup of WG
// threads holds GPW = WG / TPR thread groups; group g computes rows R*(rg*GPW + g) .. +R, its TPR
// lanes striding over the row's slices, then reducing (subgroups or workgroup memory).

// int8 activations (Q8X, src/gpu/matvec.rs `matvec_q8x`): x is first quantized per 32-element
// block in two int8 levels (kernel `quantize_x` with X2, quantize_x.wgsl: x̂ = d·q + d₂·q₂, the
// second level the residual of ggml's block_q8_1); the Q8X variants of the Q4_0, Q8_0, Q4_K,
// Q5_K and Q6_K matvec multiply the integer weight codes with both levels' codes four at a time
// (dot4I8Packed: weight codes 0..63 are valid signed bytes too; each weight word is decoded once
// for both) and apply the block scales once per integer sum: d·Σq_w·q + d₂·Σq_w·q₂. One level
// alone (error d/2 ≈ max|x|/254 per element) missed every quantized fixture bar; two are within
// max|x|/64516 and hold them (tests/activations.rs).

#include "bindings"
#include "x_int8"
#include "x_f32"
#include "prologue"
#include "weight_bytes"
#include "decoders"
#include "mv_rows"
#include "mv_store"
#include "mv_reduce"

// y[t][row] (=|+=) sum_c W[row][c] x[t][c] for token t = wid.x, rows of this part
@compute @workgroup_size(WG)
fn matvec(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
#if SUBGROUPS
          @builtin(subgroup_size) sg_size: u32, @builtin(subgroup_invocation_id) sg_lane: u32,
#endif
          @builtin(local_invocation_index) lid: u32) {
    let rg = wid.y + wid.z * nwg.y;
    if (rg * GPW * ROWS >= p.rows || no_rows()) {
        return;
    }
    let row0 = (rg * GPW + lid / TPR) * ROWS;
    let t = wid.x;
#ifndef Q8X
    pro_setup(p.x_off + t * p.x_stride, t);
#endif
    var acc = mv_partial(row0, lid % TPR, 0u, p.x_off + t * p.x_stride);
    var f = 1.0;
#if NORM_R
    // after the product: the weight stream does not wait for the row's pass
    pro_r = norm_r(lid, pro_x0);
    acc = pro_finish(acc, lid, t, rg == 0u);
    f = pro_r;
#endif
    let ybase = p.y_off + t * p.y_stride;
#if SUBGROUPS
    reduce_store(acc, lid, sg_size, sg_lane, row0, ybase);
    store_quads(f, lid, sg_size, sg_lane, row0, ybase);
#else
    reduce_store(acc, lid, row0, ybase);
    store_quads(f, lid, row0, ybase);
#endif
}

// ---- matvec over a group of tokens ----

#ifdef TT
// matvec_multi: each workgroup computes its rows for TT tokens (1..=8, a define), so each
// weight slice is loaded and decoded once for all of them (the TT calls of chunk_dot on one
// slice share their weight loads and decode: same addresses, no store in between, so the
// compiler merges them) and dotted with each token's x slice into that token's accumulators.
// Per token every step is the one-token kernel's: the same lanes per row (TPR) take the same
// slices in the same order, `mv_step` / the FSLOW loop accumulate as `mv_partial` does,
// `pro_setup` runs per token and `reduce_store` sums as it does, so each token's outputs have
// matvec's bits whatever the rows per thread group (R) and workgroup size (each row's sum only
// ever involves its own lanes; NORM_R's r is norm_r of the token's row, as matvec's is).
// Grid: wid.x = group, tokens p.pair_off + TT * wid.x + k, k < TT; rows as matvec. Tokens are unrolled by hand with literal k (a local array indexed at run time
// would go to local memory on NVIDIA, see the top of this file).

// first token of the group; the epilogue state of token k
var<private> mt_t0: u32;
#ifndef Q8X
#if EPI_SIGROW
var<private> mt_s: array<f32, 8>;
#endif
#endif

// element of column 0 of token k's x row
fn mt_x(k: u32) -> u32 {
    return p.x_off + (mt_t0 + k) * p.x_stride;
}

// Token k (a literal at every call) of the group becomes the one pro1 / store1 work for.
fn mt_use(k: u32) {
#ifndef Q8X
    pro_x0 = mt_x(k);
#if EPI_SIGROW
    epi_s = mt_s[k];
#endif
#if EPI_CONV
    epi_t = mt_t0 + k;
#endif
#endif
}

fn mt_setup(k: u32) {
#ifndef Q8X
    pro_setup(mt_x(k), mt_t0 + k);
#if EPI_SIGROW
    mt_s[k] = epi_s;
#endif
#endif
}

#if MT_ONCE
// MT_ONCE (types with a chunk_pre / chunk_fin split): each of the R rows' slices is decoded
// once (chunk_pre) and dotted with every token's x slice (chunk_fin); chunk_dot is
// chunk_fin(chunk_pre(..)), so each token's sums are the same operations as the one-token
// kernel's. The token accumulators live in ma0..ma7.
var<private> ma0: vec4<f32>;
var<private> ma1: vec4<f32>;
var<private> ma2: vec4<f32>;
var<private> ma3: vec4<f32>;
var<private> ma4: vec4<f32>;
var<private> ma5: vec4<f32>;
var<private> ma6: vec4<f32>;
var<private> ma7: vec4<f32>;

// token k's partial sums of the decoded rows w0..w3 over slice s of block blk
fn mt_tok(k: u32, blk: u32, s: u32, w0: WC, w1: WC, w2: WC, w3: WC) -> vec4<f32> {
    mt_use(k);
    let xc = load_xc(mt_x(k) + blk * BS, s);
    var acc = vec4<f32>(0.0);
    acc.x = chunk_fin(w0, xc);
    if (R > 1u) {
        acc.y = chunk_fin(w1, xc);
    }
    if (R > 2u) {
        acc.z = chunk_fin(w2, xc);
    }
    if (R > 3u) {
        acc.w = chunk_fin(w3, xc);
    }
    return acc;
}

fn mt_once(c: u32, rb: vec4<u32>) {
    let blk = c / MV_CPB;
    let s = c % MV_CPB;
    let boff = blk * BB;
    let w0 = chunk_pre(rb.x + boff, s);
    var w1 = w0;
    var w2 = w0;
    var w3 = w0;
    if (R > 1u) {
        w1 = chunk_pre(rb.y + boff, s);
    }
    if (R > 2u) {
        w2 = chunk_pre(rb.z + boff, s);
    }
    if (R > 3u) {
        w3 = chunk_pre(rb.w + boff, s);
    }
    ma0 += mt_tok(0u, blk, s, w0, w1, w2, w3);
    if (TT > 1u) { ma1 += mt_tok(1u, blk, s, w0, w1, w2, w3); }
    if (TT > 2u) { ma2 += mt_tok(2u, blk, s, w0, w1, w2, w3); }
    if (TT > 3u) { ma3 += mt_tok(3u, blk, s, w0, w1, w2, w3); }
    if (TT > 4u) { ma4 += mt_tok(4u, blk, s, w0, w1, w2, w3); }
    if (TT > 5u) { ma5 += mt_tok(5u, blk, s, w0, w1, w2, w3); }
    if (TT > 6u) { ma6 += mt_tok(6u, blk, s, w0, w1, w2, w3); }
    if (TT > 7u) { ma7 += mt_tok(7u, blk, s, w0, w1, w2, w3); }
}
#endif

#if FSLOW
// mv_partial's element step for token k
fn mt_slow(acc: vec4<f32>, e: u32, rb: vec4<u32>, k: u32) -> vec4<f32> {
    mt_use(k);
    let xe = x1(mt_x(k) + e);
    var a = acc;
    a.x += welem(rb.x, e) * xe;
    if (R > 1u) {
        a.y += welem(rb.y, e) * xe;
    }
    if (R > 2u) {
        a.z += welem(rb.z, e) * xe;
    }
    if (R > 3u) {
        a.w += welem(rb.w, e) * xe;
    }
    return a;
}
#else
// mv_partial's slice step for token k
fn mt_step(c: u32, rb: vec4<u32>, k: u32) -> vec4<f32> {
    mt_use(k);
    let v = mv_step(c, rb, mt_x(k));
    return v;
}
#endif

@compute @workgroup_size(WG)
fn matvec_multi(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
#if SUBGROUPS
                @builtin(subgroup_size) sg_size: u32, @builtin(subgroup_invocation_id) sg_lane: u32,
#endif
                @builtin(local_invocation_index) lid: u32) {
    let rg = wid.y + wid.z * nwg.y;
    if (rg * GPW * R >= p.rows || no_rows()) {
        return;
    }
    let row0 = (rg * GPW + lid / TPR) * R;
    let tl = lid % TPR;
    let first = rg == 0u;
    mt_t0 = p.pair_off + TT * wid.x;
    mt_setup(0u);
    if (TT > 1u) { mt_setup(1u); }
    if (TT > 2u) { mt_setup(2u); }
    if (TT > 3u) { mt_setup(3u); }
    if (TT > 4u) { mt_setup(4u); }
    if (TT > 5u) { mt_setup(5u); }
    if (TT > 6u) { mt_setup(6u); }
    if (TT > 7u) { mt_setup(7u); }
    let rb = rows_of(row0) * p.row_bytes;
    var a0 = vec4<f32>(0.0);
    var a1 = vec4<f32>(0.0);
    var a2 = vec4<f32>(0.0);
    var a3 = vec4<f32>(0.0);
    var a4 = vec4<f32>(0.0);
    var a5 = vec4<f32>(0.0);
    var a6 = vec4<f32>(0.0);
    var a7 = vec4<f32>(0.0);
#if FSLOW
    for (var e = tl; e < p.cols; e += TPR) {
        a0 = mt_slow(a0, e, rb, 0u);
        if (TT > 1u) { a1 = mt_slow(a1, e, rb, 1u); }
        if (TT > 2u) { a2 = mt_slow(a2, e, rb, 2u); }
        if (TT > 3u) { a3 = mt_slow(a3, e, rb, 3u); }
        if (TT > 4u) { a4 = mt_slow(a4, e, rb, 4u); }
        if (TT > 5u) { a5 = mt_slow(a5, e, rb, 5u); }
        if (TT > 6u) { a6 = mt_slow(a6, e, rb, 6u); }
        if (TT > 7u) { a7 = mt_slow(a7, e, rb, 7u); }
    }
#else
    let n_items = ((p.cols + BS - 1u) / BS) * MV_CPB;
#if MT_ONCE
    ma0 = a0;
    ma1 = a0;
    ma2 = a0;
    ma3 = a0;
    ma4 = a0;
    ma5 = a0;
    ma6 = a0;
    ma7 = a0;
    for (var c = tl; c < n_items; c += TPR) {
        mt_once(c, rb);
    }
    a0 = ma0;
    a1 = ma1;
    a2 = ma2;
    a3 = ma3;
    a4 = ma4;
    a5 = ma5;
    a6 = ma6;
    a7 = ma7;
#else
    for (var c = tl; c < n_items; c += TPR) {
        a0 += mt_step(c, rb, 0u);
        if (TT > 1u) { a1 += mt_step(c, rb, 1u); }
        if (TT > 2u) { a2 += mt_step(c, rb, 2u); }
        if (TT > 3u) { a3 += mt_step(c, rb, 3u); }
        if (TT > 4u) { a4 += mt_step(c, rb, 4u); }
        if (TT > 5u) { a5 += mt_step(c, rb, 5u); }
        if (TT > 6u) { a6 += mt_step(c, rb, 6u); }
        if (TT > 7u) { a7 += mt_step(c, rb, 7u); }
    }
#endif
#endif
#if SUBGROUPS
    mt_store(a0, 0u, lid, sg_size, sg_lane, row0, first);
    if (TT > 1u) { mt_store(a1, 1u, lid, sg_size, sg_lane, row0, first); }
    if (TT > 2u) { mt_store(a2, 2u, lid, sg_size, sg_lane, row0, first); }
    if (TT > 3u) { mt_store(a3, 3u, lid, sg_size, sg_lane, row0, first); }
    if (TT > 4u) { mt_store(a4, 4u, lid, sg_size, sg_lane, row0, first); }
    if (TT > 5u) { mt_store(a5, 5u, lid, sg_size, sg_lane, row0, first); }
    if (TT > 6u) { mt_store(a6, 6u, lid, sg_size, sg_lane, row0, first); }
    if (TT > 7u) { mt_store(a7, 7u, lid, sg_size, sg_lane, row0, first); }
#else
    mt_store(a0, 0u, lid, row0, first);
    if (TT > 1u) { mt_store(a1, 1u, lid, row0, first); }
    if (TT > 2u) { mt_store(a2, 2u, lid, row0, first); }
    if (TT > 3u) { mt_store(a3, 3u, lid, row0, first); }
    if (TT > 4u) { mt_store(a4, 4u, lid, row0, first); }
    if (TT > 5u) { mt_store(a5, 5u, lid, row0, first); }
    if (TT > 6u) { mt_store(a6, 6u, lid, row0, first); }
    if (TT > 7u) { mt_store(a7, 7u, lid, row0, first); }
#endif
}

// Token k's accumulators finished (NORM_R) as matvec's and stored by reduce_store (both
// take every thread: barriers); the closing barrier keeps the next token's from overwriting
// workgroup memory still being read.
fn mt_finish(acc: vec4<f32>, k: u32, lid: u32, first: bool) -> vec4<f32> {
    mt_use(k);
#if NORM_R
    pro_r = norm_r(lid, pro_x0);
    return pro_finish(acc, lid, mt_t0 + k, first);
#else
    return acc;
#endif
}

#if SUBGROUPS
fn mt_store(acc: vec4<f32>, k: u32, lid: u32, sg_size: u32, sg_lane: u32, row0: u32, first: bool) {
    let a = mt_finish(acc, k, lid, first);
    reduce_store(a, lid, sg_size, sg_lane, row0, p.y_off + (mt_t0 + k) * p.y_stride);
    workgroupBarrier();
}
#else
fn mt_store(acc: vec4<f32>, k: u32, lid: u32, row0: u32, first: bool) {
    let a = mt_finish(acc, k, lid, first);
    reduce_store(a, lid, row0, p.y_off + (mt_t0 + k) * p.y_stride);
    workgroupBarrier();
}
#endif
#endif

#include "mv_idx"

// MoE: for pair q = p.pair_off + wid.x (token q / n_used, slot q % n_used) with expert
// e = ids[ids_off + q]: y[q][row] (=|+=) sum_c W[e][row][c] x[q or q / n_used][c].
// Workgroups whose expert is not in the bound part return at once. (Q8X: x rows are QX rows.)
@compute @workgroup_size(WG)
fn matvec_id(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
#if SUBGROUPS
             @builtin(subgroup_size) sg_size: u32, @builtin(subgroup_invocation_id) sg_lane: u32,
#endif
             @builtin(local_invocation_index) lid: u32) {
    let rg = wid.y + wid.z * nwg.y;
    if (rg * GPW * ROWS >= p.rows || no_rows()) {
        return;
    }
    let q = p.pair_off + wid.x;
    let e = IDX[p.ids_off + q];
    if (e < p.e_lo || e - p.e_lo >= p.e_n) {
        return;
    }
    let row0 = (rg * GPW + lid / TPR) * ROWS;
    let xq = select(q / p.n_used, q, p.x_per_pair != 0u);
    let acc = mv_partial(row0, lid % TPR, (e - p.e_lo) * p.expert_bytes, p.x_off + xq * p.x_stride);
    let ybase = p.y_off + q * p.y_stride;
#if SUBGROUPS
    reduce_store(acc, lid, sg_size, sg_lane, row0, ybase);
    store_quads(1.0, lid, sg_size, sg_lane, row0, ybase);
#else
    reduce_store(acc, lid, row0, ybase);
    store_quads(1.0, lid, row0, ybase);
#endif
}

