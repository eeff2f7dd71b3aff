#if TY_F16
// virtual blocks of 256; chunk s: 4 vec4<u32> of 8 halves at elements 8s + 64j'
fn xmap(s: u32, j: u32) -> u32 {
    return 8u * s + 64u * (j >> 1u) + 4u * (j & 1u);
}

fn h4(a: u32, c: u32) -> vec4<f32> {
    return vec4<f32>(unpack2x16float(a), unpack2x16float(c));
}

fn chunk_w(b: u32, s: u32) -> array<vec4<f32>, 8> {
    let bi = (b >> 4u) + s;
    let u0 = W4[bi];
    let u1 = W4[bi + 8u];
    let u2 = W4[bi + 16u];
    let u3 = W4[bi + 24u];
    return array<vec4<f32>, 8>(h4(u0.x, u0.y), h4(u0.z, u0.w), h4(u1.x, u1.y), h4(u1.z, u1.w),
                               h4(u2.x, u2.y), h4(u2.z, u2.w), h4(u3.x, u3.y), h4(u3.z, u3.w));
}

fn welem(rb: u32, e: u32) -> f32 {
    return wf16(rb + 2u * e);
}
#endif
