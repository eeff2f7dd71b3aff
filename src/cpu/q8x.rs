//! int8 activation blocks, the CPU reference of `gpu::matvec::quantize_x`: x cut into blocks of
//! 32 values, each stored as 32 int8 codes and a scale, with ggml's `quantize_row_q8_1`
//! numerics (d = max|x| / 127, q = round(x · (1/d)), s = d · Σq), in the same f32 operations
//! as the kernel. One difference from ggml: ties round to even (WGSL `round`), where ggml's
//! `roundf` rounds them away from zero.
//!
//! The dequantized x̂ = d · q is off by at most d/2 per element, so a dot product with weights
//! w moves by at most Σ_blocks d/2 · Σ|w| over the block ([`QuantizedX::error_bound`]).

/// Values per block.
pub const BLOCK: usize = 32;

/// Rows of x as int8 blocks.
#[derive(Clone, Debug, PartialEq)]
pub struct QuantizedX {
    /// [rows, cols]: the codes.
    pub qs: Vec<i8>,
    /// [rows, cols / 32]: (d, d · Σq) per block.
    pub scales: Vec<[f32; 2]>,
    pub cols: usize,
}

/// Quantizes `x` ([rows, cols], cols a multiple of 32) block by block.
pub fn quantize_x(x: &[f32], cols: usize) -> QuantizedX {
    assert!(
        cols.is_multiple_of(BLOCK) && x.len().is_multiple_of(cols.max(1)),
        "int8 x: {} values in rows of {cols}",
        x.len()
    );
    let mut qs = Vec::with_capacity(x.len());
    let mut scales = Vec::with_capacity(x.len() / BLOCK);
    for b in x.chunks_exact(BLOCK) {
        let amax = b.iter().fold(0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        let id = if d > 0.0 { 1.0 / d } else { 0.0 };
        let mut sum = 0i32;
        for &v in b {
            let q = (v * id).round_ties_even() as i8;
            sum += q as i32;
            qs.push(q);
        }
        scales.push([d, d * sum as f32]);
    }
    QuantizedX { qs, scales, cols }
}

/// Two levels (the GPU's `X2` quantizer: `--matmul int8x2`, `--activations int8`): the first
/// as [`quantize_x`], the second the residual `x − d·q` quantized the same way, so
/// x̂ = d·q + d₂·q₂ ([`dequantize2`]) and the error bound is the second level's
/// [`QuantizedX::error_bound`].
pub fn quantize_x2(x: &[f32], cols: usize) -> (QuantizedX, QuantizedX) {
    let one = quantize_x(x, cols);
    let r: Vec<f32> = x.iter().zip(one.dequantize()).map(|(v, h)| v - h).collect();
    let two = quantize_x(&r, cols);
    (one, two)
}

/// x̂ = d·q + d₂·q₂ of two levels ([`quantize_x2`]), [rows, cols].
pub fn dequantize2(one: &QuantizedX, two: &QuantizedX) -> Vec<f32> {
    one.dequantize()
        .iter()
        .zip(two.dequantize())
        .map(|(a, b)| a + b)
        .collect()
}

impl QuantizedX {
    /// Rebuilds both levels from the GPU's two-level layout (`quantize_x2`): `words`
    /// [rows, cols/32, 2 levels, 8] and `scales` [rows, cols/32, 2 levels, 2].
    pub fn from_gpu2(words: &[u32], scales: &[f32], cols: usize) -> (QuantizedX, QuantizedX) {
        let level = |l: usize| {
            let w: Vec<u32> = words
                .chunks_exact(16)
                .flat_map(|b| b[8 * l..8 * l + 8].to_vec())
                .collect();
            let s: Vec<f32> = scales
                .chunks_exact(4)
                .flat_map(|b| b[2 * l..2 * l + 2].to_vec())
                .collect();
            QuantizedX::from_gpu(&w, &s, cols)
        };
        (level(0), level(1))
    }

    /// Rebuilds the blocks from the GPU layout: `words` [rows, cols/32, 8] (4 codes per u32,
    /// little-endian) and `scales` [rows, cols/32, 2].
    pub fn from_gpu(words: &[u32], scales: &[f32], cols: usize) -> QuantizedX {
        QuantizedX {
            qs: words
                .iter()
                .flat_map(|w| w.to_le_bytes().map(|b| b as i8))
                .collect(),
            scales: scales.chunks_exact(2).map(|s| [s[0], s[1]]).collect(),
            cols,
        }
    }

    /// x̂ = d · q, [rows, cols].
    pub fn dequantize(&self) -> Vec<f32> {
        self.qs
            .chunks_exact(BLOCK)
            .zip(&self.scales)
            .flat_map(|(q, s)| q.iter().map(move |&q| s[0] * q as f32))
            .collect()
    }

    /// Largest |w · x - w · x̂| for row `t` of x and weights `w` (cols values): Σ over blocks
    /// of d/2 · Σ|w|, in f64.
    pub fn error_bound(&self, t: usize, w: &[f32]) -> f64 {
        let nb = self.cols / BLOCK;
        w.chunks_exact(BLOCK)
            .zip(&self.scales[t * nb..(t + 1) * nb])
            .map(|(w, s)| 0.5 * s[0] as f64 * w.iter().map(|v| v.abs() as f64).sum::<f64>())
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_scales_and_bound() {
        let x: Vec<f32> = (0..64)
            .map(|i| ((i * 37 % 61) as f32 - 30.0) * 0.1)
            .collect();
        let q = quantize_x(&x, 64);
        // block max maps to ±127, every value within d/2
        for (b, s) in q.scales.iter().enumerate() {
            let amax = x[32 * b..32 * b + 32]
                .iter()
                .fold(0f32, |m, v| m.max(v.abs()));
            assert_eq!(s[0], amax / 127.0);
            let codes = &q.qs[32 * b..32 * b + 32];
            assert!(codes.iter().any(|c| c.unsigned_abs() == 127));
            let sum: i32 = codes.iter().map(|&c| c as i32).sum();
            assert_eq!(s[1], s[0] * sum as f32);
        }
        let xh = q.dequantize();
        for (i, (a, b)) in x.iter().zip(&xh).enumerate() {
            assert!(
                (a - b).abs() <= 0.5 * q.scales[i / 32][0] * 1.0001,
                "{i}: {a} {b}"
            );
        }
        // zeros: d = 0, codes 0
        let z = quantize_x(&[0.0; 32], 32);
        assert_eq!(z.scales[0], [0.0, 0.0]);
        assert!(z.qs.iter().all(|&c| c == 0));
        // GPU layout round trip
        let words: Vec<u32> =
            q.qs.chunks_exact(4)
                .map(|c| u32::from_le_bytes([c[0] as u8, c[1] as u8, c[2] as u8, c[3] as u8]))
                .collect();
        let flat: Vec<f32> = q.scales.iter().flatten().copied().collect();
        assert_eq!(QuantizedX::from_gpu(&words, &flat, 64), q);
        // the bound holds for a weight row
        let w: Vec<f32> = (0..64).map(|i| (i as f32 * 0.7).sin()).collect();
        let exact: f64 = w.iter().zip(&x).map(|(a, b)| *a as f64 * *b as f64).sum();
        let approx: f64 = w.iter().zip(&xh).map(|(a, b)| *a as f64 * *b as f64).sum();
        assert!((exact - approx).abs() <= q.error_bound(0, &w) * 1.0001);
        // two levels: the residual's scale is at most d/254, x̂ within its bound, and the GPU's
        // interleaved layout round-trips
        let (a, b) = quantize_x2(&x, 64);
        assert_eq!(a, q);
        for (s1, s2) in a.scales.iter().zip(&b.scales) {
            assert!(s2[0] <= s1[0] / 254.0 * 1.0001, "{s1:?} {s2:?}");
        }
        let xh2 = dequantize2(&a, &b);
        let approx2: f64 = w.iter().zip(&xh2).map(|(a, b)| *a as f64 * *b as f64).sum();
        assert!((exact - approx2).abs() <= b.error_bound(0, &w) * 1.001 + 1e-9);
        assert!((exact - approx2).abs() <= q.error_bound(0, &w) / 200.0);
        let pack = |q: &QuantizedX, blk: usize| -> Vec<u32> {
            q.qs[32 * blk..32 * blk + 32]
                .chunks_exact(4)
                .map(|c| u32::from_le_bytes([c[0] as u8, c[1] as u8, c[2] as u8, c[3] as u8]))
                .collect()
        };
        let words2: Vec<u32> = (0..2)
            .flat_map(|k| [pack(&a, k), pack(&b, k)].concat())
            .collect();
        let flat2: Vec<f32> = (0..2)
            .flat_map(|k| [a.scales[k], b.scales[k]].concat())
            .collect();
        assert_eq!(QuantizedX::from_gpu2(&words2, &flat2, 64), (a, b));
    }
}
