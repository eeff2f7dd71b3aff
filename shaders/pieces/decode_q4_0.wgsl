#if TY_Q4_0
// d: f16, qs[16]: byte j = element j (low nibble) and j+16 (high); value d * (q - 8)
fn xmap(s: u32, j: u32) -> u32 {
    return 4u * j;
}

fn chunk_w(b: u32, s: u32) -> array<vec4<f32>, 8> {
    let d = wf16(b);
    let q = wu4(b + 2u);
    let o = vec4<f32>(8.0);
    return array<vec4<f32>, 8>(d * (lo4(q.x) - o), d * (lo4(q.y) - o), d * (lo4(q.z) - o), d * (lo4(q.w) - o),
                               d * (hi4(q.x) - o), d * (hi4(q.y) - o), d * (hi4(q.z) - o), d * (hi4(q.w) - o));
}

#if Q8X
// matvec, int8 x: 2 lanes per block, lane k = qs bytes 8k..8k+8: low nibbles = elements 8k..
// (x words 2k, 2k+1), high = 16+8k.. (x words 4+2k, 5+2k), against both levels. The -8 offset
// of the whole block is -8 Σx̂, taken by lane 0 alone.
const MV_CPB = 2u;

struct XC {
    q: vec4<u32>,   // level-1 x words of the low nibbles (.xy) and of the high ones (.zw)
    q2: vec4<u32>,  // level 2, the same
    d: vec3<f32>,   // d, d₂, and Σx̂ for lane 0 (0 for lane 1)
}

fn load_xc(xe: u32, k: u32) -> XC {
    let blk = xe / 32u;
    let h = k == 1u;
    let u = qx(blk, 0u, 0u);
    let v = qx(blk, 0u, 1u);
    let u2 = qx(blk, 1u, 0u);
    let v2 = qx(blk, 1u, 1u);
    let sc = xsc(blk);
    return XC(vec4<u32>(select(u.xy, u.zw, h), select(v.xy, v.zw, h)),
              vec4<u32>(select(u2.xy, u2.zw, h), select(v2.xy, v2.zw, h)), vec3<f32>(sc.xy, select(sc.z, 0.0, h)));
}

fn chunk_dot(b: u32, k: u32, xc: XC) -> f32 {
    let q = wu2(b + 2u + 8u * k);
    let w = vec4<u32>(q.x & M4, q.y & M4, (q.x >> 4u) & M4, (q.y >> 4u) & M4);
    return wf16(b) * (lv2(xc.d.xy, vec2<i32>(dot16(w, xc.q), dot16(w, xc.q2))) - 8.0 * xc.d.z);
}
#else
// matvec: 2 lanes per block, lane k = qs bytes 8k..8k+8 (elements 8k.. and 16+8k..)
const MV_CPB = 2u;

struct XC {
    v: array<vec4<f32>, 4>,
    s: f32,
}

fn load_xc(xb: u32, k: u32) -> XC {
    let a = x4(xb + 8u * k);
    let c = x4(xb + 8u * k + 4u);
    let e = x4(xb + 16u + 8u * k);
    let f = x4(xb + 20u + 8u * k);
    return XC(array<vec4<f32>, 4>(a, c, e, f), dot(a + c + e + f, vec4<f32>(1.0)));
}

fn chunk_dot(b: u32, k: u32, xc: XC) -> f32 {
    let q = wu2(b + 2u + 8u * k);
    let acc = dot(lo4(q.x), xc.v[0]) + dot(lo4(q.y), xc.v[1]) + dot(ghi4(q.x), xc.v[2]) + dot(ghi4(q.y), xc.v[3]);
    return wf16(b) * (acc - 8.0 * xc.s);
}
#endif
#endif
