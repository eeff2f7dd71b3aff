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
// Qwen3.5 attention's decode prologue in one dispatch, for one token: per q head and per k
// head, RMSNorm with the head's weight (norm.wgsl's reduction, replayed), NEOX RoPE of the
// leading 2·n_freq dims (the pair math of `main`), k written to the K cache row; v copied to
// the V cache row (attention.wgsl's write_kv). The same bits as rms_norm, rope and write_kv.
// One workgroup per head: q heads, then k heads, then v heads.
// Defines: QKNR, KV_F16 (f16 cache rows, else f32). HD ≤ 256 (one element per thread).
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
@group(0) @binding(1) var<storage, read_write> x: array<f32>;      // q, k, v of the token
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

var<workgroup> red: array<f32, WG>;
var<workgroup> hv: array<f32, WG>;

// Element j of a head: the final values in `hv`; a cache row's element pair e (f16: one word).
fn put_cache_k(base: u32, e: u32) {
#if KV_F16
    k_cache[base / 2u + e] = pack2x16float(vec2<f32>(hv[2u * e], hv[2u * e + 1u]));
#else
    k_cache[base + 2u * e] = hv[2u * e];
    k_cache[base + 2u * e + 1u] = hv[2u * e + 1u];
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
    if (head >= nq + nk) {
        // v head: a copy into the V cache row.
        let h = head - nq - nk;
        let src = p.v_off + h * hd;
        let dst = row * width + h * hd;
#if KV_F16
        if (2u * lid < hd) {
            v_cache[dst / 2u + lid] = pack2x16float(vec2<f32>(x[src + 2u * lid], x[src + 2u * lid + 1u]));
        }
#else
        if (lid < hd) {
            v_cache[dst + lid] = x[src + lid];
        }
#endif
        return;
    }
    let is_q = head < nq;
    var base: u32;
    if (is_q) {
        base = p.q_off + head * p.q_stride;
    } else {
        base = p.k_off + (head - nq) * hd;
    }
    // RMSNorm as norm.wgsl: lane j holds element j (head_dim ≤ WG), tree over WG lanes.
    var a = 0.0;
    if (lid < hd) {
        a = x[base + lid];
    }
    red[lid] = a * a;
    workgroupBarrier();
    for (var st = WG / 2u; st > 0u; st >>= 1u) {
        if (lid < st) { red[lid] += red[lid + st]; }
        workgroupBarrier();
    }
    let r = inverseSqrt(red[0] / f32(hd) + p.eps);
    if (lid < hd) {
        var v = a * r;
        if (is_q) {
            v = v * q_w[lid];
        } else {
            v = v * k_w[lid];
        }
        hv[lid] = v * 1.0;
    }
    workgroupBarrier();
    // RoPE (NEOX pairs (f, f + n_freq) of the leading 2·n_freq dims), as `main`.
    var out = 0.0;
    if (lid < hd) {
        out = hv[lid];
        if (lid < 2u * p.n_freq) {
            let f = lid % p.n_freq;
            let pos = positions[p.pos_off];
            let turns = pos * table[2u * f] + mul_hi(pos, table[2u * f + 1u]);
            let cs = cos_sin_turns(turns);
            let a0 = hv[f];
            let b0 = hv[f + p.n_freq];
            if (lid < p.n_freq) {
                out = a0 * cs.x - b0 * cs.y;
            } else {
                out = b0 * cs.x + a0 * cs.y;
            }
        }
    }
    if (is_q) {
        if (lid < hd) {
            x[base + lid] = out;
        }
        return;
    }
    workgroupBarrier();
    if (lid < hd) {
        hv[lid] = out;
    }
    workgroupBarrier();
    if (2u * lid < hd) {
        put_cache_k(row * width + (head - nq) * hd, lid);
    }
}
#endif
