#if TY_Q4_1
// d, m: f16, qs[16] as Q4_0; value d * q + m (blocks of 20 bytes: 4-aligned)
fn xmap(s: u32, j: u32) -> u32 {
    return 4u * j;
}

fn chunk_w(b: u32, s: u32) -> array<vec4<f32>, 8> {
    let dm = unpack2x16float(W[b >> 2u]);
    let q = wa4(b + 4u);
    let d = dm.x;
    let m = vec4<f32>(dm.y);
    return array<vec4<f32>, 8>(d * lo4(q.x) + m, d * lo4(q.y) + m, d * lo4(q.z) + m, d * lo4(q.w) + m,
                               d * hi4(q.x) + m, d * hi4(q.y) + m, d * hi4(q.z) + m, d * hi4(q.w) + m);
}
#endif
