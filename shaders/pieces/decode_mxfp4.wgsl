#if TY_MXFP4
// e: E8M0, qs[16] as Q4_0 holding e2m1 nibbles (17 bytes: any alignment)
fn xmap(s: u32, j: u32) -> u32 {
    return 4u * j;
}

fn chunk_w(b: u32, s: u32) -> array<vec4<f32>, 8> {
    let f = mx_scale(wbyte(b));
    let q = wu4(b + 1u);
    return array<vec4<f32>, 8>(e2m1_lo(q.x) * f.x * f.y, e2m1_lo(q.y) * f.x * f.y, e2m1_lo(q.z) * f.x * f.y, e2m1_lo(q.w) * f.x * f.y,
                               e2m1_hi(q.x) * f.x * f.y, e2m1_hi(q.y) * f.x * f.y, e2m1_hi(q.z) * f.x * f.y, e2m1_hi(q.w) * f.x * f.y);
}

#ifndef MMQ
// matvec: 2 lanes per block, lane k = qs bytes 8k..8k+8 (elements 8k.. and 16+8k..)
const MV_CPB = 2u;

struct XC {
    v: array<vec4<f32>, 4>,
}

fn load_xc(xb: u32, k: u32) -> XC {
    return XC(array<vec4<f32>, 4>(x4(xb + 8u * k), x4(xb + 8u * k + 4u), x4(xb + 16u + 8u * k), x4(xb + 20u + 8u * k)));
}

fn chunk_dot(b: u32, k: u32, xc: XC) -> f32 {
    let f = mx_scale(wbyte(b));
    let q = wu2(b + 1u + 8u * k);
    let acc = dot(e2m1_lo(q.x), xc.v[0]) + dot(e2m1_lo(q.y), xc.v[1]) + dot(e2m1_hi(q.x), xc.v[2]) + dot(e2m1_hi(q.y), xc.v[3]);
    return (acc * f.x) * f.y;
}
#endif
#endif
