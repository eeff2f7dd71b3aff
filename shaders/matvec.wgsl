// Weight × activations for every stored weight type: the block decoders (shared with the tiled
// matmul, which src/gpu/matmul.rs compiles as this file followed by matmul.wgsl) and the
// decode-time kernels `matvec` (1..8 tokens) and `matvec_id` (MoE: one expert per (token, slot)).
//
// Weights are one part of a GpuTensor in raw ggml block bytes (ggml-common.h layouts), rows
// contiguous; binding 1 reads them as u32 words (blocks may start at any byte: Q8_0 is 34 bytes,
// MXFP4 17), binding 2 is the same buffer as 16-byte vectors for the layouts whose blocks are
// 16-byte aligned (Q4_K, Q5_K, F32/F16/BF16 rows of a multiple of 4/8 elements).
// Activations and outputs are f32; accumulation is f32.
//
// Work unit: a "chunk" of 32 weights of one row inside one block (float types use virtual blocks
// of 256 elements). `xmap(s, j)` says which 4 consecutive elements of the block are the j-th
// quarter-octet of chunk s: the chunk shapes follow each layout's packing so that a thread reads
// whole 16-byte groups and decodes each scale once (e.g. Q4_K chunk s = 16 bytes of qs holding
// 16 weights of sub-block 2c in the low nibbles and 16 of sub-block 2c+1 in the high ones).
//
// matvec grid: linear workgroup id = wid.x + wid.y * nwg.x (gpu::grid); a workgroup of WG threads
// holds WG/TPR thread groups; thread group g computes rows [R*(wg*GPW+g), +R) for all NT tokens,
// its TPR threads striding over the chunks of those rows, then reducing (subgroups or workgroup
// memory). Each thread loads the x chunk once per token and reuses it for its R rows.

// The route kernel of matmul.wgsl binds other buffers at the same slots: with ROUTE defined this
// whole file drops out.
#ifndef ROUTE

// ---- variant constants (the wrapper defines them; defaults make the file valid alone) ----
#ifndef QT
const QT = 0u;          // ggml type id of the weights
#endif
#ifndef BS
const BS = 256u;        // elements per (virtual) block
#endif
#ifndef BB
const BB = 1024u;       // bytes per (virtual) block
#endif
#ifndef NT
const NT = 1u;          // tokens per matvec dispatch (1..8)
#endif
#ifndef R
const R = 2u;           // rows per thread group
#endif
#ifndef TPR
const TPR = 64u;        // threads per thread group (power of two, >= 16)
#endif
#ifndef WG
const WG = 64u;         // threads per workgroup (multiple of TPR)
#endif
#ifndef FSLOW
const FSLOW = 0u;       // 1: float rows not 16-byte aligned, read element by element
#endif

const CPB = BS / 32u;   // chunks per block
const GPW = WG / TPR;   // thread groups per workgroup
const RT = R * NT;      // accumulators per thread

const T_F32 = 0u;
const T_F16 = 1u;
const T_Q4_0 = 2u;
const T_Q4_1 = 3u;
const T_Q5_0 = 6u;
const T_Q5_1 = 7u;
const T_Q8_0 = 8u;
const T_Q2_K = 10u;
const T_Q3_K = 11u;
const T_Q4_K = 12u;
const T_Q5_K = 13u;
const T_Q6_K = 14u;
const T_IQ4_NL = 20u;
const T_IQ4_XS = 23u;
const T_BF16 = 30u;
const T_MXFP4 = 39u;

const IS_FLOAT = QT == T_F32 || QT == T_F16 || QT == T_BF16;

struct Params {
    rows: u32,         // rows of this dispatch (of one part; of one expert for matvec_id)
    cols: u32,         // elements per row
    row_bytes: u32,    // bytes per stored row
    n_chunks: u32,     // chunks per row = ceil(cols / BS) * CPB
    nb_full: u32,      // complete blocks per row (float types may end in a partial one)
    x_off: u32,        // in elements: x of token 0
    x_stride: u32,     // in elements: between tokens' (or pairs') x rows
    y_off: u32,        // in elements: y[token 0][row 0 of this dispatch]
    y_stride: u32,     // in elements: between tokens' (or pairs') y rows
    accumulate: u32,   // 1: y += W x, 0: y = W x
    // matvec_id / matmul_id only:
    n_used: u32,       // expert slots per token (ids row length)
    ids_off: u32,      // in elements: ids[0][0] (matvec_id) / unused (matmul_id)
    e_lo: u32,         // first expert held by the bound part
    e_n: u32,          // experts in the bound part
    expert_bytes: u32, // bytes per expert matrix
    x_per_pair: u32,   // 1: x row per (token, slot) pair, 0: per token (shared by its slots)
    pair_off: u32,     // matvec_id: first pair of this dispatch
    n_tokens: u32,     // matmul: tokens in X / Y; matmul_id: (token, slot) pairs
    n_expert: u32,     // matmul_id: experts of the whole stack (route layout)
    tiles_off: u32,    // matmul_id: word of the route's tile list
    pairs_off: u32,    // matmul_id: word of the route's grouped pairs
    pad0: u32,
    pad1: u32,
    pad2: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> W: array<u32>;
@group(0) @binding(2) var<storage, read> W4: array<vec4<u32>>;
#if XVEC
@group(0) @binding(3) var<storage, read> X: array<vec4<f32>>;
#else
@group(0) @binding(3) var<storage, read> X: array<f32>;
#endif
@group(0) @binding(4) var<storage, read_write> Y: array<f32>;

// ---- activations ----

// x[e..e+4] (e a multiple of 4 when X is bound as vectors)
fn x4(e: u32) -> vec4<f32> {
#if XVEC
    return X[e >> 2u];
#else
    return vec4<f32>(X[e], X[e + 1u], X[e + 2u], X[e + 3u]);
#endif
}

fn x1(e: u32) -> f32 {
#if XVEC
    return X[e >> 2u][e & 3u];
#else
    return X[e];
#endif
}

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
#if MAGIC
    // 2^23 + b has b in its mantissa: an OR and a subtraction instead of int->float converts
    return bitcast<vec4<f32>>(unpack4xU8(u) | vec4<u32>(0x4b000000u)) - vec4<f32>(8388608.0);
#else
    return vec4<f32>(unpack4xU8(u));
#endif
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

// ggml's kvalues_iq4nl
const KV_IQ4NL = array<f32, 16>(-127.0, -104.0, -83.0, -65.0, -49.0, -35.0, -22.0, -10.0,
                                1.0, 13.0, 25.0, 38.0, 53.0, 69.0, 89.0, 113.0);

fn iq4(n: u32) -> f32 {
    return KV_IQ4NL[n & 15u];
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
// (sc0, m0, sc1, m1).
fn k4_scales(y: u32, z: u32, w: u32, c: u32) -> vec4<f32> {
    let yb = unpack4xU8(y);
    let zb = unpack4xU8(z);
    let wb = unpack4xU8(w);
    var sc: vec4<u32>;
    var mn: vec4<u32>;
    if (c < 2u) {
        sc = yb & vec4<u32>(63u);
        mn = zb & vec4<u32>(63u);
    } else {
        sc = (wb & vec4<u32>(15u)) | ((yb >> vec4<u32>(6u)) << vec4<u32>(4u));
        mn = (wb >> vec4<u32>(4u)) | ((zb >> vec4<u32>(6u)) << vec4<u32>(4u));
    }
    let odd = (c & 1u) == 1u;
    let s2 = select(sc.xy, sc.zw, odd);
    let m2 = select(mn.xy, mn.zw, odd);
    return vec4<f32>(f32(s2.x), f32(m2.x), f32(s2.y), f32(m2.y));
}

// signed 6-bit scale j (0..16) of a Q3_K block whose 12 scale bytes start at byte b
fn q3k_scale(b: u32, j: u32) -> f32 {
    let lo = (wbyte(b + (j & 7u)) >> (4u * (j >> 3u))) & 15u;
    let hi = (wbyte(b + 8u + (j & 3u)) >> (2u * (j >> 2u))) & 3u;
    return f32(i32(lo | (hi << 4u)) - 32);
}

// ---- chunk geometry ----

// offset within its block of the first of the 4 elements of quarter-octet j of chunk s
fn xmap(s: u32, j: u32) -> u32 {
    switch QT {
        case T_F32: {
            return 4u * s + 32u * j;
        }
        case T_F16, T_BF16: {
            return 8u * s + 64u * (j >> 1u) + 4u * (j & 1u);
        }
        case T_Q4_K, T_Q5_K: {
            return 64u * (s >> 1u) + 16u * (s & 1u) + 32u * (j >> 2u) + 4u * (j & 3u);
        }
        case T_Q6_K: {
            return 128u * (s >> 2u) + 32u * (j >> 1u) + 8u * (s & 3u) + 4u * (j & 1u);
        }
        default: {
            return 32u * s + 4u * j;
        }
    }
}

// One element of a float row starting at byte rb (slow path for unaligned rows and tails).
fn welem(rb: u32, e: u32) -> f32 {
    switch QT {
        case T_F32: {
            return bitcast<f32>(W[(rb >> 2u) + e]);
        }
        case T_F16: {
            return wf16(rb + 2u * e);
        }
        default: {
            return bitcast<f32>(whalf_bits(rb + 2u * e) << 16u);
        }
    }
}

// ---- decode: the 32 weights of chunk s of the block at byte b, in chunk order ----

fn chunk_w(b: u32, s: u32) -> array<vec4<f32>, 8> {
    var w: array<vec4<f32>, 8>;
    switch QT {
        case T_F32: {
            let bi = (b >> 4u) + s;
            for (var j = 0u; j < 8u; j++) {
                w[j] = bitcast<vec4<f32>>(W4[bi + 8u * j]);
            }
        }
        case T_F16: {
            let bi = (b >> 4u) + s;
            for (var j = 0u; j < 4u; j++) {
                let u = W4[bi + 8u * j];
                w[2u * j] = vec4<f32>(unpack2x16float(u.x), unpack2x16float(u.y));
                w[2u * j + 1u] = vec4<f32>(unpack2x16float(u.z), unpack2x16float(u.w));
            }
        }
        case T_BF16: {
            let bi = (b >> 4u) + s;
            for (var j = 0u; j < 4u; j++) {
                let u = W4[bi + 8u * j];
                w[2u * j] = vec4<f32>(bf16_lo(u.x), bf16_hi(u.x), bf16_lo(u.y), bf16_hi(u.y));
                w[2u * j + 1u] = vec4<f32>(bf16_lo(u.z), bf16_hi(u.z), bf16_lo(u.w), bf16_hi(u.w));
            }
        }
        case T_Q4_0: {
            // d: f16, qs[16]: element j low nibble, j+16 high; value d * (q - 8)
            let d = wf16(b);
            let q = wu4(b + 2u);
            for (var j = 0u; j < 4u; j++) {
                w[j] = d * (lo4(q[j]) - 8.0);
                w[j + 4u] = d * (hi4(q[j]) - 8.0);
            }
        }
        case T_Q4_1: {
            // d, m: f16, qs[16]; value d * q + m
            let dm = unpack2x16float(W[b >> 2u]);
            let q = wa4(b + 4u);
            for (var j = 0u; j < 4u; j++) {
                w[j] = dm.x * lo4(q[j]) + dm.y;
                w[j + 4u] = dm.x * hi4(q[j]) + dm.y;
            }
        }
        case T_Q5_0: {
            // d: f16, qh: u32 (bit e = 5th bit of element e), qs[16]; value d * (q - 16)
            let d = wf16(b);
            let qh = wu(b + 2u);
            let q = wu4(b + 6u);
            for (var j = 0u; j < 4u; j++) {
                let h0 = spread4(qh >> (4u * j)) << 4u;
                let h1 = spread4(qh >> (16u + 4u * j)) << 4u;
                w[j] = d * (f4u((q[j] & M4) | h0) - 16.0);
                w[j + 4u] = d * (f4u(((q[j] >> 4u) & M4) | h1) - 16.0);
            }
        }
        case T_Q5_1: {
            // d, m: f16, qh: u32, qs[16]; value d * q + m
            let dm = unpack2x16float(W[b >> 2u]);
            let qh = W[(b >> 2u) + 1u];
            let q = wa4(b + 8u);
            for (var j = 0u; j < 4u; j++) {
                let h0 = spread4(qh >> (4u * j)) << 4u;
                let h1 = spread4(qh >> (16u + 4u * j)) << 4u;
                w[j] = dm.x * f4u((q[j] & M4) | h0) + dm.y;
                w[j + 4u] = dm.x * f4u(((q[j] >> 4u) & M4) | h1) + dm.y;
            }
        }
        case T_Q8_0: {
            // d: f16, qs: 32 x i8
            let d = wf16(b);
            let q0 = wu4(b + 2u);
            let q1 = wu4(b + 18u);
            for (var j = 0u; j < 4u; j++) {
                w[j] = d * f4i(q0[j]);
                w[j + 4u] = d * f4i(q1[j]);
            }
        }
        case T_Q2_K: {
            // scales[16] (low nibble scale, high nibble min), qs[64], d, dmin. Chunk s: half
            // n = s/4, shift 2*(s%4), 32 consecutive elements from the 32 qs bytes of half n.
            let n = s >> 2u;
            let sh = 2u * (s & 3u);
            let dd = unpack2x16float(W[(b >> 2u) + 20u]);
            let scw = whalf_bits(b + 8u * n + 2u * (s & 3u));
            let s0 = scw & 0xffu;
            let s1 = scw >> 8u;
            let d0 = dd.x * f32(s0 & 15u);
            let m0 = dd.y * f32(s0 >> 4u);
            let d1 = dd.x * f32(s1 & 15u);
            let m1 = dd.y * f32(s1 >> 4u);
            let qa = wa4(b + 16u + 32u * n);
            let qb = wa4(b + 32u + 32u * n);
            for (var j = 0u; j < 4u; j++) {
                w[j] = d0 * f4u((qa[j] >> sh) & 0x03030303u) - m0;
                w[j + 4u] = d1 * f4u((qb[j] >> sh) & 0x03030303u) - m1;
            }
        }
        case T_Q3_K: {
            // hmask[32], qs[64], scales[12], d. Element 128n + 32j + l (l < 32): low bits
            // (qs[32n + l] >> 2j) & 3, high bit (hmask[l] >> (4n + j)) & 1, value
            // d * scale[8n + 2j + l/16] * (low + 4 * high - 4).
            let n = s >> 2u;
            let jj = s & 3u;
            let d = wf16(b + 108u);
            let sc0 = d * q3k_scale(b + 96u, 8u * n + 2u * jj);
            let sc1 = d * q3k_scale(b + 96u, 8u * n + 2u * jj + 1u);
            let hs = 4u * n + jj;
            for (var j = 0u; j < 8u; j++) {
                let lo = (wu(b + 32u + 32u * n + 4u * j) >> (2u * jj)) & 0x03030303u;
                let hb = ((wu(b + 4u * j) >> hs) & 0x01010101u) << 2u;
                let v = f4u(lo | hb) - 4.0;
                w[j] = select(sc0, sc1, j >= 4u) * v;
            }
        }
        case T_Q4_K: {
            // d, dmin, scales[12], qs[128]; chunk s: qs bytes 16s..16s+16, low nibbles = elements
            // 64c+16h.. of sub-block 2c, high = 64c+32+16h.. of sub-block 2c+1 (c = s/2, h = s%2);
            // value d * sc * q - dmin * m
            let bi = b >> 4u;
            let hd = W4[bi];
            let q = W4[bi + 1u + s];
            let dm = unpack2x16float(hd.x);
            let sm = k4_scales(hd.y, hd.z, hd.w, s >> 1u);
            for (var j = 0u; j < 4u; j++) {
                w[j] = dm.x * sm.x * lo4(q[j]) - dm.y * sm.y;
                w[j + 4u] = dm.x * sm.z * hi4(q[j]) - dm.y * sm.w;
            }
        }
        case T_Q5_K: {
            // d, dmin, scales[12], qh[32], qs[128]: as Q4_K plus the fifth bit, bit 2c (low
            // nibbles) / 2c+1 (high) of qh[l] for element l of the 64-group
            let bi = b >> 4u;
            let hd = W4[bi];
            let qh = W4[bi + 1u + (s & 1u)];
            let q = W4[bi + 3u + s];
            let c = s >> 1u;
            let dm = unpack2x16float(hd.x);
            let sm = k4_scales(hd.y, hd.z, hd.w, c);
            for (var j = 0u; j < 4u; j++) {
                let a = (q[j] & M4) | (((qh[j] >> (2u * c)) & 0x01010101u) << 4u);
                let h = ((q[j] >> 4u) & M4) | (((qh[j] >> (2u * c + 1u)) & 0x01010101u) << 4u);
                w[j] = dm.x * sm.x * f4u(a) - dm.y * sm.y;
                w[j + 4u] = dm.x * sm.z * f4u(h) - dm.y * sm.w;
            }
        }
        case T_Q6_K: {
            let v = q6k_chunk(b, s);
            let sc = v.sc * v.d;
            for (var j = 0u; j < 8u; j++) {
                w[j] = sc[j >> 1u] * (f4u(v.q[j]) - 32.0);
            }
        }
        case T_IQ4_NL: {
            // d: f16, qs[16] as Q4_0, value d * kvalues_iq4nl[q]
            let d = wf16(b);
            let q = wu4(b + 2u);
            for (var j = 0u; j < 4u; j++) {
                w[j] = d * iq4_lo(q[j]);
                w[j + 4u] = d * iq4_hi(q[j]);
            }
        }
        case T_IQ4_XS: {
            // d: f16, scales_h: u16, scales_l[4], qs[128]; chunk s = sub-block s (32 elements,
            // its 16 qs bytes as IQ4_NL); value d * (ls - 32) * kvalues_iq4nl[q]
            let w0 = W[b >> 2u];
            let d = unpack2x16float(w0).x;
            let sh = w0 >> 16u;
            let sl = wbyte(b + 4u + (s >> 1u));
            let ls = ((sl >> (4u * (s & 1u))) & 15u) | (((sh >> (2u * s)) & 3u) << 4u);
            let dl = d * f32(i32(ls) - 32);
            let q = wa4(b + 8u + 16u * s);
            for (var j = 0u; j < 4u; j++) {
                w[j] = dl * iq4_lo(q[j]);
                w[j + 4u] = dl * iq4_hi(q[j]);
            }
        }
        case T_MXFP4: {
            // e: E8M0, qs[16] as Q4_0 holding e2m1 nibbles
            let f = mx_scale(wbyte(b));
            let q = wu4(b + 1u);
            for (var j = 0u; j < 4u; j++) {
                w[j] = (e2m1_lo(q[j]) * f.x) * f.y;
                w[j + 4u] = (e2m1_hi(q[j]) * f.x) * f.y;
            }
        }
        default: {}
    }
    return w;
}

// Q6_K: ql[128], qh[64], scales[16] (i8), d. Element 128n + 32k + l (k < 4, l < 32): low 4 bits
// from ql[64n + l + 32(k&1)] (low nibble for k < 2, high for k >= 2), high 2 bits
// (qh[32n + l] >> 2k) & 3, scale scales[8n + 2k + l/16], value d * scale * (q - 32).
// Chunk s: n = s/4, l in 8(s%4)..+8, all four k: 6-bit levels as bytes q[2k + word].
struct Q6Chunk {
    q: array<u32, 8>,
    sc: vec4<f32>,
    d: f32,
}

fn q6k_chunk(b: u32, s: u32) -> Q6Chunk {
    var v: Q6Chunk;
    let n = s >> 2u;
    let l = 8u * (s & 3u);
    let a = wu2(b + 64u * n + l);
    let c = wu2(b + 64u * n + 32u + l);
    let h = wu2(b + 128u + 32u * n + l);
    let sb = b + 192u + 8u * n + (l >> 4u);
    let s01 = unpack4xI8(wu(sb));
    let s23 = unpack4xI8(wu(sb + 4u));
    v.sc = vec4<f32>(f32(s01.x), f32(s01.z), f32(s23.x), f32(s23.z));
    v.d = wf16(b + 208u);
    for (var i = 0u; i < 2u; i++) {
        v.q[i] = (a[i] & M4) | ((h[i] & 0x03030303u) << 4u);
        v.q[2u + i] = (c[i] & M4) | (((h[i] >> 2u) & 0x03030303u) << 4u);
        v.q[4u + i] = ((a[i] >> 4u) & M4) | (((h[i] >> 4u) & 0x03030303u) << 4u);
        v.q[6u + i] = ((c[i] >> 4u) & M4) | (((h[i] >> 6u) & 0x03030303u) << 4u);
    }
    return v;
}

// ---- matvec: dot of chunk s of the block at byte b with the x chunk xv ----
// xs[k] = sum of the 8 x values in xv[2k], xv[2k+1]: lets offsets and mins leave the inner
// loop (sum (d q - m) x = d sum q x - m sum x), as ggml's vec_dot does.

fn chunk_dot(b: u32, s: u32, xv: array<vec4<f32>, 8>, xs: vec4<f32>) -> f32 {
    switch QT {
        case T_F32: {
            let bi = (b >> 4u) + s;
            var acc = 0.0;
            for (var j = 0u; j < 8u; j++) {
                acc += dot(bitcast<vec4<f32>>(W4[bi + 8u * j]), xv[j]);
            }
            return acc;
        }
        case T_F16: {
            let bi = (b >> 4u) + s;
            var acc = 0.0;
            for (var j = 0u; j < 4u; j++) {
                let u = W4[bi + 8u * j];
                acc += dot(vec4<f32>(unpack2x16float(u.x), unpack2x16float(u.y)), xv[2u * j]);
                acc += dot(vec4<f32>(unpack2x16float(u.z), unpack2x16float(u.w)), xv[2u * j + 1u]);
            }
            return acc;
        }
        case T_BF16: {
            let bi = (b >> 4u) + s;
            var acc = 0.0;
            for (var j = 0u; j < 4u; j++) {
                let u = W4[bi + 8u * j];
                acc += dot(vec4<f32>(bf16_lo(u.x), bf16_hi(u.x), bf16_lo(u.y), bf16_hi(u.y)), xv[2u * j]);
                acc += dot(vec4<f32>(bf16_lo(u.z), bf16_hi(u.z), bf16_lo(u.w), bf16_hi(u.w)), xv[2u * j + 1u]);
            }
            return acc;
        }
        case T_Q4_0: {
            let d = wf16(b);
            let q = wu4(b + 2u);
            var acc = 0.0;
            for (var j = 0u; j < 4u; j++) {
                acc += dot(lo4(q[j]), xv[j]) + dot(hi4(q[j]), xv[j + 4u]);
            }
            return d * (acc - 8.0 * (xs.x + xs.y + xs.z + xs.w));
        }
        case T_Q8_0: {
            let d = wf16(b);
            let q0 = wu4(b + 2u);
            let q1 = wu4(b + 18u);
            var acc = 0.0;
            for (var j = 0u; j < 4u; j++) {
                acc += dot(f4i(q0[j]), xv[j]) + dot(f4i(q1[j]), xv[j + 4u]);
            }
            return d * acc;
        }
        case T_Q4_K: {
            let bi = b >> 4u;
            let hd = W4[bi];
            let q = W4[bi + 1u + s];
            let dm = unpack2x16float(hd.x);
            let sm = k4_scales(hd.y, hd.z, hd.w, s >> 1u);
            var lo = 0.0;
            var hi = 0.0;
            for (var j = 0u; j < 4u; j++) {
                lo += dot(lo4(q[j]), xv[j]);
                hi += dot(hi4(q[j]), xv[j + 4u]);
            }
            return dm.x * (sm.x * lo + sm.z * hi) - dm.y * (sm.y * (xs.x + xs.y) + sm.w * (xs.z + xs.w));
        }
        case T_Q5_K: {
            let bi = b >> 4u;
            let hd = W4[bi];
            let qh = W4[bi + 1u + (s & 1u)];
            let q = W4[bi + 3u + s];
            let c = s >> 1u;
            let dm = unpack2x16float(hd.x);
            let sm = k4_scales(hd.y, hd.z, hd.w, c);
            var lo = 0.0;
            var hi = 0.0;
            for (var j = 0u; j < 4u; j++) {
                let a = (q[j] & M4) | (((qh[j] >> (2u * c)) & 0x01010101u) << 4u);
                let h = ((q[j] >> 4u) & M4) | (((qh[j] >> (2u * c + 1u)) & 0x01010101u) << 4u);
                lo += dot(f4u(a), xv[j]);
                hi += dot(f4u(h), xv[j + 4u]);
            }
            return dm.x * (sm.x * lo + sm.z * hi) - dm.y * (sm.y * (xs.x + xs.y) + sm.w * (xs.z + xs.w));
        }
        case T_Q6_K: {
            let v = q6k_chunk(b, s);
            var acc = vec4<f32>(0.0);
            for (var k = 0u; k < 4u; k++) {
                acc[k] = dot(f4u(v.q[2u * k]), xv[2u * k]) + dot(f4u(v.q[2u * k + 1u]), xv[2u * k + 1u]);
            }
            return v.d * dot(v.sc, acc - 32.0 * xs);
        }
        case T_MXFP4: {
            let f = mx_scale(wbyte(b));
            let q = wu4(b + 1u);
            var acc = 0.0;
            for (var j = 0u; j < 4u; j++) {
                acc += dot(e2m1_lo(q[j]), xv[j]) + dot(e2m1_hi(q[j]), xv[j + 4u]);
            }
            return (acc * f.x) * f.y;
        }
        default: {
            let w = chunk_w(b, s);
            var acc = 0.0;
            for (var j = 0u; j < 8u; j++) {
                acc += dot(w[j], xv[j]);
            }
            return acc;
        }
    }
}

// Per-thread partial sums of rows row0..row0+R (clamped to the last row; writes are skipped
// later) for NT tokens. wbase: byte offset of row 0 in W; xbase: element of token 0's x.
fn mv_partial(row0: u32, tl: u32, wbase: u32, xbase: u32) -> array<f32, RT> {
    var acc: array<f32, RT>;
    var rb: array<u32, R>;
    for (var r = 0u; r < R; r++) {
        rb[r] = wbase + min(row0 + r, p.rows - 1u) * p.row_bytes;
    }
    for (var c = tl; c < p.n_chunks; c += TPR) {
        let blk = c / CPB;
        let s = c % CPB;
        let boff = blk * BB;
        let xb = xbase + blk * BS;
        if (IS_FLOAT && (FSLOW != 0u || blk >= p.nb_full)) {
            // unaligned float rows and the partial last block: element by element, masked
            for (var t = 0u; t < NT; t++) {
                for (var j = 0u; j < 8u; j++) {
                    for (var i = 0u; i < 4u; i++) {
                        let e = blk * BS + xmap(s, j) + i;
                        if (e < p.cols) {
                            let xe = x1(xbase + t * p.x_stride + e);
                            for (var r = 0u; r < R; r++) {
                                acc[r * NT + t] += welem(rb[r], e) * xe;
                            }
                        }
                    }
                }
            }
            continue;
        }
        for (var t = 0u; t < NT; t++) {
            var xv: array<vec4<f32>, 8>;
            for (var j = 0u; j < 8u; j++) {
                xv[j] = x4(xb + t * p.x_stride + xmap(s, j));
            }
            let one = vec4<f32>(1.0);
            let xs = vec4<f32>(dot(xv[0] + xv[1], one), dot(xv[2] + xv[3], one),
                               dot(xv[4] + xv[5], one), dot(xv[6] + xv[7], one));
            for (var r = 0u; r < R; r++) {
                acc[r * NT + t] += chunk_dot(rb[r] + boff, s, xv, xs);
            }
        }
    }
    return acc;
}

// ---- reduction over the TPR threads of a thread group, then the write ----

#if SUBGROUPS
var<workgroup> red: array<f32, (WG / 4u) * RT>;
#else
var<workgroup> red: array<f32, WG * RT>;
#endif

fn store_y(i: u32, row0: u32, ybase: u32, v: f32) {
    let r = i / NT;
    let t = i % NT;
    let row = row0 + r;
    if (row < p.rows) {
        let o = ybase + t * p.y_stride + row;
        if (p.accumulate != 0u) {
            Y[o] += v;
        } else {
            Y[o] = v;
        }
    }
}

#if SUBGROUPS
fn reduce_store(acc_in: array<f32, RT>, lid: u32, sg_size: u32, sg_lane: u32, row0: u32, ybase: u32) {
    var acc = acc_in;
    let g = lid / TPR;
    let tl = lid % TPR;
    if (TPR <= sg_size) {
        // butterfly inside the subgroup over the group's TPR lanes (groups are aligned runs)
        for (var i = 0u; i < RT; i++) {
            var v = acc[i];
            for (var o = 1u; o < TPR; o <<= 1u) {
                v += subgroupShuffleXor(v, o);
            }
            acc[i] = v;
        }
        for (var i = 0u; i < RT; i++) {
            if (tl == i) {
                store_y(i, row0, ybase, acc[i]);
            }
        }
        return;
    }
    for (var i = 0u; i < RT; i++) {
        acc[i] = subgroupAdd(acc[i]);
    }
    let sgi = lid / sg_size;
    if (sg_lane == 0u) {
        for (var i = 0u; i < RT; i++) {
            red[sgi * RT + i] = acc[i];
        }
    }
    workgroupBarrier();
    let per = TPR / sg_size;
    if (tl < RT) {
        var v = 0.0;
        for (var k = 0u; k < per; k++) {
            v += red[(g * per + k) * RT + tl];
        }
        store_y(tl, row0, ybase, v);
    }
}
#else
fn reduce_store(acc: array<f32, RT>, lid: u32, row0: u32, ybase: u32) {
    let g = lid / TPR;
    let tl = lid % TPR;
    for (var i = 0u; i < RT; i++) {
        red[i * WG + lid] = acc[i];
    }
    workgroupBarrier();
    for (var o = TPR / 2u; o > 0u; o >>= 1u) {
        if (tl < o) {
            for (var i = 0u; i < RT; i++) {
                red[i * WG + lid] += red[i * WG + lid + o];
            }
        }
        workgroupBarrier();
    }
    if (tl < RT) {
        store_y(tl, row0, ybase, red[tl * WG + g * TPR]);
    }
}
#endif

// y[t][row] (=|+=) sum_c W[row][c] x[t][c], rows of this part, t < NT
@compute @workgroup_size(WG)
fn matvec(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
#if SUBGROUPS
          @builtin(subgroup_size) sg_size: u32, @builtin(subgroup_invocation_id) sg_lane: u32,
#endif
          @builtin(local_invocation_index) lid: u32) {
    let wg = wid.x + wid.y * nwg.x;
    let row0 = (wg * GPW + lid / TPR) * R;
    let acc = mv_partial(row0, lid % TPR, 0u, p.x_off);
#if SUBGROUPS
    reduce_store(acc, lid, sg_size, sg_lane, row0, p.y_off);
#else
    reduce_store(acc, lid, row0, p.y_off);
#endif
}

// MoE: for pair q = p.pair_off + wid.y (token q / n_used, slot q % n_used) with expert
// e = ids[ids_off + q]: y[q][row] (=|+=) sum_c W[e][row][c] x[q or q / n_used][c].
// Workgroups whose expert is not in the bound part return at once.
@group(0) @binding(5) var<storage, read> IDX: array<u32>;

@compute @workgroup_size(WG)
fn matvec_id(@builtin(workgroup_id) wid: vec3<u32>,
#if SUBGROUPS
             @builtin(subgroup_size) sg_size: u32, @builtin(subgroup_invocation_id) sg_lane: u32,
#endif
             @builtin(local_invocation_index) lid: u32) {
    let q = p.pair_off + wid.y;
    let e = IDX[p.ids_off + q];
    if (e < p.e_lo || e - p.e_lo >= p.e_n) {
        return;
    }
    let row0 = (wid.x * GPW + lid / TPR) * R;
    let xq = select(q / p.n_used, q, p.x_per_pair != 0u);
    let acc = mv_partial(row0, lid % TPR, (e - p.e_lo) * p.expert_bytes, p.x_off + xq * p.x_stride);
#if SUBGROUPS
    reduce_store(acc, lid, sg_size, sg_lane, row0, p.y_off + q * p.y_stride);
#else
    reduce_store(acc, lid, row0, p.y_off + q * p.y_stride);
#endif
}

#endif
