// The products' uniforms (Params) and bindings 0..4: the weight part as words (W) and as
// 16-byte vectors (W4), x as f32 (X) or int8 codes and scales (QX, XS, with Q8X), y (Y); the
// split's consts where a family sets none. Included by matvec.wgsl and the matmul families.

#ifndef QT
const QT = 0u;          // ggml type id of the weights
const BS = 256u;        // elements per (virtual) block
const BB = 1024u;       // bytes per (virtual) block
#endif
#ifndef R
const R = 2u;           // rows per thread group (1..4)
const TPR = 64u;        // lanes per thread group (power of two)
const WG = 64u;         // threads per workgroup (multiple of TPR)
#endif

#ifndef RQ
const RQ = 1u;          // quads of 4 rows per thread group (1..4; above 1 only with R = 4)
#endif
const ROWS = R * RQ;    // rows per thread group of `matvec` / `matvec_id`

const CPB = BS / 32u;   // matmul chunks per block
const GPW = WG / TPR;   // thread groups per workgroup

struct Params {
    rows: u32,         // rows of this dispatch (of one part; of one expert for the _id kernels)
    cols: u32,         // elements per row
    row_bytes: u32,    // bytes per stored row
    n_chunks: u32,     // matmul: 32-weight chunks per row (matvec counts its slices itself)
    nb_full: u32,      // complete (virtual) blocks per row (float rows may end in a partial one)
    x_off: u32,        // in elements: x of token 0
    x_stride: u32,     // in elements: between tokens' (or pairs') x rows
    y_off: u32,        // in elements: y[token 0][row 0 of this dispatch]
    y_stride: u32,     // in elements: between tokens' (or pairs') y rows
    accumulate: u32,   // 1: y += W x, 0: y = W x
    n_used: u32,       // expert slots per token (ids row length)
    ids_off: u32,      // in elements: ids[0][0] (matvec_id)
    e_lo: u32,         // first expert held by the bound part
    e_n: u32,          // experts in the bound part
    expert_bytes: u32, // bytes per expert matrix
    x_per_pair: u32,   // 1: x row per (token, slot) pair, 0: per token (shared by its slots)
    pair_off: u32,     // matvec_id: first pair of this dispatch
    n_tokens: u32,     // matmul: tokens in X / Y; matmul_id: (token, slot) pairs
    n_expert: u32,     // matmul_id: experts of the whole stack (route layout)
    tiles_off: u32,    // matmul_id: word of the route's tile list
    pairs_off: u32,    // matmul_id: word of the route's grouped pairs
    pro0: u32,         // prologue word 0 (PRO_*: see "activations" below)
    pro1: u32,         // prologue word 1
    pro2: u32,         // prologue word 2
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> W: array<u32>;
@group(0) @binding(2) var<storage, read> W4: array<vec4<u32>>;
#if Q8X
// int8 x from quantize_x (matvec: with X2): codes [rows, blocks of 32, levels, 2] (vec4 of 16
// codes), scales [rows, blocks, levels] (d, d * sum q); matvec_id's ids move to binding 6
@group(0) @binding(3) var<storage, read> QX: array<vec4<u32>>;
@group(0) @binding(5) var<storage, read> XS: array<vec2<f32>>;
#else
#if XVEC
@group(0) @binding(3) var<storage, read> X: array<vec4<f32>>;
#else
@group(0) @binding(3) var<storage, read> X: array<f32>;
#endif
#endif
@group(0) @binding(4) var<storage, read_write> Y: array<f32>;

// Every entry point calls this so its layout has bindings 1 and 2 whatever the type reads (the
// wrapper always binds the weight part to both; wgpu drops bindings an entry point never reads).
// The wrapper never dispatches 0 rows, so the loads never run.
fn no_rows() -> bool {
    return p.rows == 0u && W[0] == W4[0].x;
}
