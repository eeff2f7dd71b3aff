// Prefill products: Y[t][row] = sum_c W[row][c] X[t][c] for many tokens, tiled so that each
// chunk of W is decoded once into workgroup memory and reused by BN tokens, on the pieces of
// matvec.wgsl (bindings, Params, the chunk decoders `chunk_w` / `xmap`); with ROUTE defined only
// the route kernel at the end remains (it binds other buffers at the same slots).
//
// Tile: BM rows x BN tokens per workgroup of MM_WG threads; the K loop walks the chunks of the
// row (32 weights each, in the chunk order of matvec.wgsl: the x values are gathered with the same
// `xmap`, so the product is the same sum). Per step the first BM threads decode one chunk of one
// row each, all threads gather x, then each thread accumulates a 4 x 4 block of (rows, tokens).
// Workgroup memory: 2 x 32 x 64 f32 = 16 KiB, WebGPU's default limit.
// THIN (MoE products with few pairs per expert): 64 rows x 16 tokens per workgroup of 64
// threads, four workgroups per route tile of 64 pairs; those past the expert's pairs return at
// once, so a mostly empty route tile costs neither multiply-adds nor weight decoding four times
// over. Each output is the same sum in the same order as in the wide tile.
//
// matmul grid: wid.x = row tile, wid.y = token tile.
// matmul_id grid: wid.x = row tile, wid.y = tile slot of the route (see route below).

#ifndef ROUTE

#include "bindings"
#include "x_f32"
#include "prologue"
#include "weight_bytes"
#include "decoders"
#include "prefill_chunks"
#include "mv_idx"

#if THIN
const MM_WG = 64u;
const BN = 16u;
#else
const MM_WG = 256u;
const BN = 64u;
#endif
const BM = 64u;
const RBN = 64u;         // pairs per tile of the route
const XQ = BN / 4u;      // quads of tokens
const NONE = 0xffffffffu;

var<workgroup> Ws: array<vec4<f32>, 512>;      // [32 k][16 quads of rows]
var<workgroup> Xs: array<vec4<f32>, 32u * XQ>; // [32 k][XQ quads of tokens]
var<workgroup> tokx: array<u32, BN>;       // element of x row of tile token n, NONE if absent
var<workgroup> toky: array<u32, BN>;       // element of y[token][0], NONE if absent

// weights k0..k0+4 of tile row m / x values k0..k0+4 of tile token n
fn put_w(k0: u32, m: u32, v: vec4<f32>) {
    let i = m / 4u;
    let c = m % 4u;
    Ws[k0 * 16u + i][c] = v.x;
    Ws[(k0 + 1u) * 16u + i][c] = v.y;
    Ws[(k0 + 2u) * 16u + i][c] = v.z;
    Ws[(k0 + 3u) * 16u + i][c] = v.w;
}

fn put_x(k0: u32, n: u32, v: vec4<f32>) {
    let i = n / 4u;
    let c = n % 4u;
    Xs[k0 * XQ + i][c] = v.x;
    Xs[(k0 + 1u) * XQ + i][c] = v.y;
    Xs[(k0 + 2u) * XQ + i][c] = v.z;
    Xs[(k0 + 3u) * XQ + i][c] = v.w;
}

// chunk s of block blk of the row at byte rb into tile row m
fn decode_chunk(rb: u32, blk: u32, s: u32, m: u32) {
#if FLOAT
    if (slow_chunk(blk)) {
        for (var j = 0u; j < 8u; j++) {
            var v = vec4<f32>(0.0);
            for (var i = 0u; i < 4u; i++) {
                let e = blk * BS + xmap(s, j) + i;
                if (e < p.cols) {
                    v[i] = welem(rb, e);
                }
            }
            put_w(4u * j, m, v);
        }
        return;
    }
#endif
    let w = chunk_w(rb + blk * BB, s);
    put_w(0u, m, w[0]);
    put_w(4u, m, w[1]);
    put_w(8u, m, w[2]);
    put_w(12u, m, w[3]);
    put_w(16u, m, w[4]);
    put_w(20u, m, w[5]);
    put_w(24u, m, w[6]);
    put_w(28u, m, w[7]);
}

fn mm_store(n: u32, row: u32, v: vec4<f32>) {
    let yb = toky[n];
    if (yb == NONE) {
        return;
    }
    for (var i = 0u; i < 4u; i++) {
        if (row + i < p.rows) {
            if (p.accumulate != 0u) {
                Y[yb + row + i] += v[i];
            } else {
                Y[yb + row + i] = v[i];
            }
        }
    }
}

fn mm_tile(lid: u32, row_base: u32, wbase: u32) {
    let tm = lid % 16u;
    let tn = lid / 16u;
    var acc0 = vec4<f32>(0.0);
    var acc1 = vec4<f32>(0.0);
    var acc2 = vec4<f32>(0.0);
    var acc3 = vec4<f32>(0.0);
    // decoder role (lid < BM): row m of the tile
    let m = lid % BM;
    let rb = wbase + min(row_base + m, p.rows - 1u) * p.row_bytes;
    // gather role: token xn, quarter-octets xj, xj + 1 of the chunk
    let xn = lid >> 2u;
    let xj = (lid & 3u) * 2u;
    let xrow = tokx[xn];
    for (var c = 0u; c < p.n_chunks; c++) {
        let blk = c / CPB;
        let s = c % CPB;
        if (lid < BM) {
            decode_chunk(rb, blk, s, m);
        }
        var v0 = vec4<f32>(0.0);
        var v1 = vec4<f32>(0.0);
        if (xrow != NONE) {
            v0 = gather_x(xrow, blk, s, xj);
            v1 = gather_x(xrow, blk, s, xj + 1u);
        }
        put_x(4u * xj, xn, v0);
        put_x(4u * xj + 4u, xn, v1);
        workgroupBarrier();
        for (var k = 0u; k < 32u; k++) {
            let a = Ws[k * 16u + tm];
            let b = Xs[k * XQ + tn];
            acc0 += a * b.x;
            acc1 += a * b.y;
            acc2 += a * b.z;
            acc3 += a * b.w;
        }
        workgroupBarrier();
    }
    let row = row_base + 4u * tm;
    mm_store(4u * tn, row, acc0);
    mm_store(4u * tn + 1u, row, acc1);
    mm_store(4u * tn + 2u, row, acc2);
    mm_store(4u * tn + 3u, row, acc3);
}

// Y[t][row] (=|+=) sum_c W[row][c] X[t][c]; X rows at x_off + t * x_stride, Y rows at
// y_off + t * y_stride, t < n_tokens, rows of this part.
@compute @workgroup_size(MM_WG)
fn matmul(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    if (no_rows()) {
        return;
    }
    if (lid < BN) {
        let t = wid.y * BN + lid;
        let ok = t < p.n_tokens;
        tokx[lid] = select(NONE, p.x_off + t * p.x_stride, ok);
        toky[lid] = select(NONE, p.y_off + t * p.y_stride, ok);
    }
    workgroupBarrier();
    mm_tile(lid, wid.x * BM, 0u);
}

// MoE prefill over the route built by `route` (IDX, u32, layout below; E = n_expert):
// tile slot wid.y / (RBN / BN) holds (expert e, tile j) = RBN consecutive pairs j*RBN.. of
// e's list, of which this workgroup takes BN; Y[q][row] (=|+=) sum_c W[e][row][c] X[q or q / n_used][c].
@compute @workgroup_size(MM_WG)
fn matmul_id(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let ne = p.n_expert;
    let slot = wid.y / (RBN / BN);
    if (slot >= IDX[0] || no_rows()) {
        return;
    }
    let tv = IDX[p.tiles_off + slot];
    let e = tv >> 16u;
    let j0 = (tv & 0xffffu) * RBN + (wid.y % (RBN / BN)) * BN;  // first pair of the tile
    if (e < p.e_lo || e - p.e_lo >= p.e_n || j0 >= IDX[1u + e]) {
        return;
    }
    if (lid < BN) {
        let idx = j0 + lid;
        var xb = NONE;
        var yb = NONE;
        if (idx < IDX[1u + e]) {
            let q = IDX[p.pairs_off + IDX[1u + ne + e] + idx];
            let xq = select(q / p.n_used, q, p.x_per_pair != 0u);
            xb = p.x_off + xq * p.x_stride;
            yb = p.y_off + q * p.y_stride;
        }
        tokx[lid] = xb;
        toky[lid] = yb;
    }
    workgroupBarrier();
    mm_tile(lid, wid.x * BM, (e - p.e_lo) * p.expert_bytes);
}

#else

// Route for matmul_id, one workgroup. From ids [n_tokens, n_used] (pair q = t * n_used + slot)
// it writes, in u32 words, with E = n_expert:
//   [0]                          n_tiles
//   [1 .. 1+E)                   count[e]: pairs that chose expert e
//   [1+E .. 2+2E)                start[e]: exclusive prefix sum of count (E + 1 entries)
//   [tiles_off .. +n_tiles)      (e << 16) | j for each j < ceil(count[e] / bn), experts in
//                                order; ceil(n_pairs / bn) + E bounds their number
//   [pairs_off .. +n_pairs)      the pairs grouped by expert (e's at start[e]..start[e+1], in no
//                                particular order: each output row is computed alone, so
//                                results do not depend on it)
// Ids >= E are skipped (their pairs get no output).
struct RouteParams {
    n_pairs: u32,   // n_tokens * n_used
    n_expert: u32,
    ids_off: u32,   // in elements
    bn: u32,        // pairs per tile (matmul_id's BN)
    tiles_off: u32, // in words
    pairs_off: u32, // in words
    pad0: u32,
    pad1: u32,
}

@group(0) @binding(0) var<uniform> rp: RouteParams;
@group(0) @binding(1) var<storage, read> IDS: array<u32>;
@group(0) @binding(2) var<storage, read_write> ROUTE: array<atomic<u32>>;

const RWG = 256u;

@compute @workgroup_size(RWG)
fn route(@builtin(local_invocation_index) lid: u32) {
    let ne = rp.n_expert;
    let np = rp.n_pairs;
    let cnt = 1u;
    let start = 1u + ne;
    let pairs = rp.pairs_off;
    let tiles = rp.tiles_off;
    for (var e = lid; e < ne; e += RWG) {
        atomicStore(&ROUTE[cnt + e], 0u);
    }
    storageBarrier();
    for (var q = lid; q < np; q += RWG) {
        let e = IDS[rp.ids_off + q];
        if (e < ne) {
            atomicAdd(&ROUTE[cnt + e], 1u);
        }
    }
    storageBarrier();
    if (lid == 0u) {
        var acc = 0u;
        var nt = 0u;
        for (var e = 0u; e < ne; e++) {
            let c = atomicLoad(&ROUTE[cnt + e]);
            atomicStore(&ROUTE[start + e], acc);
            for (var j = 0u; j * rp.bn < c; j++) {
                atomicStore(&ROUTE[tiles + nt], (e << 16u) | j);
                nt++;
            }
            acc += c;
            // reused as the scatter cursor; ends equal to the count again
            atomicStore(&ROUTE[cnt + e], 0u);
        }
        atomicStore(&ROUTE[start + ne], acc);
        atomicStore(&ROUTE[0], nt);
    }
    storageBarrier();
    for (var q = lid; q < np; q += RWG) {
        let e = IDS[rp.ids_off + q];
        if (e < ne) {
            let pos = atomicLoad(&ROUTE[start + e]) + atomicAdd(&ROUTE[cnt + e], 1u);
            atomicStore(&ROUTE[pairs + pos], q);
        }
    }
}

#endif
