// Gated DeltaNet (Qwen3.5 / Qwen3-Next linear attention). Wrapper, layouts and the math:
// src/gpu/gdn.rs; CPU references: cpu::gdn::{recurrent, chunked}.
// Binding 0: Params; storage buffers from 1 (each entry point declares its own set).
// Grid: linear workgroup id = wid.x + wid.y * nwg.x (see gpu::grid).
//
// Defines: DK, DV (head sizes), WG (threads, a power of two), CHUNK (64), and one of
//   RECURRENT (+ CB columns × R row groups = WG threads; + GNORM: one token per sequence,
//     one workgroup per (sequence, head) looping over the column blocks, then the gated
//     RMSNorm of the head's output, y = o · rsqrt(Σo²/DV + eps) · w · silu(z), computed as
//     norm.wgsl computes it, so the fused step gives the bits of recurrent + gated_rms_norm),
//   PREP (WG = 256, + TD dims per Gram tile),
//   SCAN (+ CB ∈ {4, 8, 16, 32} columns per workgroup, NE = CHUNK·CB / WG, TD rows per tile).
//
// Per value head h the state S [DK, DV] evolves per token as
//   S ← e^g S;  δ = β (v − Sᵀk̂);  S ← S + k̂ δᵀ;  o = Sᵀq̂
// with q̂ = q·rsqrt(Σq²+ε)/sqrt(DK), k̂ = k·rsqrt(Σk²+ε) (HF l2norm), β = sigmoid(b),
// g = a_neg · softplus(a + dt_bias). Every column j of S evolves independently of the
// others, so workgroups split the DV columns into blocks of CB.

const EPS = 1e-6;

struct Params {
    n_seq: u32,        // sequences in the batch table
    max_chunks: u32,   // chunks of CHUNK tokens of the longest sequence (PREP grid)
    n_head_k: u32,
    n_head_v: u32,
    key_tile: u32,     // key head of value head h: 0 → h / (Hv/Hk) (HF), 1 → h % Hk (llama.cpp qwen35)
    qkv_off: u32,      // in elements: row 0 of the conv output
    qkv_stride: u32,   // in elements, between token rows
    a_off: u32,        // in elements
    a_stride: u32,     // in elements, between token rows
    b_off: u32,
    b_stride: u32,
    o_off: u32,        // in elements: row 0 of the output
    o_stride: u32,     // in elements, between token rows
    state_off: u32,    // in elements: slot 0 of the state pool
    z_off: u32,        // GNORM: in elements, the gate z of row 0 ([Hv, DV] per row)
    z_stride: u32,     // GNORM: in elements, between token rows
    eps: f32,          // GNORM: the output norm's epsilon
    _pad0: u32,
    _pad1: u32,
    _pad2: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
// [n_seq][4] u32: (first row, tokens, state slot, first chunk slot) per sequence.
@group(0) @binding(1) var<storage, read> seqs: array<u32>;

// Per (chunk slot, value head) the scratch holds, in this order (f32):
//   W  [CHUNK, DK]  = (I + A)⁻¹ (β e^G K̂)
//   QG [CHUNK, DK]  = e^G Q̂
//   KD [CHUNK, DK]  = e^(G_last − G) K̂
//   U  [CHUNK, DV]  = (I + A)⁻¹ (β V)
//   P  [CHUNK, CHUNK] = e^(G_i − G_j) q̂_i·k̂_j for j ≤ i (rows i < n only)
//   GAMMA           = e^(G_last), then 3 floats of padding
// where G is the inclusive cumulative sum of g within the chunk and
// A[i][j] = β_i e^(G_i − G_j) k̂_i·k̂_j for j < i.
const OFF_W = 0u;
const OFF_QG = CHUNK * DK;
const OFF_KD = 2u * CHUNK * DK;
const OFF_U = 3u * CHUNK * DK;
const OFF_P = CHUNK * (3u * DK + DV);
const OFF_GAMMA = OFF_P + CHUNK * CHUNK;
const SLOT = OFF_GAMMA + 4u;

fn key_head(h: u32) -> u32 {
    if (p.key_tile != 0u) {
        return h % p.n_head_k;
    }
    return h / (p.n_head_v / p.n_head_k);
}

#ifndef SCAN
@group(0) @binding(2) var<storage, read> qkv: array<f32>;      // [rows, qkv_stride]: q [Hk,DK] | k [Hk,DK] | v [Hv,DV]
@group(0) @binding(3) var<storage, read> a_in: array<f32>;     // [rows, a_stride]: Hv values
@group(0) @binding(4) var<storage, read> b_in: array<f32>;     // [rows, b_stride]: Hv values
@group(0) @binding(5) var<storage, read> a_neg: array<f32>;    // [Hv] = -exp(A_log)
@group(0) @binding(6) var<storage, read> dt_bias: array<f32>;  // [Hv]

// softplus as torch (linear above 20); log(1+e) by its series when 1+e would round.
fn softplus(x: f32) -> f32 {
    if (x > 20.0) {
        return x;
    }
    let e = exp(-abs(x));
    var l = log(1.0 + e);
    if (e < 1e-4) {
        l = e * (1.0 - 0.5 * e);
    }
    return max(x, 0.0) + l;
}

// (g, β) of token row `row`, value head h.
fn gate(row: u32, h: u32) -> vec2<f32> {
    let g = a_neg[h] * softplus(a_in[p.a_off + row * p.a_stride + h] + dt_bias[h]);
    let beta = 1.0 / (1.0 + exp(-b_in[p.b_off + row * p.b_stride + h]));
    return vec2<f32>(g, beta);
}
#endif

#ifdef RECURRENT
// One workgroup per (sequence, value head, block of CB columns of S), looping over the
// sequence's tokens (decode: one). Thread (r, c) keeps rows r, r+R, ... of column c of S
// in registers; Sᵀk and Sᵀq are reduced over the R row groups in workgroup memory.
@group(0) @binding(7) var<storage, read_write> state: array<f32>;  // [slots, Hv, DK, DV]
@group(0) @binding(8) var<storage, read_write> o: array<f32>;      // [rows, o_stride]: [Hv, DV]

const NR = (DK + R - 1u) / R;
var<workgroup> qs: array<f32, DK>;
var<workgroup> ks: array<f32, DK>;
var<workgroup> red: array<vec4<f32>, WG>;
var<workgroup> rsk: array<f32, WG>;
var<workgroup> rsq: array<f32, WG>;

#if GNORM
@group(0) @binding(9) var<storage, read> z_in: array<f32>;   // [rows, z_stride]: [Hv, DV]
@group(0) @binding(10) var<storage, read> nw: array<f32>;    // [DV] norm weight
var<workgroup> ob: array<f32, DV>;
const NORM_LANES = 256u;  // norm.wgsl's WG: its partial sums and tree, replayed
var<workgroup> nred: array<f32, NORM_LANES>;

fn silu(v: f32) -> f32 { return v / (1.0 + exp(-v)); }
#endif

// Output column `col` of head h for token row `row`.
fn put_o(row: u32, h: u32, col: u32, v: f32) {
#if GNORM
    ob[col] = v;
#else
    o[p.o_off + row * p.o_stride + h * DV + col] = v;
#endif
}

// Columns cb·CB .. of value head h of sequence bq, over the sequence's tokens.
fn rec_block(bq: u32, h: u32, cb: u32, lid: u32) {
    let c = lid % CB;
    let r = lid / CB;
    let col = cb * CB + c;
    let live = col < DV;
    let row0 = seqs[bq * 4u];
    let n = seqs[bq * 4u + 1u];
    let slot = seqs[bq * 4u + 2u];
    let kh = key_head(h);
    let q_col = kh * DK;
    let k_col = (p.n_head_k + kh) * DK;
    let v_col = 2u * p.n_head_k * DK + h * DV;
    let sbase = p.state_off + (slot * p.n_head_v + h) * DK * DV;
    let scale = inverseSqrt(f32(DK));
    var s: array<f32, NR>;
    for (var m = 0u; m < NR; m++) {
        let i = r + m * R;
        if (live && i < DK) {
            s[m] = state[sbase + i * DV + col];
        }
    }
    for (var t = 0u; t < n; t++) {
        let rb = p.qkv_off + (row0 + t) * p.qkv_stride;
        // Loads that do not depend on the reductions below go first.
        let gb = gate(row0 + t, h);
        var v = 0.0;
        if (live) {
            v = qkv[rb + v_col + col];
        }
#if GNORM
        // One token, every column block in this workgroup: q, k and their sums are the same
        // for each block, so the first block loads and reduces them and the others reuse
        // qs, ks and red[0] (the same values, without three more loads and reduction trees).
        if (cb == 0u) {
#endif
        var part = vec4<f32>(0.0);
        for (var i = lid; i < DK; i += WG) {
            let qv = qkv[rb + q_col + i];
            let kv = qkv[rb + k_col + i];
            qs[i] = qv;
            ks[i] = kv;
            part += vec4<f32>(qv * qv, kv * kv, qv * kv, 0.0);
        }
        red[lid] = part;
        workgroupBarrier();
        for (var st = WG / 2u; st > 0u; st >>= 1u) {
            if (lid < st) {
                red[lid] += red[lid + st];
            }
            workgroupBarrier();
        }
#if GNORM
        }
#endif
        let tot = red[0];
        let rq = inverseSqrt(tot.x + EPS) * scale;
        let rk = inverseSqrt(tot.y + EPS);
        let decay = exp(gb.x);
        var sk = 0.0;
        var sq = 0.0;
        for (var m = 0u; m < NR; m++) {
            let i = r + m * R;
            if (i < DK) {
                sk += s[m] * ks[i];
                sq += s[m] * qs[i];
            }
        }
        rsk[lid] = sk;
        rsq[lid] = sq;
        workgroupBarrier();
        var sum_k = 0.0;
        var sum_q = 0.0;
        for (var rr = 0u; rr < R; rr++) {
            sum_k += rsk[rr * CB + c];
            sum_q += rsq[rr * CB + c];
        }
        // (e^g S)ᵀk̂ = e^g rk (Sᵀk); o = (e^g S + k̂δᵀ)ᵀq̂ = e^g rq (Sᵀq) + δ (k̂·q̂).
        let delta = gb.y * (v - decay * rk * sum_k);
        let out = decay * rq * sum_q + delta * (tot.z * rq * rk);
        if (r == 0u && live) {
            put_o(row0 + t, h, col, out);
        }
        let kd = rk * delta;
        for (var m = 0u; m < NR; m++) {
            let i = r + m * R;
            if (i < DK) {
                s[m] = decay * s[m] + ks[i] * kd;
            }
        }
        // qs, ks, red, rsk are rewritten by the next token.
        workgroupBarrier();
    }
    for (var m = 0u; m < NR; m++) {
        let i = r + m * R;
        if (live && i < DK) {
            state[sbase + i * DV + col] = s[m];
        }
    }
}

#if GNORM
// The gated RMSNorm of head h's output (in `ob`) for the sequence's one token.
fn gated_norm(bq: u32, h: u32, lid: u32) {
    for (var v = lid; v < NORM_LANES; v += WG) {
        var ss = 0.0;
        for (var j = v; j < DV; j += NORM_LANES) {
            let a = ob[j];
            ss += a * a;
        }
        nred[v] = ss;
    }
    workgroupBarrier();
    for (var st = NORM_LANES / 2u; st > 0u; st >>= 1u) {
        for (var v = lid; v < st; v += WG) {
            nred[v] += nred[v + st];
        }
        workgroupBarrier();
    }
    let rn = inverseSqrt(nred[0] / f32(DV) + p.eps);
    let row = seqs[bq * 4u];
    if (seqs[bq * 4u + 1u] == 0u) { return; }
    for (var j = lid; j < DV; j += WG) {
        var v = ob[j] * rn;
        v = v * nw[j];
        v = v * silu(z_in[p.z_off + row * p.z_stride + h * DV + j]);
        o[p.o_off + row * p.o_stride + h * DV + j] = v;
    }
}
#endif

@compute @workgroup_size(WG)
fn recurrent(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
             @builtin(local_invocation_index) lid: u32) {
    let n_cb = (DV + CB - 1u) / CB;
    let wg = wid.x + wid.y * nwg.x;
#if GNORM
    if (wg >= p.n_seq * p.n_head_v) { return; }
    for (var cb = 0u; cb < n_cb; cb++) {
        rec_block(wg / p.n_head_v, wg % p.n_head_v, cb, lid);
    }
    workgroupBarrier();
    gated_norm(wg / p.n_head_v, wg % p.n_head_v, lid);
#else
    if (wg >= p.n_seq * p.n_head_v * n_cb) { return; }
    rec_block(wg / (p.n_head_v * n_cb), (wg / n_cb) % p.n_head_v, wg % n_cb, lid);
#endif
}
#endif

#ifdef PREP
// Intra-chunk part of the chunked form, independent of the state: one workgroup of 256
// threads per (sequence, chunk, value head), all chunks in parallel. Fills the scratch
// slot above, rows i ≥ n of a short last chunk with zeros (the scan multiplies whole tiles).
//
// Global loads are written four at a time from clamped (always valid) addresses, so that
// they are in flight together: these kernels are bound by memory latency, not arithmetic.
@group(0) @binding(7) var<storage, read_write> scratch: array<f32>;  // [chunk slots, Hv, SLOT]

// Gram tiles: CHUNK rows × TD dims of q and k (TD a define: 16, or 8 when workgroup memory
// is 16 KiB), rows padded to TS floats so that the 16 rows a half-warp reads at once fall
// in distinct banks.
const TS = TD + 1u;
var<workgroup> qt: array<f32, CHUNK * TS>;
var<workgroup> kt: array<f32, CHUNK * TS>;
var<workgroup> gsh: array<f32, CHUNK>;   // g, then its inclusive cumulative sum G
var<workgroup> bsh: array<f32, CHUNK>;   // β
var<workgroup> rqs: array<f32, CHUNK>;   // rsqrt(Σq²+ε)/sqrt(DK)
var<workgroup> rks: array<f32, CHUNK>;   // rsqrt(Σk²+ε)
var<workgroup> amat: array<f32, CHUNK * (CHUNK - 1u) / 2u>;  // A, strictly lower, packed by rows

// qkv[at + d .. at + d + 4], zero where d + k ≥ cols.
fn qkv4(at: u32, d: u32, cols: u32) -> vec4<f32> {
    let x = qkv[at + min(d, cols - 1u)];
    let y = qkv[at + min(d + 1u, cols - 1u)];
    let z = qkv[at + min(d + 2u, cols - 1u)];
    let w = qkv[at + min(d + 3u, cols - 1u)];
    return select(vec4<f32>(0.0), vec4<f32>(x, y, z, w), d + vec4<u32>(0u, 1u, 2u, 3u) < vec4<u32>(cols));
}

@compute @workgroup_size(256)
fn chunk_prep(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
              @builtin(local_invocation_index) lid: u32) {
    let wg = wid.x + wid.y * nwg.x;
    if (wg >= p.n_seq * p.max_chunks * p.n_head_v) { return; }
    let bq = wg / (p.max_chunks * p.n_head_v);
    let ci = (wg / p.n_head_v) % p.max_chunks;
    let h = wg % p.n_head_v;
    let ntok = seqs[bq * 4u + 1u];
    if (ci * CHUNK >= ntok) { return; }
    let n = min(CHUNK, ntok - ci * CHUNK);
    let r0 = seqs[bq * 4u] + ci * CHUNK;
    let base = ((seqs[bq * 4u + 3u] + ci) * p.n_head_v + h) * SLOT;
    let kh = key_head(h);
    let q_col = p.qkv_off + kh * DK;
    let k_col = p.qkv_off + (p.n_head_k + kh) * DK;
    let v_col = p.qkv_off + 2u * p.n_head_k * DK + h * DV;

    if (lid >= 128u && lid < 128u + n) {
        let gb = gate(r0 + lid - 128u, h);
        gsh[lid - 128u] = gb.x;
        bsh[lid - 128u] = gb.y;
    }
    // Gram matrices QKᵀ and KKᵀ of the raw rows: thread (ti, tj) owns rows ti + 16a and
    // columns tj + 16b (a, b < 4); threads < 128 also sum the squares of one q or k row.
    let ti = lid / 16u;
    let tj = lid % 16u;
    var gqk: array<f32, 16>;
    var gkk: array<f32, 16>;
    var sq = 0.0;
    for (var d0 = 0u; d0 < DK; d0 += TD) {
        // CHUNK × TD floats of q and of k: TD / 16 quads of each per thread (TD = 8: half).
        for (var k = 0u; k < (TD + 15u) / 16u; k++) {
            let e = lid + k * 256u;
            if (e >= CHUNK * TD / 4u) { break; }
            let i = e / (TD / 4u);
            let dd = (e % (TD / 4u)) * 4u;
            let rb = (r0 + min(i, n - 1u)) * p.qkv_stride;
            let live = f32(i < n);
            let qv = qkv4(rb + q_col, d0 + dd, DK) * live;
            let kv = qkv4(rb + k_col, d0 + dd, DK) * live;
            for (var m = 0u; m < 4u; m++) {
                qt[i * TS + dd + m] = qv[m];
                kt[i * TS + dd + m] = kv[m];
            }
        }
        workgroupBarrier();
        for (var dd = 0u; dd < TD; dd++) {
            var qi: array<f32, 4>;
            var ki: array<f32, 4>;
            var kj: array<f32, 4>;
            for (var a = 0u; a < 4u; a++) {
                qi[a] = qt[(ti + 16u * a) * TS + dd];
                ki[a] = kt[(ti + 16u * a) * TS + dd];
                kj[a] = kt[(tj + 16u * a) * TS + dd];
            }
            for (var a = 0u; a < 4u; a++) {
                for (var b = 0u; b < 4u; b++) {
                    gqk[a * 4u + b] += qi[a] * kj[b];
                    gkk[a * 4u + b] += ki[a] * kj[b];
                }
            }
        }
        if (lid < 2u * CHUNK) {
            for (var dd = 0u; dd < TD; dd++) {
                var x: f32;
                if (lid < CHUNK) {
                    x = qt[lid * TS + dd];
                } else {
                    x = kt[(lid - CHUNK) * TS + dd];
                }
                sq += x * x;
            }
        }
        workgroupBarrier();
    }
    if (lid < CHUNK) {
        rqs[lid] = inverseSqrt(sq + EPS) * inverseSqrt(f32(DK));
    } else if (lid < 2u * CHUNK) {
        rks[lid - CHUNK] = inverseSqrt(sq + EPS);
    }
    workgroupBarrier();
    if (lid == 0u) {
        var acc = 0.0;
        for (var i = 0u; i < n; i++) {
            acc += gsh[i];
            gsh[i] = acc;
        }
        scratch[base + OFF_GAMMA] = exp(acc);
    }
    workgroupBarrier();
    let g_last = gsh[n - 1u];

    // P (all CHUNK² entries, zero outside j ≤ i < n) and A (strictly lower, into amat).
    for (var a = 0u; a < 4u; a++) {
        for (var b = 0u; b < 4u; b++) {
            let i = ti + 16u * a;
            let j = tj + 16u * b;
            var pv = 0.0;
            if (j <= i && i < n) {
                let decay = exp(gsh[i] - gsh[j]);
                pv = decay * rqs[i] * rks[j] * gqk[a * 4u + b];
                if (j < i) {
                    amat[i * (i - 1u) / 2u + j] = bsh[i] * decay * rks[i] * rks[j] * gkk[a * 4u + b];
                }
            }
            scratch[base + OFF_P + i * CHUNK + j] = pv;
        }
    }
    // QG = e^G Q̂ and KD = e^(G_last − G) K̂, by quads of a row.
    const DQ = (DK + 3u) / 4u;
    for (var k = 0u; k < (CHUNK * DQ + 255u) / 256u; k++) {
        let e = lid + k * 256u;
        let i = e / DQ;
        let d = (e % DQ) * 4u;
        if (i < CHUNK) {
            let ic = min(i, n - 1u);
            let rb = (r0 + ic) * p.qkv_stride;
            let live = f32(i < n);
            let qg = qkv4(rb + q_col, d, DK) * (rqs[ic] * exp(gsh[ic]) * live);
            let kd = qkv4(rb + k_col, d, DK) * (rks[ic] * exp(g_last - gsh[ic]) * live);
            for (var m = 0u; m < 4u; m++) {
                if (d + m < DK) {
                    scratch[base + OFF_QG + i * DK + d + m] = qg[m];
                    scratch[base + OFF_KD + i * DK + d + m] = kd[m];
                }
            }
        }
    }
    workgroupBarrier();

    // Solve (I + A) X = [βV | β e^G K̂] by forward substitution, one column per thread:
    // X[i] = B[i] − Σ_{m<i} A[i][m] X[m] (HF builds (I + A)⁻¹ row by row; same math).
    var xs: array<f32, CHUNK>;
    for (var col = lid; col < DV + DK; col += 256u) {
        // The right-hand side B, four rows at a time (rows ≥ n are zero).
        var at: u32;
        if (col < DV) {
            at = v_col + col;
        } else {
            at = k_col + col - DV;
        }
        for (var i0 = 0u; i0 < CHUNK; i0 += 4u) {
            let i = min(vec4<u32>(i0) + vec4<u32>(0u, 1u, 2u, 3u), vec4<u32>(n - 1u));
            let x = qkv[(r0 + i.x) * p.qkv_stride + at];
            let y = qkv[(r0 + i.y) * p.qkv_stride + at];
            let z = qkv[(r0 + i.z) * p.qkv_stride + at];
            let w = qkv[(r0 + i.w) * p.qkv_stride + at];
            let raw = array<f32, 4>(x, y, z, w);
            for (var m = 0u; m < 4u; m++) {
                let r = i0 + m;
                var f = bsh[i[m]];
                if (col >= DV) {
                    f *= exp(gsh[i[m]]) * rks[i[m]];
                }
                xs[r] = select(0.0, f * raw[m], r < n);
            }
        }
        for (var i = 0u; i < CHUNK; i++) {
            var acc = xs[i];
            let arow = i * (i - 1u) / 2u;
            for (var m = 0u; m < min(i, n); m++) {
                acc -= amat[arow + m] * xs[m];
            }
            xs[i] = acc;
            if (col < DV) {
                scratch[base + OFF_U + i * DV + col] = acc;
            } else {
                scratch[base + OFF_W + i * DK + col - DV] = acc;
            }
        }
    }
}
#endif

#ifdef SCAN
// Inter-chunk pass: one workgroup per (sequence, value head, block of CB columns of S),
// looping over the sequence's chunks in order with S in workgroup memory:
//   Δ = U − W S;  o = QG S + P Δ;  S ← γ S + KDᵀ Δ
// The chunk's W, QG, P and KD are staged through workgroup memory in CHUNK × TD tiles
// (TD ∈ {16, 32, 64}) with coalesced loads, four per thread in flight at once; every
// thread then reads them from there (the wrapper's scan_tiles says which TD and why).
@group(0) @binding(2) var<storage, read> scratch: array<f32>;        // [chunk slots, Hv, SLOT]
@group(0) @binding(3) var<storage, read_write> state: array<f32>;    // [slots, Hv, DK, DV]
@group(0) @binding(4) var<storage, read_write> o: array<f32>;        // [rows, o_stride]: [Hv, DV]

var<workgroup> ssh: array<f32, DK * CB>;     // S[:, block], [DK, CB]
var<workgroup> vn: array<f32, CHUNK * CB>;   // Δ[:, block], [CHUNK, CB]
var<workgroup> t1: array<f32, CHUNK * TD>;
var<workgroup> t2: array<f32, CHUNK * TD>;

// scratch[at + d .. at + d + 4], zero where d + k ≥ cols.
fn scratch4(at: u32, d: u32, cols: u32) -> vec4<f32> {
    let x = scratch[at + min(d, cols - 1u)];
    let y = scratch[at + min(d + 1u, cols - 1u)];
    let z = scratch[at + min(d + 2u, cols - 1u)];
    let w = scratch[at + min(d + 3u, cols - 1u)];
    return select(vec4<f32>(0.0), vec4<f32>(x, y, z, w), d + vec4<u32>(0u, 1u, 2u, 3u) < vec4<u32>(cols));
}

// Quad k of this thread's share of a CHUNK × TD tile: (row, first column).
fn quad(lid: u32, k: u32) -> vec2<u32> {
    let e = lid + k * WG;
    return vec2<u32>(e / (TD / 4u), (e % (TD / 4u)) * 4u);
}

// Store a quad into t1 / t2 (naga passes no workgroup pointers to functions).
fn put1(q: vec2<u32>, v: vec4<f32>) {
    for (var m = 0u; m < 4u; m++) {
        t1[q.x * TD + q.y + m] = v[m];
    }
}

fn put2(q: vec2<u32>, v: vec4<f32>) {
    for (var m = 0u; m < 4u; m++) {
        t2[q.x * TD + q.y + m] = v[m];
    }
}

@compute @workgroup_size(WG)
fn chunk_scan(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
              @builtin(local_invocation_index) lid: u32) {
    let n_cb = (DV + CB - 1u) / CB;
    let wg = wid.x + wid.y * nwg.x;
    if (wg >= p.n_seq * p.n_head_v * n_cb) { return; }
    let bq = wg / (p.n_head_v * n_cb);
    let h = (wg / n_cb) % p.n_head_v;
    let col0 = (wg % n_cb) * CB;
    let row0 = seqs[bq * 4u];
    let ntok = seqs[bq * 4u + 1u];
    let slot = seqs[bq * 4u + 2u];
    let chunk0 = seqs[bq * 4u + 3u];
    let sbase = p.state_off + (slot * p.n_head_v + h) * DK * DV;
    // This thread's entries of the CHUNK × CB tiles: rows lid / CB + k · (WG / CB), column c.
    let c = lid % CB;
    let live = col0 + c < DV;
    const NQ = TD / 16u;  // quads per thread per CHUNK × TD tile (WG = 256)

    for (var e = lid; e < DK * CB; e += WG) {
        let col = col0 + e % CB;
        var v = 0.0;
        if (col < DV) {
            v = state[sbase + (e / CB) * DV + col];
        }
        ssh[e] = v;
    }
    let n_chunks = (ntok + CHUNK - 1u) / CHUNK;
    for (var ci = 0u; ci < n_chunks; ci++) {
        let n = min(CHUNK, ntok - ci * CHUNK);
        let base = ((chunk0 + ci) * p.n_head_v + h) * SLOT;
        // U and γ do not depend on S: their loads are issued first and land during phase A.
        let gamma = scratch[base + OFF_GAMMA];
        var uu: array<f32, NE>;
        for (var k = 0u; k < NE; k++) {
            let i = lid / CB + k * (WG / CB);
            uu[k] = scratch[base + OFF_U + i * DV + min(col0 + c, DV - 1u)];
        }
        // Δ = U − W S and the inter-chunk output QG S, both from the old S.
        var ws: array<f32, NE>;
        var oi: array<f32, NE>;
        for (var d0 = 0u; d0 < DK; d0 += TD) {
            workgroupBarrier();
            for (var k = 0u; k < NQ; k++) {
                let q = quad(lid, k);
                let w = scratch4(base + OFF_W + q.x * DK, d0 + q.y, DK);
                let g = scratch4(base + OFF_QG + q.x * DK, d0 + q.y, DK);
                put1(q, w);
                put2(q, g);
            }
            workgroupBarrier();
            for (var k = 0u; k < NE; k++) {
                let i = lid / CB + k * (WG / CB);
                for (var dd = 0u; dd < TD; dd++) {
                    let sv = ssh[(min(d0 + dd, DK - 1u)) * CB + c];
                    ws[k] += t1[i * TD + dd] * sv;
                    oi[k] += t2[i * TD + dd] * sv;
                }
            }
        }
        for (var k = 0u; k < NE; k++) {
            let i = lid / CB + k * (WG / CB);
            vn[i * CB + c] = select(0.0, uu[k] - ws[k], live);
        }
        // o = QG S + P Δ.
        for (var j0 = 0u; j0 < CHUNK; j0 += TD) {
            workgroupBarrier();
            for (var k = 0u; k < NQ; k++) {
                let q = quad(lid, k);
                put1(q, scratch4(base + OFF_P + q.x * CHUNK, j0 + q.y, CHUNK));
            }
            workgroupBarrier();
            for (var k = 0u; k < NE; k++) {
                let i = lid / CB + k * (WG / CB);
                for (var jj = 0u; jj < TD; jj++) {
                    oi[k] += t1[i * TD + jj] * vn[(j0 + jj) * CB + c];
                }
            }
        }
        for (var k = 0u; k < NE; k++) {
            let i = lid / CB + k * (WG / CB);
            if (i < n && live) {
                o[p.o_off + (row0 + ci * CHUNK + i) * p.o_stride + h * DV + col0 + c] = oi[k];
            }
        }
        // S ← γ S + KDᵀ Δ, TD rows of S per tile.
        for (var d0 = 0u; d0 < DK; d0 += TD) {
            workgroupBarrier();
            for (var k = 0u; k < NQ; k++) {
                let q = quad(lid, k);
                put1(q, scratch4(base + OFF_KD + q.x * DK, d0 + q.y, DK));
            }
            workgroupBarrier();
            for (var e = lid; e < TD * CB; e += WG) {
                let dd = e / CB;
                let cc = e % CB;
                if (d0 + dd < DK) {
                    var acc = gamma * ssh[(d0 + dd) * CB + cc];
                    for (var j = 0u; j < CHUNK; j++) {
                        acc += t1[j * TD + dd] * vn[j * CB + cc];
                    }
                    ssh[(d0 + dd) * CB + cc] = acc;
                }
            }
        }
    }
    workgroupBarrier();
    for (var e = lid; e < DK * CB; e += WG) {
        let col = col0 + e % CB;
        if (col < DV) {
            state[sbase + (e / CB) * DV + col] = ssh[e];
        }
    }
}
#endif
