// ---- matvec ----

// Slice s of the blocks at bytes rb (R rows) dotted with the slice's x values xc.
fn quad_dot(rb: vec4<u32>, s: u32, xc: XC) -> vec4<f32> {
    var acc = vec4<f32>(0.0);
    acc.x = chunk_dot(rb.x, s, xc);
    if (R > 1u) {
        acc.y = chunk_dot(rb.y, s, xc);
    }
    if (R > 2u) {
        acc.z = chunk_dot(rb.z, s, xc);
    }
    if (R > 3u) {
        acc.w = chunk_dot(rb.w, s, xc);
    }
    return acc;
}

// Partial sums of slice c of rows at bytes rb (x of the token at element xbase).
fn mv_step(c: u32, rb: vec4<u32>, xbase: u32) -> vec4<f32> {
    let blk = c / MV_CPB;
    let s = c % MV_CPB;
    let xc = load_xc(xbase + blk * BS, s);
    return quad_dot(rb + vec4<u32>(blk * BB), s, xc);
}

// Bytes of the 4 rows of quad q from row0 (clamped to the last row; their writes are skipped).
fn quad_rb(wbase: u32, row0: u32, q: u32) -> vec4<u32> {
    return vec4<u32>(wbase) + rows_of(row0 + 4u * q) * p.row_bytes;
}

// The stored rows of logical rows l..l+4 (clamped to the last): themselves, or with EPI_GLU
// gate row o for 2o and up row o for 2o + 1.
fn rows_of(l: u32) -> vec4<u32> {
    let r = min(vec4<u32>(l) + vec4<u32>(0u, 1u, 2u, 3u), vec4<u32>(p.rows - 1u));
#if EPI_GLU
    return (r >> vec4<u32>(1u)) + (r & vec4<u32>(1u)) * (p.rows / 2u);
#else
    return r;
#endif
}

// Quads 1..RQ of mv_partial's rows (rows row0 + 4q..): with RQ > 1 each slice's x values are
// loaded once for 4 RQ rows, so the x traffic per weight byte falls by RQ. Each row's sum is
// the same expression in the same slice order whatever RQ, so RQ never changes a row's bits.
var<private> mq1: vec4<f32>;
var<private> mq2: vec4<f32>;
var<private> mq3: vec4<f32>;

// Per-lane partial sums of rows row0..row0+R (clamped to the last row; their writes are
// skipped) over the lane's slices, and with RQ > 1 those of the next quads in mq1..mq3.
// wbase: byte of row 0 in W; xbase: element of the token's x.
fn mv_partial(row0: u32, tl: u32, wbase: u32, xbase: u32) -> vec4<f32> {
    var acc = vec4<f32>(0.0);
    let rb = quad_rb(wbase, row0, 0u);
#if FSLOW
    // float rows not 16-byte aligned or not a multiple of 256 elements: element by element
    for (var e = tl; e < p.cols; e += TPR) {
        let xe = x1(xbase + e);
        acc.x += welem(rb.x, e) * xe;
        if (R > 1u) {
            acc.y += welem(rb.y, e) * xe;
        }
        if (R > 2u) {
            acc.z += welem(rb.z, e) * xe;
        }
        if (R > 3u) {
            acc.w += welem(rb.w, e) * xe;
        }
    }
#else
    let n_items = ((p.cols + BS - 1u) / BS) * MV_CPB;
    mq1 = vec4<f32>(0.0);
    mq2 = vec4<f32>(0.0);
    mq3 = vec4<f32>(0.0);
    let rb1 = quad_rb(wbase, row0, 1u);
    let rb2 = quad_rb(wbase, row0, 2u);
    let rb3 = quad_rb(wbase, row0, 3u);
    for (var c = tl; c < n_items; c += TPR) {
        let blk = c / MV_CPB;
        let s = c % MV_CPB;
        let boff = vec4<u32>(blk * BB);
        let xc = load_xc(xbase + blk * BS, s);
        acc += quad_dot(rb + boff, s, xc);
        if (RQ > 1u) {
            mq1 += quad_dot(rb1 + boff, s, xc);
        }
        if (RQ > 2u) {
            mq2 += quad_dot(rb2 + boff, s, xc);
        }
        if (RQ > 3u) {
            mq3 += quad_dot(rb3 + boff, s, xc);
        }
    }
#endif
    return acc;
}
