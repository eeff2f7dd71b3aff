#if TY_IQ4_XS
// d: f16, scales_h: u16, scales_l[4], qs[128] (136 bytes: 8-aligned); chunk s = sub-block s
// (its 16 qs bytes as IQ4_NL); value d * (ls - 32) * kvalues_iq4nl[q]
fn xmap(s: u32, j: u32) -> u32 {
    return 32u * s + 4u * j;
}

fn chunk_w(b: u32, s: u32) -> array<vec4<f32>, 8> {
    let w0 = W[b >> 2u];
    let d = unpack2x16float(w0).x;
    let sh = w0 >> 16u;
    let sl = wbyte(b + 4u + (s >> 1u));
    let ls = ((sl >> (4u * (s & 1u))) & 15u) | (((sh >> (2u * s)) & 3u) << 4u);
    let dl = d * f32(i32(ls) - 32);
    let q = wa4(b + 8u + 16u * s);
    return array<vec4<f32>, 8>(dl * iq4_lo(q.x), dl * iq4_lo(q.y), dl * iq4_lo(q.z), dl * iq4_lo(q.w),
                               dl * iq4_hi(q.x), dl * iq4_hi(q.y), dl * iq4_hi(q.z), dl * iq4_hi(q.w));
}
#endif
