#if TY_Q2_K
// scales[16] (low nibble scale, high nibble min), qs[64], d, dmin (84 bytes: 4-aligned).
// Chunk s: half n = s/4, shift 2(s%4): 32 consecutive elements from the 32 qs bytes of half n;
// value d * sc * q - dmin * m per 16 elements.
fn xmap(s: u32, j: u32) -> u32 {
    return 32u * s + 4u * j;
}

fn chunk_w(b: u32, s: u32) -> array<vec4<f32>, 8> {
    let n = s >> 2u;
    let sh = 2u * (s & 3u);
    let dd = unpack2x16float(W[(b >> 2u) + 20u]);
    let scw = whalf_bits(b + 8u * n + 2u * (s & 3u));
    let s0 = scw & 0xffu;
    let s1 = scw >> 8u;
    let d0 = dd.x * f32(s0 & 15u);
    let m0 = vec4<f32>(dd.y * f32(s0 >> 4u));
    let d1 = dd.x * f32(s1 & 15u);
    let m1 = vec4<f32>(dd.y * f32(s1 >> 4u));
    let qa = (wa4(b + 16u + 32u * n) >> vec4<u32>(sh)) & vec4<u32>(0x03030303u);
    let qb = (wa4(b + 32u + 32u * n) >> vec4<u32>(sh)) & vec4<u32>(0x03030303u);
    return array<vec4<f32>, 8>(d0 * f4u(qa.x) - m0, d0 * f4u(qa.y) - m0, d0 * f4u(qa.z) - m0, d0 * f4u(qa.w) - m0,
                               d1 * f4u(qb.x) - m1, d1 * f4u(qb.y) - m1, d1 * f4u(qb.z) - m1, d1 * f4u(qb.w) - m1);
}
#endif
