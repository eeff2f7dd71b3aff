// Sum over the TPR lanes of each thread group (aligned runs of lanes), lane 0 writes.
#if SUBGROUPS
var<workgroup> red: array<vec4<f32>, WG / 4u>;

fn reduce_store(acc: vec4<f32>, lid: u32, sg_size: u32, sg_lane: u32, row0: u32, ybase: u32) {
    let tl = lid % TPR;
    var v = acc;
    if (TPR <= sg_size) {
        for (var o = 1u; o < TPR; o <<= 1u) {
            v += subgroupShuffleXor(v, o);
        }
        if (tl == 0u) {
            store_rows(row0, ybase, v);
        }
        return;
    }
    v = subgroupAdd(v);
    if (sg_lane == 0u) {
        red[lid / sg_size] = v;
    }
    workgroupBarrier();
    if (tl == 0u) {
        let per = TPR / sg_size;
        let g0 = (lid / TPR) * per;
        var t = vec4<f32>(0.0);
        for (var k = 0u; k < per; k++) {
            t += red[g0 + k];
        }
        store_rows(row0, ybase, t);
    }
}
#else
var<workgroup> red: array<vec4<f32>, WG>;

fn reduce_store(acc: vec4<f32>, lid: u32, row0: u32, ybase: u32) {
    let tl = lid % TPR;
    red[lid] = acc;
    workgroupBarrier();
    for (var o = TPR / 2u; o > 0u; o >>= 1u) {
        if (tl < o) {
            red[lid] += red[lid + o];
        }
        workgroupBarrier();
    }
    if (tl == 0u) {
        store_rows(row0, ybase, red[lid]);
    }
}
#endif
