#if TY_Q5_0
// d: f16, qh: u32 (bit e = fifth bit of element e), qs[16] as Q4_0; value d * (q - 16)
fn xmap(s: u32, j: u32) -> u32 {
    return 4u * j;
}

fn chunk_w(b: u32, s: u32) -> array<vec4<f32>, 8> {
    let d = wf16(b);
    let h = wu(b + 2u);
    let q = wu4(b + 6u);
    let o = vec4<f32>(16.0);
    return array<vec4<f32>, 8>(d * (q5lo(q.x, h, 0u) - o), d * (q5lo(q.y, h, 1u) - o),
                               d * (q5lo(q.z, h, 2u) - o), d * (q5lo(q.w, h, 3u) - o),
                               d * (q5hi(q.x, h, 0u) - o), d * (q5hi(q.y, h, 1u) - o),
                               d * (q5hi(q.z, h, 2u) - o), d * (q5hi(q.w, h, 3u) - o));
}
#endif
