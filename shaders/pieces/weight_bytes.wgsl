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
    return vec4<f32>(unpack4xU8(u));
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

// The same conversion on the ALU: 2^23 + b has b in its mantissa, so OR in the exponent and
// subtract 2^23. Int->float converts run on a narrow pipe (16 lanes per clock per SM on Hopper,
// a quarter of the integer ALU): the 4-bit types convert half their nibbles this way, which
// measured 15-20% faster there (Q4_K, Q5_K, Q4_0); for the others it was slower.
fn g4u(u: u32) -> vec4<f32> {
    let m = vec4<u32>(u & 0xffu, (u >> 8u) & 0xffu, (u >> 16u) & 0xffu, u >> 24u) | vec4<u32>(0x4b000000u);
    return bitcast<vec4<f32>>(m) - vec4<f32>(8388608.0);
}

fn ghi4(u: u32) -> vec4<f32> {
    return g4u((u >> 4u) & M4);
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

// ggml's kvalues_iq4nl as packed i8 (a const array indexed at run time would be copied to
// local memory on some drivers)
fn iq4(n: u32) -> f32 {
    let i = n & 15u;
    let w = select(select(0xbfad9881u, 0xf6eaddcfu, i >= 4u), select(0x26190d01u, 0x71594535u, i >= 12u), i >= 8u);
    return f32(bitcast<i32>(w << (24u - 8u * (i & 3u))) >> 24u);
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
// (sc0, m0, sc1, m1). Works on the two bytes of each pair at once.
fn k4_scales(y: u32, z: u32, w: u32, c: u32) -> vec4<f32> {
    let sh = 16u * (c & 1u);
    let ys = y >> sh;
    let zs = z >> sh;
    let ws = w >> sh;
    // c < 2: low 6 bits of bytes j, j+1 (scales in y, mins in z); c >= 2: low / high nibble of w
    // with the top two bits of y / z above them
    let hi = c >= 2u;
    let sc = select(ys & 0x3f3fu, (ws & 0x0f0fu) | ((ys >> 2u) & 0x3030u), hi);
    let mn = select(zs & 0x3f3fu, ((ws >> 4u) & 0x0f0fu) | ((zs >> 2u) & 0x3030u), hi);
    return g4u((sc & 0xffu) | ((mn & 0xffu) << 8u) | ((sc & 0xff00u) << 8u) | ((mn & 0xff00u) << 16u));
}

// signed 6-bit scale j (0..16) of a Q3_K block whose 12 scale bytes start at byte b
fn q3k_scale(b: u32, j: u32) -> f32 {
    let lo = (wbyte(b + (j & 7u)) >> (4u * (j >> 3u))) & 15u;
    let hi = (wbyte(b + 8u + (j & 3u)) >> (2u * (j >> 2u))) & 3u;
    return f32(i32(lo | (hi << 4u)) - 32);
}

// Q5_0 / Q5_1: 5-bit levels of elements 4i..4i+4 (low nibbles of qs word qw) and 16+4i..
// (high nibbles), fifth bits from qh
fn q5lo(qw: u32, qh: u32, i: u32) -> vec4<f32> {
    return f4u((qw & M4) | (spread4(qh >> (4u * i)) << 4u));
}

fn q5hi(qw: u32, qh: u32, i: u32) -> vec4<f32> {
    return f4u(((qw >> 4u) & M4) | (spread4(qh >> (16u + 4u * i)) << 4u));
}
