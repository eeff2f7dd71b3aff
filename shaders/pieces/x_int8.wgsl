// ---- activations ----

// int8 x (Q8X, from quantize_x.wgsl): its two levels' codes and scales as the Q8X matvec
// kernels and decoders read them.
#if Q8X
// the four words (16 codes) h of level lv of two-level x block blk
fn qx(blk: u32, lv: u32, h: u32) -> vec4<u32> {
    return QX[4u * blk + 2u * lv + h];
}

// (d, d₂, Σx̂) of two-level x block blk: the levels' scales and s + s₂ = Σ(d·q + d₂·q₂), what
// the offsets and mins of a block multiply
fn xsc(blk: u32) -> vec3<f32> {
    let a = XS[2u * blk];
    let b = XS[2u * blk + 1u];
    return vec3<f32>(a.x, b.x, a.y + b.y);
}

fn dot16(a: vec4<u32>, b: vec4<u32>) -> i32 {
    return dot4I8Packed(a.x, b.x) + dot4I8Packed(a.y, b.y) + dot4I8Packed(a.z, b.z) + dot4I8Packed(a.w, b.w);
}

// d·i + d₂·i₂: a block's dot from its two levels' integer sums i = (i, i₂) and scales d = (d, d₂)
fn lv2(d: vec2<f32>, i: vec2<i32>) -> f32 {
    return d.x * f32(i.x) + d.y * f32(i.y);
}

// two consecutive x blocks: the slice of the Q4_K / Q5_K lanes (two 32-element sub-blocks)
struct QX2 {
    q: array<vec4<u32>, 4>,   // level 1: block blk (words 0..8), then blk+1
    q2: array<vec4<u32>, 4>,  // level 2, the same
    d: vec4<f32>,             // (d, d₂) of block blk, then of blk+1
    s: vec2<f32>,             // Σx̂ of block blk, of blk+1
}

fn load_qx2(blk: u32) -> QX2 {
    let a = xsc(blk);
    let c = xsc(blk + 1u);
    return QX2(array<vec4<u32>, 4>(qx(blk, 0u, 0u), qx(blk, 0u, 1u), qx(blk + 1u, 0u, 0u), qx(blk + 1u, 0u, 1u)),
               array<vec4<u32>, 4>(qx(blk, 1u, 0u), qx(blk, 1u, 1u), qx(blk + 1u, 1u, 0u), qx(blk + 1u, 1u, 1u)),
               vec4<f32>(a.xy, c.xy), vec2<f32>(a.z, c.z));
}

// both levels' integer sums of a 32-weight sub-block, words w0 (elements 0..16) and w1
// (16..32), against level-1 x words a0, a1 and level-2 ones b0, b1 (array elements picked by
// literal indices at the call)
fn sums2(w0: vec4<u32>, w1: vec4<u32>, a0: vec4<u32>, a1: vec4<u32>, b0: vec4<u32>, b1: vec4<u32>) -> vec2<i32> {
    return vec2<i32>(dot16(w0, a0) + dot16(w1, a1), dot16(w0, b0) + dot16(w1, b1));
}

// sum over two 32-weight sub-blocks of d * sc * q * x̂ - dmin * m * x̂ (scales and mins as
// k4_scales gives them) from the integer sums lo (sub-block 2c, both levels) and hi (2c+1)
fn k_sub2(dm: vec2<f32>, sm: vec4<f32>, lo: vec2<i32>, hi: vec2<i32>, xc: QX2) -> f32 {
    return dm.x * (sm.x * lv2(xc.d.xy, lo) + sm.z * lv2(xc.d.zw, hi)) - dm.y * (sm.y * xc.s.x + sm.w * xc.s.y);
}
#endif
