// Score-function MoE router (DeepSeek-V3/V4, model.py `Gate`): one workgroup per token.
// Wrapper and shapes: src/gpu/router.rs; CPU reference: src/cpu/router.rs.
//
// scores = f(logits): FUNC 0 softmax over the experts, 1 sigmoid, 2 sqrt(softplus) (torch's
// softplus: linear above 20). Selection: the top k of scores + bias (the bias only steers the
// choice; ties to the lower index), or, on hash layers, the token's row of a table of expert
// ids (f32 [vocab, k]). Weights: the chosen experts' unbiased scores, renormalised to sum 1
// when `renorm`, times `route_scale`. Output: ids (u32 [n, k]) and weights (f32 [n, k]), in
// rank order (table order on hash layers).
//
// NE (a define) bounds the experts held in workgroup memory.
// Bindings: 1 logits, 2 bias, 3 table, 4 tokens (u32), 5 ids, 6 weights. Every binding is
// always bound (the wrapper passes a stand-in for an unused one).
//
// COMBINE (its own entry): one thread per (token, d): y[t][d] += Σ_s w[t][s]·x[t·k + s][d],
// the routed experts' outputs weighed and added in slot order (one dispatch for all slots).
//
// EXPERT_SCALE (its own entry): one thread per (token, slot): w[i] *= scale[ids[i]], the
// chosen experts' weights times a learned per-expert factor (Gemma-4's
// `router.per_expert_scale`).

const WG = 256u;

#if COMBINE
struct CParams {
    n_tok: u32,
    n_embd: u32,
    k: u32,
    _pad: u32,
}
@group(0) @binding(0) var<uniform> cp: CParams;
@group(0) @binding(1) var<storage, read_write> y: array<f32>;
@group(0) @binding(2) var<storage, read> w: array<f32>;
@group(0) @binding(3) var<storage, read> x: array<f32>;

@compute @workgroup_size(WG)
fn combine(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
           @builtin(local_invocation_index) lid: u32) {
    let i = (wid.x + wid.y * nwg.x) * WG + lid;
    let e = cp.n_embd;
    if (i >= cp.n_tok * e) { return; }
    let t = i / e;
    let d = i - t * e;
    var acc = y[i];
    for (var s = 0u; s < cp.k; s++) { acc += w[t * cp.k + s] * x[(t * cp.k + s) * e + d]; }
    y[i] = acc;
}
#else
#if EXPERT_SCALE
struct SParams {
    n: u32,        // ids and weights (tokens · k)
    n_exp: u32,
    _pad0: u32,
    _pad1: u32,
}
@group(0) @binding(0) var<uniform> sp: SParams;
@group(0) @binding(1) var<storage, read_write> w: array<f32>;
@group(0) @binding(2) var<storage, read> ids: array<u32>;
@group(0) @binding(3) var<storage, read> scale: array<f32>;

@compute @workgroup_size(WG)
fn expert_scale(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                @builtin(local_invocation_index) lid: u32) {
    let i = (wid.x + wid.y * nwg.x) * WG + lid;
    if (i >= sp.n) { return; }
    // An id past the table (none comes from the router) leaves its weight as it is.
    let e = ids[i];
    if (e < sp.n_exp) { w[i] *= scale[e]; }
}
#else

struct Params {
    n_tok: u32,
    n_exp: u32,
    k: u32,
    func: u32,         // 0 softmax, 1 sigmoid, 2 sqrt(softplus)
    logits_off: u32,   // in elements
    logits_stride: u32,
    out_off: u32,      // ids and weights, in elements
    out_stride: u32,
    tok_off: u32,      // in u32 elements
    has_bias: u32,
    hash: u32,         // 1: ids from table[token]
    renorm: u32,
    route_scale: f32,
    _pad0: u32,
    _pad1: u32,
    _pad2: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> logits: array<f32>;
@group(0) @binding(2) var<storage, read> bias: array<f32>;
@group(0) @binding(3) var<storage, read> table: array<f32>;
@group(0) @binding(4) var<storage, read> tokens: array<u32>;
@group(0) @binding(5) var<storage, read_write> ids: array<u32>;
@group(0) @binding(6) var<storage, read_write> weights: array<f32>;

var<workgroup> sc: array<f32, NE>;
var<workgroup> sel: array<f32, NE>;
var<workgroup> chosen: array<u32, NE>;
var<workgroup> stat: array<f32, 2>;

fn score(l: f32) -> f32 {
    if (p.func == 1u) { return 1.0 / (1.0 + exp(-l)); }
    if (p.func == 2u) {
        // log1p(e^l): e^l itself where 1 + e^l would round to 1.
        var sp = l;
        if (l < -15.0) { sp = exp(l); } else if (l <= 20.0) { sp = log(1.0 + exp(l)); }
        return sqrt(sp);
    }
    return l;
}

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
    let t = wid.x + wid.y * nwg.x;
    if (t >= p.n_tok) { return; }
    let lo = p.logits_off + t * p.logits_stride;
    for (var e = lid; e < p.n_exp; e += WG) { sc[e] = score(logits[lo + e]); }
    workgroupBarrier();
    if (p.func == 0u) {
        if (lid == 0u) {
            var mx = -3.0e38;
            for (var e = 0u; e < p.n_exp; e++) { mx = max(mx, sc[e]); }
            var s = 0.0;
            for (var e = 0u; e < p.n_exp; e++) { s += exp(sc[e] - mx); }
            stat[0] = mx;
            stat[1] = s;
        }
        workgroupBarrier();
        let mx = stat[0];
        let s = stat[1];
        for (var e = lid; e < p.n_exp; e += WG) { sc[e] = exp(sc[e] - mx) / s; }
        workgroupBarrier();
    }
    for (var e = lid; e < p.n_exp; e += WG) {
        var v = sc[e];
        if (p.has_bias != 0u) { v += bias[e]; }
        sel[e] = v;
    }
    workgroupBarrier();
    if (p.hash != 0u) {
        let tok = tokens[p.tok_off + t];
        for (var s = lid; s < p.k; s += WG) { chosen[s] = u32(table[tok * p.k + s]); }
    } else {
        // Rank of each expert: how many beat it (ties to the lower index).
        for (var e = lid; e < p.n_exp; e += WG) {
            let v = sel[e];
            var rank = 0u;
            for (var j = 0u; j < p.n_exp; j++) {
                let u = sel[j];
                rank += select(0u, 1u, u > v || (u == v && j < e));
            }
            if (rank < p.k) { chosen[rank] = e; }
        }
    }
    workgroupBarrier();
    if (lid == 0u) {
        var s = 0.0;
        for (var j = 0u; j < p.k; j++) { s += sc[chosen[j]]; }
        var f = p.route_scale;
        if (p.renorm != 0u) { f = f / s; }
        let oo = p.out_off + t * p.out_stride;
        for (var j = 0u; j < p.k; j++) {
            ids[oo + j] = chosen[j];
            weights[oo + j] = sc[chosen[j]] * f;
        }
    }
}
#endif
#endif
