// Row norms: RMSNorm, L2 norm, gated RMSNorm, optional fused residual add.
// One workgroup per row; the row's Σx² is reduced in f32 (per-thread partial sums, then a
// tree), then every element is scaled. CPU references: cpu::ops::{rms_norm, l2_norm,
// gated_rms_norm}.
//
// Defines (set by src/gpu/norm.rs):
//   MODE       0: RMS   r = rsqrt(Σx²/dim + eps)       (HF RMSNorm)
//              1: L2    r = rsqrt(Σx² + eps)           (HF / FLA l2norm)
//              2: L2    r = 1 / max(sqrt(Σx²), eps)    (ggml_l2_norm)
//   HAS_W + one of W_F32 / W_F16 / W_BF16: multiply by the weight [dim] (raw bytes).
//   INPLACE    y is x (binding 1 read_write, no binding for y).
//   RESIDUAL   x += z first (written back to x), then y = norm(x): a fused residual add.
//   GATED      y *= silu(z) (Qwen3.5 GDN output norm).
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

#if INPLACE
@group(0) @binding(1) var<storage, read_write> x: array<f32>;
const B_W = 2;
#else
#if RESIDUAL
@group(0) @binding(1) var<storage, read_write> x: array<f32>;
#else
@group(0) @binding(1) var<storage, read> x: array<f32>;
#endif
@group(0) @binding(2) var<storage, read_write> y: array<f32>;
const B_W = 3;
#endif

#if HAS_W
@group(0) @binding(B_W) var<storage, read> w: array<u32>;
const B_Z = B_W + 1;
#else
const B_Z = B_W;
#endif

#if HAS_Z
@group(0) @binding(B_Z) var<storage, read> z: array<f32>;
#endif

var<workgroup> red: array<f32, WG>;

#if HAS_W
// Element j of the weight, stored as f32, f16 or bf16.
fn weight(j: u32) -> f32 {
#if W_F32
    return bitcast<f32>(w[j]);
#endif
#if W_F16
    return unpack2x16float(w[j >> 1u])[j & 1u];
#endif
#if W_BF16
    let u = w[j >> 1u];
    return bitcast<f32>(select(u << 16u, u & 0xffff0000u, (j & 1u) == 1u));
#endif
}
#endif

fn silu(v: f32) -> f32 { return v / (1.0 + exp(-v)); }

fn store(i: u32, v: f32) {
#if INPLACE
    x[i] = v;
#else
    y[i] = v;
#endif
}

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
    let row = wid.x + wid.y * nwg.x;
    if (row >= p.n_rows) { return; }
    let xb = p.x_off + row * p.x_stride;
    let zb = p.z_off + row * p.z_stride;
    var ss = 0.0;
    for (var j = lid; j < p.dim; j += WG) {
        var v = x[xb + j];
#if RESIDUAL
        v = v + z[zb + j];
        x[xb + j] = v;
#endif
        ss += v * v;
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
    let yb = p.y_off + row * p.y_stride;
    // Each thread rereads only the elements it wrote (RESIDUAL) or nobody writes (INPLACE
    // writes come after every read of the sum loop, behind the barriers above).
    for (var j = lid; j < p.dim; j += WG) {
        var v = x[xb + j] * r;
#if HAS_W
        v = v * weight(j);
#endif
        v = v * p.scale;
#if GATED
        v = v * silu(z[zb + j]);
#endif
#if INPLACE
        store(xb + j, v);
#else
        store(yb + j, v);
#endif
    }
}
