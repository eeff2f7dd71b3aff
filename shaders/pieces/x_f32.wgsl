// f32 x as stored (without Q8X).
#ifndef Q8X
// x[e..e+4] as stored (e a multiple of 4 when X is bound as vectors)
fn xraw4(e: u32) -> vec4<f32> {
#if XVEC
    return X[e >> 2u];
#else
    return vec4<f32>(X[e], X[e + 1u], X[e + 2u], X[e + 3u]);
#endif
}

fn xraw1(e: u32) -> f32 {
#if XVEC
    return X[e >> 2u][e & 3u];
#else
    return X[e];
#endif
}

#endif
