#if TY_F32
// virtual blocks of 256 elements; chunk s, vec4 j = elements 4s + 32j (8 lanes cover 128
// contiguous bytes per load)
fn xmap(s: u32, j: u32) -> u32 {
    return 4u * s + 32u * j;
}

fn wv(bi: u32) -> vec4<f32> {
    return bitcast<vec4<f32>>(W4[bi]);
}

fn chunk_w(b: u32, s: u32) -> array<vec4<f32>, 8> {
    let bi = (b >> 4u) + s;
    return array<vec4<f32>, 8>(wv(bi), wv(bi + 8u), wv(bi + 16u), wv(bi + 24u),
                               wv(bi + 32u), wv(bi + 40u), wv(bi + 48u), wv(bi + 56u));
}

fn welem(rb: u32, e: u32) -> f32 {
    return bitcast<f32>(W[(rb >> 2u) + e]);
}
#endif
