// Weight × activations for every stored weight type: the block decoders (shared with the tiled
// matmul, which src/gpu/matmul.rs compiles as this file followed by matmul.wgsl) and the
// decode-time kernels `matvec` (any number of tokens, one per grid column) and `matvec_id`
// (MoE: one expert matrix per (token, slot) pair).
//
// Weights are one part of a GpuTensor in raw ggml block bytes (ggml-common.h layouts; plus
// lathe's FP8 block F8_E4M3_B128, src/quant/fp8.rs), rows contiguous; binding 1 reads them as
// u32 words (blocks may start at any byte: Q8_0 is 34 bytes, MXFP4 17), binding 2 is the same
// buffer as 16-byte vectors for the layouts whose blocks are 16-byte aligned (Q4_K, Q5_K,
// F32/F16/BF16 rows of a multiple of 256 elements).
// Activations and outputs are f32; accumulation is f32.
//
// The wrapper defines one type flag (TY_Q4_K, ...) and the consts below. Each type block gives:
// - matmul's view: `chunk_w(b, s)`, the 32 weights of chunk s of the block at byte b, and
//   `xmap(s, j)`, the block element of the first of the 4 weights in chunk_w's vec4 j (chunk
//   shapes follow the packing: e.g. Q4_K chunk s = 16 bytes of qs, 16 weights of sub-block 2c
//   in the low nibbles and 16 of sub-block 2c+1 in the high ones);
// - matvec's view: MV_CPB lanes per block, each loading its slice of x once (`load_xc`) and
//   dotting it with that slice of R rows (`chunk_dot`). Slices are small and contiguous so that
//   neighbouring lanes read neighbouring bytes; scales are decoded once per slice, offsets and
//   mins leave the inner sums (sum (d q - m) x = d sum q x - m sum x, as ggml's vec_dot).
// All indexing of local arrays is by literal constants: with run-time indices NVIDIA's driver put
// them in local memory (the H200 ran 4x slower); literal ones stay in registers.
//
// matvec grid: wid.x = token (or pair), linear row group wid.y + wid.z * nwg.y. A workgroup of WG
// threads holds GPW = WG / TPR thread groups; group g computes rows R*(rg*GPW + g) .. +R, its TPR
// lanes striding over the row's slices, then reducing (subgroups or workgroup memory).

// int8 activations (Q8X, src/gpu/matvec.rs `matvec_q8x`): x is first quantized per 32-element
// block in two int8 levels (kernel `quantize_x` with X2, QUANT_X below: x̂ = d·q + d₂·q₂, the
// second level the residual of ggml's block_q8_1); the Q8X variants of the Q4_0, Q8_0, Q4_K,
// Q5_K and Q6_K matvec multiply the integer weight codes with both levels' codes four at a time
// (dot4I8Packed: weight codes 0..63 are valid signed bytes too; each weight word is decoded once
// for both) and apply the block scales once per integer sum: d·Σq_w·q + d₂·Σq_w·q₂. One level
// alone (error d/2 ≈ max|x|/254 per element) missed every quantized fixture bar; two are within
// max|x|/64516 and hold them (tests/activations.rs).

#if QUANT_X
// x rows (f32) to int8 blocks of 32, ggml's quantize_row_q8_1: d = max|x| / 127, q = round(x / d)
// as x * (1 / d) (WGSL round: ties to even, where ggml's roundf rounds them away from zero), and
// s = d * sum(q) for the types with an offset or min. One thread per block; a token's x is a few
// thousand values, so this kernel is tiny next to the product.
struct QParams {
    n_blocks: u32, // blocks per token row (cols / 32)
    n_tokens: u32,
    x_off: u32,    // in elements: x of token 0
    x_stride: u32, // in elements: between tokens' x rows
}

@group(0) @binding(0) var<uniform> qp: QParams;
@group(0) @binding(1) var<storage, read> XIN: array<f32>;
// [n_tokens, n_blocks, 2] vec4: the 32 codes of a block, 4 per word, little-endian
@group(0) @binding(2) var<storage, read_write> QOUT: array<vec4<u32>>;
// [n_tokens, n_blocks]: (d, d * sum q)
@group(0) @binding(3) var<storage, read_write> SOUT: array<vec2<f32>>;

fn xin4(e: u32) -> vec4<f32> {
    return vec4<f32>(XIN[e], XIN[e + 1u], XIN[e + 2u], XIN[e + 3u]);
}

fn amax4(v: vec4<f32>) -> f32 {
    let a = abs(v);
    return max(max(a.x, a.y), max(a.z, a.w));
}

fn hsum4(v: vec4<i32>) -> i32 {
    return v.x + v.y + v.z + v.w;
}

@compute @workgroup_size(64)
fn quantize_x(@builtin(global_invocation_id) gid: vec3<u32>) {
    let blk = gid.x;
    let t = gid.y;
    if (blk >= qp.n_blocks || t >= qp.n_tokens) {
        return;
    }
    let e = qp.x_off + t * qp.x_stride + 32u * blk;
    let v0 = xin4(e);
    let v1 = xin4(e + 4u);
    let v2 = xin4(e + 8u);
    let v3 = xin4(e + 12u);
    let v4 = xin4(e + 16u);
    let v5 = xin4(e + 20u);
    let v6 = xin4(e + 24u);
    let v7 = xin4(e + 28u);
    let amax = max(max(max(amax4(v0), amax4(v1)), max(amax4(v2), amax4(v3))),
                   max(max(amax4(v4), amax4(v5)), max(amax4(v6), amax4(v7))));
    let d = amax / 127.0;
    let id = select(0.0, 1.0 / d, d > 0.0);
    let q0 = vec4<i32>(round(v0 * id));
    let q1 = vec4<i32>(round(v1 * id));
    let q2 = vec4<i32>(round(v2 * id));
    let q3 = vec4<i32>(round(v3 * id));
    let q4 = vec4<i32>(round(v4 * id));
    let q5 = vec4<i32>(round(v5 * id));
    let q6 = vec4<i32>(round(v6 * id));
    let q7 = vec4<i32>(round(v7 * id));
    let o = t * qp.n_blocks + blk;
    let sum = hsum4(q0 + q1 + q2 + q3) + hsum4(q4 + q5 + q6 + q7);
#if X2
    // X2: a second level for the residual r = x − d·q (|r| ≤ d/2), quantized the same way, so
    // x̂ = d·q + d₂·q₂ is within d₂/2 ≤ max|x| / 508 / 127 of x. Block o holds both levels:
    // codes at 4o (level 1) and 4o + 2, scales at 2o and 2o + 1.
    let r0 = v0 - d * vec4<f32>(q0);
    let r1 = v1 - d * vec4<f32>(q1);
    let r2 = v2 - d * vec4<f32>(q2);
    let r3 = v3 - d * vec4<f32>(q3);
    let r4 = v4 - d * vec4<f32>(q4);
    let r5 = v5 - d * vec4<f32>(q5);
    let r6 = v6 - d * vec4<f32>(q6);
    let r7 = v7 - d * vec4<f32>(q7);
    let rmax = max(max(max(amax4(r0), amax4(r1)), max(amax4(r2), amax4(r3))),
                   max(max(amax4(r4), amax4(r5)), max(amax4(r6), amax4(r7))));
    let d2 = rmax / 127.0;
    let id2 = select(0.0, 1.0 / d2, d2 > 0.0);
    let p0 = vec4<i32>(round(r0 * id2));
    let p1 = vec4<i32>(round(r1 * id2));
    let p2 = vec4<i32>(round(r2 * id2));
    let p3 = vec4<i32>(round(r3 * id2));
    let p4 = vec4<i32>(round(r4 * id2));
    let p5 = vec4<i32>(round(r5 * id2));
    let p6 = vec4<i32>(round(r6 * id2));
    let p7 = vec4<i32>(round(r7 * id2));
    QOUT[4u * o] = vec4<u32>(pack4xI8(q0), pack4xI8(q1), pack4xI8(q2), pack4xI8(q3));
    QOUT[4u * o + 1u] = vec4<u32>(pack4xI8(q4), pack4xI8(q5), pack4xI8(q6), pack4xI8(q7));
    QOUT[4u * o + 2u] = vec4<u32>(pack4xI8(p0), pack4xI8(p1), pack4xI8(p2), pack4xI8(p3));
    QOUT[4u * o + 3u] = vec4<u32>(pack4xI8(p4), pack4xI8(p5), pack4xI8(p6), pack4xI8(p7));
    let sum2 = hsum4(p0 + p1 + p2 + p3) + hsum4(p4 + p5 + p6 + p7);
    SOUT[2u * o] = vec2<f32>(d, d * f32(sum));
    SOUT[2u * o + 1u] = vec2<f32>(d2, d2 * f32(sum2));
#else
    QOUT[2u * o] = vec4<u32>(pack4xI8(q0), pack4xI8(q1), pack4xI8(q2), pack4xI8(q3));
    QOUT[2u * o + 1u] = vec4<u32>(pack4xI8(q4), pack4xI8(q5), pack4xI8(q6), pack4xI8(q7));
    SOUT[o] = vec2<f32>(d, d * f32(sum));
#endif
}
#else

// The route kernel of matmul.wgsl binds other buffers at the same slots: with ROUTE defined this
// whole file drops out.
#ifndef ROUTE

#ifndef QT
const QT = 0u;          // ggml type id of the weights
const BS = 256u;        // elements per (virtual) block
const BB = 1024u;       // bytes per (virtual) block
#endif
#ifndef R
const R = 2u;           // rows per thread group (1..4)
const TPR = 64u;        // lanes per thread group (power of two)
const WG = 64u;         // threads per workgroup (multiple of TPR)
#endif

#ifndef RQ
const RQ = 1u;          // quads of 4 rows per thread group (1..4; above 1 only with R = 4)
#endif
const ROWS = R * RQ;    // rows per thread group of `matvec` / `matvec_id`

const CPB = BS / 32u;   // matmul chunks per block
const GPW = WG / TPR;   // thread groups per workgroup

struct Params {
    rows: u32,         // rows of this dispatch (of one part; of one expert for the _id kernels)
    cols: u32,         // elements per row
    row_bytes: u32,    // bytes per stored row
    n_chunks: u32,     // matmul: 32-weight chunks per row (matvec counts its slices itself)
    nb_full: u32,      // complete (virtual) blocks per row (float rows may end in a partial one)
    x_off: u32,        // in elements: x of token 0
    x_stride: u32,     // in elements: between tokens' (or pairs') x rows
    y_off: u32,        // in elements: y[token 0][row 0 of this dispatch]
    y_stride: u32,     // in elements: between tokens' (or pairs') y rows
    accumulate: u32,   // 1: y += W x, 0: y = W x
    n_used: u32,       // expert slots per token (ids row length)
    ids_off: u32,      // in elements: ids[0][0] (matvec_id)
    e_lo: u32,         // first expert held by the bound part
    e_n: u32,          // experts in the bound part
    expert_bytes: u32, // bytes per expert matrix
    x_per_pair: u32,   // 1: x row per (token, slot) pair, 0: per token (shared by its slots)
    pair_off: u32,     // matvec_id: first pair of this dispatch
    n_tokens: u32,     // matmul: tokens in X / Y; matmul_id: (token, slot) pairs
    n_expert: u32,     // matmul_id: experts of the whole stack (route layout)
    tiles_off: u32,    // matmul_id: word of the route's tile list
    pairs_off: u32,    // matmul_id: word of the route's grouped pairs
    pro0: u32,         // prologue word 0 (PRO_*: see "activations" below)
    pro1: u32,         // prologue word 1
    pro2: u32,         // prologue word 2
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> W: array<u32>;
@group(0) @binding(2) var<storage, read> W4: array<vec4<u32>>;
#if Q8X
// int8 x from quantize_x (matvec: with X2): codes [rows, blocks of 32, levels, 2] (vec4 of 16
// codes), scales [rows, blocks, levels] (d, d * sum q); matvec_id's ids move to binding 6
@group(0) @binding(3) var<storage, read> QX: array<vec4<u32>>;
@group(0) @binding(5) var<storage, read> XS: array<vec2<f32>>;
#else
#if XVEC
@group(0) @binding(3) var<storage, read> X: array<vec4<f32>>;
#else
@group(0) @binding(3) var<storage, read> X: array<f32>;
#endif
#endif
@group(0) @binding(4) var<storage, read_write> Y: array<f32>;

// Every entry point calls this so its layout has bindings 1 and 2 whatever the type reads (the
// wrapper always binds the weight part to both; wgpu drops bindings an entry point never reads).
// The wrapper never dispatches 0 rows, so the loads never run.
fn no_rows() -> bool {
    return p.rows == 0u && W[0] == W4[0].x;
}

// ---- activations ----

#if Q8X
// the four words (16 codes) h of level lv of two-level x block blk
fn qx(blk: u32, lv: u32, h: u32) -> vec4<u32> {
    return QX[4u * blk + 2u * lv + h];
}

// (d, d₂, Σx̂) of two-level x block blk: the levels' scales and s + s₂ = Σ(d·q + d₂·q₂), what
// the offsets and mins of a block multiply
fn xsc(blk: u32) -> vec3<f32> {
    let a = XS[2u * blk];
    let b = XS[2u * blk + 1u];
    return vec3<f32>(a.x, b.x, a.y + b.y);
}

fn dot16(a: vec4<u32>, b: vec4<u32>) -> i32 {
    return dot4I8Packed(a.x, b.x) + dot4I8Packed(a.y, b.y) + dot4I8Packed(a.z, b.z) + dot4I8Packed(a.w, b.w);
}

// d·i + d₂·i₂: a block's dot from its two levels' integer sums i = (i, i₂) and scales d = (d, d₂)
fn lv2(d: vec2<f32>, i: vec2<i32>) -> f32 {
    return d.x * f32(i.x) + d.y * f32(i.y);
}

// two consecutive x blocks: the slice of the Q4_K / Q5_K lanes (two 32-element sub-blocks)
struct QX2 {
    q: array<vec4<u32>, 4>,   // level 1: block blk (words 0..8), then blk+1
    q2: array<vec4<u32>, 4>,  // level 2, the same
    d: vec4<f32>,             // (d, d₂) of block blk, then of blk+1
    s: vec2<f32>,             // Σx̂ of block blk, of blk+1
}

fn load_qx2(blk: u32) -> QX2 {
    let a = xsc(blk);
    let c = xsc(blk + 1u);
    return QX2(array<vec4<u32>, 4>(qx(blk, 0u, 0u), qx(blk, 0u, 1u), qx(blk + 1u, 0u, 0u), qx(blk + 1u, 0u, 1u)),
               array<vec4<u32>, 4>(qx(blk, 1u, 0u), qx(blk, 1u, 1u), qx(blk + 1u, 1u, 0u), qx(blk + 1u, 1u, 1u)),
               vec4<f32>(a.xy, c.xy), vec2<f32>(a.z, c.z));
}

// both levels' integer sums of a 32-weight sub-block, words w0 (elements 0..16) and w1
// (16..32), against level-1 x words a0, a1 and level-2 ones b0, b1 (array elements picked by
// literal indices at the call)
fn sums2(w0: vec4<u32>, w1: vec4<u32>, a0: vec4<u32>, a1: vec4<u32>, b0: vec4<u32>, b1: vec4<u32>) -> vec2<i32> {
    return vec2<i32>(dot16(w0, a0) + dot16(w1, a1), dot16(w0, b0) + dot16(w1, b1));
}

// sum over two 32-weight sub-blocks of d * sc * q * x̂ - dmin * m * x̂ (scales and mins as
// k4_scales gives them) from the integer sums lo (sub-block 2c, both levels) and hi (2c+1)
fn k_sub2(dm: vec2<f32>, sm: vec4<f32>, lo: vec2<i32>, hi: vec2<i32>, xc: QX2) -> f32 {
    return dm.x * (sm.x * lv2(xc.d.xy, lo) + sm.z * lv2(xc.d.zw, hi)) - dm.y * (sm.y * xc.s.x + sm.w * xc.s.y);
}
#else
// x[e..e+4] as stored (e a multiple of 4 when X is bound as vectors)
fn xraw4(e: u32) -> vec4<f32> {
#if XVEC
    return X[e >> 2u];
#else
    return vec4<f32>(X[e], X[e + 1u], X[e + 2u], X[e + 3u]);
#endif
}

fn xraw1(e: u32) -> f32 {
#if XVEC
    return X[e >> 2u][e & 3u];
#else
    return X[e];
#endif
}

// Prologues (matvec only, src/gpu/matvec.rs `Prologue`): the product's input is computed from
// the stored x as it is loaded, in the same f32 operations as the separate kernel it replaces,
// so the fused product gives the bits of that kernel followed by the plain product.
//   PRO_NORM  x' = x · r · w (norm.wgsl's RMSNorm of the token's row, weight w [cols] f32 at
//             binding 6, r = rsqrt(Σx²/cols + eps), pro0 = eps as f32 bits), computed as
//             r · (W (x · w)): after the loop, one pass of the workgroup over the row gives r
//             (norm_r: Σx² in SSP fixed partitions and a fixed tree, whatever the split, so
//             matvec and matvec_multi give a token the same r), which scales the lanes' sums.
//             The order of operations differs from the separate norm's, so the bits differ
//             from rms_norm + matvec by rounding (a few ulps of y).
//   PRO_SWIGLU x' = silu(x[e]) · x[e + pro0] (elementwise.wgsl's swiglu without a limit: gate
//             at x, up pro0 elements later in the same buffer).
//   PRO_SIGMUL x' = sigmoid(g) · x with g = G[pro0 + (c / pro1) · pro2 + c % pro1] (binding 6;
//             elementwise.wgsl's sigmoid_mul: Qwen3.5's attention output gate, pro1 = head_dim,
//             pro2 = the gate's head stride) for column c of the token's row.
//   NORM_R    the r machinery of PRO_NORM (defined with it): the lanes' sums scaled by r.
//   NORM_RAW  (with NORM_R, without PRO_NORM) x is already x · w (written by a product's
//             EPI_NW store), read as stored, and r comes from the raw rows at binding 12
//             (same layout as x): the bits of PRO_NORM over the raw rows, without its weight
//             loads and multiplies in every thread group.
//   PVEC      (with XVEC) the prologue's own operands load as vectors too: the norm weight
//             (bound as vec4s; cols a multiple of 4) and SwiGLU's up values (pro0 a multiple of
//             4). Same operations per element, so the same bits; 4x fewer loads per x vector.
#if PRO_NORM
#if PVEC
@group(0) @binding(6) var<storage, read> NW: array<vec4<f32>>;
fn nw1(i: u32) -> f32 { return NW[i >> 2u][i & 3u]; }
#else
@group(0) @binding(6) var<storage, read> NW: array<f32>;
fn nw1(i: u32) -> f32 { return NW[i]; }
#endif
#endif
#if PRO_SIGMUL
@group(0) @binding(6) var<storage, read> G: array<f32>;
#endif
//   NORM_OUT  (with PRO_NORM) the first row group's workgroup also writes x' = (x · r) · w to
//             H (binding 7) at element token · cols: the normed rows, for later readers.
//   EPI_CONV  rows below pro1 are the channels of Qwen3.5's GDN conv (decode, one token per
//             sequence, token t = sequence t of the table SEQS): y = silu(Σ_j CW[ch][j] · x̃_j)
//             over the channel's CONV_K − 1 state rows (CST from element pro2, slot of the
//             sequence) and this product's value, written instead of the value, then the state
//             rolled: conv.wgsl's conv_out (DECODE), in the same order.
//   EPI_SIGROW epilogue y += sigmoid(s) · (W x') with s = EG[pro1 + token · pro2] (binding 8;
//             elementwise.wgsl's sigmoid_mul_row_inplace then add_inplace: Qwen's shared
//             expert gate).
//   EPI_NW    the stored (or accumulated) value v of row c is also written times the next
//             norm's weight, HN[o] = v · NWN[c] (bindings 13, 14; one weight part), at the
//             same element o as in Y: the x · w that a NORM_RAW product reads, in the f32
//             multiply PRO_NORM's load does.
//   EPI_GLU   SwiGLU of a gate+up product (rows 0..ff the gate, ff..2ff the up; p.rows = 2ff):
//             the split's rows are taken in pairs, logical row 2o the gate row o and 2o + 1 the
//             up row o (row_of), so a thread group holds both and writes y[o] = silu(g) · u
//             (elementwise.wgsl's swiglu without a limit) instead of the two values. A row's
//             sum never depends on which thread group computes it, so y has the bits of the
//             plain product followed by swiglu. R is 2 or 4 (whole pairs per quad).
#if NORM_OUT
@group(0) @binding(7) var<storage, read_write> H: array<f32>;
#endif
#if NORM_RAW
#if XVEC
@group(0) @binding(12) var<storage, read> XR: array<vec4<f32>>;
#else
@group(0) @binding(12) var<storage, read> XR: array<f32>;
#endif
#endif
#if EPI_NW
@group(0) @binding(13) var<storage, read> NWN: array<f32>;
@group(0) @binding(14) var<storage, read_write> HN: array<f32>;
#endif
#if EPI_SIGROW
@group(0) @binding(8) var<storage, read> EG: array<f32>;
var<private> epi_s: f32;
#endif
#if EPI_CONV
@group(0) @binding(9) var<storage, read> CW: array<f32>;            // [conv_dim, CONV_K]
@group(0) @binding(10) var<storage, read_write> CST: array<f32>;    // [slots, CONV_K − 1, conv_dim]
@group(0) @binding(11) var<storage, read> SEQS: array<u32>;         // [n_seq][4] gdn batch table
var<private> epi_t: u32;

// conv_out of channel ch for the current token, v = x̃'s last row.
fn conv_store(o: u32, ch: u32, v: f32) {
    let cd = p.pro1;
    let sb = p.pro2 + SEQS[4u * epi_t + 2u] * (CONV_K - 1u) * cd;
    var acc = 0.0;
    for (var j = 0u; j + 1u < CONV_K; j++) {
        acc += CW[ch * CONV_K + j] * CST[sb + j * cd + ch];
    }
    acc += CW[ch * CONV_K + CONV_K - 1u] * v;
    Y[o] = acc / (1.0 + exp(-acc));
    for (var r = 0u; r + 2u < CONV_K; r++) {
        CST[sb + r * cd + ch] = CST[sb + (r + 1u) * cd + ch];
    }
    CST[sb + (CONV_K - 2u) * cd + ch] = v;
}
#endif
// element of column 0 of the token's x row (set by pro_setup)
var<private> pro_x0: u32;

fn silu_(v: f32) -> f32 { return v / (1.0 + exp(-v)); }

// Per-workgroup setup for the token whose x row starts at element xbase.
fn pro_setup(xbase: u32, t: u32) {
    pro_x0 = xbase;
#if EPI_CONV
    epi_t = t;
#endif
#if EPI_SIGROW
    epi_s = 1.0 / (1.0 + exp(-EG[p.pro1 + t * p.pro2]));
#endif
}

#if NORM_R
// the raw row's values at e.. for norm_r
fn ss4(e: u32) -> vec4<f32> {
#if NORM_RAW
#if XVEC
    return XR[e >> 2u];
#else
    return vec4<f32>(XR[e], XR[e + 1u], XR[e + 2u], XR[e + 3u]);
#endif
#else
    return xraw4(e);
#endif
}

fn ss1(e: u32) -> f32 {
#if NORM_RAW
#if XVEC
    return XR[e >> 2u][e & 3u];
#else
    return XR[e];
#endif
#else
    return xraw1(e);
#endif
}

// Partitions of norm_r's Σx²: vector v of the row (4 elements, summed in order) belongs to
// partition v % SSP, each partition sums its vectors in order, then a fixed tree sums the
// partitions (the tail elements of a row of cols % 4 != 0 join partitions 0..3).
const SSP = 64u;
var<workgroup> ss_red: array<f32, SSP>;

// r = rsqrt(Σx²/cols + eps) of the row at element xbase, in every thread; every thread of the
// workgroup calls it (barriers), and its result depends on the row alone.
fn norm_r(lid: u32, xbase: u32) -> f32 {
    let nv = p.cols / 4u;
    for (var j = lid; j < SSP; j += WG) {
        var s = 0.0;
        for (var v = j; v < nv; v += SSP) {
            let a = ss4(xbase + 4u * v);
            s += a.x * a.x;
            s += a.y * a.y;
            s += a.z * a.z;
            s += a.w * a.w;
        }
        for (var e = 4u * nv + j; e < p.cols; e += SSP) {
            let a = ss1(xbase + e);
            s += a * a;
        }
        ss_red[j] = s;
    }
    workgroupBarrier();
    for (var st = SSP / 2u; st > 0u; st >>= 1u) {
        for (var j = lid; j < st; j += WG) {
            ss_red[j] += ss_red[j + st];
        }
        workgroupBarrier();
    }
    let r = inverseSqrt(ss_red[0] / f32(p.cols) + bitcast<f32>(p.pro0));
    // the next call (matvec_multi's next token) writes ss_red again
    workgroupBarrier();
    return r;
}

// r of the current token (norm_r, after the product)
var<private> pro_r: f32;

// acc · r, and with NORM_OUT the normed row written by the first row group's workgroup.
fn pro_finish(acc: vec4<f32>, lid: u32, t: u32, first: bool) -> vec4<f32> {
    let r = pro_r;
#if NORM_OUT
    if (first) {
        for (var j = lid; j < p.cols; j += WG) {
            H[t * p.cols + j] = (xraw1(pro_x0 + j) * r) * nw1(j);
        }
    }
#endif
    return acc * r;
}
#endif

fn pro1(e: u32, a: f32) -> f32 {
#if PRO_NORM
    return a * nw1(e - pro_x0);
#else
#if PRO_SWIGLU
    return silu_(a) * xraw1(e + p.pro0);
#else
#if PRO_SIGMUL
    let c = e - pro_x0;
    let g = G[p.pro0 + (c / p.pro1) * p.pro2 + c % p.pro1];
    return (1.0 / (1.0 + exp(-g))) * a;
#else
    return a;
#endif
#endif
#endif
}

// x' at e..e+4 (the prologue applied to the stored x)
fn pro4(e: u32) -> vec4<f32> {
    let a = xraw4(e);
#if PVEC
#if PRO_NORM
    return a * NW[(e - pro_x0) >> 2u];
#else
    let u = xraw4(e + p.pro0);
    return vec4<f32>(silu_(a.x) * u.x, silu_(a.y) * u.y, silu_(a.z) * u.z, silu_(a.w) * u.w);
#endif
#else
#if PRO
    return vec4<f32>(pro1(e, a.x), pro1(e + 1u, a.y), pro1(e + 2u, a.z), pro1(e + 3u, a.w));
#else
    return a;
#endif
#endif
}

fn x4(e: u32) -> vec4<f32> {
    return pro4(e);
}

fn x1(e: u32) -> f32 {
    return pro1(e, xraw1(e));
}
#endif

// ---- raw weight bytes ----

// 32 bits starting at byte b (any alignment), little-endian. `(hi << 1) << (31 - s)` is
// `hi << (32 - s)` without the shift by 32 that WGSL reduces modulo 32.
fn wu(b: u32) -> u32 {
    let i = b >> 2u;
    let s = (b & 3u) * 8u;
    return (W[i] >> s) | ((W[i + 1u] << 1u) << (31u - s));
}

fn wu2(b: u32) -> vec2<u32> {
    let i = b >> 2u;
    let s = (b & 3u) * 8u;
    let a = vec2<u32>(W[i], W[i + 1u]);
    let c = vec2<u32>(W[i + 1u], W[i + 2u]);
    return (a >> vec2<u32>(s)) | ((c << vec2<u32>(1u)) << vec2<u32>(31u - s));
}

fn wu4(b: u32) -> vec4<u32> {
    let i = b >> 2u;
    let s = (b & 3u) * 8u;
    let w0 = W[i];
    let w1 = W[i + 1u];
    let w2 = W[i + 2u];
    let w3 = W[i + 3u];
    let w4 = W[i + 4u];
    let a = vec4<u32>(w0, w1, w2, w3);
    let c = vec4<u32>(w1, w2, w3, w4);
    return (a >> vec4<u32>(s)) | ((c << vec4<u32>(1u)) << vec4<u32>(31u - s));
}

// 16 bytes at a 4-aligned byte offset
fn wa4(b: u32) -> vec4<u32> {
    let i = b >> 2u;
    return vec4<u32>(W[i], W[i + 1u], W[i + 2u], W[i + 3u]);
}

fn wbyte(b: u32) -> u32 {
    return (W[b >> 2u] >> ((b & 3u) * 8u)) & 0xffu;
}

// u16 at an even byte offset
fn whalf_bits(b: u32) -> u32 {
    return (W[b >> 2u] >> ((b & 2u) * 8u)) & 0xffffu;
}

// f16 at an even byte offset
fn wf16(b: u32) -> f32 {
    return unpack2x16float(whalf_bits(b)).x;
}

// four bytes as unsigned / signed values
fn f4u(u: u32) -> vec4<f32> {
    return vec4<f32>(unpack4xU8(u));
}

fn f4i(u: u32) -> vec4<f32> {
    return vec4<f32>(unpack4xI8(u));
}

const M4 = 0x0f0f0f0fu;

fn lo4(u: u32) -> vec4<f32> {
    return f4u(u & M4);
}

fn hi4(u: u32) -> vec4<f32> {
    return f4u((u >> 4u) & M4);
}

// The same conversion on the ALU: 2^23 + b has b in its mantissa, so OR in the exponent and
// subtract 2^23. Int->float converts run on a narrow pipe (16 lanes per clock per SM on Hopper,
// a quarter of the integer ALU): the 4-bit types convert half their nibbles this way, which
// measured 15-20% faster there (Q4_K, Q5_K, Q4_0); for the others it was slower.
fn g4u(u: u32) -> vec4<f32> {
    let m = vec4<u32>(u & 0xffu, (u >> 8u) & 0xffu, (u >> 16u) & 0xffu, u >> 24u) | vec4<u32>(0x4b000000u);
    return bitcast<vec4<f32>>(m) - vec4<f32>(8388608.0);
}

fn ghi4(u: u32) -> vec4<f32> {
    return g4u((u >> 4u) & M4);
}

// the 4 set-or-clear bits 0..3 of v moved to bit 0 of bytes 0..3
fn spread4(v: u32) -> u32 {
    return ((v & 0xfu) * 0x00204081u) & 0x01010101u;
}

fn bf16_lo(u: u32) -> f32 {
    return bitcast<f32>(u << 16u);
}

fn bf16_hi(u: u32) -> f32 {
    return bitcast<f32>(u & 0xffff0000u);
}

// ggml's kvalues_iq4nl as packed i8 (a const array indexed at run time would be copied to
// local memory on some drivers)
fn iq4(n: u32) -> f32 {
    let i = n & 15u;
    let w = select(select(0xbfad9881u, 0xf6eaddcfu, i >= 4u), select(0x26190d01u, 0x71594535u, i >= 12u), i >= 8u);
    return f32(bitcast<i32>(w << (24u - 8u * (i & 3u))) >> 24u);
}

fn iq4_lo(u: u32) -> vec4<f32> {
    return vec4<f32>(iq4(u), iq4(u >> 8u), iq4(u >> 16u), iq4(u >> 24u));
}

fn iq4_hi(u: u32) -> vec4<f32> {
    return iq4_lo(u >> 4u);
}

// MXFP4 e2m1 nibbles (sign, 2-bit exponent, 1-bit mantissa) become f16 bit patterns by moving
// the 3 magnitude bits to f16 bits 9..11 and the sign to bit 15: the f16 is exactly the e2m1
// value times 2^-14, subnormals included. `t` holds the nibbles of interest at bits 0..3 and
// 16..19; the result is the two values.
fn e2m1_pair(t: u32) -> vec2<f32> {
    let u = t << 9u;
    return unpack2x16float((u & 0x0e000e00u) | ((u << 3u) & 0x80008000u));
}

// the low (elements j..j+3) and high (j+16..j+19) nibbles of one qs word, in units of 2^-14
fn e2m1_lo(u: u32) -> vec4<f32> {
    let a = e2m1_pair(u);       // bytes 0, 2
    let b = e2m1_pair(u >> 8u); // bytes 1, 3
    return vec4<f32>(a.x, b.x, a.y, b.y);
}

fn e2m1_hi(u: u32) -> vec4<f32> {
    return e2m1_lo(u >> 4u);
}

// ggml: value = kvalues_mxfp4[n] * 2^(e-128) = e2m1(n) * 2^(e-127) = (f16 pattern) * 2^(e-113).
// Returns two factors to apply in order (one of them 1 unless 2^(e-113) overflows f32).
fn mx_scale(e: u32) -> vec2<f32> {
    if (e <= 240u) {
        return vec2<f32>(1.0, bitcast<f32>((e + 14u) << 23u));
    }
    return vec2<f32>(32768.0, bitcast<f32>((e - 1u) << 23u));
}

// 6-bit scale and min of sub-blocks 2c and 2c+1 of a Q4_K / Q5_K block (ggml's
// get_scale_min_k4), from the header's scale words y, z, w (bytes 4..16 of the block):
// (sc0, m0, sc1, m1). Works on the two bytes of each pair at once.
fn k4_scales(y: u32, z: u32, w: u32, c: u32) -> vec4<f32> {
    let sh = 16u * (c & 1u);
    let ys = y >> sh;
    let zs = z >> sh;
    let ws = w >> sh;
    // c < 2: low 6 bits of bytes j, j+1 (scales in y, mins in z); c >= 2: low / high nibble of w
    // with the top two bits of y / z above them
    let hi = c >= 2u;
    let sc = select(ys & 0x3f3fu, (ws & 0x0f0fu) | ((ys >> 2u) & 0x3030u), hi);
    let mn = select(zs & 0x3f3fu, ((ws >> 4u) & 0x0f0fu) | ((zs >> 2u) & 0x3030u), hi);
    return g4u((sc & 0xffu) | ((mn & 0xffu) << 8u) | ((sc & 0xff00u) << 8u) | ((mn & 0xff00u) << 16u));
}

// signed 6-bit scale j (0..16) of a Q3_K block whose 12 scale bytes start at byte b
fn q3k_scale(b: u32, j: u32) -> f32 {
    let lo = (wbyte(b + (j & 7u)) >> (4u * (j >> 3u))) & 15u;
    let hi = (wbyte(b + 8u + (j & 3u)) >> (2u * (j >> 2u))) & 3u;
    return f32(i32(lo | (hi << 4u)) - 32);
}

// Q5_0 / Q5_1: 5-bit levels of elements 4i..4i+4 (low nibbles of qs word qw) and 16+4i..
// (high nibbles), fifth bits from qh
fn q5lo(qw: u32, qh: u32, i: u32) -> vec4<f32> {
    return f4u((qw & M4) | (spread4(qh >> (4u * i)) << 4u));
}

fn q5hi(qw: u32, qh: u32, i: u32) -> vec4<f32> {
    return f4u(((qw >> 4u) & M4) | (spread4(qh >> (16u + 4u * i)) << 4u));
}

// ---- per-type decoders ----

#if TY_F32
// virtual blocks of 256 elements; chunk s, vec4 j = elements 4s + 32j (8 lanes cover 128
// contiguous bytes per load)
fn xmap(s: u32, j: u32) -> u32 {
    return 4u * s + 32u * j;
}

fn wv(bi: u32) -> vec4<f32> {
    return bitcast<vec4<f32>>(W4[bi]);
}

fn chunk_w(b: u32, s: u32) -> array<vec4<f32>, 8> {
    let bi = (b >> 4u) + s;
    return array<vec4<f32>, 8>(wv(bi), wv(bi + 8u), wv(bi + 16u), wv(bi + 24u),
                               wv(bi + 32u), wv(bi + 40u), wv(bi + 48u), wv(bi + 56u));
}

fn welem(rb: u32, e: u32) -> f32 {
    return bitcast<f32>(W[(rb >> 2u) + e]);
}
#endif

#if TY_F16
// virtual blocks of 256; chunk s: 4 vec4<u32> of 8 halves at elements 8s + 64j'
fn xmap(s: u32, j: u32) -> u32 {
    return 8u * s + 64u * (j >> 1u) + 4u * (j & 1u);
}

fn h4(a: u32, c: u32) -> vec4<f32> {
    return vec4<f32>(unpack2x16float(a), unpack2x16float(c));
}

fn chunk_w(b: u32, s: u32) -> array<vec4<f32>, 8> {
    let bi = (b >> 4u) + s;
    let u0 = W4[bi];
    let u1 = W4[bi + 8u];
    let u2 = W4[bi + 16u];
    let u3 = W4[bi + 24u];
    return array<vec4<f32>, 8>(h4(u0.x, u0.y), h4(u0.z, u0.w), h4(u1.x, u1.y), h4(u1.z, u1.w),
                               h4(u2.x, u2.y), h4(u2.z, u2.w), h4(u3.x, u3.y), h4(u3.z, u3.w));
}

fn welem(rb: u32, e: u32) -> f32 {
    return wf16(rb + 2u * e);
}
#endif

#if TY_BF16
fn xmap(s: u32, j: u32) -> u32 {
    return 8u * s + 64u * (j >> 1u) + 4u * (j & 1u);
}

fn b4(a: u32, c: u32) -> vec4<f32> {
    return vec4<f32>(bf16_lo(a), bf16_hi(a), bf16_lo(c), bf16_hi(c));
}

fn chunk_w(b: u32, s: u32) -> array<vec4<f32>, 8> {
    let bi = (b >> 4u) + s;
    let u0 = W4[bi];
    let u1 = W4[bi + 8u];
    let u2 = W4[bi + 16u];
    let u3 = W4[bi + 24u];
    return array<vec4<f32>, 8>(b4(u0.x, u0.y), b4(u0.z, u0.w), b4(u1.x, u1.y), b4(u1.z, u1.w),
                               b4(u2.x, u2.y), b4(u2.z, u2.w), b4(u3.x, u3.y), b4(u3.z, u3.w));
}

fn welem(rb: u32, e: u32) -> f32 {
    return bitcast<f32>(whalf_bits(rb + 2u * e) << 16u);
}
#endif

#if TY_Q4_0
// d: f16, qs[16]: byte j = element j (low nibble) and j+16 (high); value d * (q - 8)
fn xmap(s: u32, j: u32) -> u32 {
    return 4u * j;
}

fn chunk_w(b: u32, s: u32) -> array<vec4<f32>, 8> {
    let d = wf16(b);
    let q = wu4(b + 2u);
    let o = vec4<f32>(8.0);
    return array<vec4<f32>, 8>(d * (lo4(q.x) - o), d * (lo4(q.y) - o), d * (lo4(q.z) - o), d * (lo4(q.w) - o),
                               d * (hi4(q.x) - o), d * (hi4(q.y) - o), d * (hi4(q.z) - o), d * (hi4(q.w) - o));
}

#if Q8X
// matvec, int8 x: 2 lanes per block, lane k = qs bytes 8k..8k+8: low nibbles = elements 8k..
// (x words 2k, 2k+1), high = 16+8k.. (x words 4+2k, 5+2k), against both levels. The -8 offset
// of the whole block is -8 Σx̂, taken by lane 0 alone.
const MV_CPB = 2u;

struct XC {
    q: vec4<u32>,   // level-1 x words of the low nibbles (.xy) and of the high ones (.zw)
    q2: vec4<u32>,  // level 2, the same
    d: vec3<f32>,   // d, d₂, and Σx̂ for lane 0 (0 for lane 1)
}

fn load_xc(xe: u32, k: u32) -> XC {
    let blk = xe / 32u;
    let h = k == 1u;
    let u = qx(blk, 0u, 0u);
    let v = qx(blk, 0u, 1u);
    let u2 = qx(blk, 1u, 0u);
    let v2 = qx(blk, 1u, 1u);
    let sc = xsc(blk);
    return XC(vec4<u32>(select(u.xy, u.zw, h), select(v.xy, v.zw, h)),
              vec4<u32>(select(u2.xy, u2.zw, h), select(v2.xy, v2.zw, h)), vec3<f32>(sc.xy, select(sc.z, 0.0, h)));
}

fn chunk_dot(b: u32, k: u32, xc: XC) -> f32 {
    let q = wu2(b + 2u + 8u * k);
    let w = vec4<u32>(q.x & M4, q.y & M4, (q.x >> 4u) & M4, (q.y >> 4u) & M4);
    return wf16(b) * (lv2(xc.d.xy, vec2<i32>(dot16(w, xc.q), dot16(w, xc.q2))) - 8.0 * xc.d.z);
}
#else
// matvec: 2 lanes per block, lane k = qs bytes 8k..8k+8 (elements 8k.. and 16+8k..)
const MV_CPB = 2u;

struct XC {
    v: array<vec4<f32>, 4>,
    s: f32,
}

fn load_xc(xb: u32, k: u32) -> XC {
    let a = x4(xb + 8u * k);
    let c = x4(xb + 8u * k + 4u);
    let e = x4(xb + 16u + 8u * k);
    let f = x4(xb + 20u + 8u * k);
    return XC(array<vec4<f32>, 4>(a, c, e, f), dot(a + c + e + f, vec4<f32>(1.0)));
}

fn chunk_dot(b: u32, k: u32, xc: XC) -> f32 {
    let q = wu2(b + 2u + 8u * k);
    let acc = dot(lo4(q.x), xc.v[0]) + dot(lo4(q.y), xc.v[1]) + dot(ghi4(q.x), xc.v[2]) + dot(ghi4(q.y), xc.v[3]);
    return wf16(b) * (acc - 8.0 * xc.s);
}
#endif
#endif

#if TY_Q4_1
// d, m: f16, qs[16] as Q4_0; value d * q + m (blocks of 20 bytes: 4-aligned)
fn xmap(s: u32, j: u32) -> u32 {
    return 4u * j;
}

fn chunk_w(b: u32, s: u32) -> array<vec4<f32>, 8> {
    let dm = unpack2x16float(W[b >> 2u]);
    let q = wa4(b + 4u);
    let d = dm.x;
    let m = vec4<f32>(dm.y);
    return array<vec4<f32>, 8>(d * lo4(q.x) + m, d * lo4(q.y) + m, d * lo4(q.z) + m, d * lo4(q.w) + m,
                               d * hi4(q.x) + m, d * hi4(q.y) + m, d * hi4(q.z) + m, d * hi4(q.w) + m);
}
#endif

#if TY_Q5_0
// d: f16, qh: u32 (bit e = fifth bit of element e), qs[16] as Q4_0; value d * (q - 16)
fn xmap(s: u32, j: u32) -> u32 {
    return 4u * j;
}

fn chunk_w(b: u32, s: u32) -> array<vec4<f32>, 8> {
    let d = wf16(b);
    let h = wu(b + 2u);
    let q = wu4(b + 6u);
    let o = vec4<f32>(16.0);
    return array<vec4<f32>, 8>(d * (q5lo(q.x, h, 0u) - o), d * (q5lo(q.y, h, 1u) - o),
                               d * (q5lo(q.z, h, 2u) - o), d * (q5lo(q.w, h, 3u) - o),
                               d * (q5hi(q.x, h, 0u) - o), d * (q5hi(q.y, h, 1u) - o),
                               d * (q5hi(q.z, h, 2u) - o), d * (q5hi(q.w, h, 3u) - o));
}
#endif

#if TY_Q5_1
// d, m: f16, qh: u32, qs[16]; value d * q + m (blocks of 24 bytes: 4-aligned)
fn xmap(s: u32, j: u32) -> u32 {
    return 4u * j;
}

fn chunk_w(b: u32, s: u32) -> array<vec4<f32>, 8> {
    let dm = unpack2x16float(W[b >> 2u]);
    let h = W[(b >> 2u) + 1u];
    let q = wa4(b + 8u);
    let d = dm.x;
    let m = vec4<f32>(dm.y);
    return array<vec4<f32>, 8>(d * q5lo(q.x, h, 0u) + m, d * q5lo(q.y, h, 1u) + m,
                               d * q5lo(q.z, h, 2u) + m, d * q5lo(q.w, h, 3u) + m,
                               d * q5hi(q.x, h, 0u) + m, d * q5hi(q.y, h, 1u) + m,
                               d * q5hi(q.z, h, 2u) + m, d * q5hi(q.w, h, 3u) + m);
}
#endif

#if TY_Q8_0
// d: f16, qs: 32 x i8; value d * q
fn xmap(s: u32, j: u32) -> u32 {
    return 4u * j;
}

fn chunk_w(b: u32, s: u32) -> array<vec4<f32>, 8> {
    let d = wf16(b);
    let q0 = wu4(b + 2u);
    let q1 = wu4(b + 18u);
    return array<vec4<f32>, 8>(d * f4i(q0.x), d * f4i(q0.y), d * f4i(q0.z), d * f4i(q0.w),
                               d * f4i(q1.x), d * f4i(q1.y), d * f4i(q1.z), d * f4i(q1.w));
}

#if Q8X
// matvec, int8 x: 2 lanes per block, lane k = codes 16k..16k+16 (one 5-word read) against x
// words 4k..4k+4 of both levels
const MV_CPB = 2u;

struct XC {
    q: vec4<u32>,
    q2: vec4<u32>,
    d: vec2<f32>,   // d, d₂
}

fn load_xc(xe: u32, k: u32) -> XC {
    let blk = xe / 32u;
    return XC(qx(blk, 0u, k), qx(blk, 1u, k), xsc(blk).xy);
}

fn chunk_dot(b: u32, k: u32, xc: XC) -> f32 {
    let w = wu4(b + 2u + 16u * k);
    return wf16(b) * lv2(xc.d, vec2<i32>(dot16(w, xc.q), dot16(w, xc.q2)));
}
#else
// matvec: 2 lanes per block, lane k = qs bytes 16k..16k+16 (one 5-word read)
const MV_CPB = 2u;

struct XC {
    v: array<vec4<f32>, 4>,
}

fn load_xc(xb: u32, k: u32) -> XC {
    let b0 = xb + 16u * k;
    return XC(array<vec4<f32>, 4>(x4(b0), x4(b0 + 4u), x4(b0 + 8u), x4(b0 + 12u)));
}

// the x-independent half of chunk_dot: the slice's codes as floats and the block scale
struct WC {
    q: array<vec4<f32>, 4>,
    d: f32,
}

fn chunk_pre(b: u32, k: u32) -> WC {
    let q = wu4(b + 2u + 16u * k);
    return WC(array<vec4<f32>, 4>(f4i(q.x), f4i(q.y), f4i(q.z), f4i(q.w)), wf16(b));
}

fn chunk_fin(w: WC, xc: XC) -> f32 {
    return w.d * (dot(w.q[0], xc.v[0]) + dot(w.q[1], xc.v[1]) + dot(w.q[2], xc.v[2]) + dot(w.q[3], xc.v[3]));
}

fn chunk_dot(b: u32, k: u32, xc: XC) -> f32 {
    return chunk_fin(chunk_pre(b, k), xc);
}
#endif

#endif

#if TY_Q2_K
// scales[16] (low nibble scale, high nibble min), qs[64], d, dmin (84 bytes: 4-aligned).
// Chunk s: half n = s/4, shift 2(s%4): 32 consecutive elements from the 32 qs bytes of half n;
// value d * sc * q - dmin * m per 16 elements.
fn xmap(s: u32, j: u32) -> u32 {
    return 32u * s + 4u * j;
}

fn chunk_w(b: u32, s: u32) -> array<vec4<f32>, 8> {
    let n = s >> 2u;
    let sh = 2u * (s & 3u);
    let dd = unpack2x16float(W[(b >> 2u) + 20u]);
    let scw = whalf_bits(b + 8u * n + 2u * (s & 3u));
    let s0 = scw & 0xffu;
    let s1 = scw >> 8u;
    let d0 = dd.x * f32(s0 & 15u);
    let m0 = vec4<f32>(dd.y * f32(s0 >> 4u));
    let d1 = dd.x * f32(s1 & 15u);
    let m1 = vec4<f32>(dd.y * f32(s1 >> 4u));
    let qa = (wa4(b + 16u + 32u * n) >> vec4<u32>(sh)) & vec4<u32>(0x03030303u);
    let qb = (wa4(b + 32u + 32u * n) >> vec4<u32>(sh)) & vec4<u32>(0x03030303u);
    return array<vec4<f32>, 8>(d0 * f4u(qa.x) - m0, d0 * f4u(qa.y) - m0, d0 * f4u(qa.z) - m0, d0 * f4u(qa.w) - m0,
                               d1 * f4u(qb.x) - m1, d1 * f4u(qb.y) - m1, d1 * f4u(qb.z) - m1, d1 * f4u(qb.w) - m1);
}
#endif

#if TY_Q3_K
// hmask[32], qs[64], scales[12], d. Element 128n + 32j + l: low bits (qs[32n + l] >> 2j) & 3,
// high bit (hmask[l] >> (4n + j)) & 1, value d * scale[8n + 2j + l/16] * (low + 4 high - 4).
// Chunk s = (n, j) = (s/4, s%4): 32 consecutive elements.
fn xmap(s: u32, j: u32) -> u32 {
    return 32u * s + 4u * j;
}

// levels of elements 4i..4i+4 of chunk (n, j), offset removed
fn q3v(b: u32, n: u32, j: u32, i: u32) -> vec4<f32> {
    let lo = (wu(b + 32u + 32u * n + 4u * i) >> (2u * j)) & 0x03030303u;
    let hb = ((wu(b + 4u * i) >> (4u * n + j)) & 0x01010101u) << 2u;
    return f4u(lo | hb) - vec4<f32>(4.0);
}

fn chunk_w(b: u32, s: u32) -> array<vec4<f32>, 8> {
    let n = s >> 2u;
    let j = s & 3u;
    let d = wf16(b + 108u);
    let s0 = d * q3k_scale(b + 96u, 8u * n + 2u * j);
    let s1 = d * q3k_scale(b + 96u, 8u * n + 2u * j + 1u);
    return array<vec4<f32>, 8>(s0 * q3v(b, n, j, 0u), s0 * q3v(b, n, j, 1u), s0 * q3v(b, n, j, 2u), s0 * q3v(b, n, j, 3u),
                               s1 * q3v(b, n, j, 4u), s1 * q3v(b, n, j, 5u), s1 * q3v(b, n, j, 6u), s1 * q3v(b, n, j, 7u));
}
#endif

#if TY_Q4_K
// d, dmin, scales[12], qs[128] (144 bytes: 16-aligned). Chunk s: qs bytes 16s..16s+16; low
// nibbles = elements 64c+16h.. of sub-block 2c, high = 64c+32+16h.. of sub-block 2c+1
// (c = s/2, h = s%2); value d * sc * q - dmin * m.
fn xmap(s: u32, j: u32) -> u32 {
    return 64u * (s >> 1u) + 16u * (s & 1u) + 32u * (j >> 2u) + 4u * (j & 3u);
}

fn chunk_w(b: u32, s: u32) -> array<vec4<f32>, 8> {
    let bi = b >> 4u;
    let hd = W4[bi];
    let q = W4[bi + 1u + s];
    let dm = unpack2x16float(hd.x);
    let sm = k4_scales(hd.y, hd.z, hd.w, s >> 1u);
    let d0 = dm.x * sm.x;
    let m0 = vec4<f32>(dm.y * sm.y);
    let d1 = dm.x * sm.z;
    let m1 = vec4<f32>(dm.y * sm.w);
    return array<vec4<f32>, 8>(d0 * lo4(q.x) - m0, d0 * lo4(q.y) - m0, d0 * lo4(q.z) - m0, d0 * lo4(q.w) - m0,
                               d1 * hi4(q.x) - m1, d1 * hi4(q.y) - m1, d1 * hi4(q.z) - m1, d1 * hi4(q.w) - m1);
}

#if Q8X
// matvec, int8 x: 4 lanes per block, lane c = qs bytes 32c..32c+32 (two 16-byte loads): low
// nibbles = sub-block 2c against x block 2c, high = sub-block 2c+1 against x block 2c+1 (both
// levels); the mins as dmin * m * Σx̂ per sub-block (ggml's vec_dot_q4_K_q8_1).
const MV_CPB = 4u;

alias XC = QX2;

fn load_xc(xe: u32, c: u32) -> XC {
    return load_qx2(xe / 32u + 2u * c);
}

fn chunk_dot(b: u32, c: u32, xc: XC) -> f32 {
    let bi = b >> 4u;
    let hd = W4[bi];
    let q0 = W4[bi + 1u + 2u * c];
    let q1 = W4[bi + 2u + 2u * c];
    let m4 = vec4<u32>(M4);
    let f = vec4<u32>(4u);
    let lo = sums2(q0 & m4, q1 & m4, xc.q[0], xc.q[1], xc.q2[0], xc.q2[1]);
    let hi = sums2((q0 >> f) & m4, (q1 >> f) & m4, xc.q[2], xc.q[3], xc.q2[2], xc.q2[3]);
    return k_sub2(unpack2x16float(hd.x), k4_scales(hd.y, hd.z, hd.w, c), lo, hi, xc);
}
#else
// matvec: the same chunks, 8 lanes per block: one 16-byte load of qs plus the 16-byte header
const MV_CPB = 8u;

struct XC {
    v: array<vec4<f32>, 8>,
    s: vec2<f32>,   // sums of v[0..4] and v[4..8]
}

fn load_xc(xb: u32, s: u32) -> XC {
    let b0 = xb + 64u * (s >> 1u) + 16u * (s & 1u);
    let a0 = x4(b0);
    let a1 = x4(b0 + 4u);
    let a2 = x4(b0 + 8u);
    let a3 = x4(b0 + 12u);
    let a4 = x4(b0 + 32u);
    let a5 = x4(b0 + 36u);
    let a6 = x4(b0 + 40u);
    let a7 = x4(b0 + 44u);
    let one = vec4<f32>(1.0);
    return XC(array<vec4<f32>, 8>(a0, a1, a2, a3, a4, a5, a6, a7),
              vec2<f32>(dot(a0 + a1 + a2 + a3, one), dot(a4 + a5 + a6 + a7, one)));
}

// the x-independent half of chunk_dot: the slice's codes as floats (the v[] order) and scales
struct WC {
    q: array<vec4<f32>, 8>,
    dm: vec2<f32>,
    sm: vec4<f32>,
}

fn chunk_pre(b: u32, s: u32) -> WC {
    let bi = b >> 4u;
    let hd = W4[bi];
    let q = W4[bi + 1u + s];
    return WC(array<vec4<f32>, 8>(lo4(q.x), lo4(q.y), lo4(q.z), lo4(q.w), ghi4(q.x), ghi4(q.y), ghi4(q.z), ghi4(q.w)),
              unpack2x16float(hd.x), k4_scales(hd.y, hd.z, hd.w, s >> 1u));
}

fn chunk_fin(w: WC, xc: XC) -> f32 {
    let lo = dot(w.q[0], xc.v[0]) + dot(w.q[1], xc.v[1]) + dot(w.q[2], xc.v[2]) + dot(w.q[3], xc.v[3]);
    let hi = dot(w.q[4], xc.v[4]) + dot(w.q[5], xc.v[5]) + dot(w.q[6], xc.v[6]) + dot(w.q[7], xc.v[7]);
    return w.dm.x * (w.sm.x * lo + w.sm.z * hi) - w.dm.y * (w.sm.y * xc.s.x + w.sm.w * xc.s.y);
}

fn chunk_dot(b: u32, s: u32, xc: XC) -> f32 {
    return chunk_fin(chunk_pre(b, s), xc);
}
#endif
#endif

#if TY_Q5_K
// d, dmin, scales[12], qh[32], qs[128] (176 bytes: 16-aligned): as Q4_K plus the fifth bit,
// bit 2c (low nibbles) / 2c+1 (high) of qh[l] for element l of the 64-group c
fn xmap(s: u32, j: u32) -> u32 {
    return 64u * (s >> 1u) + 16u * (s & 1u) + 32u * (j >> 2u) + 4u * (j & 3u);
}

struct Q5K {
    lo: vec4<u32>,  // 5-bit levels, 4 per word, of sub-block 2c
    hi: vec4<u32>,  // of sub-block 2c+1
    sm: vec4<f32>,  // d*sc0, dmin*m0, d*sc1, dmin*m1
}

fn q5k(b: u32, s: u32) -> Q5K {
    let bi = b >> 4u;
    let hd = W4[bi];
    let qh = W4[bi + 1u + (s & 1u)];
    let q = W4[bi + 3u + s];
    let c = s >> 1u;
    let dm = unpack2x16float(hd.x);
    let sm = k4_scales(hd.y, hd.z, hd.w, c);
    let m4 = vec4<u32>(M4);
    let one = vec4<u32>(0x01010101u);
    let lo = (q & m4) | (((qh >> vec4<u32>(2u * c)) & one) << vec4<u32>(4u));
    let hi = ((q >> vec4<u32>(4u)) & m4) | (((qh >> vec4<u32>(2u * c + 1u)) & one) << vec4<u32>(4u));
    return Q5K(lo, hi, vec4<f32>(dm.x * sm.x, dm.y * sm.y, dm.x * sm.z, dm.y * sm.w));
}

fn chunk_w(b: u32, s: u32) -> array<vec4<f32>, 8> {
    let v = q5k(b, s);
    let d0 = v.sm.x;
    let m0 = vec4<f32>(v.sm.y);
    let d1 = v.sm.z;
    let m1 = vec4<f32>(v.sm.w);
    return array<vec4<f32>, 8>(d0 * f4u(v.lo.x) - m0, d0 * f4u(v.lo.y) - m0, d0 * f4u(v.lo.z) - m0, d0 * f4u(v.lo.w) - m0,
                               d1 * f4u(v.hi.x) - m1, d1 * f4u(v.hi.y) - m1, d1 * f4u(v.hi.z) - m1, d1 * f4u(v.hi.w) - m1);
}

#if Q8X
// matvec, int8 x: as Q4_K's, 4 lanes per block, lane c = qs bytes 32c..32c+32 with the fifth
// bits from qh (bytes 0..16 for the first 16 qs bytes, 16..32 for the next); 5-bit levels are
// valid signed bytes.
const MV_CPB = 4u;

alias XC = QX2;

fn load_xc(xe: u32, c: u32) -> XC {
    return load_qx2(xe / 32u + 2u * c);
}

fn chunk_dot(b: u32, c: u32, xc: XC) -> f32 {
    let bi = b >> 4u;
    let hd = W4[bi];
    let qh0 = W4[bi + 1u];
    let qh1 = W4[bi + 2u];
    let q0 = W4[bi + 3u + 2u * c];
    let q1 = W4[bi + 4u + 2u * c];
    let m4 = vec4<u32>(M4);
    let one = vec4<u32>(0x01010101u);
    let sl = vec4<u32>(2u * c);
    let sh = vec4<u32>(2u * c + 1u);
    let f = vec4<u32>(4u);
    let lo = sums2((q0 & m4) | (((qh0 >> sl) & one) << f), (q1 & m4) | (((qh1 >> sl) & one) << f),
                   xc.q[0], xc.q[1], xc.q2[0], xc.q2[1]);
    let hi = sums2(((q0 >> f) & m4) | (((qh0 >> sh) & one) << f), ((q1 >> f) & m4) | (((qh1 >> sh) & one) << f),
                   xc.q[2], xc.q[3], xc.q2[2], xc.q2[3]);
    return k_sub2(unpack2x16float(hd.x), k4_scales(hd.y, hd.z, hd.w, c), lo, hi, xc);
}
#else
const MV_CPB = 8u;

struct XC {
    v: array<vec4<f32>, 8>,
    s: vec2<f32>,
}

fn load_xc(xb: u32, s: u32) -> XC {
    let b0 = xb + 64u * (s >> 1u) + 16u * (s & 1u);
    let a0 = x4(b0);
    let a1 = x4(b0 + 4u);
    let a2 = x4(b0 + 8u);
    let a3 = x4(b0 + 12u);
    let a4 = x4(b0 + 32u);
    let a5 = x4(b0 + 36u);
    let a6 = x4(b0 + 40u);
    let a7 = x4(b0 + 44u);
    let one = vec4<f32>(1.0);
    return XC(array<vec4<f32>, 8>(a0, a1, a2, a3, a4, a5, a6, a7),
              vec2<f32>(dot(a0 + a1 + a2 + a3, one), dot(a4 + a5 + a6 + a7, one)));
}

fn chunk_dot(b: u32, s: u32, xc: XC) -> f32 {
    let v = q5k(b, s);
    let lo = dot(f4u(v.lo.x), xc.v[0]) + dot(f4u(v.lo.y), xc.v[1]) + dot(f4u(v.lo.z), xc.v[2]) + dot(f4u(v.lo.w), xc.v[3]);
    let hi = dot(g4u(v.hi.x), xc.v[4]) + dot(g4u(v.hi.y), xc.v[5]) + dot(g4u(v.hi.z), xc.v[6]) + dot(g4u(v.hi.w), xc.v[7]);
    return v.sm.x * lo + v.sm.z * hi - (v.sm.y * xc.s.x + v.sm.w * xc.s.y);
}
#endif
#endif

#if TY_Q6_K
// ql[128], qh[64], scales[16] (i8), d (210 bytes: 2-aligned). Element 128n + 32k + l (k < 4,
// l < 32): low 4 bits from ql[64n + l + 32(k&1)] (low nibble for k < 2, high for k >= 2), high 2
// bits (qh[32n + l] >> 2k) & 3, value d * scales[8n + 2k + l/16] * (q - 32).

// 6-bit levels of 4 consecutive l for k = 0..3, one word each, from the ql words at l and l+32
// and the qh word at l
fn q6w(a: u32, c: u32, h: u32) -> vec4<u32> {
    let m2 = 0x03030303u;
    return vec4<u32>((a & M4) | ((h & m2) << 4u), (c & M4) | (((h >> 2u) & m2) << 4u),
                     ((a >> 4u) & M4) | (((h >> 4u) & m2) << 4u), ((c >> 4u) & M4) | (((h >> 6u) & m2) << 4u));
}

// the four scales of k = 0..3 for half n, l in a 16-group
fn q6_scales(b: u32, n: u32, l: u32) -> vec4<f32> {
    let sb = b + 192u + 8u * n + (l >> 4u);
    let s01 = unpack4xI8(wu(sb));
    let s23 = unpack4xI8(wu(sb + 4u));
    return vec4<f32>(f32(s01.x), f32(s01.z), f32(s23.x), f32(s23.z));
}

// matmul chunk s: n = s/4, l = 8(s%4)..+8, all four k; vec4 j = 2k + (which 4 of the 8 l)
fn xmap(s: u32, j: u32) -> u32 {
    return 128u * (s >> 2u) + 32u * (j >> 1u) + 8u * (s & 3u) + 4u * (j & 1u);
}

fn chunk_w(b: u32, s: u32) -> array<vec4<f32>, 8> {
    let n = s >> 2u;
    let l = 8u * (s & 3u);
    let a = wu2(b + 64u * n + l);
    let c = wu2(b + 64u * n + 32u + l);
    let h = wu2(b + 128u + 32u * n + l);
    let sc = wf16(b + 208u) * q6_scales(b, n, l);
    let q0 = q6w(a.x, c.x, h.x);
    let q1 = q6w(a.y, c.y, h.y);
    let o = vec4<f32>(32.0);
    return array<vec4<f32>, 8>(sc.x * (f4u(q0.x) - o), sc.x * (f4u(q1.x) - o), sc.y * (f4u(q0.y) - o), sc.y * (f4u(q1.y) - o),
                               sc.z * (f4u(q0.z) - o), sc.z * (f4u(q1.z) - o), sc.w * (f4u(q0.w) - o), sc.w * (f4u(q1.w) - o));
}

#if Q8X
// matvec, int8 x: 4 lanes per block, lane j = half n = j/2, l = 16(j%2)..+16, all four k:
// elements 128n + 32k + l.. = words 4(j%2)..+4 of x block 4n+k, one scale per k. The 6-bit
// levels (0..63, valid signed bytes) dot both levels of x, and the -32 offset is -32 Σq per
// level over the same 16 codes, summed once in load_xc for the R rows (exact integers in f32).
const MV_CPB = 4u;

struct XC {
    q: array<vec4<u32>, 4>,   // level 1 per k
    q2: array<vec4<u32>, 4>,  // level 2 per k
    d: vec4<f32>,             // d per k
    d2: vec4<f32>,            // d₂ per k
    s: vec4<f32>,             // 32 * Σq per k
    s2: vec4<f32>,            // 32 * Σq₂ per k
}

fn load_xc(xe: u32, j: u32) -> XC {
    let blk = xe / 32u + 4u * (j >> 1u);
    let h = j & 1u;
    let a0 = qx(blk, 0u, h);
    let a1 = qx(blk + 1u, 0u, h);
    let a2 = qx(blk + 2u, 0u, h);
    let a3 = qx(blk + 3u, 0u, h);
    let b0 = qx(blk, 1u, h);
    let b1 = qx(blk + 1u, 1u, h);
    let b2 = qx(blk + 2u, 1u, h);
    let b3 = qx(blk + 3u, 1u, h);
    let c0 = xsc(blk);
    let c1 = xsc(blk + 1u);
    let c2 = xsc(blk + 2u);
    let c3 = xsc(blk + 3u);
    let one = vec4<u32>(0x01010101u);
    let s = vec4<i32>(dot16(a0, one), dot16(a1, one), dot16(a2, one), dot16(a3, one));
    let s2 = vec4<i32>(dot16(b0, one), dot16(b1, one), dot16(b2, one), dot16(b3, one));
    return XC(array<vec4<u32>, 4>(a0, a1, a2, a3), array<vec4<u32>, 4>(b0, b1, b2, b3),
              vec4<f32>(c0.x, c1.x, c2.x, c3.x), vec4<f32>(c0.y, c1.y, c2.y, c3.y),
              32.0 * vec4<f32>(s), 32.0 * vec4<f32>(s2));
}

fn chunk_dot(b: u32, j: u32, xc: XC) -> f32 {
    let n = j >> 1u;
    let l = 16u * (j & 1u);
    let a = wu4(b + 64u * n + l);
    let c = wu4(b + 64u * n + 32u + l);
    let h = wu4(b + 128u + 32u * n + l);
    let v0 = q6w(a.x, c.x, h.x);
    let v1 = q6w(a.y, c.y, h.y);
    let v2 = q6w(a.z, c.z, h.z);
    let v3 = q6w(a.w, c.w, h.w);
    let w0 = vec4<u32>(v0.x, v1.x, v2.x, v3.x);
    let w1 = vec4<u32>(v0.y, v1.y, v2.y, v3.y);
    let w2 = vec4<u32>(v0.z, v1.z, v2.z, v3.z);
    let w3 = vec4<u32>(v0.w, v1.w, v2.w, v3.w);
    let i = vec4<i32>(dot16(w0, xc.q[0]), dot16(w1, xc.q[1]), dot16(w2, xc.q[2]), dot16(w3, xc.q[3]));
    let i2 = vec4<i32>(dot16(w0, xc.q2[0]), dot16(w1, xc.q2[1]), dot16(w2, xc.q2[2]), dot16(w3, xc.q2[3]));
    return wf16(b + 208u) * dot(q6_scales(b, n, l), xc.d * (vec4<f32>(i) - xc.s) + xc.d2 * (vec4<f32>(i2) - xc.s2));
}
#else
// matvec: matmul's chunks, 8 lanes per block, 32 weights each (three 8-byte reads)
const MV_CPB = 8u;

struct XC {
    v: array<vec4<f32>, 8>,
    s: vec4<f32>,   // sums of v[2k] + v[2k+1]
}

fn load_xc(xb: u32, s: u32) -> XC {
    let b0 = xb + 128u * (s >> 2u) + 8u * (s & 3u);
    let a0 = x4(b0);
    let a1 = x4(b0 + 4u);
    let a2 = x4(b0 + 32u);
    let a3 = x4(b0 + 36u);
    let a4 = x4(b0 + 64u);
    let a5 = x4(b0 + 68u);
    let a6 = x4(b0 + 96u);
    let a7 = x4(b0 + 100u);
    let one = vec4<f32>(1.0);
    return XC(array<vec4<f32>, 8>(a0, a1, a2, a3, a4, a5, a6, a7),
              vec4<f32>(dot(a0 + a1, one), dot(a2 + a3, one), dot(a4 + a5, one), dot(a6 + a7, one)));
}

// the x-independent half of chunk_dot: the slice's codes as floats (the v[] order) and scales
struct WC {
    q: array<vec4<f32>, 8>,
    d: f32,
    sc: vec4<f32>,
}

fn chunk_pre(b: u32, s: u32) -> WC {
    let n = s >> 2u;
    let l = 8u * (s & 3u);
    let a = wu2(b + 64u * n + l);
    let c = wu2(b + 64u * n + 32u + l);
    let h = wu2(b + 128u + 32u * n + l);
    let q0 = q6w(a.x, c.x, h.x);
    let q1 = q6w(a.y, c.y, h.y);
    return WC(array<vec4<f32>, 8>(f4u(q0.x), f4u(q1.x), f4u(q0.y), f4u(q1.y), f4u(q0.z), f4u(q1.z), f4u(q0.w), f4u(q1.w)),
              wf16(b + 208u), q6_scales(b, n, l));
}

fn chunk_fin(w: WC, xc: XC) -> f32 {
    let v = vec4<f32>(dot(w.q[0], xc.v[0]) + dot(w.q[1], xc.v[1]), dot(w.q[2], xc.v[2]) + dot(w.q[3], xc.v[3]),
                      dot(w.q[4], xc.v[4]) + dot(w.q[5], xc.v[5]), dot(w.q[6], xc.v[6]) + dot(w.q[7], xc.v[7]));
    return w.d * dot(w.sc, v - 32.0 * xc.s);
}

fn chunk_dot(b: u32, s: u32, xc: XC) -> f32 {
    return chunk_fin(chunk_pre(b, s), xc);
}
#endif

#endif

#if TY_IQ4_NL
// d: f16, qs[16] as Q4_0; value d * kvalues_iq4nl[q]
fn xmap(s: u32, j: u32) -> u32 {
    return 4u * j;
}

fn chunk_w(b: u32, s: u32) -> array<vec4<f32>, 8> {
    let d = wf16(b);
    let q = wu4(b + 2u);
    return array<vec4<f32>, 8>(d * iq4_lo(q.x), d * iq4_lo(q.y), d * iq4_lo(q.z), d * iq4_lo(q.w),
                               d * iq4_hi(q.x), d * iq4_hi(q.y), d * iq4_hi(q.z), d * iq4_hi(q.w));
}
#endif

#if TY_IQ4_XS
// d: f16, scales_h: u16, scales_l[4], qs[128] (136 bytes: 8-aligned); chunk s = sub-block s
// (its 16 qs bytes as IQ4_NL); value d * (ls - 32) * kvalues_iq4nl[q]
fn xmap(s: u32, j: u32) -> u32 {
    return 32u * s + 4u * j;
}

fn chunk_w(b: u32, s: u32) -> array<vec4<f32>, 8> {
    let w0 = W[b >> 2u];
    let d = unpack2x16float(w0).x;
    let sh = w0 >> 16u;
    let sl = wbyte(b + 4u + (s >> 1u));
    let ls = ((sl >> (4u * (s & 1u))) & 15u) | (((sh >> (2u * s)) & 3u) << 4u);
    let dl = d * f32(i32(ls) - 32);
    let q = wa4(b + 8u + 16u * s);
    return array<vec4<f32>, 8>(dl * iq4_lo(q.x), dl * iq4_lo(q.y), dl * iq4_lo(q.z), dl * iq4_lo(q.w),
                               dl * iq4_hi(q.x), dl * iq4_hi(q.y), dl * iq4_hi(q.z), dl * iq4_hi(q.w));
}
#endif

#if TY_MXFP4
// e: E8M0, qs[16] as Q4_0 holding e2m1 nibbles (17 bytes: any alignment)
fn xmap(s: u32, j: u32) -> u32 {
    return 4u * j;
}

fn chunk_w(b: u32, s: u32) -> array<vec4<f32>, 8> {
    let f = mx_scale(wbyte(b));
    let q = wu4(b + 1u);
    return array<vec4<f32>, 8>(e2m1_lo(q.x) * f.x * f.y, e2m1_lo(q.y) * f.x * f.y, e2m1_lo(q.z) * f.x * f.y, e2m1_lo(q.w) * f.x * f.y,
                               e2m1_hi(q.x) * f.x * f.y, e2m1_hi(q.y) * f.x * f.y, e2m1_hi(q.z) * f.x * f.y, e2m1_hi(q.w) * f.x * f.y);
}

#ifndef MMQ
// matvec: 2 lanes per block, lane k = qs bytes 8k..8k+8 (elements 8k.. and 16+8k..)
const MV_CPB = 2u;

struct XC {
    v: array<vec4<f32>, 4>,
}

fn load_xc(xb: u32, k: u32) -> XC {
    return XC(array<vec4<f32>, 4>(x4(xb + 8u * k), x4(xb + 8u * k + 4u), x4(xb + 16u + 8u * k), x4(xb + 20u + 8u * k)));
}

fn chunk_dot(b: u32, k: u32, xc: XC) -> f32 {
    let f = mx_scale(wbyte(b));
    let q = wu2(b + 1u + 8u * k);
    let acc = dot(e2m1_lo(q.x), xc.v[0]) + dot(e2m1_lo(q.y), xc.v[1]) + dot(e2m1_hi(q.x), xc.v[2]) + dot(e2m1_hi(q.y), xc.v[3]);
    return (acc * f.x) * f.y;
}
#endif
#endif

#if TY_F8_E4M3_B128
// lathe's FP8 block (src/quant/fp8.rs): d: f32, qs: 128 e4m3fn codes (132 bytes: 4-aligned, so
// whole words); value e4m3(q) * d. Chunk s = elements 32s..32s+32 = qs words 8s..8s+8.
fn xmap(s: u32, j: u32) -> u32 {
    return 32u * s + 4u * j;
}

// e4m3fn (sign, 4-bit exponent with bias 7, 3-bit mantissa) becomes an f16 bit pattern by moving
// the 7 magnitude bits to f16 bits 7..13 (the low 4 exponent bits and the top 3 mantissa bits)
// and the sign to bit 15: the f16 is exactly the e4m3 value times 2^-8 (bias 15 vs 7),
// subnormals included (exponent 0: m * 2^-9 becomes the f16 subnormal m * 2^-17). Bytes 0 and 2
// of t; the NaN codes S.1111.111 (never in valid weights) decode as +-480.
fn e4m3_pair(t: u32) -> vec2<f32> {
    return unpack2x16float(((t << 7u) & 0x3f803f80u) | ((t << 8u) & 0x80008000u));
}

// the four codes of one qs word, in units of 2^-8
fn e4m3_4(u: u32) -> vec4<f32> {
    let a = e4m3_pair(u);       // bytes 0, 2
    let c = e4m3_pair(u >> 8u); // bytes 1, 3
    return vec4<f32>(a.x, c.x, a.y, c.y);
}

// the block scale times 2^8, undoing e4m3_4's units exactly (the product e4m3 * d then rounds
// once, as the CPU reference's)
fn f8_scale(b: u32) -> f32 {
    return bitcast<f32>(W[b >> 2u]) * 256.0;
}

fn chunk_w(b: u32, s: u32) -> array<vec4<f32>, 8> {
    let d = f8_scale(b);
    let i = (b >> 2u) + 1u + 8u * s;
    return array<vec4<f32>, 8>(e4m3_4(W[i]) * d, e4m3_4(W[i + 1u]) * d, e4m3_4(W[i + 2u]) * d, e4m3_4(W[i + 3u]) * d,
                               e4m3_4(W[i + 4u]) * d, e4m3_4(W[i + 5u]) * d, e4m3_4(W[i + 6u]) * d, e4m3_4(W[i + 7u]) * d);
}

// matvec: matmul's chunks, 4 lanes per block, the scale applied once per 32-weight slice
const MV_CPB = 4u;

struct XC {
    v: array<vec4<f32>, 8>,
}

fn load_xc(xb: u32, s: u32) -> XC {
    let b0 = xb + 32u * s;
    return XC(array<vec4<f32>, 8>(x4(b0), x4(b0 + 4u), x4(b0 + 8u), x4(b0 + 12u),
                                  x4(b0 + 16u), x4(b0 + 20u), x4(b0 + 24u), x4(b0 + 28u)));
}

fn chunk_dot(b: u32, s: u32, xc: XC) -> f32 {
    let i = (b >> 2u) + 1u + 8u * s;
    let acc = dot(e4m3_4(W[i]), xc.v[0]) + dot(e4m3_4(W[i + 1u]), xc.v[1]) + dot(e4m3_4(W[i + 2u]), xc.v[2])
            + dot(e4m3_4(W[i + 3u]), xc.v[3]) + dot(e4m3_4(W[i + 4u]), xc.v[4]) + dot(e4m3_4(W[i + 5u]), xc.v[5])
            + dot(e4m3_4(W[i + 6u]), xc.v[6]) + dot(e4m3_4(W[i + 7u]), xc.v[7]);
    return acc * f8_scale(b);
}
#endif

#if MV32
#ifndef MMQ
// matvec over matmul's chunks: one lane per 32-weight chunk, chunk_w dotted with x
const MV_CPB = CPB;

struct XC {
    v: array<vec4<f32>, 8>,
}

fn load_xc(xb: u32, s: u32) -> XC {
    return XC(array<vec4<f32>, 8>(x4(xb + xmap(s, 0u)), x4(xb + xmap(s, 1u)), x4(xb + xmap(s, 2u)), x4(xb + xmap(s, 3u)),
                                  x4(xb + xmap(s, 4u)), x4(xb + xmap(s, 5u)), x4(xb + xmap(s, 6u)), x4(xb + xmap(s, 7u))));
}

fn chunk_dot(b: u32, s: u32, xc: XC) -> f32 {
    let w = chunk_w(b, s);
    return dot(w[0], xc.v[0]) + dot(w[1], xc.v[1]) + dot(w[2], xc.v[2]) + dot(w[3], xc.v[3])
         + dot(w[4], xc.v[4]) + dot(w[5], xc.v[5]) + dot(w[6], xc.v[6]) + dot(w[7], xc.v[7]);
}
#endif
#endif

#ifndef Q8X
// ---- chunks of the prefill kernels (matmul.wgsl, matmul_coop.wgsl) ----

// Float rows not 16-byte aligned (FSLOW) or the partial last block: element by element.
fn slow_chunk(blk: u32) -> bool {
#if FSLOW
    return true;
#else
    return blk >= p.nb_full;
#endif
}

// x values of quarter-octet j of chunk s of block blk for the token whose x row is at xrow
fn gather_x(xrow: u32, blk: u32, s: u32, j: u32) -> vec4<f32> {
    let e0 = blk * BS + xmap(s, j);
#if FLOAT
    if (slow_chunk(blk)) {
        var v = vec4<f32>(0.0);
        for (var i = 0u; i < 4u; i++) {
            if (e0 + i < p.cols) {
                v[i] = x1(xrow + e0 + i);
            }
        }
        return v;
    }
#endif
    return x4(xrow + e0);
}

#endif

// ---- matvec ----
// (left out of the int8 matmul's module, MMQ: matmul_q8.wgsl also serves types without an int8
// matvec)
#ifndef MMQ

// Slice s of the blocks at bytes rb (R rows) dotted with the slice's x values xc.
fn quad_dot(rb: vec4<u32>, s: u32, xc: XC) -> vec4<f32> {
    var acc = vec4<f32>(0.0);
    acc.x = chunk_dot(rb.x, s, xc);
    if (R > 1u) {
        acc.y = chunk_dot(rb.y, s, xc);
    }
    if (R > 2u) {
        acc.z = chunk_dot(rb.z, s, xc);
    }
    if (R > 3u) {
        acc.w = chunk_dot(rb.w, s, xc);
    }
    return acc;
}

// Partial sums of slice c of rows at bytes rb (x of the token at element xbase).
fn mv_step(c: u32, rb: vec4<u32>, xbase: u32) -> vec4<f32> {
    let blk = c / MV_CPB;
    let s = c % MV_CPB;
    let xc = load_xc(xbase + blk * BS, s);
    return quad_dot(rb + vec4<u32>(blk * BB), s, xc);
}

// Bytes of the 4 rows of quad q from row0 (clamped to the last row; their writes are skipped).
fn quad_rb(wbase: u32, row0: u32, q: u32) -> vec4<u32> {
    return vec4<u32>(wbase) + rows_of(row0 + 4u * q) * p.row_bytes;
}

// The stored rows of logical rows l..l+4 (clamped to the last): themselves, or with EPI_GLU
// gate row o for 2o and up row o for 2o + 1.
fn rows_of(l: u32) -> vec4<u32> {
    let r = min(vec4<u32>(l) + vec4<u32>(0u, 1u, 2u, 3u), vec4<u32>(p.rows - 1u));
#if EPI_GLU
    return (r >> vec4<u32>(1u)) + (r & vec4<u32>(1u)) * (p.rows / 2u);
#else
    return r;
#endif
}

// Quads 1..RQ of mv_partial's rows (rows row0 + 4q..): with RQ > 1 each slice's x values are
// loaded once for 4 RQ rows, so the x traffic per weight byte falls by RQ. Each row's sum is
// the same expression in the same slice order whatever RQ, so RQ never changes a row's bits.
var<private> mq1: vec4<f32>;
var<private> mq2: vec4<f32>;
var<private> mq3: vec4<f32>;

// Per-lane partial sums of rows row0..row0+R (clamped to the last row; their writes are
// skipped) over the lane's slices, and with RQ > 1 those of the next quads in mq1..mq3.
// wbase: byte of row 0 in W; xbase: element of the token's x.
fn mv_partial(row0: u32, tl: u32, wbase: u32, xbase: u32) -> vec4<f32> {
    var acc = vec4<f32>(0.0);
    let rb = quad_rb(wbase, row0, 0u);
#if FSLOW
    // float rows not 16-byte aligned or not a multiple of 256 elements: element by element
    for (var e = tl; e < p.cols; e += TPR) {
        let xe = x1(xbase + e);
        acc.x += welem(rb.x, e) * xe;
        if (R > 1u) {
            acc.y += welem(rb.y, e) * xe;
        }
        if (R > 2u) {
            acc.z += welem(rb.z, e) * xe;
        }
        if (R > 3u) {
            acc.w += welem(rb.w, e) * xe;
        }
    }
#else
    let n_items = ((p.cols + BS - 1u) / BS) * MV_CPB;
    mq1 = vec4<f32>(0.0);
    mq2 = vec4<f32>(0.0);
    mq3 = vec4<f32>(0.0);
    let rb1 = quad_rb(wbase, row0, 1u);
    let rb2 = quad_rb(wbase, row0, 2u);
    let rb3 = quad_rb(wbase, row0, 3u);
    for (var c = tl; c < n_items; c += TPR) {
        let blk = c / MV_CPB;
        let s = c % MV_CPB;
        let boff = vec4<u32>(blk * BB);
        let xc = load_xc(xbase + blk * BS, s);
        acc += quad_dot(rb + boff, s, xc);
        if (RQ > 1u) {
            mq1 += quad_dot(rb1 + boff, s, xc);
        }
        if (RQ > 2u) {
            mq2 += quad_dot(rb2 + boff, s, xc);
        }
        if (RQ > 3u) {
            mq3 += quad_dot(rb3 + boff, s, xc);
        }
    }
#endif
    return acc;
}

// reduce_store of quads 1..RQ (mq1..mq3, each scaled by f) after quad 0's; the barriers keep
// reduce_store's workgroup memory from being overwritten while it is read.
#if SUBGROUPS
fn store_quads(f: f32, lid: u32, sg_size: u32, sg_lane: u32, row0: u32, ybase: u32) {
    if (RQ > 1u) {
        workgroupBarrier();
        reduce_store(mq1 * f, lid, sg_size, sg_lane, row0 + 4u, ybase);
    }
    if (RQ > 2u) {
        workgroupBarrier();
        reduce_store(mq2 * f, lid, sg_size, sg_lane, row0 + 8u, ybase);
    }
    if (RQ > 3u) {
        workgroupBarrier();
        reduce_store(mq3 * f, lid, sg_size, sg_lane, row0 + 12u, ybase);
    }
}
#else
fn store_quads(f: f32, lid: u32, row0: u32, ybase: u32) {
    if (RQ > 1u) {
        workgroupBarrier();
        reduce_store(mq1 * f, lid, row0 + 4u, ybase);
    }
    if (RQ > 2u) {
        workgroupBarrier();
        reduce_store(mq2 * f, lid, row0 + 8u, ybase);
    }
    if (RQ > 3u) {
        workgroupBarrier();
        reduce_store(mq3 * f, lid, row0 + 12u, ybase);
    }
}
#endif

fn store1(row: u32, ybase: u32, v: f32) {
    if (row < p.rows) {
        let o = ybase + row;
#if EPI_CONV
        if (row < p.pro1) {
            conv_store(o, row, v);
            return;
        }
#endif
#if EPI_SIGROW
        Y[o] = Y[o] + epi_s * v;
#else
#if EPI_NW
        var h = v;
        if (p.accumulate != 0u) {
            h = Y[o] + v;
        }
        Y[o] = h;
        HN[o] = h * NWN[row];
#else
        if (p.accumulate != 0u) {
            Y[o] += v;
        } else {
            Y[o] = v;
        }
#endif
#endif
    }
}

#if EPI_GLU
// elementwise.wgsl's swiglu with its limit at f32's largest value
fn glu(g: f32, u: f32) -> f32 {
    let a = 3.40282347e38;
    let gc = min(g, a);
    return gc / (1.0 + exp(-gc)) * clamp(u, -a, a);
}

// logical rows row0.. hold (gate, up) pairs: y[row0 / 2 + i] = swiglu of pair i
fn store_rows(row0: u32, ybase: u32, v: vec4<f32>) {
    if (row0 < p.rows) {
        Y[ybase + row0 / 2u] = glu(v.x, v.y);
    }
    if (R > 2u && row0 + 2u < p.rows) {
        Y[ybase + row0 / 2u + 1u] = glu(v.z, v.w);
    }
}
#else
fn store_rows(row0: u32, ybase: u32, v: vec4<f32>) {
    store1(row0, ybase, v.x);
    if (R > 1u) {
        store1(row0 + 1u, ybase, v.y);
    }
    if (R > 2u) {
        store1(row0 + 2u, ybase, v.z);
    }
    if (R > 3u) {
        store1(row0 + 3u, ybase, v.w);
    }
}
#endif

// Sum over the TPR lanes of each thread group (aligned runs of lanes), lane 0 writes.
#if SUBGROUPS
var<workgroup> red: array<vec4<f32>, WG / 4u>;

fn reduce_store(acc: vec4<f32>, lid: u32, sg_size: u32, sg_lane: u32, row0: u32, ybase: u32) {
    let tl = lid % TPR;
    var v = acc;
    if (TPR <= sg_size) {
        for (var o = 1u; o < TPR; o <<= 1u) {
            v += subgroupShuffleXor(v, o);
        }
        if (tl == 0u) {
            store_rows(row0, ybase, v);
        }
        return;
    }
    v = subgroupAdd(v);
    if (sg_lane == 0u) {
        red[lid / sg_size] = v;
    }
    workgroupBarrier();
    if (tl == 0u) {
        let per = TPR / sg_size;
        let g0 = (lid / TPR) * per;
        var t = vec4<f32>(0.0);
        for (var k = 0u; k < per; k++) {
            t += red[g0 + k];
        }
        store_rows(row0, ybase, t);
    }
}
#else
var<workgroup> red: array<vec4<f32>, WG>;

fn reduce_store(acc: vec4<f32>, lid: u32, row0: u32, ybase: u32) {
    let tl = lid % TPR;
    red[lid] = acc;
    workgroupBarrier();
    for (var o = TPR / 2u; o > 0u; o >>= 1u) {
        if (tl < o) {
            red[lid] += red[lid + o];
        }
        workgroupBarrier();
    }
    if (tl == 0u) {
        store_rows(row0, ybase, red[lid]);
    }
}
#endif

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

// MoE: for pair q = p.pair_off + wid.x (token q / n_used, slot q % n_used) with expert
// e = ids[ids_off + q]: y[q][row] (=|+=) sum_c W[e][row][c] x[q or q / n_used][c].
// Workgroups whose expert is not in the bound part return at once. (Q8X: x rows are QX rows.)
#if Q8X
@group(0) @binding(6) var<storage, read> IDX: array<u32>;
#else
@group(0) @binding(5) var<storage, read> IDX: array<u32>;
#endif

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

#endif
#endif
#endif
