// Rotary position embedding, in place on rows of [n_tokens, n_heads, head_dim] (strided).
// One thread per rotated pair. CPU references: cpu::ops::{rope_neox, rope_interleaved}.
//
// Pairs: NEOX (default) rotates (i, i + n_freq) of the slice starting at rot_off (HF
// rotate_half; Qwen3.5: the leading 64 of 256); INTERLEAVED rotates (2i, 2i+1) (DeepSeek's
// complex pairs; V4: the trailing 64 of 512). Pair i turns by θ = pos · inv_freq[i]
// (−θ with `inverse`).
//
// Accuracy: the angle is never formed in f32 (at pos 1e5 an f32 θ is off by up to 4e-3 rad).
// The table holds, per frequency, inv_freq/(2π) as a 64-bit binary fraction of a turn
// (src/gpu/rope.rs); pos · that, mod 1, is exact in integer arithmetic, so the reduction to
// an octant is exact and sin/cos are short polynomials on [−π/4, π/4] (Cephes sinf/cosf
// coefficients): |error| ≈ 1e-7 for any u32 position, on any GPU (WGSL's sin/cos give no
// accuracy guarantee outside [−π, π]).
//
// Defines: INTERLEAVED, POS_BUF (positions from binding 3, else pos0 + t).
// Bindings: 1 x, 2 table [n_freq] × (hi, lo), 3 positions u32 (POS_BUF).

const WG = 256u;

#ifndef QKNR
struct Params {
    n_tokens: u32,
    n_heads: u32,
    n_freq: u32,       // rotated pairs per head = n_rot / 2
    x_off: u32,        // in elements: head 0 of token 0
    token_stride: u32, // elements between tokens
    head_stride: u32,  // elements between heads
    rot_off: u32,      // first rotated element within a head
    pos0: u32,         // position of token 0 (no POS_BUF)
    pos_off: u32,      // index of token 0 in the positions buffer (POS_BUF)
    inverse: u32,      // 1: rotate by −θ
    _pad0: u32,
    _pad1: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> x: array<f32>;
@group(0) @binding(2) var<storage, read> table: array<u32>;
#if POS_BUF
@group(0) @binding(3) var<storage, read> positions: array<u32>;
#endif
#endif

// High 32 bits of the 64-bit product a·b.
fn mul_hi(a: u32, b: u32) -> u32 {
    let a0 = a & 0xffffu;
    let a1 = a >> 16u;
    let b0 = b & 0xffffu;
    let b1 = b >> 16u;
    let p01 = a0 * b1;
    let p10 = a1 * b0;
    let mid = ((a0 * b0) >> 16u) + (p01 & 0xffffu) + (p10 & 0xffffu);
    return a1 * b1 + (p01 >> 16u) + (p10 >> 16u) + (mid >> 16u);
}

// (cos, sin) of the angle u / 2^32 turns.
fn cos_sin_turns(u: u32) -> vec2<f32> {
    // Octant reduction: q = nearest quarter turn, r = signed remainder in [−1/8, 1/8) turn.
    let v = u + 0x20000000u;
    let q = v >> 30u;
    let r = i32(v & 0x3fffffffu) - 0x20000000;
    let t = f32(r) * 1.4629180792671596e-9; // 2π / 2^32
    let z = t * t;
    let s = ((-1.9515295891e-4 * z + 8.3321608736e-3) * z - 1.6666654611e-1) * z * t + t;
    let c = ((2.443315711809948e-5 * z - 1.388731625493765e-3) * z + 4.166664568298827e-2) * z * z
        - 0.5 * z + 1.0;
    switch q {
        case 0u: { return vec2<f32>(c, s); }
        case 1u: { return vec2<f32>(-s, c); }
        case 2u: { return vec2<f32>(-c, -s); }
        default: { return vec2<f32>(s, -c); }
    }
}

#ifndef QKNR
@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
    let i = (wid.x + wid.y * nwg.x) * WG + lid;
    if (i >= p.n_tokens * p.n_heads * p.n_freq) { return; }
    let f = i % p.n_freq;
    let th = i / p.n_freq;
    let h = th % p.n_heads;
    let t = th / p.n_heads;
#if POS_BUF
    let pos = positions[p.pos_off + t];
#else
    let pos = p.pos0 + t;
#endif
    // Turns mod 1, as a 32-bit fraction: (pos · (hi·2^32 + lo)) >> 32, mod 2^32.
    let hi = table[2u * f];
    let lo = table[2u * f + 1u];
    let turns = pos * hi + mul_hi(pos, lo);
    var cs = cos_sin_turns(turns);
    if (p.inverse != 0u) { cs.y = -cs.y; }
    let base = p.x_off + t * p.token_stride + h * p.head_stride + p.rot_off;
#if INTERLEAVED
    let i0 = base + 2u * f;
    let i1 = i0 + 1u;
#else
    let i0 = base + f;
    let i1 = i0 + p.n_freq;
#endif
    let a = x[i0];
    let b = x[i1];
    x[i0] = a * cs.x - b * cs.y;
    x[i1] = b * cs.x + a * cs.y;
}
#endif

#if QKNR
// An attention's decode prologue in one dispatch, for one token: per q head and per k head,
// RMSNorm with the head's weight (norm.wgsl's reduction, replayed), NEOX RoPE of the leading
// 2·n_freq dims (the pair math of `main`), k written to the K cache row; v copied to the V
// cache row (attention.wgsl's write_kv), or with V_NORM first RMSNormed without a weight
// (Gemma-4's v_norm). The same bits as rms_norm, rope and write_kv.
// One workgroup per head: q heads, then k heads, then v heads.
// Defines: QKNR, KV_F16 (f16 cache rows, else f32), V_NORM, KV3 (k and v heads in their own
// buffers, bindings 9 and 10, instead of x: Gemma-4's separate products; v may be k's buffer),
// V4 (norm.wgsl's V4 items: head_dim > WG, a multiple of 4, every offset and stride too).
// head_dim ≤ MAX_HD: each thread keeps up to E = 4 elements, norm.wgsl's items of its thread
// in its order (scalar: elements lid, lid + WG; V4: the vec4 item lid).
struct QParams {
    n_head: u32,      // q heads
    n_head_kv: u32,   // k and v heads
    head_dim: u32,
    n_freq: u32,      // rotated pairs per head
    q_off: u32,       // in elements: q head 0
    q_stride: u32,    // in elements between q heads
    k_off: u32,       // in elements: k head 0 (heads packed)
    v_off: u32,       // in elements: v head 0 (heads packed)
    pos_off: u32,     // index of the token in `positions`
    row_off: u32,     // index of the token's cache row in `rows`
    eps: f32,
    _pad0: u32,
}

@group(0) @binding(0) var<uniform> p: QParams;
@group(0) @binding(1) var<storage, read_write> x: array<f32>;      // q (and k, v) of the token
@group(0) @binding(2) var<storage, read> table: array<u32>;
@group(0) @binding(3) var<storage, read> positions: array<u32>;
@group(0) @binding(4) var<storage, read> q_w: array<f32>;          // [head_dim]
@group(0) @binding(5) var<storage, read> k_w: array<f32>;          // [head_dim]
@group(0) @binding(6) var<storage, read> rows: array<u32>;
#if KV_F16
@group(0) @binding(7) var<storage, read_write> k_cache: array<u32>;   // f16 pairs
@group(0) @binding(8) var<storage, read_write> v_cache: array<u32>;
#else
@group(0) @binding(7) var<storage, read_write> k_cache: array<f32>;
@group(0) @binding(8) var<storage, read_write> v_cache: array<f32>;
#endif
#if KV3
@group(0) @binding(9) var<storage, read> kx: array<f32>;
@group(0) @binding(10) var<storage, read> vx: array<f32>;
#endif

// Elements per thread, and the largest head.
const E = 4u;
const MAX_HD = 512u;

var<workgroup> red: array<f32, WG>;
var<workgroup> hv: array<f32, MAX_HD>;

// Element c of thread lid's E (norm.wgsl's order: its items, each item's elements).
fn elem(lid: u32, c: u32) -> u32 {
#if V4
    return 4u * lid + c;
#else
    return lid + c * WG;
#endif
}

// Element j of the head at `base` of the token's q, k (kind 1) or v (kind 2).
fn src(kind: u32, base: u32, j: u32) -> f32 {
#if KV3
    if (kind == 1u) { return kx[base + j]; }
    if (kind == 2u) { return vx[base + j]; }
#endif
    return x[base + j];
}

// Cache row element pair e (f16: one word) from the final values in `hv`.
fn put_cache(is_k: bool, base: u32, e: u32) {
#if KV_F16
    let w = pack2x16float(vec2<f32>(hv[2u * e], hv[2u * e + 1u]));
    if (is_k) { k_cache[base / 2u + e] = w; } else { v_cache[base / 2u + e] = w; }
#else
    if (is_k) {
        k_cache[base + 2u * e] = hv[2u * e];
        k_cache[base + 2u * e + 1u] = hv[2u * e + 1u];
    } else {
        v_cache[base + 2u * e] = hv[2u * e];
        v_cache[base + 2u * e + 1u] = hv[2u * e + 1u];
    }
#endif
}

@compute @workgroup_size(WG)
fn qk_norm_rope(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                @builtin(local_invocation_index) lid: u32) {
    let head = wid.x + wid.y * nwg.x;
    let nq = p.n_head;
    let nk = p.n_head_kv;
    if (head >= nq + 2u * nk) { return; }
    let hd = p.head_dim;
    let width = nk * hd;
    let row = rows[p.row_off];
    // kind 0: q head, 1: k head, 2: v head (uniform over the workgroup); h: its index among
    // its kind's heads; base: its first element
    let is_v = head >= nq + nk;
    let is_k = !is_v && head >= nq;
    let kind = select(select(0u, 1u, is_k), 2u, is_v);
    let h = select(select(head, head - nq, is_k), head - nq - nk, is_v);
    let base = select(select(p.q_off + head * p.q_stride, p.k_off + h * hd, is_k),
                      p.v_off + h * hd, is_v);
    let dst = row * width + h * hd;
#if V_NORM
#else
    if (kind == 2u) {
        // v head: a copy into the V cache row.
        for (var j = lid; j < hd; j += WG) {
            hv[j] = src(2u, base, j);
        }
        workgroupBarrier();
        for (var e = lid; 2u * e < hd; e += WG) {
            put_cache(false, dst, e);
        }
        return;
    }
#endif
    // RMSNorm as norm.wgsl: the thread's items summed in its order, tree over WG lanes.
    var a: array<f32, E>;
    var ss = 0.0;
#if V4
    if (4u * lid < hd) {
        let v = vec4<f32>(src(kind, base, 4u * lid), src(kind, base, 4u * lid + 1u),
                          src(kind, base, 4u * lid + 2u), src(kind, base, 4u * lid + 3u));
        a[0] = v.x;
        a[1] = v.y;
        a[2] = v.z;
        a[3] = v.w;
        ss += dot(v, v);
    }
#else
    for (var c = 0u; c < E; c++) {
        let j = elem(lid, c);
        if (j < hd) {
            a[c] = src(kind, base, j);
            ss += a[c] * a[c];
        }
    }
#endif
    red[lid] = ss;
    workgroupBarrier();
    for (var st = WG / 2u; st > 0u; st >>= 1u) {
        if (lid < st) { red[lid] += red[lid + st]; }
        workgroupBarrier();
    }
    let r = inverseSqrt(red[0] / f32(hd) + p.eps);
    for (var c = 0u; c < E; c++) {
        let j = elem(lid, c);
        if (j < hd) {
            var v = a[c] * r;
            if (kind == 0u) {
                v = v * q_w[j];
            } else if (kind == 1u) {
                v = v * k_w[j];
            }
            hv[j] = v * 1.0;
        }
    }
    workgroupBarrier();
    if (kind == 2u) {
        // v head (V_NORM): its normed values into the V cache row.
        for (var e = lid; 2u * e < hd; e += WG) {
            put_cache(false, dst, e);
        }
        return;
    }
    // RoPE (NEOX pairs (f, f + n_freq) of the leading 2·n_freq dims), as `main`.
    var out: array<f32, E>;
    let pos = positions[p.pos_off];
    for (var c = 0u; c < E; c++) {
        let j = elem(lid, c);
        if (j < hd) {
            out[c] = hv[j];
            if (j < 2u * p.n_freq) {
                let f = j % p.n_freq;
                let turns = pos * table[2u * f] + mul_hi(pos, table[2u * f + 1u]);
                let cs = cos_sin_turns(turns);
                let a0 = hv[f];
                let b0 = hv[f + p.n_freq];
                if (j < p.n_freq) {
                    out[c] = a0 * cs.x - b0 * cs.y;
                } else {
                    out[c] = b0 * cs.x + a0 * cs.y;
                }
            }
        }
    }
    if (kind == 0u) {
        for (var c = 0u; c < E; c++) {
            let j = elem(lid, c);
            if (j < hd) {
                x[base + j] = out[c];
            }
        }
        return;
    }
    workgroupBarrier();
    for (var c = 0u; c < E; c++) {
        let j = elem(lid, c);
        if (j < hd) {
            hv[j] = out[c];
        }
    }
    workgroupBarrier();
    for (var e = lid; 2u * e < hd; e += WG) {
        put_cache(true, dst, e);
    }
}
#endif
