// Activations to two-level int8 blocks for the int8 products (Q8X matvec, matmul_q8.wgsl);
// the scheme is in matvec.wgsl's header.

// x rows (f32) to int8 blocks of 32, ggml's quantize_row_q8_1: d = max|x| / 127, q = round(x / d)
// as x * (1 / d) (WGSL round: ties to even, where ggml's roundf rounds them away from zero), and
// s = d * sum(q) for the types with an offset or min. One thread per block; a token's x is a few
// thousand values, so this kernel is tiny next to the product.
struct QParams {
    n_blocks: u32, // blocks per token row (cols / 32)
    n_tokens: u32,
    x_off: u32,    // in elements: x of token 0
    x_stride: u32, // in elements: between tokens' x rows
}

@group(0) @binding(0) var<uniform> qp: QParams;
@group(0) @binding(1) var<storage, read> XIN: array<f32>;
// [n_tokens, n_blocks, 2] vec4: the 32 codes of a block, 4 per word, little-endian
@group(0) @binding(2) var<storage, read_write> QOUT: array<vec4<u32>>;
// [n_tokens, n_blocks]: (d, d * sum q)
@group(0) @binding(3) var<storage, read_write> SOUT: array<vec2<f32>>;

fn xin4(e: u32) -> vec4<f32> {
    return vec4<f32>(XIN[e], XIN[e + 1u], XIN[e + 2u], XIN[e + 3u]);
}

fn amax4(v: vec4<f32>) -> f32 {
    let a = abs(v);
    return max(max(a.x, a.y), max(a.z, a.w));
}

fn hsum4(v: vec4<i32>) -> i32 {
    return v.x + v.y + v.z + v.w;
}

@compute @workgroup_size(64)
fn quantize_x(@builtin(global_invocation_id) gid: vec3<u32>) {
    let blk = gid.x;
    let t = gid.y;
    if (blk >= qp.n_blocks || t >= qp.n_tokens) {
        return;
    }
    let e = qp.x_off + t * qp.x_stride + 32u * blk;
    let v0 = xin4(e);
    let v1 = xin4(e + 4u);
    let v2 = xin4(e + 8u);
    let v3 = xin4(e + 12u);
    let v4 = xin4(e + 16u);
    let v5 = xin4(e + 20u);
    let v6 = xin4(e + 24u);
    let v7 = xin4(e + 28u);
    let amax = max(max(max(amax4(v0), amax4(v1)), max(amax4(v2), amax4(v3))),
                   max(max(amax4(v4), amax4(v5)), max(amax4(v6), amax4(v7))));
    let d = amax / 127.0;
    let id = select(0.0, 1.0 / d, d > 0.0);
    let q0 = vec4<i32>(round(v0 * id));
    let q1 = vec4<i32>(round(v1 * id));
    let q2 = vec4<i32>(round(v2 * id));
    let q3 = vec4<i32>(round(v3 * id));
    let q4 = vec4<i32>(round(v4 * id));
    let q5 = vec4<i32>(round(v5 * id));
    let q6 = vec4<i32>(round(v6 * id));
    let q7 = vec4<i32>(round(v7 * id));
    let o = t * qp.n_blocks + blk;
    let sum = hsum4(q0 + q1 + q2 + q3) + hsum4(q4 + q5 + q6 + q7);
#if X2
    // X2: a second level for the residual r = x − d·q (|r| ≤ d/2), quantized the same way, so
    // x̂ = d·q + d₂·q₂ is within d₂/2 ≤ max|x| / 508 / 127 of x. Block o holds both levels:
    // codes at 4o (level 1) and 4o + 2, scales at 2o and 2o + 1.
    let r0 = v0 - d * vec4<f32>(q0);
    let r1 = v1 - d * vec4<f32>(q1);
    let r2 = v2 - d * vec4<f32>(q2);
    let r3 = v3 - d * vec4<f32>(q3);
    let r4 = v4 - d * vec4<f32>(q4);
    let r5 = v5 - d * vec4<f32>(q5);
    let r6 = v6 - d * vec4<f32>(q6);
    let r7 = v7 - d * vec4<f32>(q7);
    let rmax = max(max(max(amax4(r0), amax4(r1)), max(amax4(r2), amax4(r3))),
                   max(max(amax4(r4), amax4(r5)), max(amax4(r6), amax4(r7))));
    let d2 = rmax / 127.0;
    let id2 = select(0.0, 1.0 / d2, d2 > 0.0);
    let p0 = vec4<i32>(round(r0 * id2));
    let p1 = vec4<i32>(round(r1 * id2));
    let p2 = vec4<i32>(round(r2 * id2));
    let p3 = vec4<i32>(round(r3 * id2));
    let p4 = vec4<i32>(round(r4 * id2));
    let p5 = vec4<i32>(round(r5 * id2));
    let p6 = vec4<i32>(round(r6 * id2));
    let p7 = vec4<i32>(round(r7 * id2));
    QOUT[4u * o] = vec4<u32>(pack4xI8(q0), pack4xI8(q1), pack4xI8(q2), pack4xI8(q3));
    QOUT[4u * o + 1u] = vec4<u32>(pack4xI8(q4), pack4xI8(q5), pack4xI8(q6), pack4xI8(q7));
    QOUT[4u * o + 2u] = vec4<u32>(pack4xI8(p0), pack4xI8(p1), pack4xI8(p2), pack4xI8(p3));
    QOUT[4u * o + 3u] = vec4<u32>(pack4xI8(p4), pack4xI8(p5), pack4xI8(p6), pack4xI8(p7));
    let sum2 = hsum4(p0 + p1 + p2 + p3) + hsum4(p4 + p5 + p6 + p7);
    SOUT[2u * o] = vec2<f32>(d, d * f32(sum));
    SOUT[2u * o + 1u] = vec2<f32>(d2, d2 * f32(sum2));
#else
    QOUT[2u * o] = vec4<u32>(pack4xI8(q0), pack4xI8(q1), pack4xI8(q2), pack4xI8(q3));
    QOUT[2u * o + 1u] = vec4<u32>(pack4xI8(q4), pack4xI8(q5), pack4xI8(q6), pack4xI8(q7));
    SOUT[o] = vec2<f32>(d, d * f32(sum));
#endif
}
