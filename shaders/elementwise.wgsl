// Elementwise kernels over f32 rows. Binding 0: Params; storage buffers from 1.
//
// Every op works on an [n_rows, n_cols] view: operand o's element (r, c) is
// o[o_off + r * o_stride + c]; a "row scalar" operand reads o[o_off + r * o_stride] for the
// whole row (MoE combine weights, shared-expert gates). One thread per element.
//
// Bindings are y (1), a (2), b (3). Each entry point uses a prefix of them (y; y, a; or
// y, a, b), so the auto layout of any entry is contiguous and the wrapper passes exactly those.
// In-place ops read y too: wgpu forbids binding one buffer both read-only and writable in a
// dispatch, so an update of a buffer by itself must be one of the `*_inplace` / `acc` entries.
//
// Grid: linear workgroup id = wid.x + wid.y * nwg.x (see gpu::grid), WG threads each.

const WG = 256u;

struct Params {
    n_cols: u32,    // elements per row
    n_rows: u32,
    y_off: u32,     // in elements
    y_stride: u32,  // elements between rows
    a_off: u32,
    a_stride: u32,
    b_off: u32,
    b_stride: u32,
    alpha: f32,     // scale for `scale*`, clamp limit for `swiglu` (f32::MAX: none), cap of `softcap_inplace`
    k: u32,         // slots of `moe_combine`
    _pad1: u32,
    _pad2: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> y: array<f32>;
@group(0) @binding(2) var<storage, read> a: array<f32>;
@group(0) @binding(3) var<storage, read> b: array<f32>;

// (row, col) of this thread's element, or row == n_rows when past the end.
fn coord(wid: vec3<u32>, nwg: vec3<u32>, lid: u32) -> vec2<u32> {
    let i = (wid.x + wid.y * nwg.x) * WG + lid;
    let r = i / p.n_cols;
    return vec2<u32>(r, i - r * p.n_cols);
}

fn yi(rc: vec2<u32>) -> u32 { return p.y_off + rc.x * p.y_stride + rc.y; }
fn ai(rc: vec2<u32>) -> u32 { return p.a_off + rc.x * p.a_stride + rc.y; }
fn bi(rc: vec2<u32>) -> u32 { return p.b_off + rc.x * p.b_stride + rc.y; }
fn a_row(rc: vec2<u32>) -> f32 { return a[p.a_off + rc.x * p.a_stride]; }
fn b_row(rc: vec2<u32>) -> f32 { return b[p.b_off + rc.x * p.b_stride]; }

// x / (1 + e^-x): exp overflows to +inf for very negative x and the quotient is -0, as wanted.
fn silu(x: f32) -> f32 { return x / (1.0 + exp(-x)); }
fn sigmoid(x: f32) -> f32 { return 1.0 / (1.0 + exp(-x)); }
// tanh through exp of a clamped argument: tanh(±10) is ±1 in f32, and a backend's tanh of a
// large argument may be exp(2x) overflowing to inf/inf = NaN.
fn tanh_safe(x: f32) -> f32 {
    let e = exp(2.0 * clamp(x, -10.0, 10.0));
    return (e - 1.0) / (e + 1.0);
}
// GELU, tanh approximation (PyTorch's gelu(approximate="tanh"), HF "gelu_pytorch_tanh"):
// x/2 · (1 + tanh(u)) written as x · sigmoid(2u), which has no 1 + tanh ≈ 0 cancellation in
// the negative tail.
fn gelu_tanh(x: f32) -> f32 {
    let u = 0.7978845608028654 * (x + 0.044715 * x * x * x);
    return x / (1.0 + exp(-2.0 * u));
}

// y = a + b
@compute @workgroup_size(WG)
fn add(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
       @builtin(local_invocation_index) lid: u32) {
    let rc = coord(wid, nwg, lid);
    if (rc.x >= p.n_rows) { return; }
    y[yi(rc)] = a[ai(rc)] + b[bi(rc)];
}

// y = a * b
@compute @workgroup_size(WG)
fn mul(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
       @builtin(local_invocation_index) lid: u32) {
    let rc = coord(wid, nwg, lid);
    if (rc.x >= p.n_rows) { return; }
    y[yi(rc)] = a[ai(rc)] * b[bi(rc)];
}

// y = alpha * a
@compute @workgroup_size(WG)
fn scale(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
         @builtin(local_invocation_index) lid: u32) {
    let rc = coord(wid, nwg, lid);
    if (rc.x >= p.n_rows) { return; }
    y[yi(rc)] = p.alpha * a[ai(rc)];
}

// y = a
@compute @workgroup_size(WG)
fn copy(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
    let rc = coord(wid, nwg, lid);
    if (rc.x >= p.n_rows) { return; }
    y[yi(rc)] = a[ai(rc)];
}

// y = silu(a)
@compute @workgroup_size(WG)
fn silu_op(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
           @builtin(local_invocation_index) lid: u32) {
    let rc = coord(wid, nwg, lid);
    if (rc.x >= p.n_rows) { return; }
    y[yi(rc)] = silu(a[ai(rc)]);
}

// y = sigmoid(a)
@compute @workgroup_size(WG)
fn sigmoid_op(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
              @builtin(local_invocation_index) lid: u32) {
    let rc = coord(wid, nwg, lid);
    if (rc.x >= p.n_rows) { return; }
    y[yi(rc)] = sigmoid(a[ai(rc)]);
}

// y = silu(min(a, alpha)) * clamp(b, -alpha, alpha): SwiGLU with gate a, up b and
// DeepSeek-V4's clamps (alpha = f32::MAX leaves finite values alone).
@compute @workgroup_size(WG)
fn swiglu(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
          @builtin(local_invocation_index) lid: u32) {
    let rc = coord(wid, nwg, lid);
    if (rc.x >= p.n_rows) { return; }
    let g = min(a[ai(rc)], p.alpha);
    let u = clamp(b[bi(rc)], -p.alpha, p.alpha);
    y[yi(rc)] = silu(g) * u;
}

// y = min(silu(a), alpha) * clamp(b, -alpha, alpha): Step-3.5/3.7's clamped SwiGLU, the
// limit applied to SiLU's output (transformers' Step3p7MLP, llama.cpp's `ffn_silu_clamped`).
@compute @workgroup_size(WG)
fn swiglu_act_clamp(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                    @builtin(local_invocation_index) lid: u32) {
    let rc = coord(wid, nwg, lid);
    if (rc.x >= p.n_rows) { return; }
    let u = clamp(b[bi(rc)], -p.alpha, p.alpha);
    y[yi(rc)] = min(silu(a[ai(rc)]), p.alpha) * u;
}

// y = gelu_tanh(a) * b: GeGLU with gate a, up b (Gemma's FFN).
@compute @workgroup_size(WG)
fn geglu(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
         @builtin(local_invocation_index) lid: u32) {
    let rc = coord(wid, nwg, lid);
    if (rc.x >= p.n_rows) { return; }
    y[yi(rc)] = gelu_tanh(a[ai(rc)]) * b[bi(rc)];
}

// y = alpha * tanh(y / alpha): logit softcapping (Gemma's final_logit_softcapping).
@compute @workgroup_size(WG)
fn softcap_inplace(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                   @builtin(local_invocation_index) lid: u32) {
    let rc = coord(wid, nwg, lid);
    if (rc.x >= p.n_rows) { return; }
    let i = yi(rc);
    y[i] = p.alpha * tanh_safe(y[i] / p.alpha);
}

// y = sigmoid(a) * b  (gate a, value b)
@compute @workgroup_size(WG)
fn sigmoid_mul(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
               @builtin(local_invocation_index) lid: u32) {
    let rc = coord(wid, nwg, lid);
    if (rc.x >= p.n_rows) { return; }
    y[yi(rc)] = sigmoid(a[ai(rc)]) * b[bi(rc)];
}

// y = sigmoid(b[row]) * a  (one gate per row: Qwen's shared-expert gate)
@compute @workgroup_size(WG)
fn sigmoid_mul_row(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                   @builtin(local_invocation_index) lid: u32) {
    let rc = coord(wid, nwg, lid);
    if (rc.x >= p.n_rows) { return; }
    y[yi(rc)] = sigmoid(b_row(rc)) * a[ai(rc)];
}

// y += a
@compute @workgroup_size(WG)
fn add_inplace(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
               @builtin(local_invocation_index) lid: u32) {
    let rc = coord(wid, nwg, lid);
    if (rc.x >= p.n_rows) { return; }
    let i = yi(rc);
    y[i] = y[i] + a[ai(rc)];
}

// y *= a
@compute @workgroup_size(WG)
fn mul_inplace(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
               @builtin(local_invocation_index) lid: u32) {
    let rc = coord(wid, nwg, lid);
    if (rc.x >= p.n_rows) { return; }
    let i = yi(rc);
    y[i] = y[i] * a[ai(rc)];
}

// y *= alpha
@compute @workgroup_size(WG)
fn scale_inplace(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                 @builtin(local_invocation_index) lid: u32) {
    let rc = coord(wid, nwg, lid);
    if (rc.x >= p.n_rows) { return; }
    let i = yi(rc);
    y[i] = p.alpha * y[i];
}

// y *= sigmoid(a)  (Qwen3.5 gated attention: attn · sigmoid(gate))
@compute @workgroup_size(WG)
fn sigmoid_mul_inplace(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                       @builtin(local_invocation_index) lid: u32) {
    let rc = coord(wid, nwg, lid);
    if (rc.x >= p.n_rows) { return; }
    let i = yi(rc);
    y[i] = sigmoid(a[ai(rc)]) * y[i];
}

// y *= sigmoid(a[row])
@compute @workgroup_size(WG)
fn sigmoid_mul_row_inplace(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                           @builtin(local_invocation_index) lid: u32) {
    let rc = coord(wid, nwg, lid);
    if (rc.x >= p.n_rows) { return; }
    let i = yi(rc);
    y[i] = sigmoid(a_row(rc)) * y[i];
}

// y += b[row] * a  (MoE combine: one routing weight per row)
@compute @workgroup_size(WG)
fn axpy_row(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
            @builtin(local_invocation_index) lid: u32) {
    let rc = coord(wid, nwg, lid);
    if (rc.x >= p.n_rows) { return; }
    let i = yi(rc);
    y[i] = y[i] + b_row(rc) * a[ai(rc)];
}

// y += sum over s < k of b[row, s] * a[row, slot s]: the MoE combine of all k expert slots in
// one dispatch, summed in slot order as k `axpy_row` dispatches would. Slot s of row r starts
// at a_off + r * a_stride + s * n_cols; its weight is b[b_off + r * b_stride + s].
@compute @workgroup_size(WG)
fn moe_combine(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
               @builtin(local_invocation_index) lid: u32) {
    let rc = coord(wid, nwg, lid);
    if (rc.x >= p.n_rows) { return; }
    let i = yi(rc);
    let wr = p.b_off + rc.x * p.b_stride;
    var acc = y[i];
    for (var s = 0u; s < p.k; s = s + 1u) {
        acc = acc + b[wr + s] * a[ai(rc) + s * p.n_cols];
    }
    y[i] = acc;
}
