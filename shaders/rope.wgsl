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
