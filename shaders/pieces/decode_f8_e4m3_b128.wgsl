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
