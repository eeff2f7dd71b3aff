// Softmax over rows of `dim`: y = exp(s·x − max(s·x)) / Σ exp(s·x − max(s·x)), s = scale.
// One workgroup per row: a max reduction, a sum reduction (f32, per-thread partials then a
// tree), then the normalised write. CPU reference: cpu::ops::softmax.
//
// Defines: INPLACE (y is x: binding 1 read_write, no y binding).
// Bindings: 1 x, 2 y (unless INPLACE). Grid: linear workgroup id = row.

const WG = 256u;

struct Params {
    dim: u32,       // elements per row
    n_rows: u32,
    x_off: u32,     // in elements
    x_stride: u32,  // elements between rows
    y_off: u32,
    y_stride: u32,
    scale: f32,
    _pad0: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
#if INPLACE
@group(0) @binding(1) var<storage, read_write> x: array<f32>;
#else
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read_write> y: array<f32>;
#endif

var<workgroup> red: array<f32, WG>;

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
    let row = wid.x + wid.y * nwg.x;
    if (row >= p.n_rows) { return; }
    let xb = p.x_off + row * p.x_stride;

    var m = -3.4028235e38;
    for (var j = lid; j < p.dim; j += WG) {
        m = max(m, p.scale * x[xb + j]);
    }
    red[lid] = m;
    workgroupBarrier();
    for (var s = WG / 2u; s > 0u; s >>= 1u) {
        if (lid < s) { red[lid] = max(red[lid], red[lid + s]); }
        workgroupBarrier();
    }
    m = red[0];
    workgroupBarrier();

    var sum = 0.0;
    for (var j = lid; j < p.dim; j += WG) {
        sum += exp(p.scale * x[xb + j] - m);
    }
    red[lid] = sum;
    workgroupBarrier();
    for (var s = WG / 2u; s > 0u; s >>= 1u) {
        if (lid < s) { red[lid] += red[lid + s]; }
        workgroupBarrier();
    }
    let inv = 1.0 / red[0];

#if INPLACE
    for (var j = lid; j < p.dim; j += WG) {
        x[xb + j] = exp(p.scale * x[xb + j] - m) * inv;
    }
#else
    let yb = p.y_off + row * p.y_stride;
    for (var j = lid; j < p.dim; j += WG) {
        y[yb + j] = exp(p.scale * x[xb + j] - m) * inv;
    }
#endif
}
