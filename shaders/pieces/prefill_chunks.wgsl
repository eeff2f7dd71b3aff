#ifndef Q8X
// ---- chunks of the prefill kernels (matmul.wgsl, matmul_coop.wgsl) ----

// Float rows not 16-byte aligned (FSLOW) or the partial last block: element by element.
fn slow_chunk(blk: u32) -> bool {
#if FSLOW
    return true;
#else
    return blk >= p.nb_full;
#endif
}

// x values of quarter-octet j of chunk s of block blk for the token whose x row is at xrow
fn gather_x(xrow: u32, blk: u32, s: u32, j: u32) -> vec4<f32> {
    let e0 = blk * BS + xmap(s, j);
#if FLOAT
    if (slow_chunk(blk)) {
        var v = vec4<f32>(0.0);
        for (var i = 0u; i < 4u; i++) {
            if (e0 + i < p.cols) {
                v[i] = x1(xrow + e0 + i);
            }
        }
        return v;
    }
#endif
    return x4(xrow + e0);
}

#endif
