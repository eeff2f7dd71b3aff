// reduce_store of quads 1..RQ (mq1..mq3, each scaled by f) after quad 0's; the barriers keep
// reduce_store's workgroup memory from being overwritten while it is read.
#if SUBGROUPS
fn store_quads(f: f32, lid: u32, sg_size: u32, sg_lane: u32, row0: u32, ybase: u32) {
    if (RQ > 1u) {
        workgroupBarrier();
        reduce_store(mq1 * f, lid, sg_size, sg_lane, row0 + 4u, ybase);
    }
    if (RQ > 2u) {
        workgroupBarrier();
        reduce_store(mq2 * f, lid, sg_size, sg_lane, row0 + 8u, ybase);
    }
    if (RQ > 3u) {
        workgroupBarrier();
        reduce_store(mq3 * f, lid, sg_size, sg_lane, row0 + 12u, ybase);
    }
}
#else
fn store_quads(f: f32, lid: u32, row0: u32, ybase: u32) {
    if (RQ > 1u) {
        workgroupBarrier();
        reduce_store(mq1 * f, lid, row0 + 4u, ybase);
    }
    if (RQ > 2u) {
        workgroupBarrier();
        reduce_store(mq2 * f, lid, row0 + 8u, ybase);
    }
    if (RQ > 3u) {
        workgroupBarrier();
        reduce_store(mq3 * f, lid, row0 + 12u, ybase);
    }
}
#endif

fn store1(row: u32, ybase: u32, v: f32) {
    if (row < p.rows) {
        let o = ybase + row;
#if EPI_CONV
        if (row < p.pro1) {
            conv_store(o, row, v);
            return;
        }
#endif
#if EPI_SIGROW
        Y[o] = Y[o] + epi_s * v;
#else
#if EPI_NW
        var h = v;
        if (p.accumulate != 0u) {
            h = Y[o] + v;
        }
        Y[o] = h;
        HN[o] = h * NWN[row];
#else
        if (p.accumulate != 0u) {
            Y[o] += v;
        } else {
            Y[o] = v;
        }
#endif
#endif
    }
}

#if EPI_GLU
#if EPI_GEGLU
// elementwise.wgsl's geglu: gelu_tanh(g) · u (its gelu_tanh, the same operations)
fn glu(g: f32, u: f32) -> f32 {
    let t = 0.7978845608028654 * (g + 0.044715 * g * g * g);
    return g / (1.0 + exp(-2.0 * t)) * u;
}
#else
// elementwise.wgsl's swiglu with its limit at f32's largest value
fn glu(g: f32, u: f32) -> f32 {
    let a = 3.40282347e38;
    let gc = min(g, a);
    return gc / (1.0 + exp(-gc)) * clamp(u, -a, a);
}
#endif

// logical rows row0.. hold (gate, up) pairs: y[row0 / 2 + i] = swiglu of pair i
fn store_rows(row0: u32, ybase: u32, v: vec4<f32>) {
    if (row0 < p.rows) {
        Y[ybase + row0 / 2u] = glu(v.x, v.y);
    }
    if (R > 2u && row0 + 2u < p.rows) {
        Y[ybase + row0 / 2u + 1u] = glu(v.z, v.w);
    }
}
#else
fn store_rows(row0: u32, ybase: u32, v: vec4<f32>) {
    store1(row0, ybase, v.x);
    if (R > 1u) {
        store1(row0 + 1u, ybase, v.y);
    }
    if (R > 2u) {
        store1(row0 + 2u, ybase, v.z);
    }
    if (R > 3u) {
        store1(row0 + 3u, ybase, v.w);
    }
}
#endif
