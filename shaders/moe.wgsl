// Expert-arena helpers for MoE models larger than VRAM. Binding 0: Params; storage from 1.
//
// Every entry reads `a` (binding 1), writes `b` (binding 2) and, when it has a third
// operand, reads `c` (binding 3); all are u32 words (f32 rows are copied as bit patterns),
// so one layout serves every entry and the wrapper passes exactly the prefix it uses.
//
// - remap:        b[out_off + i] = a[tab_off + c[in_off + i]] for router ids below n_expert,
//                 COLD (0xFFFFFFFF) otherwise. `a` is the layer's remap table (expert → arena
//                 slot or COLD), `c` the router's chosen ids, `b` the slot ids the indexed
//                 matvec / matmul read (ids ≥ the arena's slot count write nothing there).
// - scatter_rows: row r of `a` (width words at in_off + r·width) goes to row c[tab_off + r]
//                 of `b` (at out_off + row·out_stride); rows whose index is ≥ n_out are
//                 skipped. Puts the CPU's cold expert outputs into the GPU's per-pair buffer.
// - copy_bytes:   n_bytes bytes from the start of `a` into `b` at byte byte_off, merging the
//                 partial words at both ends (expert slots whose size is not a multiple of 4
//                 bytes start and end inside words; queue.write_buffer cannot write them).
//
// Grid: linear workgroup id = wid.x + wid.y * nwg.x (gpu::grid), WG threads each.

const WG = 256u;
const COLD = 0xFFFFFFFFu;

struct Params {
    n: u32,          // remap: ids; scatter_rows: rows of a; copy_bytes: words of b touched
    n_expert: u32,   // remap: entries of the table
    width: u32,      // scatter_rows: words per row
    n_out: u32,      // scatter_rows: rows of b (indices >= n_out are skipped)
    in_off: u32,     // words: first id (remap) / first row (scatter_rows) of c / a
    out_off: u32,    // words
    out_stride: u32, // words between rows of b (scatter_rows)
    tab_off: u32,    // words: remap table start in a (remap) / first index in c (scatter_rows)
    byte_off: u32,   // copy_bytes: destination byte offset in b
    n_bytes: u32,    // copy_bytes: bytes to copy
    _pad0: u32,
    _pad1: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> a: array<u32>;
@group(0) @binding(2) var<storage, read_write> b: array<u32>;
@group(0) @binding(3) var<storage, read> c: array<u32>;

fn linear(wid: vec3<u32>, nwg: vec3<u32>, lid: u32) -> u32 {
    return (wid.x + wid.y * nwg.x) * WG + lid;
}

@compute @workgroup_size(WG)
fn remap(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
         @builtin(local_invocation_index) lid: u32) {
    let i = linear(wid, nwg, lid);
    if (i >= p.n) { return; }
    let e = c[p.in_off + i];
    var s = COLD;
    if (e < p.n_expert) {
        s = a[p.tab_off + e];
    }
    b[p.out_off + i] = s;
}

@compute @workgroup_size(WG)
fn scatter_rows(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                @builtin(local_invocation_index) lid: u32) {
    let i = linear(wid, nwg, lid);
    let r = i / p.width;
    if (r >= p.n) { return; }
    let col = i - r * p.width;
    let dst = c[p.tab_off + r];
    if (dst >= p.n_out) { return; }
    b[p.out_off + dst * p.out_stride + col] = a[p.in_off + r * p.width + col];
}

// Byte j of the source (j < n_bytes), from its little-endian word.
fn src_byte(j: u32) -> u32 {
    return (a[j >> 2u] >> ((j & 3u) * 8u)) & 0xFFu;
}

@compute @workgroup_size(WG)
fn copy_bytes(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
              @builtin(local_invocation_index) lid: u32) {
    let i = linear(wid, nwg, lid);
    if (i >= p.n) { return; }
    // Destination word w covers bytes 4w..4w+3; only bytes in [byte_off, byte_off + n_bytes)
    // change, the others keep what the neighbouring slot holds. One thread per word, so the
    // read-modify-write of a shared edge word has no competing writer in this dispatch.
    let w = (p.byte_off >> 2u) + i;
    var v = b[w];
    for (var k = 0u; k < 4u; k++) {
        let d = w * 4u + k;
        if (d >= p.byte_off && d - p.byte_off < p.n_bytes) {
            let sh = k * 8u;
            v = (v & ~(0xFFu << sh)) | (src_byte(d - p.byte_off) << sh);
        }
    }
    b[w] = v;
}
