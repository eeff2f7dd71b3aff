// Embedding row gather: y[t] = dequant(E[ids[t]]) for a table E in any stored type.
// One thread per output element; a table split into parts (row ranges in separate buffers)
// is gathered with one dispatch per part, each writing only the tokens whose id it holds.
// Ids past the table (≥ n_total_rows) give zero rows, written by the dispatch of part 0.
// CPU reference: cpu::ops::embed (quant::dequantize).
//
// The decoders follow ggml's block layouts (ggml-common.h) and dequantize_row_* element by
// element, in the same f32 operation order. Blocks may sit at any byte address (Q8_0 blocks
// are 34 bytes), so bytes are read out of u32 words with shifts.
//
// Defines: exactly one of T_F32, T_F16, T_BF16, T_Q4_0, T_Q4_1, T_Q5_0, T_Q5_1, T_Q8_0,
// T_Q2_K, T_Q3_K, T_Q4_K, T_Q5_K, T_Q6_K, T_IQ4_NL, T_IQ4_XS, T_MXFP4, plus TYPE_SET.
// Bindings: 1 y (f32), 2 ids (u32), 3 the part's raw bytes.

const WG = 256u;

struct Params {
    row_len: u32,      // elements per row
    n_tokens: u32,
    ids_off: u32,      // index of token 0's id in ids
    y_off: u32,        // in elements
    y_stride: u32,     // elements between output rows
    row_bytes: u32,    // bytes per stored row
    part_start: u32,   // first table row held by this part
    part_rows: u32,    // rows held by this part
    n_total_rows: u32, // rows of the whole table
    zero_invalid: u32, // 1: write zeros for ids ≥ n_total_rows (part 0's dispatch)
    _pad0: u32,
    _pad1: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> y: array<f32>;
@group(0) @binding(2) var<storage, read> ids: array<u32>;
@group(0) @binding(3) var<storage, read> e: array<u32>;

fn byte(b: u32) -> u32 { return (e[b >> 2u] >> ((b & 3u) * 8u)) & 0xffu; }
fn u16_at(b: u32) -> u32 { return byte(b) | (byte(b + 1u) << 8u); }
fn f16_at(b: u32) -> f32 { return unpack2x16float(u16_at(b)).x; }
fn i8_of(v: u32) -> i32 { return bitcast<i32>(v << 24u) >> 24u; }
// Nibble i (0..32) of 16 bytes at b: element i < 16 in the low nibbles, 16.. in the high.
fn nib32(b: u32, i: u32) -> u32 { return (byte(b + (i & 15u)) >> ((i >> 4u) * 4u)) & 15u; }

// Element j of the row whose first byte is at `rb`.
#ifndef TYPE_SET
// No type chosen (the raw file, as naga's translation test reads it): F32.
fn deq(rb: u32, j: u32) -> f32 { return bitcast<f32>(e[(rb >> 2u) + j]); }
#endif
#if T_F32
fn deq(rb: u32, j: u32) -> f32 { return bitcast<f32>(e[(rb >> 2u) + j]); }
#endif
#if T_F16
fn deq(rb: u32, j: u32) -> f32 { return unpack2x16float(u16_at(rb + 2u * j)).x; }
#endif
#if T_BF16
fn deq(rb: u32, j: u32) -> f32 { return bitcast<f32>(u16_at(rb + 2u * j) << 16u); }
#endif
#if T_Q4_0
fn deq(rb: u32, j: u32) -> f32 {
    let bb = rb + (j / 32u) * 18u;
    let i = j % 32u;
    return f32(i32(nib32(bb + 2u, i)) - 8) * f16_at(bb);
}
#endif
#if T_Q4_1
fn deq(rb: u32, j: u32) -> f32 {
    let bb = rb + (j / 32u) * 20u;
    let i = j % 32u;
    return f32(nib32(bb + 4u, i)) * f16_at(bb) + f16_at(bb + 2u);
}
#endif
#if T_Q5_0
fn deq(rb: u32, j: u32) -> f32 {
    let bb = rb + (j / 32u) * 22u;
    let i = j % 32u;
    let h = (byte(bb + 2u + (i >> 3u)) >> (i & 7u)) & 1u;
    return f32(i32(nib32(bb + 6u, i) | (h << 4u)) - 16) * f16_at(bb);
}
#endif
#if T_Q5_1
fn deq(rb: u32, j: u32) -> f32 {
    let bb = rb + (j / 32u) * 24u;
    let i = j % 32u;
    let h = (byte(bb + 4u + (i >> 3u)) >> (i & 7u)) & 1u;
    return f32(nib32(bb + 8u, i) | (h << 4u)) * f16_at(bb) + f16_at(bb + 2u);
}
#endif
#if T_Q8_0
fn deq(rb: u32, j: u32) -> f32 {
    let bb = rb + (j / 32u) * 34u;
    return f32(i8_of(byte(bb + 2u + j % 32u))) * f16_at(bb);
}
#endif
#if T_Q2_K
// scales[16] @0 (scale low nibble, min high), qs[64] @16, d @80, dmin @82.
fn deq(rb: u32, j: u32) -> f32 {
    let bb = rb + (j / 256u) * 84u;
    let i = j % 256u;
    let n = i / 128u;
    let g = (i % 128u) / 32u;    // 2-bit field within the byte
    let l = i % 32u;
    let sc = byte(bb + 8u * n + 2u * g + l / 16u);
    let q = (byte(bb + 16u + 32u * n + l) >> (2u * g)) & 3u;
    let dl = f16_at(bb + 80u) * f32(sc & 15u);
    let ml = f16_at(bb + 82u) * f32(sc >> 4u);
    return dl * f32(q) - ml;
}
#endif
#if T_Q3_K
// hmask[32] @0, qs[64] @32, scales[12] @96 (6-bit, offset 32), d @108.
fn deq(rb: u32, j: u32) -> f32 {
    let bb = rb + (j / 256u) * 110u;
    let i = j % 256u;
    let n = i / 128u;
    let g = (i % 128u) / 32u;
    let l = i % 32u;
    let k = 8u * n + 2u * g + l / 16u;
    var lo: u32;
    if (k < 8u) { lo = byte(bb + 96u + k) & 15u; } else { lo = byte(bb + 96u + k - 8u) >> 4u; }
    let hi = (byte(bb + 96u + 8u + k % 4u) >> (2u * (k / 4u))) & 3u;
    let sc = i32(lo | (hi << 4u)) - 32;
    let q = i32((byte(bb + 32u + 32u * n + l) >> (2u * g)) & 3u);
    let off = select(4, 0, ((byte(bb + l) >> (4u * n + g)) & 1u) != 0u);
    let dl = f16_at(bb + 108u) * f32(sc);
    return dl * f32(q - off);
}
#endif
#if T_Q4_K
// d @0, dmin @2, scales[12] @4 (get_scale_min_k4), qs[128] @16.
fn deq(rb: u32, j: u32) -> f32 {
    let bb = rb + (j / 256u) * 144u;
    let i = j % 256u;
    let c = i / 64u;
    let up = (i % 64u) / 32u;
    let l = i % 32u;
    let sm = scale_min_k4(bb + 4u, 2u * c + up);
    let q = (byte(bb + 16u + 32u * c + l) >> (4u * up)) & 15u;
    return f16_at(bb) * f32(sm.x) * f32(q) - f16_at(bb + 2u) * f32(sm.y);
}
#endif
#if T_Q5_K
// d @0, dmin @2, scales[12] @4, qh[32] @16, qs[128] @48.
fn deq(rb: u32, j: u32) -> f32 {
    let bb = rb + (j / 256u) * 176u;
    let i = j % 256u;
    let c = i / 64u;
    let up = (i % 64u) / 32u;
    let l = i % 32u;
    let sm = scale_min_k4(bb + 4u, 2u * c + up);
    let h = (byte(bb + 16u + l) >> (2u * c + up)) & 1u;
    let q = ((byte(bb + 48u + 32u * c + l) >> (4u * up)) & 15u) + 16u * h;
    return f16_at(bb) * f32(sm.x) * f32(q) - f16_at(bb + 2u) * f32(sm.y);
}
#endif
#if T_Q6_K
// ql[128] @0, qh[64] @128, scales[16] (i8) @192, d @208.
fn deq(rb: u32, j: u32) -> f32 {
    let bb = rb + (j / 256u) * 210u;
    let i = j % 256u;
    let n = i / 128u;
    let k = (i % 128u) / 32u;
    let l = i % 32u;
    let lo = (byte(bb + 64u * n + l + 32u * (k & 1u)) >> (4u * (k >> 1u))) & 15u;
    let hi = (byte(bb + 128u + 32u * n + l) >> (2u * k)) & 3u;
    let q = i32(lo | (hi << 4u)) - 32;
    let sc = i8_of(byte(bb + 192u + 8u * n + l / 16u + 2u * k));
    return f16_at(bb + 208u) * f32(sc) * f32(q);
}
#endif
#if T_IQ4_NL
fn deq(rb: u32, j: u32) -> f32 {
    let bb = rb + (j / 32u) * 18u;
    return f16_at(bb) * KV_IQ4NL[nib32(bb + 2u, j % 32u)];
}
#endif
#if T_IQ4_XS
// d @0, scales_h (u16) @2, scales_l[4] @4, qs[128] @8 (16 bytes per 32-element sub-block).
fn deq(rb: u32, j: u32) -> f32 {
    let bb = rb + (j / 256u) * 136u;
    let i = j % 256u;
    let ib = i / 32u;
    let ls = ((byte(bb + 4u + ib / 2u) >> (4u * (ib % 2u))) & 15u)
        | (((u16_at(bb + 2u) >> (2u * ib)) & 3u) << 4u);
    let dl = f16_at(bb) * f32(i32(ls) - 32);
    return dl * KV_IQ4NL[nib32(bb + 8u + 16u * ib, i % 32u)];
}
#endif
#if T_MXFP4
// e (E8M0) @0, qs[16] @1; ggml keeps e2m1 doubled and halves the scale: 2^(e−128).
fn deq(rb: u32, j: u32) -> f32 {
    let bb = rb + (j / 32u) * 17u;
    let x = byte(bb);
    var d: f32;
    if (x < 2u) { d = bitcast<f32>(0x00200000u << x); } else { d = bitcast<f32>((x - 1u) << 23u); }
    return KV_MXFP4[nib32(bb + 1u, j % 32u)] * d;
}
#endif

// ggml's get_scale_min_k4: 6-bit (scale, min) of sub-block s (0..8) from 12 bytes at b.
fn scale_min_k4(b: u32, s: u32) -> vec2<u32> {
    if (s < 4u) {
        return vec2<u32>(byte(b + s) & 63u, byte(b + s + 4u) & 63u);
    }
    return vec2<u32>((byte(b + s + 4u) & 15u) | ((byte(b + s - 4u) >> 6u) << 4u),
                     (byte(b + s + 4u) >> 4u) | ((byte(b + s) >> 6u) << 4u));
}

// ggml's kvalues_iq4nl and kvalues_mxfp4 (e2m1 doubled).
var<private> KV_IQ4NL: array<f32, 16> = array<f32, 16>(
    -127.0, -104.0, -83.0, -65.0, -49.0, -35.0, -22.0, -10.0,
    1.0, 13.0, 25.0, 38.0, 53.0, 69.0, 89.0, 113.0);
var<private> KV_MXFP4: array<f32, 16> = array<f32, 16>(
    0.0, 1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0,
    0.0, -1.0, -2.0, -3.0, -4.0, -6.0, -8.0, -12.0);

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
    let i = (wid.x + wid.y * nwg.x) * WG + lid;
    let t = i / p.row_len;
    if (t >= p.n_tokens) { return; }
    let j = i - t * p.row_len;
    let id = ids[p.ids_off + t];
    let yi = p.y_off + t * p.y_stride + j;
    if (id >= p.part_start && id - p.part_start < p.part_rows) {
        y[yi] = deq((id - p.part_start) * p.row_bytes, j);
    } else if (id >= p.n_total_rows && p.zero_invalid != 0u) {
        y[yi] = 0.0;
    }
}
