#if TY_Q6_K
// ql[128], qh[64], scales[16] (i8), d (210 bytes: 2-aligned). Element 128n + 32k + l (k < 4,
// l < 32): low 4 bits from ql[64n + l + 32(k&1)] (low nibble for k < 2, high for k >= 2), high 2
// bits (qh[32n + l] >> 2k) & 3, value d * scales[8n + 2k + l/16] * (q - 32).

// 6-bit levels of 4 consecutive l for k = 0..3, one word each, from the ql words at l and l+32
// and the qh word at l
fn q6w(a: u32, c: u32, h: u32) -> vec4<u32> {
    let m2 = 0x03030303u;
    return vec4<u32>((a & M4) | ((h & m2) << 4u), (c & M4) | (((h >> 2u) & m2) << 4u),
                     ((a >> 4u) & M4) | (((h >> 4u) & m2) << 4u), ((c >> 4u) & M4) | (((h >> 6u) & m2) << 4u));
}

// the four scales of k = 0..3 for half n, l in a 16-group
fn q6_scales(b: u32, n: u32, l: u32) -> vec4<f32> {
    let sb = b + 192u + 8u * n + (l >> 4u);
    let s01 = unpack4xI8(wu(sb));
    let s23 = unpack4xI8(wu(sb + 4u));
    return vec4<f32>(f32(s01.x), f32(s01.z), f32(s23.x), f32(s23.z));
}

// matmul chunk s: n = s/4, l = 8(s%4)..+8, all four k; vec4 j = 2k + (which 4 of the 8 l)
fn xmap(s: u32, j: u32) -> u32 {
    return 128u * (s >> 2u) + 32u * (j >> 1u) + 8u * (s & 3u) + 4u * (j & 1u);
}

fn chunk_w(b: u32, s: u32) -> array<vec4<f32>, 8> {
    let n = s >> 2u;
    let l = 8u * (s & 3u);
    let a = wu2(b + 64u * n + l);
    let c = wu2(b + 64u * n + 32u + l);
    let h = wu2(b + 128u + 32u * n + l);
    let sc = wf16(b + 208u) * q6_scales(b, n, l);
    let q0 = q6w(a.x, c.x, h.x);
    let q1 = q6w(a.y, c.y, h.y);
    let o = vec4<f32>(32.0);
    return array<vec4<f32>, 8>(sc.x * (f4u(q0.x) - o), sc.x * (f4u(q1.x) - o), sc.y * (f4u(q0.y) - o), sc.y * (f4u(q1.y) - o),
                               sc.z * (f4u(q0.z) - o), sc.z * (f4u(q1.z) - o), sc.w * (f4u(q0.w) - o), sc.w * (f4u(q1.w) - o));
}

#if Q8X
// matvec, int8 x: 4 lanes per block, lane j = half n = j/2, l = 16(j%2)..+16, all four k:
// elements 128n + 32k + l.. = words 4(j%2)..+4 of x block 4n+k, one scale per k. The 6-bit
// levels (0..63, valid signed bytes) dot both levels of x, and the -32 offset is -32 Σq per
// level over the same 16 codes, summed once in load_xc for the R rows (exact integers in f32).
const MV_CPB = 4u;

struct XC {
    q: array<vec4<u32>, 4>,   // level 1 per k
    q2: array<vec4<u32>, 4>,  // level 2 per k
    d: vec4<f32>,             // d per k
    d2: vec4<f32>,            // d₂ per k
    s: vec4<f32>,             // 32 * Σq per k
    s2: vec4<f32>,            // 32 * Σq₂ per k
}

fn load_xc(xe: u32, j: u32) -> XC {
    let blk = xe / 32u + 4u * (j >> 1u);
    let h = j & 1u;
    let a0 = qx(blk, 0u, h);
    let a1 = qx(blk + 1u, 0u, h);
    let a2 = qx(blk + 2u, 0u, h);
    let a3 = qx(blk + 3u, 0u, h);
    let b0 = qx(blk, 1u, h);
    let b1 = qx(blk + 1u, 1u, h);
    let b2 = qx(blk + 2u, 1u, h);
    let b3 = qx(blk + 3u, 1u, h);
    let c0 = xsc(blk);
    let c1 = xsc(blk + 1u);
    let c2 = xsc(blk + 2u);
    let c3 = xsc(blk + 3u);
    let one = vec4<u32>(0x01010101u);
    let s = vec4<i32>(dot16(a0, one), dot16(a1, one), dot16(a2, one), dot16(a3, one));
    let s2 = vec4<i32>(dot16(b0, one), dot16(b1, one), dot16(b2, one), dot16(b3, one));
    return XC(array<vec4<u32>, 4>(a0, a1, a2, a3), array<vec4<u32>, 4>(b0, b1, b2, b3),
              vec4<f32>(c0.x, c1.x, c2.x, c3.x), vec4<f32>(c0.y, c1.y, c2.y, c3.y),
              32.0 * vec4<f32>(s), 32.0 * vec4<f32>(s2));
}

fn chunk_dot(b: u32, j: u32, xc: XC) -> f32 {
    let n = j >> 1u;
    let l = 16u * (j & 1u);
    let a = wu4(b + 64u * n + l);
    let c = wu4(b + 64u * n + 32u + l);
    let h = wu4(b + 128u + 32u * n + l);
    let v0 = q6w(a.x, c.x, h.x);
    let v1 = q6w(a.y, c.y, h.y);
    let v2 = q6w(a.z, c.z, h.z);
    let v3 = q6w(a.w, c.w, h.w);
    let w0 = vec4<u32>(v0.x, v1.x, v2.x, v3.x);
    let w1 = vec4<u32>(v0.y, v1.y, v2.y, v3.y);
    let w2 = vec4<u32>(v0.z, v1.z, v2.z, v3.z);
    let w3 = vec4<u32>(v0.w, v1.w, v2.w, v3.w);
    let i = vec4<i32>(dot16(w0, xc.q[0]), dot16(w1, xc.q[1]), dot16(w2, xc.q[2]), dot16(w3, xc.q[3]));
    let i2 = vec4<i32>(dot16(w0, xc.q2[0]), dot16(w1, xc.q2[1]), dot16(w2, xc.q2[2]), dot16(w3, xc.q2[3]));
    return wf16(b + 208u) * dot(q6_scales(b, n, l), xc.d * (vec4<f32>(i) - xc.s) + xc.d2 * (vec4<f32>(i2) - xc.s2));
}
#else
// matvec: matmul's chunks, 8 lanes per block, 32 weights each (three 8-byte reads)
const MV_CPB = 8u;

struct XC {
    v: array<vec4<f32>, 8>,
    s: vec4<f32>,   // sums of v[2k] + v[2k+1]
}

fn load_xc(xb: u32, s: u32) -> XC {
    let b0 = xb + 128u * (s >> 2u) + 8u * (s & 3u);
    let a0 = x4(b0);
    let a1 = x4(b0 + 4u);
    let a2 = x4(b0 + 32u);
    let a3 = x4(b0 + 36u);
    let a4 = x4(b0 + 64u);
    let a5 = x4(b0 + 68u);
    let a6 = x4(b0 + 96u);
    let a7 = x4(b0 + 100u);
    let one = vec4<f32>(1.0);
    return XC(array<vec4<f32>, 8>(a0, a1, a2, a3, a4, a5, a6, a7),
              vec4<f32>(dot(a0 + a1, one), dot(a2 + a3, one), dot(a4 + a5, one), dot(a6 + a7, one)));
}

// the x-independent half of chunk_dot: the slice's codes as floats (the v[] order) and scales
struct WC {
    q: array<vec4<f32>, 8>,
    d: f32,
    sc: vec4<f32>,
}

fn chunk_pre(b: u32, s: u32) -> WC {
    let n = s >> 2u;
    let l = 8u * (s & 3u);
    let a = wu2(b + 64u * n + l);
    let c = wu2(b + 64u * n + 32u + l);
    let h = wu2(b + 128u + 32u * n + l);
    let q0 = q6w(a.x, c.x, h.x);
    let q1 = q6w(a.y, c.y, h.y);
    return WC(array<vec4<f32>, 8>(f4u(q0.x), f4u(q1.x), f4u(q0.y), f4u(q1.y), f4u(q0.z), f4u(q1.z), f4u(q0.w), f4u(q1.w)),
              wf16(b + 208u), q6_scales(b, n, l));
}

fn chunk_fin(w: WC, xc: XC) -> f32 {
    let v = vec4<f32>(dot(w.q[0], xc.v[0]) + dot(w.q[1], xc.v[1]), dot(w.q[2], xc.v[2]) + dot(w.q[3], xc.v[3]),
                      dot(w.q[4], xc.v[4]) + dot(w.q[5], xc.v[5]), dot(w.q[6], xc.v[6]) + dot(w.q[7], xc.v[7]));
    return w.d * dot(w.sc, v - 32.0 * xc.s);
}

fn chunk_dot(b: u32, s: u32, xc: XC) -> f32 {
    return chunk_fin(chunk_pre(b, s), xc);
}
#endif

#endif
