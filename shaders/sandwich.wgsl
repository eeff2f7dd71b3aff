// Gemma's sandwich norms (HF Gemma4DecoderLayer: a branch's output normed before it joins the
// residual stream, the stream's next norm right after) in one kernel per row, instead of
// norm.wgsl's rms_norm, elementwise.wgsl's add_inplace and scale_inplace, and rms_norm again:
//   BRANCHES 1:  b = rms(z)·wz                                  (post_attention / _ffn norm)
//            2:  b = rms(rms(z)·wz + rms(z2)·wz2)·wb            (MoE: post_ffw_norm_1 of the
//                dense branch z, _2 of the routed z2, then post_feedforward_layernorm wb)
//            0:  b = 0 (no branch: x is scaled and normed, e.g. the scaled embedding)
//   x = (x + b) · scale  (written back; scale 1 where the block has no layer_scalar)
//   y = rms(x)·wy        (the next norm: the next block's or the output norm)
//   y2 = rms(x)·wy2, y3 = rms(x)·wy3 with MORE1 / MORE2 (more norms of the same rows: a MoE
//                        block's router input and routed-expert input beside its pre-FFN norm)
// Every step has the bits of the kernels it replaces: each RMSNorm is norm.wgsl's (the same
// items per thread in the same order, the same tree, the same scaling operations: V4 for rows
// of more than WG elements that are a multiple of 4), the add and the scale are
// elementwise.wgsl's. Each thread keeps its items in registers: rows of up to K · WG · L
// elements (8192).
//
// Defines: V4, HAS_Z (BRANCHES ≥ 1), TWO (BRANCHES 2), MORE1 (y2), MORE2 (with MORE1: y3), one
// of W_F32 / W_F16 / W_BF16 (every weight's stored type: norm_items).
// Bindings: 1 x (read_write), 2 y, 3 wy, 4 z and 5 wz (HAS_Z), 6 z2, 7 wz2 and 8 wb (TWO),
// 9 y2 and 10 wy2 (MORE1), 11 y3 and 12 wy3 (MORE2). Grid: linear workgroup id = row. Rows are
// packed, dim apart, from element 0.

const WG = 256u;

struct Params {
    dim: u32,
    n_rows: u32,
    eps: f32,
    scale: f32,
}

@group(0) @binding(0) var<uniform> p: Params;

#include "norm_items"

#if V4
const K = 8u;
#else
const K = 32u;
#endif

@group(0) @binding(1) var<storage, read_write> x: array<T>;
@group(0) @binding(2) var<storage, read_write> y: array<T>;
@group(0) @binding(3) var<storage, read> wy: array<u32>;
#if HAS_Z
@group(0) @binding(4) var<storage, read> z: array<T>;
@group(0) @binding(5) var<storage, read> wz: array<u32>;
#endif
#if TWO
@group(0) @binding(6) var<storage, read> z2: array<T>;
@group(0) @binding(7) var<storage, read> wz2: array<u32>;
@group(0) @binding(8) var<storage, read> wb: array<u32>;
#endif

#if MORE1
@group(0) @binding(9) var<storage, read_write> y2: array<T>;
@group(0) @binding(10) var<storage, read> wy2: array<u32>;
#endif
#if MORE2
@group(0) @binding(11) var<storage, read_write> y3: array<T>;
@group(0) @binding(12) var<storage, read> wy3: array<u32>;
#endif

var<workgroup> red: array<f32, WG>;

// Which weight a reader takes (WGSL as naga takes it has no pointer parameters into storage:
// one reader picks the binding by a constant at every call, which the switch folds away).
const WY = 0u;
const WZ = 1u;
const WZ2 = 2u;
const WB = 3u;
const WY2 = 4u;
const WY3 = 5u;

fn wword(which: u32, k: u32) -> u32 {
    switch which {
#if HAS_Z
        case WZ: { return wz[k]; }
#endif
#if TWO
        case WZ2: { return wz2[k]; }
        case WB: { return wb[k]; }
#endif
#if MORE1
        case WY2: { return wy2[k]; }
#endif
#if MORE2
        case WY3: { return wy3[k]; }
#endif
        default: { return wy[k]; }
    }
}

// Item i of weight `which` (norm.wgsl's weight per element).
fn wt(which: u32, i: u32) -> T {
#if V4
    let j = 4u * i;
    return vec4<f32>(norm_dec(wword(which, norm_word(j)), j),
                     norm_dec(wword(which, norm_word(j + 1u)), j + 1u),
                     norm_dec(wword(which, norm_word(j + 2u)), j + 2u),
                     norm_dec(wword(which, norm_word(j + 3u)), j + 3u));
#else
    return norm_dec(wword(which, norm_word(i)), i);
#endif
}

// norm.wgsl's r of a row from each thread's sum of its items' squares: the same tree.
fn rms_r(ss: f32, lid: u32) -> f32 {
    red[lid] = ss;
    workgroupBarrier();
    for (var s = WG / 2u; s > 0u; s >>= 1u) {
        if (lid < s) { red[lid] += red[lid + s]; }
        workgroupBarrier();
    }
    let r = inverseSqrt(red[0] / f32(p.dim) + p.eps);
    // every thread has read red[0] before the next reduction writes it
    workgroupBarrier();
    return r;
}

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
    let row = wid.x + wid.y * nwg.x;
    if (row >= p.n_rows) { return; }
    let n = p.dim / L;
    let rb = row * n;
    // the branch b of each of the thread's items lid, lid + WG, ... (K of them)
    var b: array<T, K>;
#if HAS_Z
    var ss = 0.0;
    for (var k = 0u; k < K; k++) {
        let i = lid + k * WG;
        if (i < n) {
            b[k] = z[rb + i];
            ss += sq(b[k]);
        }
    }
    let rz = rms_r(ss, lid);
    for (var k = 0u; k < K; k++) {
        let i = lid + k * WG;
        if (i < n) {
            b[k] = b[k] * rz * wt(WZ, i) * 1.0;
        }
    }
#endif
#if TWO
    var c: array<T, K>;
    var ss2 = 0.0;
    for (var k = 0u; k < K; k++) {
        let i = lid + k * WG;
        if (i < n) {
            c[k] = z2[rb + i];
            ss2 += sq(c[k]);
        }
    }
    let rz2 = rms_r(ss2, lid);
    var sb = 0.0;
    for (var k = 0u; k < K; k++) {
        let i = lid + k * WG;
        if (i < n) {
            b[k] = b[k] + c[k] * rz2 * wt(WZ2, i) * 1.0;
            sb += sq(b[k]);
        }
    }
    let rbb = rms_r(sb, lid);
    for (var k = 0u; k < K; k++) {
        let i = lid + k * WG;
        if (i < n) {
            b[k] = b[k] * rbb * wt(WB, i) * 1.0;
        }
    }
#endif
    var sx = 0.0;
    for (var k = 0u; k < K; k++) {
        let i = lid + k * WG;
        if (i < n) {
#if HAS_Z
            let v = p.scale * (x[rb + i] + b[k]);
#else
            let v = p.scale * x[rb + i];
#endif
            x[rb + i] = v;
            b[k] = v;
            sx += sq(v);
        }
    }
    let rx = rms_r(sx, lid);
    for (var k = 0u; k < K; k++) {
        let i = lid + k * WG;
        if (i < n) {
            y[rb + i] = b[k] * rx * wt(WY, i) * 1.0;
#if MORE1
            y2[rb + i] = b[k] * rx * wt(WY2, i) * 1.0;
#endif
#if MORE2
            y3[rb + i] = b[k] * rx * wt(WY3, i) * 1.0;
#endif
        }
    }
}
