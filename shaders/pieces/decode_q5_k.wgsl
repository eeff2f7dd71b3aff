#if TY_Q5_K
// d, dmin, scales[12], qh[32], qs[128] (176 bytes: 16-aligned): as Q4_K plus the fifth bit,
// bit 2c (low nibbles) / 2c+1 (high) of qh[l] for element l of the 64-group c
fn xmap(s: u32, j: u32) -> u32 {
    return 64u * (s >> 1u) + 16u * (s & 1u) + 32u * (j >> 2u) + 4u * (j & 3u);
}

struct Q5K {
    lo: vec4<u32>,  // 5-bit levels, 4 per word, of sub-block 2c
    hi: vec4<u32>,  // of sub-block 2c+1
    sm: vec4<f32>,  // d*sc0, dmin*m0, d*sc1, dmin*m1
}

fn q5k(b: u32, s: u32) -> Q5K {
    let bi = b >> 4u;
    let hd = W4[bi];
    let qh = W4[bi + 1u + (s & 1u)];
    let q = W4[bi + 3u + s];
    let c = s >> 1u;
    let dm = unpack2x16float(hd.x);
    let sm = k4_scales(hd.y, hd.z, hd.w, c);
    let m4 = vec4<u32>(M4);
    let one = vec4<u32>(0x01010101u);
    let lo = (q & m4) | (((qh >> vec4<u32>(2u * c)) & one) << vec4<u32>(4u));
    let hi = ((q >> vec4<u32>(4u)) & m4) | (((qh >> vec4<u32>(2u * c + 1u)) & one) << vec4<u32>(4u));
    return Q5K(lo, hi, vec4<f32>(dm.x * sm.x, dm.y * sm.y, dm.x * sm.z, dm.y * sm.w));
}

fn chunk_w(b: u32, s: u32) -> array<vec4<f32>, 8> {
    let v = q5k(b, s);
    let d0 = v.sm.x;
    let m0 = vec4<f32>(v.sm.y);
    let d1 = v.sm.z;
    let m1 = vec4<f32>(v.sm.w);
    return array<vec4<f32>, 8>(d0 * f4u(v.lo.x) - m0, d0 * f4u(v.lo.y) - m0, d0 * f4u(v.lo.z) - m0, d0 * f4u(v.lo.w) - m0,
                               d1 * f4u(v.hi.x) - m1, d1 * f4u(v.hi.y) - m1, d1 * f4u(v.hi.z) - m1, d1 * f4u(v.hi.w) - m1);
}

#if Q8X
// matvec, int8 x: as Q4_K's, 4 lanes per block, lane c = qs bytes 32c..32c+32 with the fifth
// bits from qh (bytes 0..16 for the first 16 qs bytes, 16..32 for the next); 5-bit levels are
// valid signed bytes.
const MV_CPB = 4u;

alias XC = QX2;

fn load_xc(xe: u32, c: u32) -> XC {
    return load_qx2(xe / 32u + 2u * c);
}

fn chunk_dot(b: u32, c: u32, xc: XC) -> f32 {
    let bi = b >> 4u;
    let hd = W4[bi];
    let qh0 = W4[bi + 1u];
    let qh1 = W4[bi + 2u];
    let q0 = W4[bi + 3u + 2u * c];
    let q1 = W4[bi + 4u + 2u * c];
    let m4 = vec4<u32>(M4);
    let one = vec4<u32>(0x01010101u);
    let sl = vec4<u32>(2u * c);
    let sh = vec4<u32>(2u * c + 1u);
    let f = vec4<u32>(4u);
    let lo = sums2((q0 & m4) | (((qh0 >> sl) & one) << f), (q1 & m4) | (((qh1 >> sl) & one) << f),
                   xc.q[0], xc.q[1], xc.q2[0], xc.q2[1]);
    let hi = sums2(((q0 >> f) & m4) | (((qh0 >> sh) & one) << f), ((q1 >> f) & m4) | (((qh1 >> sh) & one) << f),
                   xc.q[2], xc.q[3], xc.q2[2], xc.q2[3]);
    return k_sub2(unpack2x16float(hd.x), k4_scales(hd.y, hd.z, hd.w, c), lo, hi, xc);
}
#else
const MV_CPB = 8u;

struct XC {
    v: array<vec4<f32>, 8>,
    s: vec2<f32>,
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

fn chunk_dot(b: u32, s: u32, xc: XC) -> f32 {
    let v = q5k(b, s);
    let lo = dot(f4u(v.lo.x), xc.v[0]) + dot(f4u(v.lo.y), xc.v[1]) + dot(f4u(v.lo.z), xc.v[2]) + dot(f4u(v.lo.w), xc.v[3]);
    let hi = dot(g4u(v.hi.x), xc.v[4]) + dot(g4u(v.hi.y), xc.v[5]) + dot(g4u(v.hi.z), xc.v[6]) + dot(g4u(v.hi.w), xc.v[7]);
    return v.sm.x * lo + v.sm.z * hi - (v.sm.y * xc.s.x + v.sm.w * xc.s.y);
}
#endif
#endif
