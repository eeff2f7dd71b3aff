// Prefill products with int8 activations, the portable path for adapters without matrix units
// (`--matmul int8`): Y[t][row] = Σ_g d_x[t][g] · (a · Σ_{i} q_w[row][g][i] · q_x[t][g][i]) − m · s_x[t][g]
// over the row's 32-element sub-blocks g, the integer sums four codes at a time with
// dot4I8Packed (ggml's MMQ idea: weights stay as their integer codes, x is quantized per 32
// values as block_q8_1 by `quantize_x`). On the pieces of matvec.wgsl, with Q8X and MMQ
// (bindings: QX codes at 3, XS scales at 5, Y at 4, the MoE route at 6).
//
// Per type (the legacy and K quants with integer levels, and the table types IQ4_NL and MXFP4,
// whose tables are int8 in ggml), `qsub(rb, g)` gives sub-block g of the row at byte rb: 8 words of codes (element
// 4i + j of the sub-block in byte j of word i, signed or unsigned bytes that dot4I8Packed reads
// as i8), the scale a0 of elements 0..16 and a1 of 16..32, and m, the weight's offset per unit
// of s_x = d_x · Σ q_x (Q4_0's 8d, the K quants' dmin · min): Σ w x̂ = d_x (a0 i_lo + a1 i_hi) − m s_x.
// Only Q6_K has two scales per sub-block (HALVES); the others fold the whole sum at once.
//
// X2 (`--matmul int8x2`): x carries a second int8 level for its residual (`quantize_x` with X2:
// x̂ = d·q + d₂·q₂), a second integer sum per output, and the f32-level accuracy the MoE routers
// need (error ≤ max|x| of the block / 64516 against 1/254 with one level).
//
// Tile: 64 rows × 64 tokens per workgroup of 256 threads (THIN, for MoE products with few pairs
// per expert: 64 rows × 16 tokens, 64 threads, four workgroups per route tile), two sub-blocks
// (64 columns) per step; each thread owns 4 rows × 4 tokens. Each output sums its sub-blocks in
// column order, so the result depends on neither the grid nor the tile.
//
// matmul_q8 grid: wid.x = row tile, wid.y = token tile. matmul_q8_id: as matmul.wgsl's
// matmul_id, over the same route.

#include "bindings"
#include "x_int8"
#include "weight_bytes"
#include "decoders"

#if THIN
const MQ_WG = 64u;
const MQ_BN = 16u;
#else
const MQ_WG = 256u;
const MQ_BN = 64u;
#endif
const MQ_BM = 64u;

// the route of matmul.wgsl (matmul_q8_id)
@group(0) @binding(6) var<storage, read> IDX: array<u32>;
const MQ_RBN = 64u;      // pairs per tile of the route
const XQ = MQ_BN / 4u;   // quads of tokens
const KS = 2u;           // sub-blocks per step
const MQ_NONE = 0xffffffffu;

var<workgroup> Wq: array<vec4<u32>, 256>;          // [KS · 8 words][16 quads of rows]
var<workgroup> Wa: array<vec4<f32>, 96>;           // [KS][a0, a1, m][16 quads of rows]
#if X2
const NLEV = 2u;                                   // int8 levels of x
const XL = 3u;                                     // [KS][d_x, d₂, s_x + s₂]
#else
const NLEV = 1u;
const XL = 2u;                                     // [KS][d_x, s_x]
#endif
var<workgroup> Xq: array<vec4<u32>, NLEV * 16u * XQ>; // [level][KS · 8 words][XQ quads of tokens]
var<workgroup> Xd: array<vec4<f32>, KS * XL * XQ>; // [KS][XL][XQ quads of tokens]
var<workgroup> mq_x: array<u32, MQ_BN>;   // first x block of tile token n, MQ_NONE if absent
var<workgroup> mq_y: array<u32, MQ_BN>;   // element of y[token][0], MQ_NONE if absent

struct QS {
    q0: vec4<u32>,   // words 0..4 (elements 0..16)
    q1: vec4<u32>,   // words 4..8 (elements 16..32)
    a: vec2<f32>,    // a0, a1
    m: f32,
}

#if TY_Q4_0
// block of 32 = one sub-block: low nibbles are elements 0..16, high ones 16..32; value d (q − 8)
fn qsub(rb: u32, g: u32) -> QS {
    let b = rb + g * BB;
    let d = wf16(b);
    let q = wu4(b + 2u);
    let m4 = vec4<u32>(M4);
    return QS(q & m4, (q >> vec4<u32>(4u)) & m4, vec2<f32>(d), 8.0 * d);
}
#endif

#if TY_Q8_0
fn qsub(rb: u32, g: u32) -> QS {
    let b = rb + g * BB;
    let d = wf16(b);
    return QS(wu4(b + 2u), wu4(b + 18u), vec2<f32>(d), 0.0);
}
#endif

#if TY_Q4_K
// sub-block j = g % 8 of block g / 8: the low (j even) or high nibbles of qs bytes 32c..32c+32,
// c = j / 2; value d · sc_j · q − dmin · m_j
fn qsub(rb: u32, g: u32) -> QS {
    let j = g & 7u;
    let c = j >> 1u;
    let bi = (rb + (g >> 3u) * BB) >> 4u;
    let hd = W4[bi];
    let sh = vec4<u32>(4u * (j & 1u));
    let m4 = vec4<u32>(M4);
    let dm = unpack2x16float(hd.x);
    let sm = k4_scales(hd.y, hd.z, hd.w, c);
    let odd = (j & 1u) == 1u;
    let d = dm.x * select(sm.x, sm.z, odd);
    return QS((W4[bi + 1u + 2u * c] >> sh) & m4, (W4[bi + 2u + 2u * c] >> sh) & m4, vec2<f32>(d),
              dm.y * select(sm.y, sm.w, odd));
}
#endif

#if TY_Q5_K
// as Q4_K, the fifth bit of element l being bit j of qh[l]
fn qsub(rb: u32, g: u32) -> QS {
    let j = g & 7u;
    let c = j >> 1u;
    let bi = (rb + (g >> 3u) * BB) >> 4u;
    let hd = W4[bi];
    let sh = vec4<u32>(4u * (j & 1u));
    let bit = vec4<u32>(j);
    let m4 = vec4<u32>(M4);
    let one = vec4<u32>(0x01010101u);
    let f = vec4<u32>(4u);
    let dm = unpack2x16float(hd.x);
    let sm = k4_scales(hd.y, hd.z, hd.w, c);
    let odd = (j & 1u) == 1u;
    let d = dm.x * select(sm.x, sm.z, odd);
    let q0 = ((W4[bi + 3u + 2u * c] >> sh) & m4) | (((W4[bi + 1u] >> bit) & one) << f);
    let q1 = ((W4[bi + 4u + 2u * c] >> sh) & m4) | (((W4[bi + 2u] >> bit) & one) << f);
    return QS(q0, q1, vec2<f32>(d), dm.y * select(sm.y, sm.w, odd));
}
#endif

// four bytes of codes from the 4-bit indices in the low nibbles of u's bytes, through a table of
// 16 signed bytes (kvalues) packed in four words, lo..hi
fn nib_codes(u: u32, t0: u32, t1: u32, t2: u32, t3: u32) -> u32 {
    var out = 0u;
    for (var k = 0u; k < 4u; k++) {
        let i = (u >> (8u * k)) & 15u;
        let w = select(select(t0, t1, i >= 4u), select(t2, t3, i >= 12u), i >= 8u);
        out |= ((w >> (8u * (i & 3u))) & 0xffu) << (8u * k);
    }
    return out;
}

fn nib_words(q: vec4<u32>, t: vec4<u32>) -> vec4<u32> {
    return vec4<u32>(nib_codes(q.x, t.x, t.y, t.z, t.w), nib_codes(q.y, t.x, t.y, t.z, t.w),
                     nib_codes(q.z, t.x, t.y, t.z, t.w), nib_codes(q.w, t.x, t.y, t.z, t.w));
}

#if TY_IQ4_NL
// d, qs[16] as Q4_0; value d · kvalues_iq4nl[q] (ggml-common.h), the table as signed bytes
fn qsub(rb: u32, g: u32) -> QS {
    let b = rb + g * BB;
    let q = wu4(b + 2u);
    let m4 = vec4<u32>(M4);
    let t = vec4<u32>(0xbfad9881u, 0xf6eaddcfu, 0x26190d01u, 0x71594535u);
    return QS(nib_words(q & m4, t), nib_words((q >> vec4<u32>(4u)) & m4, t), vec2<f32>(wf16(b)), 0.0);
}
#endif

#if TY_MXFP4
// e (E8M0), qs[16] as Q4_0 of e2m1 nibbles; value kvalues_mxfp4[q] · 2^(e − 128) with ggml's
// doubled e2m1 values 0, 1, 2, 3, 4, 6, 8, 12 and their negatives (ggml-common.h). Scales
// below 2^-126 (e < 2) are flushed to zero as denormals may be.
fn qsub(rb: u32, g: u32) -> QS {
    let b = rb + g * BB;
    let e = wbyte(b);
    let q = wu4(b + 1u);
    let m4 = vec4<u32>(M4);
    let t = vec4<u32>(0x03020100u, 0x0c080604u, 0xfdfeff00u, 0xf4f8fafcu);
    let a = select(0.0, bitcast<f32>((e - 1u) << 23u), e >= 2u);
    return QS(nib_words(q & m4, t), nib_words((q >> vec4<u32>(4u)) & m4, t), vec2<f32>(a), 0.0);
}
#endif

#if TY_Q6_K
const HALVES = true;

// the 6-bit levels 0..63 of four bytes as the signed bytes q − 32: flip bit 5, then copy the new
// bit 5 into bits 6 and 7 (0x20 · 6 = 0xc0 stays inside its byte)
fn q6s(u: u32) -> u32 {
    let t = u ^ 0x20202020u;
    return t | ((t & 0x20202020u) * 6u);
}

// sub-block j = g % 8 of block g / 8 is (n, k) = (j / 4, j % 4): elements 128n + 32k + l, scales
// 8n + 2k (l < 16) and 8n + 2k + 1; value d · scale · (q − 32)
fn qsub(rb: u32, g: u32) -> QS {
    let j = g & 7u;
    let n = j >> 2u;
    let k = j & 3u;
    let b = rb + (g >> 3u) * BB;
    var q: array<u32, 8>;
    for (var h = 0u; h < 2u; h++) {
        let l = 16u * h;
        let a = wu4(b + 64u * n + l);
        let c = wu4(b + 64u * n + 32u + l);
        let e = wu4(b + 128u + 32u * n + l);
        let v0 = q6w(a.x, c.x, e.x);
        let v1 = q6w(a.y, c.y, e.y);
        let v2 = q6w(a.z, c.z, e.z);
        let v3 = q6w(a.w, c.w, e.w);
        let w = vec4<u32>(v0[k], v1[k], v2[k], v3[k]);
        if (h == 0u) {
            q[0] = w.x; q[1] = w.y; q[2] = w.z; q[3] = w.w;
        } else {
            q[4] = w.x; q[5] = w.y; q[6] = w.z; q[7] = w.w;
        }
    }
    let s = unpack4xI8(wu(b + 192u + 8u * n + 2u * k)).xy;
    let d = wf16(b + 208u);
    return QS(vec4<u32>(q6s(q[0]), q6s(q[1]), q6s(q[2]), q6s(q[3])),
              vec4<u32>(q6s(q[4]), q6s(q[5]), q6s(q[6]), q6s(q[7])), d * vec2<f32>(s), 0.0);
}
#else
const HALVES = false;
#endif

fn put_wq(i: u32, m: u32, v: u32) {
    Wq[i * 16u + m / 4u][m % 4u] = v;
}

fn put_xq(i: u32, n: u32, v: vec4<u32>) {
    Xq[i * XQ + n / 4u][n % 4u] = v.x;
    Xq[(i + 1u) * XQ + n / 4u][n % 4u] = v.y;
    Xq[(i + 2u) * XQ + n / 4u][n % 4u] = v.z;
    Xq[(i + 3u) * XQ + n / 4u][n % 4u] = v.w;
}

fn put_xd(s: u32, l: u32, n: u32, v: f32) {
    Xd[(XL * s + l) * XQ + n / 4u][n % 4u] = v;
}

fn idot4(a: vec4<u32>, b: u32) -> vec4<i32> {
    return vec4<i32>(dot4I8Packed(a.x, b), dot4I8Packed(a.y, b), dot4I8Packed(a.z, b), dot4I8Packed(a.w, b));
}

// One tile over mq_x / mq_y (set by the entry point) of the weights at byte wbase.
fn mq_tile(lid: u32, row_base: u32, wbase: u32) {
    let n_sub = p.cols / 32u;
    let tm = lid % 16u;
    let tn = lid / 16u;
    // decoder role: row dm of the tile, sub-blocks ds, ds + MQ_WG / BM, ... of the step
    let dm = lid % MQ_BM;
    let rb = wbase + min(row_base + dm, p.rows - 1u) * p.row_bytes;
    // loader role: token xn, sub-block xs, half xh of its 8 code words
    let xn = lid / 4u;
    let xs = (lid / 2u) % 2u;
    let xh = lid % 2u;
    let xb = mq_x[xn];
    var acc0 = vec4<f32>(0.0);
    var acc1 = vec4<f32>(0.0);
    var acc2 = vec4<f32>(0.0);
    var acc3 = vec4<f32>(0.0);
    for (var g0 = 0u; g0 < n_sub; g0 += KS) {
        for (var ds = lid / MQ_BM; ds < KS; ds += MQ_WG / MQ_BM) {
            let g = g0 + ds;
            var v = QS(vec4<u32>(0u), vec4<u32>(0u), vec2<f32>(0.0), 0.0);
            if (g < n_sub) {
                v = qsub(rb, g);
            }
            let i = 8u * ds;
            put_wq(i, dm, v.q0.x);
            put_wq(i + 1u, dm, v.q0.y);
            put_wq(i + 2u, dm, v.q0.z);
            put_wq(i + 3u, dm, v.q0.w);
            put_wq(i + 4u, dm, v.q1.x);
            put_wq(i + 5u, dm, v.q1.y);
            put_wq(i + 6u, dm, v.q1.z);
            put_wq(i + 7u, dm, v.q1.w);
            Wa[(3u * ds) * 16u + dm / 4u][dm % 4u] = v.a.x;
            Wa[(3u * ds + 1u) * 16u + dm / 4u][dm % 4u] = v.a.y;
            Wa[(3u * ds + 2u) * 16u + dm / 4u][dm % 4u] = v.m;
        }
        {
            let g = g0 + xs;
            let ok = xb != MQ_NONE && g < n_sub;
            let i = 8u * xs + 4u * xh;
            let o = select(0u, xb + g, ok);
#if X2
            var q = vec4<u32>(0u);
            var q2 = vec4<u32>(0u);
            var s1 = vec2<f32>(0.0);
            var s2 = vec2<f32>(0.0);
            if (ok) {
                q = QX[4u * o + xh];
                q2 = QX[4u * o + 2u + xh];
                s1 = XS[2u * o];
                s2 = XS[2u * o + 1u];
            }
            put_xq(i, xn, q);
            put_xq(16u + i, xn, q2);
            if (xh == 0u) {
                put_xd(xs, 0u, xn, s1.x);
                put_xd(xs, 1u, xn, s2.x);
                put_xd(xs, 2u, xn, s1.y + s2.y);
            }
#else
            var q = vec4<u32>(0u);
            var sc = vec2<f32>(0.0);
            if (ok) {
                q = QX[2u * o + xh];
                sc = XS[o];
            }
            put_xq(i, xn, q);
            if (xh == 0u) {
                put_xd(xs, 0u, xn, sc.x);
                put_xd(xs, 1u, xn, sc.y);
            }
#endif
        }
        workgroupBarrier();
        for (var s = 0u; s < KS; s++) {
            let a0 = Wa[(3u * s) * 16u + tm];
            let a1 = Wa[(3u * s + 1u) * 16u + tm];
            let m = Wa[(3u * s + 2u) * 16u + tm];
            let sx = Xd[(XL * s + XL - 1u) * XQ + tn];
            // one level at a time: the integer sums of a level reuse the same registers
            for (var lv = 0u; lv < NLEV; lv++) {
                let d = Xd[(XL * s + lv) * XQ + tn];
                var i0 = vec4<i32>(0);
                var i1 = vec4<i32>(0);
                var i2 = vec4<i32>(0);
                var i3 = vec4<i32>(0);
                for (var h = 0u; h < 2u; h++) {
                    for (var i = 4u * h; i < 4u * h + 4u; i++) {
                        let a = Wq[(8u * s + i) * 16u + tm];
                        let b = Xq[(16u * lv + 8u * s + i) * XQ + tn];
                        i0 += idot4(a, b.x);
                        i1 += idot4(a, b.y);
                        i2 += idot4(a, b.z);
                        i3 += idot4(a, b.w);
                    }
                    // fold per half where the scale changes (Q6_K), else once at the end
                    if (HALVES || h == 1u) {
                        let sc = select(a0, a1, h == 1u);
                        acc0 += (sc * d.x) * vec4<f32>(i0);
                        acc1 += (sc * d.y) * vec4<f32>(i1);
                        acc2 += (sc * d.z) * vec4<f32>(i2);
                        acc3 += (sc * d.w) * vec4<f32>(i3);
                        i0 = vec4<i32>(0);
                        i1 = vec4<i32>(0);
                        i2 = vec4<i32>(0);
                        i3 = vec4<i32>(0);
                    }
                }
            }
            acc0 -= m * sx.x;
            acc1 -= m * sx.y;
            acc2 -= m * sx.z;
            acc3 -= m * sx.w;
        }
        workgroupBarrier();
    }
    let row = row_base + 4u * tm;
    mq_store(4u * tn, row, acc0);
    mq_store(4u * tn + 1u, row, acc1);
    mq_store(4u * tn + 2u, row, acc2);
    mq_store(4u * tn + 3u, row, acc3);
}

fn mq_store(n: u32, row: u32, v: vec4<f32>) {
    let yb = mq_y[n];
    if (yb == MQ_NONE) {
        return;
    }
    for (var i = 0u; i < 4u; i++) {
        if (row + i < p.rows) {
            if (p.accumulate != 0u) {
                Y[yb + row + i] += v[i];
            } else {
                Y[yb + row + i] = v[i];
            }
        }
    }
}

// Y[t][row] (=|+=) Σ_c W[row][c] x̂[t][c], t < n_tokens, rows of this part; x̂ row t at block
// (x_off + t · x_stride) / 32 of the int8 scratch, Y rows at y_off + t · y_stride.
@compute @workgroup_size(MQ_WG)
fn matmul_q8(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    if (no_rows()) {
        return;
    }
    if (lid < MQ_BN) {
        let t = wid.y * MQ_BN + lid;
        let ok = t < p.n_tokens;
        mq_x[lid] = select(MQ_NONE, (p.x_off + t * p.x_stride) / 32u, ok);
        mq_y[lid] = select(MQ_NONE, p.y_off + t * p.y_stride, ok);
    }
    workgroupBarrier();
    mq_tile(lid, wid.x * MQ_BM, 0u);
}

// MoE prefill over the route of matmul.wgsl (IDX at binding 6): tile slot wid.y / (RBN / BN)
// holds (expert e, tile j), of whose RBN pairs this workgroup takes BN;
// Y[q][row] (=|+=) Σ_c W[e][row][c] x̂[q or q / n_used][c].
@compute @workgroup_size(MQ_WG)
fn matmul_q8_id(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let ne = p.n_expert;
    let slot = wid.y / (MQ_RBN / MQ_BN);
    if (slot >= IDX[0] || no_rows()) {
        return;
    }
    let tv = IDX[p.tiles_off + slot];
    let e = tv >> 16u;
    let j0 = (tv & 0xffffu) * MQ_RBN + (wid.y % (MQ_RBN / MQ_BN)) * MQ_BN;
    if (e < p.e_lo || e - p.e_lo >= p.e_n || j0 >= IDX[1u + e]) {
        return;
    }
    if (lid < MQ_BN) {
        let idx = j0 + lid;
        var xb = MQ_NONE;
        var yb = MQ_NONE;
        if (idx < IDX[1u + e]) {
            let q = IDX[p.pairs_off + IDX[1u + ne + e] + idx];
            let xq = select(q / p.n_used, q, p.x_per_pair != 0u);
            xb = (p.x_off + xq * p.x_stride) / 32u;
            yb = p.y_off + q * p.y_stride;
        }
        mq_x[lid] = xb;
        mq_y[lid] = yb;
    }
    workgroupBarrier();
    mq_tile(lid, wid.x * MQ_BM, (e - p.e_lo) * p.expert_bytes);
}
