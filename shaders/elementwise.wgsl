// Elementwise kernels over f32 vectors. Binding 0: Params; storage buffers from 1.
// Grid: linear workgroup id = wid.x + wid.y * nwg.x (see gpu::grid), WG threads each.

const WG = 256u;

struct Params {
    n: u32,        // elements
    a_off: u32,    // in elements
    b_off: u32,    // in elements
    y_off: u32,    // in elements
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> a: array<f32>;
@group(0) @binding(2) var<storage, read> b: array<f32>;
@group(0) @binding(3) var<storage, read_write> y: array<f32>;

// y = a + b
@compute @workgroup_size(WG)
fn add(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
       @builtin(local_invocation_index) lid: u32) {
    let i = (wid.x + wid.y * nwg.x) * WG + lid;
    if (i >= p.n) { return; }
    y[p.y_off + i] = a[p.a_off + i] + b[p.b_off + i];
}
