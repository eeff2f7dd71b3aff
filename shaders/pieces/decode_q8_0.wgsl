#if TY_Q8_0
// d: f16, qs: 32 x i8; value d * q
fn xmap(s: u32, j: u32) -> u32 {
    return 4u * j;
}

fn chunk_w(b: u32, s: u32) -> array<vec4<f32>, 8> {
    let d = wf16(b);
    let q0 = wu4(b + 2u);
    let q1 = wu4(b + 18u);
    return array<vec4<f32>, 8>(d * f4i(q0.x), d * f4i(q0.y), d * f4i(q0.z), d * f4i(q0.w),
                               d * f4i(q1.x), d * f4i(q1.y), d * f4i(q1.z), d * f4i(q1.w));
}

#if Q8X
// matvec, int8 x: 2 lanes per block, lane k = codes 16k..16k+16 (one 5-word read) against x
// words 4k..4k+4 of both levels
const MV_CPB = 2u;

struct XC {
    q: vec4<u32>,
    q2: vec4<u32>,
    d: vec2<f32>,   // d, d₂
}

fn load_xc(xe: u32, k: u32) -> XC {
    let blk = xe / 32u;
    return XC(qx(blk, 0u, k), qx(blk, 1u, k), xsc(blk).xy);
}

fn chunk_dot(b: u32, k: u32, xc: XC) -> f32 {
    let w = wu4(b + 2u + 16u * k);
    return wf16(b) * lv2(xc.d, vec2<i32>(dot16(w, xc.q), dot16(w, xc.q2)));
}
#else
// matvec: 2 lanes per block, lane k = qs bytes 16k..16k+16 (one 5-word read)
const MV_CPB = 2u;

struct XC {
    v: array<vec4<f32>, 4>,
}

fn load_xc(xb: u32, k: u32) -> XC {
    let b0 = xb + 16u * k;
    return XC(array<vec4<f32>, 4>(x4(b0), x4(b0 + 4u), x4(b0 + 8u), x4(b0 + 12u)));
}

// the x-independent half of chunk_dot: the slice's codes as floats and the block scale
struct WC {
    q: array<vec4<f32>, 4>,
    d: f32,
}

fn chunk_pre(b: u32, k: u32) -> WC {
    let q = wu4(b + 2u + 16u * k);
    return WC(array<vec4<f32>, 4>(f4i(q.x), f4i(q.y), f4i(q.z), f4i(q.w)), wf16(b));
}

fn chunk_fin(w: WC, xc: XC) -> f32 {
    return w.d * (dot(w.q[0], xc.v[0]) + dot(w.q[1], xc.v[1]) + dot(w.q[2], xc.v[2]) + dot(w.q[3], xc.v[3]));
}

fn chunk_dot(b: u32, k: u32, xc: XC) -> f32 {
    return chunk_fin(chunk_pre(b, k), xc);
}
#endif

#endif
