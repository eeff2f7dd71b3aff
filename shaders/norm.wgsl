// Row norms: RMSNorm, L2 norm, gated RMSNorm, optional fused residual add.
// One workgroup per row; the row's Σx² is reduced in f32 (per-thread partial sums, then a
// tree), then every element is scaled. CPU references: cpu::ops::{rms_norm, l2_norm,
// gated_rms_norm}.
//
// V4: a decode norm of a model-width row is one workgroup on one SM, so its time is the
// latency of its loads: each thread loads its first K vec4s by a loop of constant length
// (unrolled: all in flight at once) and keeps them in registers for the scaling pass, instead
// of one scalar load per trip and a second read of x. H200, Qwen3.5-9B decode: 13.6 → 9.0 µs
// per call (65 a token). A 32-element scalar form of the same idea measured 16.2 µs.
//
// Defines (set by src/gpu/norm.rs):
//   MODE       0: RMS   r = rsqrt(Σx²/dim + eps)       (HF RMSNorm)
//              1: L2    r = rsqrt(Σx² + eps)           (HF / FLA l2norm)
//              2: L2    r = 1 / max(sqrt(Σx²), eps)    (ggml_l2_norm)
//   HAS_W + one of W_F32 / W_F16 / W_BF16: multiply by the weight [dim] (raw bytes).
//   INPLACE    y is x (binding 1 read_write, no binding for y).
//   RESIDUAL   x += z first (written back to x), then y = norm(x): a fused residual add.
//   GATED      y *= silu(z) (Qwen3.5 GDN output norm).
//   V4         x, y and z as vec4s (dim and every offset and stride a multiple of 4): Σx² sums
//              each vec4's squares first, other rounding than the scalar order, which the
//              fused kernels replay for rows of up to WG elements (gdn.wgsl's GNORM,
//              rope.wgsl's qk_norm_rope), so norm.rs takes V4 only for longer rows, ungated.
//              The scaling is the same operations per element.
// Output: y = x · r [· w] · scale [· silu(z)].
//
// Bindings: 1 x, 2 y (unless INPLACE), then w (HAS_W), then z (GATED or RESIDUAL).
// Grid: linear workgroup id = row.

const WG = 256u;
#ifndef MODE
const MODE = 0u;
#endif

struct Params {
    dim: u32,       // elements per row
    n_rows: u32,
    x_off: u32,     // in elements
    x_stride: u32,  // elements between rows
    y_off: u32,
    y_stride: u32,
    z_off: u32,     // gate / residual rows
    z_stride: u32,
    eps: f32,
    scale: f32,     // extra factor on the output (L2 q: 1/sqrt(d_k)); 1 otherwise
    _pad0: u32,
    _pad1: u32,
}

@group(0) @binding(0) var<uniform> p: Params;

#include "norm_items"

#if V4
// vec4s per thread kept in registers: rows of up to K · WG · L = 8192 elements load once
const K = 8u;
#else
// the scalar loops as they were: each thread's elements lid, lid + WG, ... in that order
const K = 1u;
#endif

#if INPLACE
@group(0) @binding(1) var<storage, read_write> x: array<T>;
const B_W = 2;
#else
#if RESIDUAL
@group(0) @binding(1) var<storage, read_write> x: array<T>;
#else
@group(0) @binding(1) var<storage, read> x: array<T>;
#endif
@group(0) @binding(2) var<storage, read_write> y: array<T>;
const B_W = 3;
#endif

#if HAS_W
@group(0) @binding(B_W) var<storage, read> w: array<u32>;
const B_Z = B_W + 1;
#else
const B_Z = B_W;
#endif

#if HAS_Z
@group(0) @binding(B_Z) var<storage, read> z: array<T>;
#endif

var<workgroup> red: array<f32, WG>;

#if HAS_W
// Element j of the weight.
fn weight(j: u32) -> f32 {
    return norm_dec(w[norm_word(j)], j);
}

// The weight of item i.
fn wt(i: u32) -> T {
#if V4
    let j = 4u * i;
    return vec4<f32>(weight(j), weight(j + 1u), weight(j + 2u), weight(j + 3u));
#else
    return weight(i);
#endif
}
#endif

fn silu(v: T) -> T { return v / (1.0 + exp(-v)); }

// Item i of the row at items xb (x) and zb (z), through the residual add (written back).
fn load(xb: u32, zb: u32, i: u32) -> T {
    var v = x[xb + i];
#if RESIDUAL
    v = v + z[zb + i];
    x[xb + i] = v;
#endif
    return v;
}

// Item i of the output from its input v0, stored at items yb (or back into x at xb).
fn scale_store(xb: u32, yb: u32, zb: u32, i: u32, v0: T, r: f32) {
    var v = v0 * r;
#if HAS_W
    v = v * wt(i);
#endif
    v = v * p.scale;
#if GATED
    v = v * silu(z[zb + i]);
#endif
#if INPLACE
    x[xb + i] = v;
#else
    y[yb + i] = v;
#endif
}

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
    let row = wid.x + wid.y * nwg.x;
    if (row >= p.n_rows) { return; }
    let n = p.dim / L;
    let xb = (p.x_off + row * p.x_stride) / L;
    let zb = (p.z_off + row * p.z_stride) / L;
    let yb = (p.y_off + row * p.y_stride) / L;
    // items lid, lid + WG, ... in that order (the first K unrolled and kept)
    var xs: array<T, K>;
    var ss = 0.0;
    for (var k = 0u; k < K; k++) {
        let i = lid + k * WG;
        if (i < n) {
            let v = load(xb, zb, i);
            xs[k] = v;
            ss += sq(v);
        }
    }
    for (var i = lid + K * WG; i < n; i += WG) {
        ss += sq(load(xb, zb, i));
    }
    red[lid] = ss;
    workgroupBarrier();
    for (var s = WG / 2u; s > 0u; s >>= 1u) {
        if (lid < s) { red[lid] += red[lid + s]; }
        workgroupBarrier();
    }
    let total = red[0];
    var r: f32;
    if (MODE == 0u) {
        r = inverseSqrt(total / f32(p.dim) + p.eps);
    } else if (MODE == 1u) {
        r = inverseSqrt(total + p.eps);
    } else {
        r = 1.0 / max(sqrt(total), p.eps);
    }
    // Each thread rereads only the items it wrote (RESIDUAL) or nobody writes (INPLACE
    // writes come after every read of the sum loop, behind the barriers above).
    for (var k = 0u; k < K; k++) {
        let i = lid + k * WG;
        if (i < n) {
            scale_store(xb, yb, zb, i, xs[k], r);
        }
    }
    for (var i = lid + K * WG; i < n; i += WG) {
        scale_store(xb, yb, zb, i, x[xb + i], r);
    }
}
