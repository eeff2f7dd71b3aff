#if TY_Q5_1
// d, m: f16, qh: u32, qs[16]; value d * q + m (blocks of 24 bytes: 4-aligned)
fn xmap(s: u32, j: u32) -> u32 {
    return 4u * j;
}

fn chunk_w(b: u32, s: u32) -> array<vec4<f32>, 8> {
    let dm = unpack2x16float(W[b >> 2u]);
    let h = W[(b >> 2u) + 1u];
    let q = wa4(b + 8u);
    let d = dm.x;
    let m = vec4<f32>(dm.y);
    return array<vec4<f32>, 8>(d * q5lo(q.x, h, 0u) + m, d * q5lo(q.y, h, 1u) + m,
                               d * q5lo(q.z, h, 2u) + m, d * q5lo(q.w, h, 3u) + m,
                               d * q5hi(q.x, h, 0u) + m, d * q5hi(q.y, h, 1u) + m,
                               d * q5hi(q.z, h, 2u) + m, d * q5hi(q.w, h, 3u) + m);
}
#endif
