#if TY_Q4_K
// d, dmin, scales[12], qs[128] (144 bytes: 16-aligned). Chunk s: qs bytes 16s..16s+16; low
// nibbles = elements 64c+16h.. of sub-block 2c, high = 64c+32+16h.. of sub-block 2c+1
// (c = s/2, h = s%2); value d * sc * q - dmin * m.
fn xmap(s: u32, j: u32) -> u32 {
    return 64u * (s >> 1u) + 16u * (s & 1u) + 32u * (j >> 2u) + 4u * (j & 3u);
}

fn chunk_w(b: u32, s: u32) -> array<vec4<f32>, 8> {
    let bi = b >> 4u;
    let hd = W4[bi];
    let q = W4[bi + 1u + s];
    let dm = unpack2x16float(hd.x);
    let sm = k4_scales(hd.y, hd.z, hd.w, s >> 1u);
    let d0 = dm.x * sm.x;
    let m0 = vec4<f32>(dm.y * sm.y);
    let d1 = dm.x * sm.z;
    let m1 = vec4<f32>(dm.y * sm.w);
    return array<vec4<f32>, 8>(d0 * lo4(q.x) - m0, d0 * lo4(q.y) - m0, d0 * lo4(q.z) - m0, d0 * lo4(q.w) - m0,
                               d1 * hi4(q.x) - m1, d1 * hi4(q.y) - m1, d1 * hi4(q.z) - m1, d1 * hi4(q.w) - m1);
}

#if Q8X
// matvec, int8 x: 4 lanes per block, lane c = qs bytes 32c..32c+32 (two 16-byte loads): low
// nibbles = sub-block 2c against x block 2c, high = sub-block 2c+1 against x block 2c+1 (both
// levels); the mins as dmin * m * Σx̂ per sub-block (ggml's vec_dot_q4_K_q8_1).
const MV_CPB = 4u;

alias XC = QX2;

fn load_xc(xe: u32, c: u32) -> XC {
    return load_qx2(xe / 32u + 2u * c);
}

fn chunk_dot(b: u32, c: u32, xc: XC) -> f32 {
    let bi = b >> 4u;
    let hd = W4[bi];
    let q0 = W4[bi + 1u + 2u * c];
    let q1 = W4[bi + 2u + 2u * c];
    let m4 = vec4<u32>(M4);
    let f = vec4<u32>(4u);
    let lo = sums2(q0 & m4, q1 & m4, xc.q[0], xc.q[1], xc.q2[0], xc.q2[1]);
    let hi = sums2((q0 >> f) & m4, (q1 >> f) & m4, xc.q[2], xc.q[3], xc.q2[2], xc.q2[3]);
    return k_sub2(unpack2x16float(hd.x), k4_scales(hd.y, hd.z, hd.w, c), lo, hi, xc);
}
#else
// matvec: the same chunks, 8 lanes per block: one 16-byte load of qs plus the 16-byte header
const MV_CPB = 8u;

struct XC {
    v: array<vec4<f32>, 8>,
    s: vec2<f32>,   // sums of v[0..4] and v[4..8]
}

fn load_xc(xb: u32, s: u32) -> XC {
    let b0 = xb + 64u * (s >> 1u) + 16u * (s & 1u);
    let a0 = x4(b0);
    let a1 = x4(b0 + 4u);
    let a2 = x4(b0 + 8u);
    let a3 = x4(b0 + 12u);
    let a4 = x4(b0 + 32u);
    let a5 = x4(b0 + 36u);
    let a6 = x4(b0 + 40u);
    let a7 = x4(b0 + 44u);
    let one = vec4<f32>(1.0);
    return XC(array<vec4<f32>, 8>(a0, a1, a2, a3, a4, a5, a6, a7),
              vec2<f32>(dot(a0 + a1 + a2 + a3, one), dot(a4 + a5 + a6 + a7, one)));
}

// the x-independent half of chunk_dot: the slice's codes as floats (the v[] order) and scales
struct WC {
    q: array<vec4<f32>, 8>,
    dm: vec2<f32>,
    sm: vec4<f32>,
}

fn chunk_pre(b: u32, s: u32) -> WC {
    let bi = b >> 4u;
    let hd = W4[bi];
    let q = W4[bi + 1u + s];
    return WC(array<vec4<f32>, 8>(lo4(q.x), lo4(q.y), lo4(q.z), lo4(q.w), ghi4(q.x), ghi4(q.y), ghi4(q.z), ghi4(q.w)),
              unpack2x16float(hd.x), k4_scales(hd.y, hd.z, hd.w, s >> 1u));
}

fn chunk_fin(w: WC, xc: XC) -> f32 {
    let lo = dot(w.q[0], xc.v[0]) + dot(w.q[1], xc.v[1]) + dot(w.q[2], xc.v[2]) + dot(w.q[3], xc.v[3]);
    let hi = dot(w.q[4], xc.v[4]) + dot(w.q[5], xc.v[5]) + dot(w.q[6], xc.v[6]) + dot(w.q[7], xc.v[7]);
    return w.dm.x * (w.sm.x * lo + w.sm.z * hi) - w.dm.y * (w.sm.y * xc.s.x + w.sm.w * xc.s.y);
}

fn chunk_dot(b: u32, s: u32, xc: XC) -> f32 {
    return chunk_fin(chunk_pre(b, s), xc);
}
#endif
#endif
