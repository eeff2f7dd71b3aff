// What a row norm's threads load (norm.wgsl, sandwich.wgsl): items of an element, or of 4 with
// V4 (T; L elements per item; sq an item's sum of squares), and element j of a norm weight
// stored as f32, f16 or bf16 (W_F16 / W_BF16, f32 otherwise): norm_dec of its buffer's word
// norm_word(j).

#if V4
alias T = vec4<f32>;
const L = 4u;
fn sq(v: T) -> f32 { return dot(v, v); }
#else
alias T = f32;
const L = 1u;
fn sq(v: T) -> f32 { return v * v; }
#endif

fn norm_word(j: u32) -> u32 {
#if W_F16
    return j >> 1u;
#else
#if W_BF16
    return j >> 1u;
#else
    return j;
#endif
#endif
}

fn norm_dec(u: u32, j: u32) -> f32 {
#if W_F16
    return unpack2x16float(u)[j & 1u];
#else
#if W_BF16
    return bitcast<f32>(select(u << 16u, u & 0xffff0000u, (j & 1u) == 1u));
#else
    return bitcast<f32>(u);
#endif
#endif
}
