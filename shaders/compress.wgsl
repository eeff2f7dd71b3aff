// DeepSeek-V4 KV compression, lightning indexer and attention index lists (model.py
// `Compressor`, `Indexer`, and the window ∪ compressed key set of `Attention`). Wrapper and
// shapes: src/gpu/compress.rs; CPU reference: src/cpu/compress.rs.
//
// A compressor of ratio m turns every window of m tokens into one entry of d channels. Its
// per-token rows (kv | score, each `width` = coff·d wide, coff = 2 when windows overlap) live
// in a store ring of `cap` rows [cap][2·width] per sequence slot: slot s, position q in row
// s·cap + q % cap of a pool shared by the sequences of a pass. A slot's compressed entries
// are rows s·cap_e + i of the cache pool, its window ring rows s·ring + q % ring.
//
// Row table `tab` (u32): row r of a pass is at position tab[r], in slot tab[tab_rows + r], so
// rows of many sequences (and a verify pass's rows at consecutive positions) go through one
// dispatch, each with the bits it has alone.
//
// Entry points (one flag each):
//   STORE   one thread per (token, element): the row of token t = table row row0 + t at
//           position pos goes to store row slot·cap + pos % cap, the score half plus
//           ape[pos % m] (the absolute position bias inside the window).
//   POOL    one workgroup per completed window k of a window table (w, slot, cache row):
//           per channel c, a softmax over the window's scores weighs its kv values
//           (overlapping: the previous window's channels [0, d) and this window's [d, 2d), 2m
//           rows; window 0 has no previous one), then RMSNorm · norm and RoPE (interleaved
//           pairs on the last 2·n_freq channels) at the window's first position w·m. Out: f32
//           rows of d at out_off + k·d, or (direct) at the window's cache row.
//   SCORE   indexer scores: one workgroup per (token, 64 entries): for entry i visible to the
//           token (i < (pos+1)/m) s = scale · Σ_h relu(q_h · k_i) · w_h (k_i: cache row
//           slot·cap_e + i), else −1e30.
//   SELECT  one workgroup per token: the top k of the visible scores (ties to the lower
//           index) into the token's index-list slots from n_win = min(window, pos+1) on, as
//           SRC_B | (slot·cap_e + entry) in entry order; min(k, visible) slots.
//   INDEX   one thread per (token, slot) of the attention's key list (rows of n_idx slots): a
//           token at pos sees n_win = min(window, pos+1) window slots, newest first (ring row
//           slot·ring + (pos − i) % ring), then its compressed slots: with `fill_comp` the
//           entries c < (pos+1)/m in order (SRC_B | slot·cap_e + c), else min(top_k,
//           (pos+1)/m) slots the indexer's SELECT writes; INVALID after them. Each token's
//           list is the one-token decode step's list at its position, padded.
//
// Grid: linear workgroup id = wid.x + wid.y * nwg.x (see gpu::grid).

const INVALID = 0xffffffffu;
const SRC_B = 0x80000000u;
const NEG = -1.0e30;


#if STORE
const WG = 256u;
struct Params {
    n_tok: u32,
    row0: u32,        // table row of token 0
    ratio: u32,       // m
    cap: u32,         // store rows per slot
    width: u32,       // coff·d: kv (and score) elements per row
    src_off: u32,     // in elements
    src_stride: u32,  // elements between tokens of src (rows of kv | score)
    tab_rows: u32,    // rows of the table (slots follow the positions)
}
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> src: array<f32>;
@group(0) @binding(2) var<storage, read> ape: array<f32>;
@group(0) @binding(3) var<storage, read> tab: array<u32>;
@group(0) @binding(4) var<storage, read_write> store: array<f32>;

@compute @workgroup_size(WG)
fn store_rows(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
              @builtin(local_invocation_index) lid: u32) {
    let i = (wid.x + wid.y * nwg.x) * WG + lid;
    let row = 2u * p.width;
    if (i >= p.n_tok * row) { return; }
    let t = i / row;
    let c = i - t * row;
    let pos = tab[p.row0 + t];
    let slot = tab[p.tab_rows + p.row0 + t];
    var v = src[p.src_off + t * p.src_stride + c];
    if (c >= p.width) { v += ape[(pos % p.ratio) * p.width + c - p.width]; }
    store[(slot * p.cap + pos % p.cap) * row + c] = v;
}
#endif

#if POOL
const WG = 128u;
struct Params {
    n_win: u32,
    ratio: u32,
    cap: u32,         // store rows per slot
    d: u32,           // channels of an entry (= D)
    width: u32,       // coff·d
    overlap: u32,     // 1: ratio-4 style overlapping windows
    n_freq: u32,      // rotated pairs at the end of the entry
    out_off: u32,     // in elements
    eps: f32,
    win_off: u32,     // in u32 elements: windows[n_win] | slots[n_win] | cache rows[n_win]
    direct: u32,      // 1: window k goes to out row (its cache row), else out_off + k·d
    _pad: u32,
}
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> store: array<f32>;
@group(0) @binding(2) var<storage, read> norm_w: array<f32>;
@group(0) @binding(3) var<storage, read> table: array<u32>;
@group(0) @binding(4) var<storage, read> wins: array<u32>;
@group(0) @binding(5) var<storage, read_write> out: array<f32>;

var<workgroup> ent: array<f32, D>;
var<workgroup> red: array<f32, WG>;

// High 32 bits of the 64-bit product a·b (as shaders/rope.wgsl).
fn mul_hi(a: u32, b: u32) -> u32 {
    let a0 = a & 0xffffu;
    let a1 = a >> 16u;
    let b0 = b & 0xffffu;
    let b1 = b >> 16u;
    let p01 = a0 * b1;
    let p10 = a1 * b0;
    let mid = ((a0 * b0) >> 16u) + (p01 & 0xffffu) + (p10 & 0xffffu);
    return a1 * b1 + (p01 >> 16u) + (p10 >> 16u) + (mid >> 16u);
}

// (cos, sin) of u / 2^32 turns: exact octant reduction, then short polynomials (the method
// and coefficients of shaders/rope.wgsl, so entries rotate exactly as keys do).
fn cos_sin_turns(u: u32) -> vec2<f32> {
    let v = u + 0x20000000u;
    let q = v >> 30u;
    let r = i32(v & 0x3fffffffu) - 0x20000000;
    let t = f32(r) * 1.4629180792671596e-9;
    let z = t * t;
    let s = ((-1.9515295891e-4 * z + 8.3321608736e-3) * z - 1.6666654611e-1) * z * t + t;
    let c = ((2.443315711809948e-5 * z - 1.388731625493765e-3) * z + 4.166664568298827e-2) * z * z
        - 0.5 * z + 1.0;
    switch q {
        case 0u: { return vec2<f32>(c, s); }
        case 1u: { return vec2<f32>(-s, c); }
        case 2u: { return vec2<f32>(-c, -s); }
        default: { return vec2<f32>(s, -c); }
    }
}

// Score and kv of position q, channel c of the store row (slot base row sb).
fn sc_at(sb: u32, q: u32, c: u32) -> f32 { return store[(sb + q % p.cap) * 2u * p.width + p.width + c]; }
fn kv_at(sb: u32, q: u32, c: u32) -> f32 { return store[(sb + q % p.cap) * 2u * p.width + c]; }

@compute @workgroup_size(WG)
fn pool(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
    let k = wid.x + wid.y * nwg.x;
    if (k >= p.n_win) { return; }
    let w = wins[p.win_off + k];
    let sb = wins[p.win_off + p.n_win + k] * p.cap;
    let m = p.ratio;
    let d = p.d;
    let overlap = p.overlap != 0u;
    // Rows (position, channel offset) of the window: the previous window's [0, d) channels
    // when overlapping (none before window 0), then this window's (offset d when overlapping).
    let has_prev = overlap && w > 0u;
    let cur_off = select(0u, d, overlap);
    var ss = 0.0;
    for (var c = lid; c < d; c += WG) {
        var mx = NEG;
        if (has_prev) {
            for (var r = 0u; r < m; r++) { mx = max(mx, sc_at(sb, (w - 1u) * m + r, c)); }
        }
        for (var r = 0u; r < m; r++) { mx = max(mx, sc_at(sb, w * m + r, cur_off + c)); }
        var num = 0.0;
        var den = 0.0;
        if (has_prev) {
            for (var r = 0u; r < m; r++) {
                let q = (w - 1u) * m + r;
                let e = exp(sc_at(sb, q, c) - mx);
                num += e * kv_at(sb, q, c);
                den += e;
            }
        }
        for (var r = 0u; r < m; r++) {
            let q = w * m + r;
            let e = exp(sc_at(sb, q, cur_off + c) - mx);
            num += e * kv_at(sb, q, cur_off + c);
            den += e;
        }
        let v = num / den;
        ent[c] = v;
        ss += v * v;
    }
    red[lid] = ss;
    workgroupBarrier();
    for (var s = WG / 2u; s > 0u; s >>= 1u) {
        if (lid < s) { red[lid] += red[lid + s]; }
        workgroupBarrier();
    }
    let rn = inverseSqrt(red[0] / f32(d) + p.eps);
    for (var c = lid; c < d; c += WG) { ent[c] = ent[c] * rn * norm_w[c]; }
    workgroupBarrier();
    let n_freq = p.n_freq;
    let rot = d - 2u * n_freq;
    let pos = w * m;
    for (var f = lid; f < n_freq; f += WG) {
        let turns = pos * table[2u * f] + mul_hi(pos, table[2u * f + 1u]);
        let cs = cos_sin_turns(turns);
        let a = ent[rot + 2u * f];
        let b = ent[rot + 2u * f + 1u];
        ent[rot + 2u * f] = a * cs.x - b * cs.y;
        ent[rot + 2u * f + 1u] = b * cs.x + a * cs.y;
    }
    workgroupBarrier();
    let ob = select(p.out_off + k * d, wins[p.win_off + 2u * p.n_win + k] * d, p.direct != 0u);
    for (var c = lid; c < d; c += WG) { out[ob + c] = ent[c]; }
}
#endif

#if SCORE
// Workgroup: one token, WG entries (one per thread). Query heads go through workgroup memory
// HG at a time (HG·D floats), so each thread reads its key row once per group of heads.
const WG = 64u;
struct Params {
    n_tok: u32,
    row0: u32,        // table row of token 0
    ratio: u32,
    n_ent: u32,       // entries per score row
    n_head: u32,
    d: u32,           // indexer head size (= D)
    scale: f32,       // d^-½ · n_head^-½
    tab_rows: u32,
    cap_e: u32,       // cache entries per slot
    q_row0: u32,      // q / w row of token 0
    _pad0: u32,
    _pad1: u32,
}
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> q: array<f32>;
@group(0) @binding(2) var<storage, read> wts: array<f32>;
@group(0) @binding(3) var<storage, read> keys: array<f32>;
@group(0) @binding(4) var<storage, read> tab: array<u32>;
@group(0) @binding(5) var<storage, read_write> scores: array<f32>;

var<workgroup> qs: array<f32, HG * D>;

@compute @workgroup_size(WG)
fn score(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
         @builtin(local_invocation_index) lid: u32) {
    let gid = wid.x + wid.y * nwg.x;
    let tiles = (p.n_ent + WG - 1u) / WG;
    let t = gid / tiles;
    if (t >= p.n_tok) { return; }
    let i = (gid % tiles) * WG + lid;
    let nh = p.n_head;
    let pos = tab[p.row0 + t];
    let slot = tab[p.tab_rows + p.row0 + t];
    let n_vis = min((pos + 1u) / p.ratio, p.n_ent);
    let live = i < n_vis;
    let kb = (slot * p.cap_e + select(0u, i, live)) * D;
    var acc = 0.0;
    for (var h0 = 0u; h0 < nh; h0 += HG) {
        let hn = min(HG, nh - h0);
        for (var c = lid; c < hn * D; c += WG) { qs[c] = q[((p.q_row0 + t) * nh + h0) * D + c]; }
        workgroupBarrier();
        if (live) {
            var dots: array<f32, HG>;
            for (var c = 0u; c < D; c++) {
                let kc = keys[kb + c];
                for (var j = 0u; j < HG; j++) { dots[j] += qs[j * D + c] * kc; }
            }
            for (var j = 0u; j < hn; j++) { acc += max(dots[j], 0.0) * wts[(p.q_row0 + t) * nh + h0 + j]; }
        }
        workgroupBarrier();
    }
    if (i < p.n_ent) { scores[t * p.n_ent + i] = select(NEG, acc * p.scale, live); }
}
#endif

#if SELECT
// Workgroup: one token. The k-th largest score is found by bisection on order-preserving
// u32 keys (32 counting passes), then the entries above it and the lowest-index ones equal
// to it are written in index order (two workgroup prefix sums per WG entries): the same set
// as a full sort with ties to the lower index, at O(32·n) instead of O(n²).
const WG = 256u;
struct Params {
    n_tok: u32,
    row0: u32,        // table row of token 0
    ratio: u32,
    n_ent: u32,       // entries per score row
    k: u32,
    idx_stride: u32,  // slots per token of the index list
    idx_off: u32,     // in u32 elements: token 0's list
    window: u32,      // the token's slots start after its min(window, pos+1) window slots
    tab_rows: u32,
    cap_e: u32,       // cache entries per slot
    _pad0: u32,
    _pad1: u32,
}
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> scores: array<f32>;
@group(0) @binding(2) var<storage, read> tab: array<u32>;
@group(0) @binding(3) var<storage, read_write> idx: array<u32>;

var<workgroup> red: array<u32, WG>;
var<workgroup> wg_row: vec2<u32>;   // the token's (position, slot)

// Larger float ↔ larger key (negative floats: all bits flipped; others: sign bit set).
fn key(v: f32) -> u32 {
    let b = bitcast<u32>(v);
    return select(b | 0x80000000u, ~b, (b & 0x80000000u) != 0u);
}

fn wg_sum(v: u32, lid: u32) -> u32 {
    red[lid] = v;
    workgroupBarrier();
    for (var s = WG / 2u; s > 0u; s >>= 1u) {
        if (lid < s) { red[lid] += red[lid + s]; }
        workgroupBarrier();
    }
    let r = red[0];
    workgroupBarrier();
    return r;
}

// Exclusive prefix sum over the workgroup (Hillis–Steele); .y = the total.
fn wg_scan(v: u32, lid: u32) -> vec2<u32> {
    red[lid] = v;
    workgroupBarrier();
    for (var s = 1u; s < WG; s <<= 1u) {
        var add = 0u;
        if (lid >= s) { add = red[lid - s]; }
        workgroupBarrier();
        red[lid] += add;
        workgroupBarrier();
    }
    let r = vec2<u32>(red[lid] - v, red[WG - 1u]);
    workgroupBarrier();
    return r;
}

@compute @workgroup_size(WG)
fn select_topk(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
               @builtin(local_invocation_index) lid: u32) {
    let t = wid.x + wid.y * nwg.x;
    if (t >= p.n_tok) { return; }
    // Through workgroup memory: the loops below hold barriers, so their bounds must be uniform.
    if (lid == 0u) { wg_row = vec2<u32>(tab[p.row0 + t], tab[p.tab_rows + p.row0 + t]); }
    let pt = workgroupUniformLoad(&wg_row);
    let pos = pt.x;
    let base = SRC_B | (pt.y * p.cap_e);
    let n_vis = min((pos + 1u) / p.ratio, p.n_ent);
    let k = p.k;
    let row = t * p.n_ent;
    let out = p.idx_off + t * p.idx_stride + min(p.window, pos + 1u);
    if (n_vis <= k) {
        for (var s = lid; s < n_vis; s += WG) { idx[out + s] = base + s; }
        return;
    }
    // T = the largest key with at least k keys ≥ T: the k-th largest.
    var thr = 0u;
    for (var bit = 31i; bit >= 0i; bit--) {
        let cand = thr | (1u << u32(bit));
        var c = 0u;
        for (var i = lid; i < n_vis; i += WG) { c += select(0u, 1u, key(scores[row + i]) >= cand); }
        if (wg_sum(c, lid) >= k) { thr = cand; }
    }
    var c = 0u;
    for (var i = lid; i < n_vis; i += WG) { c += select(0u, 1u, key(scores[row + i]) > thr); }
    let quota = k - wg_sum(c, lid);   // entries equal to T to take, lowest index first
    var done = 0u;
    var eq_seen = 0u;
    for (var c0 = 0u; c0 < n_vis; c0 += WG) {
        let i = c0 + lid;
        var kk = 0u;
        if (i < n_vis) { kk = key(scores[row + i]); }
        let gt = i < n_vis && kk > thr;
        let eq = i < n_vis && kk == thr;
        let e = wg_scan(select(0u, 1u, eq), lid);
        let take = gt || (eq && eq_seen + e.x < quota);
        let tk = wg_scan(select(0u, 1u, take), lid);
        if (take) { idx[out + done + tk.x] = base + i; }
        done += tk.y;
        eq_seen += e.y;
    }
}
#endif

#if INDEX
const WG = 256u;
struct Params {
    n_tok: u32,
    row0: u32,        // table row of token 0
    n_idx: u32,       // slots per token
    idx_off: u32,     // in u32 elements: token 0's list
    window: u32,
    ring: u32,        // rows of a slot's window ring
    ratio: u32,       // compressed entries: i < (pos+1)/ratio (0: none)
    fill_comp: u32,   // 1: write the compressed slots too (else the indexer owns them)
    top_k: u32,       // the indexer's picks (fill_comp 0)
    tab_rows: u32,
    cap_e: u32,       // cache entries per slot
    _pad: u32,
}
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> tab: array<u32>;
@group(0) @binding(2) var<storage, read_write> idx: array<u32>;

@compute @workgroup_size(WG)
fn index_list(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
              @builtin(local_invocation_index) lid: u32) {
    let g = (wid.x + wid.y * nwg.x) * WG + lid;
    if (g >= p.n_tok * p.n_idx) { return; }
    let t = g / p.n_idx;
    let i = g - t * p.n_idx;
    let pos = tab[p.row0 + t];
    let slot = tab[p.tab_rows + p.row0 + t];
    let n_win = min(p.window, pos + 1u);
    var n_comp = 0u;
    if (p.ratio > 0u) { n_comp = (pos + 1u) / p.ratio; }
    var v = INVALID;
    if (i < n_win) {
        v = slot * p.ring + (pos - i) % p.ring;
    } else if (p.fill_comp != 0u) {
        let c = i - n_win;
        if (c < n_comp) { v = SRC_B | (slot * p.cap_e + c); }
    } else if (i - n_win < min(p.top_k, n_comp)) {
        return;
    }
    idx[p.idx_off + g] = v;
}
#endif
