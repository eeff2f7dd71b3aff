// The MoE ids (IDX): matvec_id's [n_tokens, n_used] expert ids, the route of matmul.wgsl's
// matmul_id and matmul_coop.wgsl's matmul_coop_id.
#if Q8X
@group(0) @binding(6) var<storage, read> IDX: array<u32>;
#else
@group(0) @binding(5) var<storage, read> IDX: array<u32>;
#endif
