// Attention kernels: KV-cache write, flash attention (online softmax over key tiles held in
// workgroup memory, GQA, causal / per-query ranges / per-query index lists, sinks, split-K
// partials) and the split-K combine. Wrapper and shapes: src/gpu/attention.rs; CPU
// reference: src/cpu/attention.rs.
//
// KV cache layout (all kernels): position-major rows, cache[row][kv_head][HD], one row per
// cached token holding every KV head, in f32 or f16 (`KV_F16`: pairs of halves in u32
// words). Row `r` of kv head `h` starts at element (r * n_head_kv + h) * HD.
//
// One of the flags ATTEND / COMBINE / WRITE selects the entry point's declarations (each
// entry has its own bindings). Binding 0: uniforms; storage from 1 in the wrapper's order.
// Grid: linear workgroup id = wid.x + wid.y * nwg.x (see gpu::grid).

const INVALID = 0xffffffffu;   // masked slot of an index list
const SRC_B = 0x80000000u;     // index-list bit: the row is in source B
const NEG = -1.0e30;           // "minus infinity" that stays finite (exp(NEG - m) == 0)

#if WRITE
// ---------------------------------------------------------------------------------------
// KV write: cache rows <- f32 source rows. HD is unused here; WIDTH elements per row.
const WG_W = 256u;

struct WParams {
    n_tok: u32,       // tokens to write
    width: u32,       // elements per row: n_head_kv * head_dim (even)
    src_off: u32,     // in elements: token 0's first element in `src`
    src_stride: u32,  // in elements between tokens of `src`
    row0: u32,        // destination row of token 0 when use_rows == 0
    rows_off: u32,    // in u32 elements: token 0's destination row in `rows`
    use_rows: u32,    // 1: destination row of token t is rows[rows_off + t]
    pad: u32,
}

@group(0) @binding(0) var<uniform> p: WParams;
@group(0) @binding(1) var<storage, read> src: array<f32>;
@group(0) @binding(2) var<storage, read> rows: array<u32>;
#if KV_F16
@group(0) @binding(3) var<storage, read_write> cache: array<u32>;   // f16 pairs
#else
@group(0) @binding(3) var<storage, read_write> cache: array<f32>;
#endif

@compute @workgroup_size(WG_W)
fn write_kv(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
            @builtin(local_invocation_index) lid: u32) {
    let i = (wid.x + wid.y * nwg.x) * WG_W + lid;
#if KV_F16
    // One thread per pair of halves.
    let per_tok = p.width / 2u;
#else
    let per_tok = p.width;
#endif
    if (i >= p.n_tok * per_tok) { return; }
    let t = i / per_tok;
    let e = i % per_tok;
    var row = p.row0 + t;
    if (p.use_rows != 0u) { row = rows[p.rows_off + t]; }
    let s = p.src_off + t * p.src_stride;
#if KV_F16
    // pack2x16float rounds to nearest even on the drivers tested (lavapipe, NVIDIA).
    cache[row * per_tok + e] = pack2x16float(vec2<f32>(src[s + 2u * e], src[s + 2u * e + 1u]));
#else
    cache[row * per_tok + e] = src[s + e];
#endif
}
#endif

#if ATTEND
// ---------------------------------------------------------------------------------------
// Flash attention. Defines: HD (head_dim, multiple of 4), BR (query rows per tile), TPR
// (threads per row), BK (keys per tile).
//
// A tile is BR query rows of one KV head; a row is a (token, q head of the group) pair, so
// the group's heads share every key tile (GQA: q head = kv_head * G + g, G = n_head /
// n_head_kv, as llama.cpp and HF repeat_kv). Causal mode flattens rows over (token, g) so a
// tile may hold several tokens; the per-query modes keep one token per tile (its keys are
// its own). Thread (r, s) of a tile owns row r and the vec4 columns c = s + TPR * i of Q
// (in registers, pre-scaled) and of the output accumulator.
//
// Per key tile: store K (fetched a tile ahead) and fetch the next tile -> partial dots ->
// reduce to scores, store V -> per-row online-softmax update -> O = O * alpha + P V.
const HD4 = HD / 4;
const WG = BR * TPR;
const NC = (HD4 + TPR - 1) / TPR;   // vec4 columns per thread
const LPT = (BK * HD4 + WG - 1) / WG; // tile vec4 loads per thread
const BKP = BK + 1;                 // padded stride of `red`: partial writes hit distinct banks
const PS = HD + 2;                  // split partial stride: o[HD], m, l

const MODE_CAUSAL = 0u;
const MODE_RANGES = 1u;
const MODE_INDEX = 2u;
const MODE_ROWS = 3u;
const FLAG_SINK = 1u;
const FLAG_SHARED_KV = 2u;
const FLAG_SPLIT = 4u;

struct Params {
    mode: u32,           // MODE_*
    n_q: u32,            // query tokens
    n_head: u32,         // q heads
    n_head_kv: u32,      // kv heads (divides n_head)
    q_off: u32,          // in elements: q[t][head][d] at q_off + t*q_tok_stride + head*q_head_stride + d
    q_tok_stride: u32,   // in elements
    q_head_stride: u32,  // in elements
    o_off: u32,          // in elements: out[t][head][d] at o_off + t*o_tok_stride + head*HD + d
    o_tok_stride: u32,   // in elements
    row0: u32,           // causal: cache row of position 0
    pos0: u32,           // causal: position of query token 0
    n_keys: u32,         // causal: rows written (positions 0..n_keys); index: list length n_idx
    window: u32,         // causal: 0 = unlimited, else key j visible iff pos - j < window
    aux_off: u32,        // in u32 elements: ranges: desc[t] = (first row, n) at aux_off + 2t;
                         // index: idx[t][i] at aux_off + t*n_keys + i; rows: desc[t] =
                         // (n_idx, n_split, split_len, list) at aux_off + 4t, idx[i] at list + i
    sink_off: u32,       // in elements: sink of q head h at sinks[sink_off + h]
    flags: u32,          // FLAG_*
    n_split: u32,        // key splits (1 = none)
    split_len: u32,      // keys per split (multiple of BK)
    n_tiles: u32,        // row tiles per kv head
    tiles_per_tok: u32,  // per-query modes: tiles of one token = ceil(G / BR)
    n_groups: u32,       // workgroups: n_tiles * n_head_kv * n_split
    scale: f32,          // softmax scale applied to q.k (sinks are not scaled)
    pad0: u32,
    pad1: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> q: array<f32>;
#if KV_F16
// Raw tile element: 4 halves in two words (8-byte loads).
alias Raw = vec2<u32>;
fn widen(w: Raw) -> vec4<f32> { return vec4<f32>(unpack2x16float(w.x), unpack2x16float(w.y)); }
#else
alias Raw = vec4<f32>;
fn widen(w: Raw) -> vec4<f32> { return w; }
#endif
@group(0) @binding(2) var<storage, read> k_a: array<Raw>;
@group(0) @binding(3) var<storage, read> v_a: array<Raw>;
@group(0) @binding(4) var<storage, read> k_b: array<Raw>;
@group(0) @binding(5) var<storage, read> v_b: array<Raw>;
@group(0) @binding(6) var<storage, read> aux: array<u32>;
@group(0) @binding(7) var<storage, read> sinks: array<f32>;
// out[t][head][HD], or split partials [n_q * n_head][n_split][PS] (rows t * n_head + head).
@group(0) @binding(8) var<storage, read_write> dst: array<f32>;

var<workgroup> kv: array<vec4<f32>, BK * HD4>;    // key tile, then value tile [BK][HD4]
var<workgroup> red: array<f32, BR * TPR * BKP>;    // partial dots [r][s][k]
var<workgroup> sc: array<f32, BR * BK>;            // scores [r][k] (NEG = masked)
var<workgroup> pr: array<f32, BR * BK>;            // probabilities [r][k]
var<workgroup> wg_lo: u32;
var<workgroup> wg_hi: u32;
var<workgroup> wg_first: u32;

// Raw loads of the next tile, issued a tile ahead so their latency hides behind the
// current tile's arithmetic. Bit j of `kbad`: this thread's element j is a masked key.
var<private> kreg: array<Raw, LPT>;
var<private> vreg: array<Raw, LPT>;
var<private> kbad: u32;

// Cache row of key index `i` for token `t` (SRC_B bit for source B), INVALID if masked.
fn key_row(i: u32, hi: u32, t: u32, first: u32) -> u32 {
    if (i >= hi) { return INVALID; }
    if (p.mode == MODE_CAUSAL) { return p.row0 + i; }
    if (p.mode == MODE_RANGES) { return first + i; }
    if (p.mode == MODE_ROWS) { return aux[first + i]; }
    return aux[p.aux_off + t * p.n_keys + i];
}

// Issue this thread's loads of the tile at key index `kb`. Masked keys read row 0 of A
// (and are stored as zeros, so never-written rows cannot inject NaN).
fn fetch(kb: u32, hi: u32, lid: u32, h: u32, t: u32, first: u32, shared_kv: bool) {
    kbad = 0u;
    for (var j = 0u; j < LPT; j++) {
        let e = min(lid + j * WG, BK * HD4 - 1u);
        let kr = key_row(kb + e / HD4, hi, t, first);
        let bad = kr == INVALID;
        kbad |= select(0u, 1u << j, bad);
        let i = (select(kr & ~SRC_B, 0u, bad) * p.n_head_kv + h) * HD4 + e % HD4;
        if (!bad && (kr & SRC_B) != 0u) {
            kreg[j] = k_b[i];
            if (!shared_kv) { vreg[j] = v_b[i]; }
        } else {
            kreg[j] = k_a[i];
            if (!shared_kv) { vreg[j] = v_a[i]; }
        }
    }
}

@compute @workgroup_size(WG)
fn attend(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
          @builtin(local_invocation_index) lid: u32) {
    let gid = wid.x + wid.y * nwg.x;
    if (gid >= p.n_groups) { return; }
    let tile = gid % p.n_tiles;
    let rest = gid / p.n_tiles;
    let h = rest % p.n_head_kv;
    let split = rest / p.n_head_kv;
    let G = p.n_head / p.n_head_kv;
    let r = lid / TPR;
    let s = lid % TPR;
    let per_tok = p.mode != MODE_CAUSAL;
    let shared_kv = (p.flags & FLAG_SHARED_KV) != 0u;

    // This thread's row: token t, group head g.
    var t: u32;
    var g: u32;
    var valid: bool;
    if (per_tok) {
        t = tile / p.tiles_per_tok;
        g = (tile % p.tiles_per_tok) * BR + r;
        valid = g < G;
    } else {
        let rho = tile * BR + r;
        t = rho / G;
        g = rho % G;
        valid = rho < p.n_q * G;
    }
    let head = h * G + g;
    let pos = p.pos0 + t;   // causal only

    // Key index range of this workgroup (uniform: computed once, read with a barrier).
    if (lid == 0u) {
        var lo = 0u;
        var hi = 0u;
        var first = 0u;
        if (p.mode == MODE_CAUSAL) {
            let rho0 = tile * BR;
            let rho1 = min(rho0 + BR, p.n_q * G) - 1u;
            let pos_first = p.pos0 + rho0 / G;
            let pos_last = p.pos0 + rho1 / G;
            hi = min(p.n_keys, pos_last + 1u);
            if (p.window != 0u && pos_first + 1u > p.window) { lo = pos_first + 1u - p.window; }
        } else if (p.mode == MODE_RANGES) {
            let tt = tile / p.tiles_per_tok;
            first = aux[p.aux_off + 2u * tt];
            hi = aux[p.aux_off + 2u * tt + 1u];
        } else if (p.mode == MODE_ROWS) {
            // The token's own list length and split, as a one-token call would pick them;
            // splits past its own count are left empty (the combine reads its count).
            let d = p.aux_off + 4u * (tile / p.tiles_per_tok);
            let n_split = aux[d + 1u];
            let split_len = aux[d + 2u];
            first = aux[d + 3u];
            if (split < n_split) {
                lo = split * split_len;
                hi = min(aux[d], (split + 1u) * split_len);
            }
        } else {
            hi = p.n_keys;
        }
        if (p.n_split > 1u && p.mode != MODE_ROWS) {
            lo = max(lo, split * p.split_len);
            hi = min(hi, (split + 1u) * p.split_len);
        }
        wg_lo = lo;
        wg_hi = max(lo, hi);
        wg_first = first;
    }
    let lo = workgroupUniformLoad(&wg_lo);
    let hi = workgroupUniformLoad(&wg_hi);
    let first = workgroupUniformLoad(&wg_first);

    // Q row slice in registers, scale folded in; output accumulator; the row's running max
    // (the same in every thread of a row) and this thread's share of the running sum.
    var qv: array<vec4<f32>, NC>;
    var o: array<vec4<f32>, NC>;
    var m_run = NEG;
    var l_part = 0.0;
    let qbase = p.q_off + t * p.q_tok_stride + head * p.q_head_stride;
    for (var i = 0u; i < NC; i++) {
        let c = s + TPR * i;
        o[i] = vec4<f32>(0.0);
        qv[i] = vec4<f32>(0.0);
        if (valid && c < HD4) {
            let j = qbase + 4u * c;
            qv[i] = vec4<f32>(q[j], q[j + 1u], q[j + 2u], q[j + 3u]) * p.scale;
        }
    }

    if (lo < hi) { fetch(lo, hi, lid, h, t, first, shared_kv); }
    var vcur: array<Raw, LPT>;
    for (var kb = lo; kb < hi; kb += BK) {
        // 1. Store the fetched key tile; keep its values in registers; fetch the next tile.
        for (var j = 0u; j < LPT; j++) {
            let e = lid + j * WG;
            if (e < BK * HD4) {
                kv[e] = select(widen(kreg[j]), vec4<f32>(0.0), ((kbad >> j) & 1u) != 0u);
            }
        }
        vcur = vreg;
        let vbad = kbad;
        workgroupBarrier();
        if (kb + BK < hi) { fetch(kb + BK, hi, lid, h, t, first, shared_kv); }
        // 2. Partial dots over this thread's columns.
        if (valid) {
            for (var k = 0u; k < BK; k++) {
                var acc = 0.0;
                for (var i = 0u; i < NC; i++) {
                    let c = s + TPR * i;
                    if (c < HD4) { acc += dot(qv[i], kv[k * HD4 + c]); }
                }
                red[(r * TPR + s) * BKP + k] = acc;
            }
        }
        workgroupBarrier();
        // 3. Scores (masked to NEG); the value tile replaces the key tile unless V is K.
        if (valid) {
            for (var k = s; k < BK; k += TPR) {
                var x = 0.0;
                for (var j = 0u; j < TPR; j++) { x += red[(r * TPR + j) * BKP + k]; }
                let kp = kb + k;
                var masked = key_row(kp, hi, t, first) == INVALID;
                if (p.mode == MODE_CAUSAL) {
                    masked = masked || kp > pos || (p.window != 0u && pos - kp >= p.window);
                }
                sc[r * BK + k] = select(x, NEG, masked);
            }
        }
        if (!shared_kv) {
            for (var j = 0u; j < LPT; j++) {
                let e = lid + j * WG;
                if (e < BK * HD4) {
                    kv[e] = select(widen(vcur[j]), vec4<f32>(0.0), ((vbad >> j) & 1u) != 0u);
                }
            }
        }
        workgroupBarrier();
        // 4. Online softmax: every thread of a row finds the same new max; each turns its
        // own keys into probabilities and keeps its share of the sum.
        var alpha = 1.0;
        if (valid) {
            var mx = m_run;
            for (var k = 0u; k < BK; k++) { mx = max(mx, sc[r * BK + k]); }
            alpha = exp(m_run - mx);
            var sum = 0.0;
            for (var k = s; k < BK; k += TPR) {
                let x = sc[r * BK + k];
                let e = select(exp(x - mx), 0.0, x == NEG);
                pr[r * BK + k] = e;
                sum += e;
            }
            l_part = l_part * alpha + sum;
            m_run = mx;
        }
        workgroupBarrier();
        // 5. O = O * alpha + P V.
        if (valid) {
            for (var i = 0u; i < NC; i++) { o[i] *= alpha; }
            for (var k = 0u; k < BK; k++) {
                let pk = pr[r * BK + k];
                for (var i = 0u; i < NC; i++) {
                    let c = s + TPR * i;
                    if (c < HD4) { o[i] += pk * kv[k * HD4 + c]; }
                }
            }
        }
        workgroupBarrier();   // the next tile overwrites kv
    }

    // The row's sum: add the threads' shares (`red` is free after the last step 3).
    red[lid] = l_part;
    workgroupBarrier();
    if (!valid) { return; }
    var l = 0.0;
    for (var j = 0u; j < TPR; j++) { l += red[r * TPR + j]; }
    let m = m_run;
    if ((p.flags & FLAG_SPLIT) != 0u) {
        let base = ((t * p.n_head + head) * p.n_split + split) * PS;
        for (var i = 0u; i < NC; i++) {
            let c = s + TPR * i;
            if (c < HD4) {
                let j = base + 4u * c;
                dst[j] = o[i].x;
                dst[j + 1u] = o[i].y;
                dst[j + 2u] = o[i].z;
                dst[j + 3u] = o[i].w;
            }
        }
        if (s == 0u) {
            dst[base + HD] = m;
            dst[base + HD + 1u] = l;
        }
        return;
    }
    // softmax over [scores..., sink]: the sink adds exp(sink - M) to the denominator only.
    var f = select(0.0, 1.0 / l, l > 0.0);
    if ((p.flags & FLAG_SINK) != 0u) {
        let sk = sinks[p.sink_off + head];
        let mm = max(m, sk);
        f = exp(m - mm) / (l * exp(m - mm) + exp(sk - mm));
    }
    let obase = p.o_off + t * p.o_tok_stride + head * HD;
    for (var i = 0u; i < NC; i++) {
        let c = s + TPR * i;
        if (c < HD4) {
            let j = obase + 4u * c;
            let y = o[i] * f;
            dst[j] = y.x;
            dst[j + 1u] = y.y;
            dst[j + 2u] = y.z;
            dst[j + 3u] = y.w;
        }
    }
}
#endif

#if COMBINE
// ---------------------------------------------------------------------------------------
// Split-K combine: out = sum_s e^(m_s - M) o_s / (sum_s e^(m_s - M) l_s [+ e^(sink - M)]),
// M the largest m_s of a non-empty split (and the sink). One workgroup per (row, chunk of
// WG_C output elements), rows being (token, head): each computes the split weights once
// (in parallel), then each thread sums one output element over the splits with four
// independent accumulators (loads in flight). Defines: HD, MAX_SPLIT.
const WG_C = 64u;
const PS = HD + 2;
const N_CHUNK = (HD + WG_C - 1) / WG_C;

struct CParams {
    n_rows: u32,        // n_q * n_head
    n_head: u32,
    n_split: u32,       // <= MAX_SPLIT
    o_off: u32,         // in elements, as attend
    o_tok_stride: u32,  // in elements
    sink_off: u32,      // in elements
    has_sink: u32,
    desc_off: u32,      // in u32 elements: per-token splits at desc[desc_off + 4t + 1] (rows mode)
    use_desc: u32,      // 1: token t combines its own split count, else n_split
    pad0: u32,
    pad1: u32,
    pad2: u32,
}

@group(0) @binding(0) var<uniform> p: CParams;
@group(0) @binding(1) var<storage, read> part: array<f32>;   // [n_rows][n_split][PS]
@group(0) @binding(2) var<storage, read> sinks: array<f32>;
@group(0) @binding(3) var<storage, read> desc: array<u32>;
@group(0) @binding(4) var<storage, read_write> out: array<f32>;

var<workgroup> w: array<f32, MAX_SPLIT>;   // e^(m_s - M), 0 for empty splits
var<workgroup> red_c: array<f32, WG_C>;

@compute @workgroup_size(WG_C)
fn combine(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
           @builtin(local_invocation_index) lid: u32) {
    let gid = wid.x + wid.y * nwg.x;
    if (gid >= p.n_rows * N_CHUNK) { return; }
    let row = gid / N_CHUNK;
    let d = (gid % N_CHUNK) * WG_C + lid;
    let t = row / p.n_head;
    let head = row % p.n_head;
    let base = row * p.n_split * PS;
    var n_split = min(p.n_split, MAX_SPLIT);
    if (p.use_desc != 0u) { n_split = min(desc[p.desc_off + 4u * t + 1u], n_split); }
    var sk = NEG;
    if (p.has_sink != 0u) { sk = sinks[p.sink_off + head]; }
    var mx = NEG;
    for (var s = lid; s < n_split; s += WG_C) {
        if (part[base + s * PS + HD + 1u] > 0.0) { mx = max(mx, part[base + s * PS + HD]); }
    }
    red_c[lid] = mx;
    workgroupBarrier();
    mx = sk;
    for (var j = 0u; j < WG_C; j++) { mx = max(mx, red_c[j]); }
    workgroupBarrier();
    var den = 0.0;
    for (var s = lid; s < n_split; s += WG_C) {
        let l = part[base + s * PS + HD + 1u];
        let e = select(0.0, exp(part[base + s * PS + HD] - mx), l > 0.0);
        w[s] = e;
        den += e * l;
    }
    red_c[lid] = den;
    workgroupBarrier();
    den = select(0.0, exp(sk - mx), p.has_sink != 0u);
    for (var j = 0u; j < WG_C; j++) { den += red_c[j]; }
    if (d >= HD) { return; }
    let f = select(0.0, 1.0 / den, den > 0.0);
    var a = vec4<f32>(0.0);
    var s = 0u;
    for (; s + 4u <= n_split; s += 4u) {
        let j = base + s * PS + d;
        a += vec4<f32>(w[s], w[s + 1u], w[s + 2u], w[s + 3u])
           * vec4<f32>(part[j], part[j + PS], part[j + 2u * PS], part[j + 3u * PS]);
    }
    for (; s < n_split; s++) { a.x += w[s] * part[base + s * PS + d]; }
    out[p.o_off + t * p.o_tok_stride + head * HD + d] = (a.x + a.y + a.z + a.w) * f;
}
#endif
