//! llama.cpp's scale searches (ggml-quants.c `make_qkx2_quants`, `make_qx_quants`, the scale
//! fit of `quantize_row_iq4_nl_impl`), run on 8 independent groups at once.
//!
//! Each search is a chain of dependent f32 sums; one group at a time it is latency-bound
//! (~40 MB/s). Lane k of every array here is group k, and each lane performs exactly the
//! scalar reference's operations in the reference's order, so the results are bit-identical
//! to running the groups one by one (the scalar versions in the tests below check that) while
//! the 8 chains fill the pipeline and vectorise.
//!
//! Inputs are transposed: `x[i][k]` is element i of group k.

#![allow(clippy::needless_range_loop)] // lane loops index several arrays in step

use super::k::nearest_int;

pub(super) const LANES: usize = 8;
pub(super) type Lf = [f32; LANES];

/// ggml's `GROUP_MAX_EPS`: a group whose largest magnitude is below this counts as zero.
pub(super) const GROUP_MAX_EPS: f32 = 1e-15;

#[inline(always)]
fn err<const MAD: bool>(d: f32) -> f32 {
    if MAD {
        d.abs()
    } else {
        d * d
    }
}

/// `make_qkx2_quants` on 8 groups of N: fit `x ≈ scale·L − the_min` with L in 0..=nmax and
/// min ≤ 0, weighted by `w`, over `nstep + 1` candidate scales (`rmin + rdelta·is + nmax`
/// steps over the range); a candidate is kept when its weighted error (|·| if MAD, else
/// squared) is lower. Writes the levels to `l` and returns (scale, the_min) per group.
pub(super) fn make_qkx2_x8<const N: usize, const MAD: bool>(
    nmax: i32,
    x: &[Lf; N],
    w: &[Lf; N],
    l: &mut [[u8; LANES]; N],
    rmin: f32,
    rdelta: f32,
    nstep: i32,
) -> (Lf, Lf) {
    let (mut min, mut max) = (x[0], x[0]);
    let mut sum_w = w[0];
    let mut sum_x = [0f32; LANES];
    for k in 0..LANES {
        sum_x[k] = sum_w[k] * x[0][k];
    }
    for i in 1..N {
        for k in 0..LANES {
            let v = x[i][k];
            if v < min[k] {
                min[k] = v;
            }
            if v > max[k] {
                max[k] = v;
            }
            sum_w[k] += w[i][k];
            sum_x[k] += w[i][k] * v;
        }
    }
    let mut flat = [false; LANES];
    for k in 0..LANES {
        if min[k] > 0.0 {
            min[k] = 0.0;
        }
        flat[k] = max[k] == min[k];
    }
    let min0 = min;
    let mut iscale = [0f32; LANES];
    let mut scale = [0f32; LANES];
    for k in 0..LANES {
        iscale[k] = nmax as f32 / (max[k] - min[k]);
        scale[k] = 1.0 / iscale[k];
    }
    // Levels are kept as f32 in the loops: nearest_int's result is an integer below 2^22 in
    // magnitude, so clamping it as a float is exact and saves the int/float round trips.
    let nmaxf = nmax as f32;
    let level = |v: f32| (nearest_int(v) as f32).clamp(0.0, nmaxf);
    let mut lf = [[0f32; LANES]; N];
    let mut best_error = [0f32; LANES];
    for i in 0..N {
        for k in 0..LANES {
            let q = level(iscale[k] * (x[i][k] - min[k]));
            lf[i][k] = q;
            best_error[k] += w[i][k] * err::<MAD>(scale[k] * q + min[k] - x[i][k]);
        }
    }
    let mut laux = [[0f32; LANES]; N];
    for is in 0..=nstep {
        let num = rmin + rdelta * is as f32 + nmaxf;
        for k in 0..LANES {
            iscale[k] = num / (max[k] - min[k]);
        }
        let (mut sum_l, mut sum_l2, mut sum_xl) = ([0f32; LANES], [0f32; LANES], [0f32; LANES]);
        for i in 0..N {
            for k in 0..LANES {
                let q = level(iscale[k] * (x[i][k] - min[k]));
                laux[i][k] = q;
                sum_l[k] += w[i][k] * q;
                sum_l2[k] += w[i][k] * q * q;
                sum_xl[k] += w[i][k] * q * x[i][k];
            }
        }
        let (mut this_scale, mut this_min, mut ok) = ([0f32; LANES], [0f32; LANES], [false; LANES]);
        for k in 0..LANES {
            let det = sum_w[k] * sum_l2[k] - sum_l[k] * sum_l[k];
            ok[k] = det > 0.0;
            this_scale[k] = (sum_w[k] * sum_xl[k] - sum_x[k] * sum_l[k]) / det;
            this_min[k] = (sum_l2[k] * sum_x[k] - sum_l[k] * sum_xl[k]) / det;
            if this_min[k] > 0.0 {
                this_min[k] = 0.0;
                this_scale[k] = sum_xl[k] / sum_l2[k];
            }
        }
        let mut cur_error = [0f32; LANES];
        for i in 0..N {
            for k in 0..LANES {
                let d = this_scale[k] * laux[i][k] + this_min[k] - x[i][k];
                cur_error[k] += w[i][k] * err::<MAD>(d);
            }
        }
        let mut take = [false; LANES];
        for k in 0..LANES {
            take[k] = ok[k] && cur_error[k] < best_error[k];
        }
        if take.contains(&true) {
            for i in 0..N {
                for k in 0..LANES {
                    if take[k] {
                        lf[i][k] = laux[i][k];
                    }
                }
            }
            for k in 0..LANES {
                if take[k] {
                    best_error[k] = cur_error[k];
                    scale[k] = this_scale[k];
                    min[k] = this_min[k];
                }
            }
        }
    }
    for i in 0..N {
        for k in 0..LANES {
            l[i][k] = lf[i][k] as u8;
        }
    }
    // A flat group (max == min) returns early in the reference: no levels, no scale.
    let mut the_min = [0f32; LANES];
    for k in 0..LANES {
        if flat[k] {
            for li in l.iter_mut() {
                li[k] = 0;
            }
            scale[k] = 0.0;
            min[k] = min0[k];
        }
        the_min[k] = -min[k];
    }
    (scale, the_min)
}

/// The signed value of largest magnitude (first on ties) and that magnitude, per group.
#[inline]
fn signed_absmax<const N: usize>(x: &[Lf; N]) -> (Lf, Lf) {
    let (mut amax, mut max) = ([0f32; LANES], [0f32; LANES]);
    for xi in x {
        for k in 0..LANES {
            if xi[k].abs() > amax[k] {
                amax[k] = xi[k].abs();
                max[k] = xi[k];
            }
        }
    }
    (max, amax)
}

/// `make_qx_quants` with `rmse_type = 1` and no importance weights, on 8 groups of N:
/// symmetric levels −nmax..nmax−1 weighted by x², 19 candidate scales `−(nmax + 0.1·is)/max`,
/// least-squares scale of the best. Writes the levels offset by nmax; returns the scales.
pub(super) fn make_qx_x8<const N: usize>(nmax: i32, x: &[Lf; N], l: &mut [[i8; LANES]; N]) -> Lf {
    let (max, amax) = signed_absmax(x);
    let nmaxf = nmax as f32;
    let mut laux = [[0i8; LANES]; N];
    // One candidate: levels into `laux`, returns (Σ w·x·l, Σ w·l²).
    let fit = |iscale: &Lf, laux: &mut [[i8; LANES]; N]| {
        let (mut sumlx, mut suml2) = ([0f32; LANES], [0f32; LANES]);
        for i in 0..N {
            for k in 0..LANES {
                let v = x[i][k];
                let q = nearest_int(iscale[k] * v).clamp(-nmax, nmax - 1);
                laux[i][k] = (q + nmax) as i8;
                let qf = q as f32;
                let w = v * v;
                sumlx[k] += w * v * qf;
                suml2[k] += w * qf * qf;
            }
        }
        (sumlx, suml2)
    };
    let mut iscale = [0f32; LANES];
    for k in 0..LANES {
        iscale[k] = -nmaxf / max[k];
    }
    let (sumlx, suml2) = fit(&iscale, l);
    let (mut scale, mut best) = ([0f32; LANES], [0f32; LANES]);
    for k in 0..LANES {
        scale[k] = if suml2[k] != 0.0 {
            sumlx[k] / suml2[k]
        } else {
            0.0
        };
        best[k] = scale[k] * sumlx[k];
    }
    for is in -9..=9 {
        if is == 0 {
            continue;
        }
        for k in 0..LANES {
            iscale[k] = -(nmaxf + 0.1 * is as f32) / max[k];
        }
        let (sumlx, suml2) = fit(&iscale, &mut laux);
        let mut take = [false; LANES];
        for k in 0..LANES {
            take[k] = suml2[k] > 0.0 && sumlx[k] * sumlx[k] > best[k] * suml2[k];
            if take[k] {
                scale[k] = sumlx[k] / suml2[k];
                best[k] = scale[k] * sumlx[k];
            }
        }
        if take.contains(&true) {
            for i in 0..N {
                for k in 0..LANES {
                    if take[k] {
                        l[i][k] = laux[i][k];
                    }
                }
            }
        }
    }
    // An all-zero group (below GROUP_MAX_EPS) returns early in the reference.
    for k in 0..LANES {
        if amax[k] < GROUP_MAX_EPS {
            scale[k] = 0.0;
            for li in l.iter_mut() {
                li[k] = 0;
            }
        }
    }
    scale
}

/// ggml's `kvalues_iq4nl` (as in iq.rs; repeated here so the search stands alone).
const KV: [i8; 16] = super::iq::KVALUES_IQ4NL;

/// The table level nearest to `x` (ggml's `best_index_int8`: level j wins once 2x reaches
/// `KV[j−1] + KV[j]`, ties go up), as a count of the thresholds passed, which is what the
/// reference's branchless binary search computes and which vectorises.
#[inline(always)]
pub(super) fn best_index_iq4(x: f32) -> usize {
    let x2 = x + x;
    let mut idx = 0;
    for j in 1..16 {
        idx += (x2 >= (KV[j - 1] as i32 + KV[j] as i32) as f32) as usize;
    }
    idx
}

/// Thresholds and steps of the IQ4 table: level j wins once 2x ≥ `KV[j−1] + KV[j]`.
const IQ4_THRESH: [f32; 16] = {
    let mut t = [0f32; 16];
    let mut j = 1;
    while j < 16 {
        t[j] = (KV[j - 1] as i32 + KV[j] as i32) as f32;
        j += 1;
    }
    t
};
const IQ4_STEP: [f32; 16] = {
    let mut t = [0f32; 16];
    let mut j = 1;
    while j < 16 {
        t[j] = (KV[j] as i32 - KV[j - 1] as i32) as f32;
        j += 1;
    }
    t
};

/// `KV[best_index_iq4(x)]` as f32, by adding the steps of the thresholds passed (small
/// integers, so exact) instead of a table lookup, which keeps the lane loops vectorised.
#[inline(always)]
fn best_value_iq4(x: f32) -> f32 {
    let x2 = x + x;
    let mut q = KV[0] as f32;
    for j in 1..16 {
        q += if x2 >= IQ4_THRESH[j] {
            IQ4_STEP[j]
        } else {
            0.0
        };
    }
    q
}

/// The IQ4 scale fit of `quantize_row_iq4_nl_impl` (no importance weights: w = x²) with
/// `ntry` candidates on each side, on 8 groups of 32: the least-squares scale of the best
/// candidate. Returns the scales (0 for an all-zero group).
pub(super) fn fit_iq4_x8(x: &[Lf; 32], ntry: i32) -> Lf {
    let (max, amax) = signed_absmax(x);
    let v0 = KV[0] as f32;
    let sums = |id: &Lf| {
        let (mut sumqx, mut sumq2) = ([0f32; LANES], [0f32; LANES]);
        for xi in x {
            for k in 0..LANES {
                let v = xi[k];
                let q = best_value_iq4(id[k] * v);
                let w = v * v;
                sumqx[k] += w * q * v;
                sumq2[k] += w * q * q;
            }
        }
        (sumqx, sumq2)
    };
    let mut id = [0f32; LANES];
    for k in 0..LANES {
        id[k] = 1.0 / (-max[k] / v0);
    }
    let (sumqx, sumq2) = sums(&id);
    let (mut d, mut best) = ([0f32; LANES], [0f32; LANES]);
    for k in 0..LANES {
        d[k] = if sumq2[k] > 0.0 {
            sumqx[k] / sumq2[k]
        } else {
            0.0
        };
        best[k] = d[k] * sumqx[k];
    }
    for itry in -ntry..=ntry {
        for k in 0..LANES {
            id[k] = (itry + KV[0] as i32) as f32 / max[k];
        }
        let (sumqx, sumq2) = sums(&id);
        for k in 0..LANES {
            if sumq2[k] > 0.0 && sumqx[k] * sumqx[k] > best[k] * sumq2[k] {
                d[k] = sumqx[k] / sumq2[k];
                best[k] = d[k] * sumqx[k];
            }
        }
    }
    for k in 0..LANES {
        if amax[k] < GROUP_MAX_EPS {
            d[k] = 0.0;
        }
    }
    d
}

/// Transposes 8 consecutive groups of N elements into lanes: `out[i][k] = x[N·k + i]`.
#[inline]
pub(super) fn to_lanes<const N: usize>(x: &[f32]) -> [Lf; N] {
    let mut out = [[0f32; LANES]; N];
    for k in 0..LANES {
        for i in 0..N {
            out[i][k] = x[N * k + i];
        }
    }
    out
}

#[cfg(test)]
mod tests {
    //! The scalar reference searches, transcribed one group at a time, against the lane
    //! versions on random groups (normal, heavy-tailed, one-signed, flat and zero).
    use super::*;

    fn make_qkx2_ref<const N: usize, const MAD: bool>(
        nmax: i32,
        x: &[f32; N],
        w: &[f32; N],
        l: &mut [u8; N],
        rmin: f32,
        rdelta: f32,
        nstep: i32,
    ) -> (f32, f32) {
        let (mut min, mut max) = (x[0], x[0]);
        let mut sum_w = w[0];
        let mut sum_x = sum_w * x[0];
        for i in 1..N {
            if x[i] < min {
                min = x[i];
            }
            if x[i] > max {
                max = x[i];
            }
            sum_w += w[i];
            sum_x += w[i] * x[i];
        }
        if min > 0.0 {
            min = 0.0;
        }
        if max == min {
            l.fill(0);
            return (0.0, -min);
        }
        let e = |d: f32| if MAD { d.abs() } else { d * d };
        let iscale = nmax as f32 / (max - min);
        let mut scale = 1.0 / iscale;
        let mut best_error = 0f32;
        for i in 0..N {
            let q = nearest_int(iscale * (x[i] - min)).clamp(0, nmax);
            l[i] = q as u8;
            best_error += w[i] * e(scale * q as f32 + min - x[i]);
        }
        let mut laux = [0u8; N];
        for is in 0..=nstep {
            let iscale = (rmin + rdelta * is as f32 + nmax as f32) / (max - min);
            let (mut sum_l, mut sum_l2, mut sum_xl) = (0f32, 0f32, 0f32);
            for i in 0..N {
                let q = nearest_int(iscale * (x[i] - min)).clamp(0, nmax);
                laux[i] = q as u8;
                let lf = q as f32;
                sum_l += w[i] * lf;
                sum_l2 += w[i] * lf * lf;
                sum_xl += w[i] * lf * x[i];
            }
            let det = sum_w * sum_l2 - sum_l * sum_l;
            if det > 0.0 {
                let mut this_scale = (sum_w * sum_xl - sum_x * sum_l) / det;
                let mut this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det;
                if this_min > 0.0 {
                    this_min = 0.0;
                    this_scale = sum_xl / sum_l2;
                }
                let mut cur_error = 0f32;
                for i in 0..N {
                    cur_error += w[i] * e(this_scale * laux[i] as f32 + this_min - x[i]);
                }
                if cur_error < best_error {
                    *l = laux;
                    best_error = cur_error;
                    scale = this_scale;
                    min = this_min;
                }
            }
        }
        (scale, -min)
    }

    fn make_qx_ref<const N: usize>(nmax: i32, x: &[f32; N], l: &mut [i8; N]) -> f32 {
        let (mut max, mut amax) = (0f32, 0f32);
        for &v in x {
            if v.abs() > amax {
                amax = v.abs();
                max = v;
            }
        }
        if amax < GROUP_MAX_EPS {
            l.fill(0);
            return 0.0;
        }
        let mut iscale = -(nmax as f32) / max;
        let (mut sumlx, mut suml2) = (0f32, 0f32);
        for i in 0..N {
            let q = nearest_int(iscale * x[i]).clamp(-nmax, nmax - 1);
            l[i] = (q + nmax) as i8;
            let w = x[i] * x[i];
            sumlx += w * x[i] * q as f32;
            suml2 += w * q as f32 * q as f32;
        }
        let mut scale = if suml2 != 0.0 { sumlx / suml2 } else { 0.0 };
        let mut best = scale * sumlx;
        for is in -9..=9 {
            if is == 0 {
                continue;
            }
            iscale = -(nmax as f32 + 0.1 * is as f32) / max;
            let (mut sumlx, mut suml2) = (0f32, 0f32);
            for &v in x {
                let q = nearest_int(iscale * v).clamp(-nmax, nmax - 1) as f32;
                let w = v * v;
                sumlx += w * v * q;
                suml2 += w * q * q;
            }
            if suml2 > 0.0 && sumlx * sumlx > best * suml2 {
                for i in 0..N {
                    l[i] = (nmax + nearest_int(iscale * x[i]).clamp(-nmax, nmax - 1)) as i8;
                }
                scale = sumlx / suml2;
                best = scale * sumlx;
            }
        }
        scale
    }

    /// The reference's binary search, to check the counting form.
    fn best_index_ref(x: f32) -> usize {
        let x2 = x + x;
        let (mut idx, mut step) = (0usize, 8usize);
        while step > 0 {
            let j = idx + step;
            if x2 >= (KV[j - 1] as i32 + KV[j] as i32) as f32 {
                idx = j;
            }
            step >>= 1;
        }
        idx
    }

    fn fit_iq4_ref(xb: &[f32; 32], ntry: i32) -> f32 {
        let (mut amax, mut max) = (0f32, 0f32);
        for &v in xb {
            if v.abs() > amax {
                amax = v.abs();
                max = v;
            }
        }
        if amax < GROUP_MAX_EPS {
            return 0.0;
        }
        let sums = |id: f32| {
            let (mut sumqx, mut sumq2) = (0f32, 0f32);
            for &v in xb {
                let q = KV[best_index_ref(id * v)] as f32;
                let w = v * v;
                sumqx += w * q * v;
                sumq2 += w * q * q;
            }
            (sumqx, sumq2)
        };
        let d0 = -max / KV[0] as f32;
        let (sumqx, sumq2) = sums(1.0 / d0);
        let mut d = if sumq2 > 0.0 { sumqx / sumq2 } else { 0.0 };
        let mut best = d * sumqx;
        for itry in -ntry..=ntry {
            let (sumqx, sumq2) = sums((itry + KV[0] as i32) as f32 / max);
            if sumq2 > 0.0 && sumqx * sumqx > best * sumq2 {
                d = sumqx / sumq2;
                best = d * sumqx;
            }
        }
        d
    }

    /// 8 groups of N test values; group kinds rotate with `seed`.
    fn groups<const N: usize>(seed: u64) -> Vec<f32> {
        let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
        let mut next = || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 40) as f32 / (1u64 << 24) as f32 - 0.5
        };
        let mut x = Vec::with_capacity(8 * N);
        for k in 0..LANES {
            let kind = (seed as usize + k) % 6;
            for _ in 0..N {
                let u = next() + next() + next();
                x.push(match kind {
                    0 => u,
                    1 => u * u * u * 8.0,
                    2 => u.abs() + 0.1,
                    3 => 0.7,
                    4 => 0.0,
                    _ => -u.abs() * 1e-3,
                });
            }
        }
        x
    }

    fn check_qkx2<const N: usize, const MAD: bool>(nmax: i32, rmin: f32, nstep: i32) {
        for seed in 0..200 {
            let x = groups::<N>(seed);
            let xt = to_lanes::<N>(&x);
            let w: Vec<f32> = x
                .iter()
                .map(|v| if MAD { v.abs() } else { 0.3 + v.abs() })
                .collect();
            let wt = to_lanes::<N>(&w);
            let mut lt = [[0u8; LANES]; N];
            let (s, m) = make_qkx2_x8::<N, MAD>(nmax, &xt, &wt, &mut lt, rmin, 0.1, nstep);
            for k in 0..LANES {
                let mut l = [0u8; N];
                let xs: &[f32; N] = x[N * k..N * k + N].try_into().unwrap();
                let ws: &[f32; N] = w[N * k..N * k + N].try_into().unwrap();
                let (rs, rm) = make_qkx2_ref::<N, MAD>(nmax, xs, ws, &mut l, rmin, 0.1, nstep);
                assert_eq!(
                    (s[k].to_bits(), m[k].to_bits()),
                    (rs.to_bits(), rm.to_bits())
                );
                assert!((0..N).all(|i| lt[i][k] == l[i]), "seed {seed} lane {k}");
            }
        }
    }

    #[test]
    fn qkx2_lanes_equal_reference() {
        check_qkx2::<16, true>(3, -0.5, 15); // Q2_K
        check_qkx2::<32, false>(15, -1.0, 20); // Q4_K
        check_qkx2::<32, false>(31, -0.5, 15); // Q5_K
    }

    #[test]
    fn qx_lanes_equal_reference() {
        for seed in 0..200 {
            let x = groups::<16>(seed);
            let mut lt = [[0i8; LANES]; 16];
            let s = make_qx_x8::<16>(32, &to_lanes(&x), &mut lt);
            for k in 0..LANES {
                let mut l = [0i8; 16];
                let r = make_qx_ref(32, x[16 * k..16 * k + 16].try_into().unwrap(), &mut l);
                assert_eq!(s[k].to_bits(), r.to_bits(), "seed {seed} lane {k}");
                assert!((0..16).all(|i| lt[i][k] == l[i]), "seed {seed} lane {k}");
            }
        }
    }

    #[test]
    fn iq4_lanes_equal_reference() {
        for v in -300..300 {
            let x = v as f32 * 0.5 + 0.25;
            assert_eq!(best_index_iq4(x), best_index_ref(x));
            assert_eq!(
                best_index_iq4(v as f32 * 0.5),
                best_index_ref(v as f32 * 0.5)
            );
        }
        assert_eq!(best_index_iq4(f32::NAN), best_index_ref(f32::NAN));
        for v in -2000..2000 {
            let x = v as f32 * 0.0625;
            assert_eq!(best_value_iq4(x), KV[best_index_ref(x)] as f32);
        }
        for seed in 0..100 {
            let x = groups::<32>(seed);
            let d = fit_iq4_x8(&to_lanes(&x), 7);
            for k in 0..LANES {
                let r = fit_iq4_ref(x[32 * k..32 * k + 32].try_into().unwrap(), 7);
                assert_eq!(d[k].to_bits(), r.to_bits(), "seed {seed} lane {k}");
            }
        }
    }
}
