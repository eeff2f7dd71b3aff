#if MV32
#ifndef MMQ
// matvec over matmul's chunks: one lane per 32-weight chunk, chunk_w dotted with x
const MV_CPB = CPB;

struct XC {
    v: array<vec4<f32>, 8>,
}

fn load_xc(xb: u32, s: u32) -> XC {
    return XC(array<vec4<f32>, 8>(x4(xb + xmap(s, 0u)), x4(xb + xmap(s, 1u)), x4(xb + xmap(s, 2u)), x4(xb + xmap(s, 3u)),
                                  x4(xb + xmap(s, 4u)), x4(xb + xmap(s, 5u)), x4(xb + xmap(s, 6u)), x4(xb + xmap(s, 7u))));
}

fn chunk_dot(b: u32, s: u32, xc: XC) -> f32 {
    let w = chunk_w(b, s);
    return dot(w[0], xc.v[0]) + dot(w[1], xc.v[1]) + dot(w[2], xc.v[2]) + dot(w[3], xc.v[3])
         + dot(w[4], xc.v[4]) + dot(w[5], xc.v[5]) + dot(w[6], xc.v[6]) + dot(w[7], xc.v[7]);
}
#endif
#endif
