#if TY_Q3_K
// hmask[32], qs[64], scales[12], d. Element 128n + 32j + l: low bits (qs[32n + l] >> 2j) & 3,
// high bit (hmask[l] >> (4n + j)) & 1, value d * scale[8n + 2j + l/16] * (low + 4 high - 4).
// Chunk s = (n, j) = (s/4, s%4): 32 consecutive elements.
fn xmap(s: u32, j: u32) -> u32 {
    return 32u * s + 4u * j;
}

// levels of elements 4i..4i+4 of chunk (n, j), offset removed
fn q3v(b: u32, n: u32, j: u32, i: u32) -> vec4<f32> {
    let lo = (wu(b + 32u + 32u * n + 4u * i) >> (2u * j)) & 0x03030303u;
    let hb = ((wu(b + 4u * i) >> (4u * n + j)) & 0x01010101u) << 2u;
    return f4u(lo | hb) - vec4<f32>(4.0);
}

fn chunk_w(b: u32, s: u32) -> array<vec4<f32>, 8> {
    let n = s >> 2u;
    let j = s & 3u;
    let d = wf16(b + 108u);
    let s0 = d * q3k_scale(b + 96u, 8u * n + 2u * j);
    let s1 = d * q3k_scale(b + 96u, 8u * n + 2u * j + 1u);
    return array<vec4<f32>, 8>(s0 * q3v(b, n, j, 0u), s0 * q3v(b, n, j, 1u), s0 * q3v(b, n, j, 2u), s0 * q3v(b, n, j, 3u),
                               s1 * q3v(b, n, j, 4u), s1 * q3v(b, n, j, 5u), s1 * q3v(b, n, j, 6u), s1 * q3v(b, n, j, 7u));
}
#endif
