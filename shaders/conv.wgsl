// Causal depthwise conv1d + SiLU of the Gated DeltaNet (Qwen3.5), with a per-sequence
// state of the last K-1 inputs. Wrapper and layouts: src/gpu/conv.rs; CPU reference:
// cpu::gdn::conv1d. Binding 0: Params; storage buffers from 1.
// Grid: linear workgroup id = wid.x + wid.y * nwg.x (see gpu::grid), WG threads each.
//
// Defines: WG (threads per workgroup), K (kernel width), DECODE (one token per sequence:
// conv_out rolls the state itself, no conv_state dispatch).

struct Params {
    n_seq: u32,        // sequences in the batch table
    max_tokens: u32,   // tokens of the longest sequence
    conv_dim: u32,     // channels
    x_off: u32,        // in elements: row 0 of x
    x_stride: u32,     // in elements, between token rows of x
    y_off: u32,        // in elements: row 0 of y
    y_stride: u32,     // in elements, between token rows of y
    state_off: u32,    // in elements: slot 0 of the conv-state pool
}

@group(0) @binding(0) var<uniform> p: Params;
// [n_seq][4] u32: (first row, tokens, state slot, first chunk) per sequence.
@group(0) @binding(1) var<storage, read> seqs: array<u32>;
@group(0) @binding(2) var<storage, read> x: array<f32>;            // [rows, x_stride]
@group(0) @binding(3) var<storage, read_write> state: array<f32>;  // [slots, K-1, conv_dim]
#ifdef OUT
@group(0) @binding(4) var<storage, read> w: array<f32>;            // [conv_dim, K]
@group(0) @binding(5) var<storage, read_write> y: array<f32>;      // [rows, y_stride]
#endif

// Input row r of x̃ = state ++ x of sequence (row0, slot): oldest state row first.
fn x_ext(r: i32, ch: u32, row0: u32, slot: u32) -> f32 {
    if (r < 0) {
        return state[p.state_off + (slot * (K - 1u) + u32(r + i32(K) - 1)) * p.conv_dim + ch];
    }
    return x[p.x_off + (row0 + u32(r)) * p.x_stride + ch];
}

#ifdef OUT
// y[t][c] = silu(Σ_j w[c][j] · x̃[t - (K-1) + j][c]): one thread per (sequence, token, channel).
@compute @workgroup_size(WG)
fn conv_out(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
            @builtin(local_invocation_index) lid: u32) {
    let i = (wid.x + wid.y * nwg.x) * WG + lid;
    let per_seq = p.max_tokens * p.conv_dim;
    if (i >= p.n_seq * per_seq) { return; }
    let b = i / per_seq;
    let t = (i % per_seq) / p.conv_dim;
    let ch = i % p.conv_dim;
    let row0 = seqs[b * 4u];
    if (t >= seqs[b * 4u + 1u]) { return; }
    let slot = seqs[b * 4u + 2u];
    var acc = 0.0;
    for (var j = 0u; j < K; j++) {
        acc += w[ch * K + j] * x_ext(i32(t + j) - i32(K) + 1, ch, row0, slot);
    }
    y[p.y_off + (row0 + t) * p.y_stride + ch] = acc / (1.0 + exp(-acc));
#if DECODE
    // One token per sequence (the wrapper's check): this thread is its channel's only reader
    // of the state, so it rolls the state too, as conv_state would (ascending r reads row
    // r + 1 before it is overwritten).
    for (var r = 0u; r + 1u < K; r++) {
        state[p.state_off + (slot * (K - 1u) + r) * p.conv_dim + ch] = x_ext(i32(r) - i32(K) + 2, ch, row0, slot);
    }
#endif
}
#else
// state ← the last K-1 rows of x̃ (after conv_out has read the old state): one thread per
// (sequence, channel); ascending r reads x̃ row n + r ≥ r before it is overwritten.
@compute @workgroup_size(WG)
fn conv_state(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
              @builtin(local_invocation_index) lid: u32) {
    let i = (wid.x + wid.y * nwg.x) * WG + lid;
    if (i >= p.n_seq * p.conv_dim) { return; }
    let b = i / p.conv_dim;
    let ch = i % p.conv_dim;
    let row0 = seqs[b * 4u];
    let n = seqs[b * 4u + 1u];
    let slot = seqs[b * 4u + 2u];
    if (n == 0u) { return; }
    for (var r = 0u; r + 1u < K; r++) {
        let v = x_ext(i32(n + r) - i32(K) + 1, ch, row0, slot);
        state[p.state_off + (slot * (K - 1u) + r) * p.conv_dim + ch] = v;
    }
}
#endif
