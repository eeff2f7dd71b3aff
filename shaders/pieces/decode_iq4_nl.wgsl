#if TY_IQ4_NL
// d: f16, qs[16] as Q4_0; value d * kvalues_iq4nl[q]
fn xmap(s: u32, j: u32) -> u32 {
    return 4u * j;
}

fn chunk_w(b: u32, s: u32) -> array<vec4<f32>, 8> {
    let d = wf16(b);
    let q = wu4(b + 2u);
    return array<vec4<f32>, 8>(d * iq4_lo(q.x), d * iq4_lo(q.y), d * iq4_lo(q.z), d * iq4_lo(q.w),
                               d * iq4_hi(q.x), d * iq4_hi(q.y), d * iq4_hi(q.z), d * iq4_hi(q.w));
}
#endif
