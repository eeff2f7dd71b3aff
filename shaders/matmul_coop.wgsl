// Prefill products on the matrix units: Y[t][row] = sum_c W[row][c] X[t][c] with cooperative
// matrices (16x16x16, f16 inputs, f32 accumulators; VK_KHR_cooperative_matrix through wgpu's
// `wgpu_cooperative_matrix` extension), on the pieces of matvec.wgsl (bindings, Params, the
// chunk decoders `chunk_w` / `xmap`, `gather_x`); the preprocessor (src/gpu/pipeline.rs) puts
// the `enable` lines below first.
//
// Two kernels per product:
// - `coop_x` stages X as f16 in the chunk order of the weights (chunk c occupies halves
//   32c..32c+32, the 4 values of chunk_w's vec4 j at 4j: the same permutation the tiled kernel
//   gathers with `xmap`), one row per token (or, for MoE, per (token, slot) pair in the route's
//   grouped order). Each row is scaled by a power of two that puts its largest magnitude in
//   [2^14, 2^15): f16's range (65504) cannot overflow and small rows keep f16's full precision;
//   the product is scaled back exactly in the epilogue. With SPLIT the rounding remainder goes
//   to a second f16 row (x = hi + lo to ~22 bits), used for float weights, which f16 holds
//   exactly (F16, BF16 up to its range), so those products keep f32-level accuracy.
// - `matmul_coop` / `matmul_coop_id`: a workgroup of NSG subgroups of 32 computes CBM rows x CBN
//   tokens, each subgroup 64 rows x 16 * TT tokens (4 x 2 fragments; 4 x 4 measured slower on
//   the H200: one workgroup per multiprocessor for its registers). Per step of 64 weights (two chunks) every thread decodes one chunk of one row into
//   workgroup memory as f16 (Wh, [row][k], rows padded to CKP halves against bank conflicts;
//   two buffers, so the next step is staged while this one multiplies);
//   each subgroup then multiplies its 64 rows x 16*TT tokens with A fragments loaded straight
//   from the staged X (L2-resident) and B fragments from Wh. Results leave through a per-
//   subgroup 16x16 f32 tile in workgroup memory, so the epilogue (scale, accumulate, MoE
//   scatter, bounds) is the tiled kernel's.
// - XSTAGE (products with one f16 accumulator per fragment, quantized and FP8 weights at f16
//   precision, on 8-subgroup tiles): X goes through workgroup memory too, in steps of one chunk (32
//   weights): per step threads 0..CBM each decode one weight row's chunk (8 vector stores) and
//   the others copy the tile's CBN x rows' 64 bytes (16-byte loads), both into the other of
//   two buffers while the current one multiplies, so no fragment load waits on L2.
// - WSPLIT (quantized and FP8 weights on the `coop-split` path): the decoded weight w keeps its
//   top 11 significant bits as hi (truncation, as coop_x splits x), and the remainder goes to a
//   second staged tile as lo = f16((w - hi) * 2^11)
//   (the scale keeps lo out of f16's subnormals for |w| down to ~1e-5). With the split
//   activations every product is hi*hi + lo_x*hi into one accumulator and hi_x*lo into a second
//   one scaled back by 2^-11 in the epilogue: ~22 bits of each operand, f32-level products for
//   models whose routing (top-k of values) flips on f16 rounding upstream. Three times the
//   multiply-adds of the plain kernel, on 4 subgroups x 64 rows x 16 tokens (both tiles and
//   their double buffers fill the workgroup memory of 8 subgroups).
//
// - XSPLIT (kernel lab, LAB_XSPLIT; split weights and x, dense, 8 subgroups): the XSTAGE tile
//   with all four operands staged (weights hi and lo from one decode, x hi and lo copied), one
//   buffer (two barriers a step), and the three products of WSPLIT into one set of
//   accumulators: x_hi w_hi + x_lo w_hi + (x_hi 2^-11)(w_lo 2^11).
//
// Kernel-lab variants (`bench_kernels --variant`, never compiled otherwise): LAB_NODECODE skips
// the weight staging, LAB_NOMMA the products, so the two parts of a step can be timed apart;
// LAB_NOXSTAGE (src/gpu/coopmat.rs) keeps the x fragments loaded from L2; LAB_UNCHECKED (same)
// compiles the product without runtime bounds checks.
//
// Workgroup memory (NSG 8): Wh 2 x 128 x 72 x 2 B = 36 KiB + Cs 8 KiB (+ 0.5 KiB of token
// tables for MoE); XSTAGE: Ws and Xs 2 x 128 x 80 B = 20 KiB each + Cs 8 KiB = 48 KiB (the
// dense kernel computes its token rows instead of keeping tables);
// WSPLIT (NSG 4): Wh and Wl 2 x 64 x 72 x 2 B = 18 KiB each + Cs 4 KiB + 0.5 KiB;
// XSPLIT: Ws, Wsl, Xs, Xsl 128 x 80 B = 10 KiB each + Cs 8 KiB = 48 KiB.
enable f16;
enable wgpu_cooperative_matrix;

#include "bindings"
#include "x_f32"
#include "prologue"
#include "weight_bytes"
#include "decoders"
#include "prefill_chunks"
#include "mv_idx"

#ifndef CBN
const CBN = 128u;    // tokens per workgroup: 128 (dense), 64 (MoE, the route's tile)
const TT = 2u;       // token fragments per subgroup (CBN / 64; flag TT2: 2)
#endif
#ifndef NSG
const NSG = 8u;      // subgroups of 32 lanes per workgroup: 8, or 4 for products too small
                     // to fill the GPU with 128-row tiles
#endif
const CWG = 32u * NSG;
#if THIN
const CBM = 64u * NSG; // rows per workgroup: every subgroup 4 fragments of 16 rows
const WBUF = 1u;       // staged steps in workgroup memory
#else
const CBM = 16u * NSG; // rows per workgroup: NSG / 4 subgroups x 4 fragments of 16
const WBUF = 2u;
#endif
const RBN = 64u;       // pairs per tile of the MoE route (matmul.wgsl's BN)
const SUBS = RBN / min(CBN, RBN); // MoE workgroups per route tile
const CK = 64u;      // weights per step (two chunks)
const CKP = 72u;     // halves per staged weight row (64 + 8 of padding)
const CNONE = 0xffffffffu;

// coop_x: X (binding 3) -> XO (f16 pairs), XLO (SPLIT), SO (the inverse row scales)
@group(0) @binding(9) var<storage, read_write> XO: array<vec2<u32>>;
@group(0) @binding(10) var<storage, read_write> SO: array<f32>;
#if SPLIT
@group(0) @binding(11) var<storage, read_write> XLO: array<vec2<u32>>;
#endif

// matmul_coop: the staged rows as f16, row stride p.cols_pad halves; their scales
#if XSTAGE
// (XSTAGE) the same rows in 16-byte pieces of 8 halves (two vec4 columns), copied into
// workgroup memory
@group(0) @binding(7) var<storage, read> XH: array<mat2x4<f16>>;
#else
@group(0) @binding(7) var<storage, read> XH: array<f16>;
#endif
@group(0) @binding(8) var<storage, read> SC: array<f32>;
#if SPLIT
#if XSPLIT
@group(0) @binding(12) var<storage, read> XL: array<mat2x4<f16>>;
#else
@group(0) @binding(12) var<storage, read> XL: array<f16>;
#endif
#endif

// halves per staged row: chunks rounded up to whole steps
fn staged_halves() -> u32 {
    return ((p.n_chunks + 1u) / 2u) * CK;
}

#if XSTAGE
#else
var<workgroup> xmax: array<f32, 64>;

fn pack4h(v: vec4<f32>) -> vec2<u32> {
    return vec2<u32>(pack2x16float(v.xy), pack2x16float(v.zw));
}

// grid: one workgroup of 64 per staged row g (wid.x + wid.y * nwg.x); p.n_tokens rows. The x row
// of g: token g (dense) or, with ID, the pair at position g of the route's grouped list.
@compute @workgroup_size(64)
fn coop_x(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
          @builtin(local_invocation_index) lid: u32) {
    let g = wid.x + wid.y * nwg.x;
    if (g >= p.n_tokens) {
        return;
    }
#if ID
    let q = IDX[p.pairs_off + g];
    let xq = select(q / p.n_used, q, p.x_per_pair != 0u);
#else
    let xq = g;
#endif
    let xrow = p.x_off + xq * p.x_stride;
    var m = 0.0;
    for (var e = lid; e < p.cols; e += 64u) {
        m = max(m, abs(x1(xrow + e)));
    }
    xmax[lid] = m;
    workgroupBarrier();
    for (var h = 32u; h > 0u; h >>= 1u) {
        if (lid < h) {
            xmax[lid] = max(xmax[lid], xmax[lid + h]);
        }
        workgroupBarrier();
    }
    let amax = xmax[0];
    // amax = f * 2^ex with f in [0.5, 1): scale by 2^(15 - ex); 0, inf and NaN rows stay as
    // they are (an f32 product would give inf / NaN too)
    var ex = 15;
    if (amax > 0.0 && amax <= 3.4e38) {
        ex = frexp(amax).exp;
    }
    let s = ldexp(1.0, 15 - ex);
    let halves = staged_halves();
    let ob = g * (halves / 4u);
    for (var u = lid; u < halves / 4u; u += 64u) {
        let c = u / 8u;
        let j = u % 8u;
        var v = vec4<f32>(0.0);
        if (c < p.n_chunks) {
            v = gather_x(xrow, c / CPB, c % CPB, j) * s;
        }
#if SPLIT
        // hi keeps the top 11 significant bits by truncation (exact in f16 for the scaled
        // range), so v - hi is exact and needs ~13 bits: bit operations, which no compiler
        // folds away as it may fold an f32 -> f16 -> f32 round trip
        let hv = bitcast<vec4<f32>>(bitcast<vec4<u32>>(v) & vec4<u32>(0xffffe000u));
        XO[ob + u] = pack4h(hv);
        XLO[ob + u] = pack4h(v - hv);
#else
        XO[ob + u] = pack4h(v);
#endif
    }
    if (lid == 0u) {
        SO[g] = ldexp(1.0, ex - 15);
    }
}

#endif

#if XSTAGE
#else
// as vec4<f16>, so a chunk takes 8 vector stores; indices and fragment strides count vec4s
const CKV = CKP / 4u;
var<workgroup> Wh: array<vec4<f16>, WBUF * CBM * CKV>;  // WBUF buffers of [CBM rows][CKV]
#if WSPLIT
var<workgroup> Wl: array<vec4<f16>, WBUF * CBM * CKV>;  // the remainders (x 2^11), same layout
const LO_SCALE = 2048.0;
#endif
#endif
var<workgroup> Cs: array<f32, 256u * NSG>;      // [subgroup][16 tokens][16 rows]
#if ID
var<workgroup> cty: array<u32, CBN>;   // y element of tile token n's row 0, CNONE if absent
var<workgroup> cts: array<f32, CBN>;   // its inverse x scale
fn tok_y(n: u32) -> u32 { return cty[n]; }
fn tok_s(n: u32) -> f32 { return cts[n]; }
#else
// dense: tile token n is token tile_g0 + n (no tables: the XSTAGE tile fills 48 KiB without)
var<private> tile_g0: u32;
fn tok_y(n: u32) -> u32 {
    let t = tile_g0 + n;
    return select(CNONE, p.y_off + t * p.y_stride, t < p.n_tokens);
}
fn tok_s(n: u32) -> f32 { return SC[min(tile_g0 + n, p.n_tokens - 1u)]; }
#endif

#if XSTAGE
// XSTAGE: both operands go through workgroup memory, one 32-weight chunk per step. Rows of CKQ
// vec4<f16> (32 halves + 8 of padding: 80 bytes, so every fragment row starts 16-byte aligned
// and the 8 rows of a fragment load fall in distinct banks); double-buffered.
// 8 subgroups: 2 x 128 x 80 B of weights + 2 x 128 x 80 B of x + Cs 8 KiB = 48 KiB.
const CKQ = 10u;
#if XSPLIT
// XSPLIT: four tiles (weights and x, each hi and lo) of one buffer: 4 x 128 x 80 B = 40 KiB +
// Cs 8 KiB = 48 KiB
const XBUF = 1u;
var<workgroup> Wsl: array<vec4<f16>, CBM * CKQ>;  // the weights' remainders (x 2^11)
var<workgroup> Xsl: array<vec4<f16>, CBN * CKQ>;  // the x remainders
const LO_SCALE = 2048.0;
#else
const XBUF = 2u;
#endif
var<workgroup> Ws: array<vec4<f16>, XBUF * CBM * CKQ>;  // [buffer][CBM rows][CKQ]
var<workgroup> Xs: array<vec4<f16>, XBUF * CBN * CKQ>;  // [buffer][CBN tokens][CKQ]

// chunk c of the row at byte rb into row m of the weight buffer at wb (8 vector stores)
fn stage_w(rb: u32, c: u32, m: u32, wb: u32) {
    let base = wb + m * CKQ;
#if LAB_NODECODE
    return;
#endif
    if (c >= p.n_chunks) {
        for (var j = 0u; j < 8u; j++) {
            Ws[base + j] = vec4<f16>(0.0);
#if XSPLIT
            Wsl[base + j] = vec4<f16>(0.0);
#endif
        }
        return;
    }
    let w = chunk_w(rb + (c / CPB) * BB, c % CPB);
    for (var j = 0u; j < 8u; j++) {
#if XSPLIT
        // hi by truncation to f16's 11 significant bits (as WSPLIT); a Q8_0 weight d * q has at
        // most 19 (d's 11, q's 8), so hi + lo holds it exactly
        let t = bitcast<vec4<f32>>(bitcast<vec4<u32>>(w[j]) & vec4<u32>(0xffffe000u));
        Ws[base + j] = vec4<f16>(t);
        Wsl[base + j] = vec4<f16>((w[j] - t) * LO_SCALE);
#else
        Ws[base + j] = vec4<f16>(w[j]);
#endif
    }
}

// Step c's operands into buffer b: CBM weight rows (decoded) and 4 pieces of 8 halves of each of
// the tile's CBN staged x rows from g0 (copied; coop_x wrote them in chunk order).
// With at least twice CBM threads, threads 0..CBM only decode and the others only copy (the
// decode is the longer part of a step).
fn stage_step(lid: u32, row_base: u32, wbase: u32, g0: u32, c: u32, b: u32) {
    for (var m = lid; m < CBM; m += CWG) {
        let rb = wbase + min(row_base + m, p.rows - 1u) * p.row_bytes;
        stage_w(rb, c, m, b * CBM * CKQ);
    }
    let split = CWG >= 2u * CBM;
    if (split && lid < CBM) {
        return;
    }
    let u0 = select(lid, lid - CBM, split);
    let du = select(CWG, CWG - CBM, split);
    let rv = staged_halves() / 8u;
    for (var u = u0; u < 4u * CBN; u += du) {
        let n = u / 4u;
        let q = u % 4u;
        let v = XH[(g0 + n) * rv + 4u * c + q];
        let o = b * CBN * CKQ + n * CKQ + 2u * q;
        Xs[o] = v[0];
        Xs[o + 1u] = v[1];
#if XSPLIT
        let l = XL[(g0 + n) * rv + 4u * c + q];
        Xsl[o] = l[0];
        Xsl[o + 1u] = l[1];
#endif
    }
}
#else
// chunk c of the row at byte rb (clamped into the part) into row m of Wh buffer wb (in vec4s),
// halves 32h..
fn stage_chunk(rb: u32, c: u32, m: u32, h: u32, wb: u32) {
    let base = wb + m * CKV + 8u * h;
#if LAB_NODECODE
    return;
#endif
    if (c >= p.n_chunks) {
        for (var j = 0u; j < 8u; j++) {
            Wh[base + j] = vec4<f16>(0.0);
#if WSPLIT
            Wl[base + j] = vec4<f16>(0.0);
#endif
        }
        return;
    }
    let blk = c / CPB;
    let s = c % CPB;
#if FLOAT
    if (slow_chunk(blk)) {
        for (var j = 0u; j < 8u; j++) {
            var v = vec4<f32>(0.0);
            for (var i = 0u; i < 4u; i++) {
                let e = blk * BS + xmap(s, j) + i;
                if (e < p.cols) {
                    v[i] = welem(rb, e);
                }
            }
            Wh[base + j] = vec4<f16>(v);
        }
        return;
    }
#endif
    let w = chunk_w(rb + blk * BB, s);
    for (var j = 0u; j < 8u; j++) {
#if WSPLIT
        // hi by truncation to f16's 11 significant bits, as coop_x splits x
        let t = bitcast<vec4<f32>>(bitcast<vec4<u32>>(w[j]) & vec4<u32>(0xffffe000u));
        let v = vec4<f16>(t);
#else
        let v = vec4<f16>(w[j]);
#endif
        Wh[base + j] = v;
#if WSPLIT
        Wl[base + j] = vec4<f16>((w[j] - t) * LO_SCALE);
#endif
    }
}

#endif

// Tile token n of this subgroup's fragment tf, rows of fragment rf: scale, bounds, store.
// With WSPLIT, `d` holds the products with the weights' remainders (x 2^11).
#if WSPLIT
fn coop_out(c: coop_mat16x16<f32, C>, d: coop_mat16x16<f32, C>, sg: u32, lane: u32, n0: u32,
            r0: u32) {
    coopStoreT(d, &Cs[sg * 256u], 16u);
    workgroupBarrier();
    var lo: array<f32, 8>;
    for (var u = 0u; u < 8u; u++) {
        lo[u] = Cs[sg * 256u + lane + 32u * u] * (1.0 / LO_SCALE);
    }
    workgroupBarrier();
#else
fn coop_out(c: coop_mat16x16<f32, C>, sg: u32, lane: u32, n0: u32, r0: u32) {
#endif
    coopStoreT(c, &Cs[sg * 256u], 16u);
    workgroupBarrier();
    for (var u = 0u; u < 8u; u++) {
        let i = lane + 32u * u;
        let n = n0 + i / 16u;
        let row = r0 + i % 16u;
        let yb = tok_y(n);
        if (yb != CNONE && row < p.rows) {
#if WSPLIT
            let v = (Cs[sg * 256u + i] + lo[u]) * tok_s(n);
#else
            let v = Cs[sg * 256u + i] * tok_s(n);
#endif
            if (p.accumulate != 0u) {
                Y[yb + row] += v;
            } else {
                Y[yb + row] = v;
            }
        }
    }
    workgroupBarrier();
}

#if XSTAGE
// The tile (XSTAGE): as below, with the x fragments from workgroup memory instead of L2. Per
// step every thread stages its share of the next step (weights decoded by threads 0..CBM, x
// copied by all), then each subgroup multiplies its 64 rows x 16 * TT tokens over the step's
// two k sub-steps.
fn coop_tile(lid: u32, sg: u32, lane: u32, row_base: u32, wbase: u32, g0: u32) {
    let sr = 64u * (sg % (NSG / 4u));
    let st = 16u * TT * (sg / (NSG / 4u));
    var c00: coop_mat16x16<f32, C>;
    var c01: coop_mat16x16<f32, C>;
    var c02: coop_mat16x16<f32, C>;
    var c03: coop_mat16x16<f32, C>;
#if TT2
    var c10: coop_mat16x16<f32, C>;
    var c11: coop_mat16x16<f32, C>;
    var c12: coop_mat16x16<f32, C>;
    var c13: coop_mat16x16<f32, C>;
#endif
    let n_steps = p.n_chunks;
#if XSPLIT
    // one buffer: stage after every subgroup has read the last step, multiply after the staging
    for (var step = 0u; step < n_steps; step++) {
        let cur = 0u;
        workgroupBarrier();
        stage_step(lid, row_base, wbase, g0, step, 0u);
        workgroupBarrier();
#else
    stage_step(lid, row_base, wbase, g0, 0u, 0u);
    workgroupBarrier();
    for (var step = 0u; step < n_steps; step++) {
        let cur = step % 2u;
        if (step + 1u < n_steps) {
            stage_step(lid, row_base, wbase, g0, step + 1u, 1u - cur);
        }
#endif
#ifndef LAB_NOMMA
        let wq = (cur * CBM + sr) * CKQ;
        let xq = (cur * CBN + st) * CKQ;
        for (var k4 = 0u; k4 < 8u; k4 += 4u) {
            let b0 = coopLoad<coop_mat16x16<f16, B>>(&Ws[wq + k4], CKQ);
            let b1 = coopLoad<coop_mat16x16<f16, B>>(&Ws[wq + 16u * CKQ + k4], CKQ);
            let b2 = coopLoad<coop_mat16x16<f16, B>>(&Ws[wq + 32u * CKQ + k4], CKQ);
            let b3 = coopLoad<coop_mat16x16<f16, B>>(&Ws[wq + 48u * CKQ + k4], CKQ);
            let a0 = coopLoadT<coop_mat16x16<f16, A>>(&Xs[xq + k4], CKQ);
            c00 = coopMultiplyAdd(a0, b0, c00);
            c01 = coopMultiplyAdd(a0, b1, c01);
            c02 = coopMultiplyAdd(a0, b2, c02);
            c03 = coopMultiplyAdd(a0, b3, c03);
#if XSPLIT
            // x_lo * w_hi and (x_hi * 2^-11) * (w_lo * 2^11) into the same accumulators (the
            // scale moves to x, exact for a power of two: no second set of accumulators)
            let e0 = coopLoad<coop_mat16x16<f16, B>>(&Wsl[wq + k4], CKQ);
            let e1 = coopLoad<coop_mat16x16<f16, B>>(&Wsl[wq + 16u * CKQ + k4], CKQ);
            let e2 = coopLoad<coop_mat16x16<f16, B>>(&Wsl[wq + 32u * CKQ + k4], CKQ);
            let e3 = coopLoad<coop_mat16x16<f16, B>>(&Wsl[wq + 48u * CKQ + k4], CKQ);
            let l0 = coopLoadT<coop_mat16x16<f16, A>>(&Xsl[xq + k4], CKQ);
            let s0 = a0 * f16(1.0 / LO_SCALE);
            c00 = coopMultiplyAdd(l0, b0, c00);
            c01 = coopMultiplyAdd(l0, b1, c01);
            c02 = coopMultiplyAdd(l0, b2, c02);
            c03 = coopMultiplyAdd(l0, b3, c03);
            c00 = coopMultiplyAdd(s0, e0, c00);
            c01 = coopMultiplyAdd(s0, e1, c01);
            c02 = coopMultiplyAdd(s0, e2, c02);
            c03 = coopMultiplyAdd(s0, e3, c03);
#endif
#if TT2
            let a1 = coopLoadT<coop_mat16x16<f16, A>>(&Xs[xq + 16u * CKQ + k4], CKQ);
            c10 = coopMultiplyAdd(a1, b0, c10);
            c11 = coopMultiplyAdd(a1, b1, c11);
            c12 = coopMultiplyAdd(a1, b2, c12);
            c13 = coopMultiplyAdd(a1, b3, c13);
#if XSPLIT
            let l1 = coopLoadT<coop_mat16x16<f16, A>>(&Xsl[xq + 16u * CKQ + k4], CKQ);
            let s1 = a1 * f16(1.0 / LO_SCALE);
            c10 = coopMultiplyAdd(l1, b0, c10);
            c11 = coopMultiplyAdd(l1, b1, c11);
            c12 = coopMultiplyAdd(l1, b2, c12);
            c13 = coopMultiplyAdd(l1, b3, c13);
            c10 = coopMultiplyAdd(s1, e0, c10);
            c11 = coopMultiplyAdd(s1, e1, c11);
            c12 = coopMultiplyAdd(s1, e2, c12);
            c13 = coopMultiplyAdd(s1, e3, c13);
#endif
#endif
        }
#endif
#if XSPLIT
#else
        workgroupBarrier();
#endif
    }
    let r = row_base + sr;
    coop_out(c00, sg, lane, st, r);
    coop_out(c01, sg, lane, st, r + 16u);
    coop_out(c02, sg, lane, st, r + 32u);
    coop_out(c03, sg, lane, st, r + 48u);
#if TT2
    coop_out(c10, sg, lane, st + 16u, r);
    coop_out(c11, sg, lane, st + 16u, r + 16u);
    coop_out(c12, sg, lane, st + 16u, r + 32u);
    coop_out(c13, sg, lane, st + 16u, r + 48u);
#endif
}
#else
// The tile: rows row_base.. of the expert at byte wbase, staged X rows g0.. Fragments of
// tokens past the valid ones are computed all the same (naga requires cooperative operations in
// uniform control flow, and a per-subgroup skip is not uniform); the epilogue drops them.
// Per step, a subgroup stages the next step's weights, then multiplies its fragments over the
// step's four k sub-steps (loading all of a step's A fragments before the staging measured no
// faster on the H200, and spilled registers with the split activations).
fn coop_tile(lid: u32, sg: u32, lane: u32, row_base: u32, wbase: u32, g0: u32) {
#if THIN
    // THIN: one group of 16 tokens, subgroup sg rows 64 sg..
    let sr = 64u * sg;
    let st = 0u;
#else
    // subgroup sg: rows 64 * (sg % (NSG / 4)).., tokens 16 * TT * (sg / (NSG / 4))..
    let sr = 64u * (sg % (NSG / 4u));
    let st = 16u * TT * (sg / (NSG / 4u));
#endif
    let halves = staged_halves();
    let xa = (g0 + st) * halves;
    var c00: coop_mat16x16<f32, C>;
    var c01: coop_mat16x16<f32, C>;
    var c02: coop_mat16x16<f32, C>;
    var c03: coop_mat16x16<f32, C>;
#if WSPLIT
    var d00: coop_mat16x16<f32, C>;
    var d01: coop_mat16x16<f32, C>;
    var d02: coop_mat16x16<f32, C>;
    var d03: coop_mat16x16<f32, C>;
#endif
#if TT2
    var c10: coop_mat16x16<f32, C>;
    var c11: coop_mat16x16<f32, C>;
    var c12: coop_mat16x16<f32, C>;
    var c13: coop_mat16x16<f32, C>;
#endif
    let n_steps = halves / CK;
#if THIN
    // one buffer: each step stages (2 CBM chunks over CWG threads), then multiplies
    for (var step = 0u; step < n_steps; step++) {
        let cur = 0u;
        for (var q = lid; q < 2u * CBM; q += CWG) {
            let m = q % CBM;
            let h = q / CBM;
            let rb = wbase + min(row_base + m, p.rows - 1u) * p.row_bytes;
            stage_chunk(rb, 2u * step + h, m, h, 0u);
        }
        workgroupBarrier();
#else
    // staging role: chunk half lid / CBM of row lid % CBM
    let m = lid % CBM;
    let h = lid / CBM;
    let rb = wbase + min(row_base + m, p.rows - 1u) * p.row_bytes;
    // double buffering: step s multiplies buffer s % 2 while step s + 1 is staged into the
    // other, one barrier per step
    stage_chunk(rb, h, m, h, 0u);
    workgroupBarrier();
    for (var step = 0u; step < n_steps; step++) {
        let cur = (step % 2u) * CBM * CKV;
        if (step + 1u < n_steps) {
            stage_chunk(rb, 2u * step + 2u + h, m, h, CBM * CKV - cur);
        }
#endif
        let kx = xa + step * CK;
#ifndef LAB_NOMMA
        for (var kk = 0u; kk < CK; kk += 16u) {
            let wk = cur + sr * CKV + kk / 4u;
            let b0 = coopLoad<coop_mat16x16<f16, B>>(&Wh[wk], CKV);
            let b1 = coopLoad<coop_mat16x16<f16, B>>(&Wh[wk + 16u * CKV], CKV);
            let b2 = coopLoad<coop_mat16x16<f16, B>>(&Wh[wk + 32u * CKV], CKV);
            let b3 = coopLoad<coop_mat16x16<f16, B>>(&Wh[wk + 48u * CKV], CKV);
            let a0 = coopLoadT<coop_mat16x16<f16, A>>(&XH[kx + kk], halves);
            c00 = coopMultiplyAdd(a0, b0, c00);
            c01 = coopMultiplyAdd(a0, b1, c01);
            c02 = coopMultiplyAdd(a0, b2, c02);
            c03 = coopMultiplyAdd(a0, b3, c03);
#if SPLIT
            let l0 = coopLoadT<coop_mat16x16<f16, A>>(&XL[kx + kk], halves);
            c00 = coopMultiplyAdd(l0, b0, c00);
            c01 = coopMultiplyAdd(l0, b1, c01);
            c02 = coopMultiplyAdd(l0, b2, c02);
            c03 = coopMultiplyAdd(l0, b3, c03);
#endif
#if WSPLIT
            let e0 = coopLoad<coop_mat16x16<f16, B>>(&Wl[wk], CKV);
            let e1 = coopLoad<coop_mat16x16<f16, B>>(&Wl[wk + 16u * CKV], CKV);
            let e2 = coopLoad<coop_mat16x16<f16, B>>(&Wl[wk + 32u * CKV], CKV);
            let e3 = coopLoad<coop_mat16x16<f16, B>>(&Wl[wk + 48u * CKV], CKV);
            d00 = coopMultiplyAdd(a0, e0, d00);
            d01 = coopMultiplyAdd(a0, e1, d01);
            d02 = coopMultiplyAdd(a0, e2, d02);
            d03 = coopMultiplyAdd(a0, e3, d03);
#endif
#if TT2
            let a1 = coopLoadT<coop_mat16x16<f16, A>>(&XH[kx + kk + 16u * halves], halves);
            c10 = coopMultiplyAdd(a1, b0, c10);
            c11 = coopMultiplyAdd(a1, b1, c11);
            c12 = coopMultiplyAdd(a1, b2, c12);
            c13 = coopMultiplyAdd(a1, b3, c13);
#if SPLIT
            let l1 = coopLoadT<coop_mat16x16<f16, A>>(&XL[kx + kk + 16u * halves], halves);
            c10 = coopMultiplyAdd(l1, b0, c10);
            c11 = coopMultiplyAdd(l1, b1, c11);
            c12 = coopMultiplyAdd(l1, b2, c12);
            c13 = coopMultiplyAdd(l1, b3, c13);
#endif
#endif
        }
#endif
        workgroupBarrier();
    }
    let r = row_base + sr;
#if WSPLIT
    coop_out(c00, d00, sg, lane, st, r);
    coop_out(c01, d01, sg, lane, st, r + 16u);
    coop_out(c02, d02, sg, lane, st, r + 32u);
    coop_out(c03, d03, sg, lane, st, r + 48u);
#else
    coop_out(c00, sg, lane, st, r);
    coop_out(c01, sg, lane, st, r + 16u);
    coop_out(c02, sg, lane, st, r + 32u);
    coop_out(c03, sg, lane, st, r + 48u);
#endif
#if TT2
    coop_out(c10, sg, lane, st + 16u, r);
    coop_out(c11, sg, lane, st + 16u, r + 16u);
    coop_out(c12, sg, lane, st + 16u, r + 32u);
    coop_out(c13, sg, lane, st + 16u, r + 48u);
#endif
}

#endif

#if ID
// MoE over the route of matmul.wgsl (tiles of RBN = 64 pairs): tile slot wid.y = (expert e,
// tile j), staged rows start[e] + 64j.. (coop_x staged the pairs in the route's grouped order).
// THIN (few pairs per expert): four workgroups per slot, of 16 pairs each; those past the
// expert's pairs return at once, so a mostly empty route tile costs no multiply-adds.
@compute @workgroup_size(CWG)
fn matmul_coop_id(@builtin(workgroup_id) wid: vec3<u32>,
                  @builtin(local_invocation_index) lid: u32,
                  @builtin(subgroup_id) sg: u32,
                  @builtin(subgroup_invocation_id) lane: u32) {
    let ne = p.n_expert;
    let slot = wid.y / SUBS;
    if (slot >= IDX[0] || no_rows()) {
        return;
    }
    let tv = IDX[p.tiles_off + slot];
    let e = tv >> 16u;
    let j0 = (tv & 0xffffu) * RBN + (wid.y % SUBS) * CBN;  // first pair of the tile
    let cnt = IDX[1u + e];
    if (e < p.e_lo || e - p.e_lo >= p.e_n || j0 >= cnt) {
        return;
    }
    let g0 = IDX[1u + ne + e] + j0;
    if (lid < CBN) {
        let idx = j0 + lid;
        var yb = CNONE;
        var sc = 0.0;
        if (idx < cnt) {
            let q = IDX[p.pairs_off + g0 + lid];
            yb = p.y_off + q * p.y_stride;
            sc = SC[g0 + lid];
        }
        cty[lid] = yb;
        cts[lid] = sc;
    }
    workgroupBarrier();
    coop_tile(lid, sg, lane, wid.x * CBM, (e - p.e_lo) * p.expert_bytes, g0);
}
#else
// Dense: grid x = row tile, y = token tile.
@compute @workgroup_size(CWG)
fn matmul_coop(@builtin(workgroup_id) wid: vec3<u32>,
               @builtin(local_invocation_index) lid: u32,
               @builtin(subgroup_id) sg: u32,
               @builtin(subgroup_invocation_id) lane: u32) {
    if (no_rows()) {
        return;
    }
    let g0 = wid.y * CBN;
    tile_g0 = g0;
    coop_tile(lid, sg, lane, wid.x * CBM, 0u, g0);
}
#endif
