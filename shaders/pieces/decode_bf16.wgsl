#if TY_BF16
fn xmap(s: u32, j: u32) -> u32 {
    return 8u * s + 64u * (j >> 1u) + 4u * (j & 1u);
}

fn b4(a: u32, c: u32) -> vec4<f32> {
    return vec4<f32>(bf16_lo(a), bf16_hi(a), bf16_lo(c), bf16_hi(c));
}

fn chunk_w(b: u32, s: u32) -> array<vec4<f32>, 8> {
    let bi = (b >> 4u) + s;
    let u0 = W4[bi];
    let u1 = W4[bi + 8u];
    let u2 = W4[bi + 16u];
    let u3 = W4[bi + 24u];
    return array<vec4<f32>, 8>(b4(u0.x, u0.y), b4(u0.z, u0.w), b4(u1.x, u1.y), b4(u1.z, u1.w),
                               b4(u2.x, u2.y), b4(u2.z, u2.w), b4(u3.x, u3.y), b4(u3.z, u3.w));
}

fn welem(rb: u32, e: u32) -> f32 {
    return bitcast<f32>(whalf_bits(rb + 2u * e) << 16u);
}
#endif
