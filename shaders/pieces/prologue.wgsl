#ifndef Q8X
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
//   EPI_GEGLU (with EPI_GLU) y[o] = gelu_tanh(g) · u instead (elementwise.wgsl's geglu:
//             Gemma's FFN), the bits of the plain product followed by geglu.
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
