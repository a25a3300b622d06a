//! Products checked against the CPU reference within a bound: the random
//! matrices such a check multiplies, the bound, and the comparison. The
//! GPU's start-up check (`gpu::Gpu`, `cuda` builds) and `tests/gpu.rs` use
//! them.
//!
//! The bound is per output: |y - y_ref| <= rel · Σ_c |w_rc x_c|. For a sum
//! of `cols` products in f32, in any order, rounding to nearest, rel =
//! (cols + 64) · 2^-24 holds ([`core_rel`]); a kernel that rounds its inputs
//! (BF16, E4M3, int8) is compared against the reference on those rounded
//! inputs, or with a bound of its own.

use crate::kernels::{Matrix, Weights};
use crate::plan::Format;

/// A matrix that owns its weight and scale bytes, drawn at random: F32 and
/// BF16 weights uniform in [-1, 1), FP8 any code but NaN, FP4 any code; the
/// UE8M0 scales from 2^-7 to 2^4. `next` gives 64 random bits a call.
pub struct CheckMatrix {
    format: Format,
    rows: usize,
    cols: usize,
    f32w: Vec<f32>,
    bf16w: Vec<u16>,
    bytes: Vec<u8>,
    scale: Vec<u8>,
}

/// SplitMix64 from `seed`: 64 random bits a call, the same on every
/// platform (what [`CheckMatrix::random`] draws from in the start-up check).
pub fn splitmix64(mut seed: u64) -> impl FnMut() -> u64 {
    move || {
        seed = seed.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = seed;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
}

/// A value uniform in [-1, 1) from the top 24 bits of `u`.
pub fn unit(u: u64) -> f32 {
    (u >> 40) as f32 / (1u64 << 23) as f32 - 1.0
}

impl CheckMatrix {
    pub fn random(
        format: Format,
        rows: usize,
        cols: usize,
        next: &mut dyn FnMut() -> u64,
    ) -> CheckMatrix {
        let mut o = CheckMatrix {
            format,
            rows,
            cols,
            f32w: vec![],
            bf16w: vec![],
            bytes: vec![],
            scale: vec![],
        };
        let scale = |n: usize, next: &mut dyn FnMut() -> u64| -> Vec<u8> {
            (0..n).map(|_| 120 + (next() % 12) as u8).collect()
        };
        match format {
            Format::F32 => o.f32w = (0..rows * cols).map(|_| unit(next())).collect(),
            Format::Bf16 => {
                o.bf16w = (0..rows * cols)
                    .map(|_| crate::formats::f32_to_bf16(unit(next())))
                    .collect()
            }
            Format::Fp8 => {
                // Any code but NaN (0x7F / 0xFF).
                o.bytes = (0..rows * cols)
                    .map(|_| match (next() % 256) as u8 {
                        b if b & 0x7F == 0x7F => 0x7E,
                        b => b,
                    })
                    .collect();
                o.scale = scale(rows.div_ceil(128) * cols.div_ceil(128), next);
            }
            Format::Fp4 => {
                o.bytes = (0..rows * cols / 2).map(|_| (next() % 256) as u8).collect();
                o.scale = scale(rows * cols.div_ceil(32), next);
            }
        }
        o
    }

    /// The matrix, borrowing these bytes (Err: a shape the format cannot
    /// take, such as FP4 with an odd column count).
    pub fn matrix(&self) -> Result<Matrix<'_>, String> {
        let w = match self.format {
            Format::F32 => Weights::F32(&self.f32w),
            Format::Bf16 => Weights::Bf16(&self.bf16w),
            Format::Fp8 => Weights::Fp8 {
                w: &self.bytes,
                scale: &self.scale,
            },
            Format::Fp4 => Weights::Fp4 {
                w: &self.bytes,
                scale: &self.scale,
            },
        };
        Matrix::new(self.rows, self.cols, w).map_err(|e| e.to_string())
    }
}

/// Σ_c |w_rc x_c| for each output of Y = W · X (`n` tokens of `cols`
/// values, token-major like the result).
pub fn magnitudes(m: &Matrix, x: &[f32], n: usize) -> Vec<f32> {
    let (rows, cols) = (m.rows(), m.cols());
    let mut out = vec![0f32; n * rows];
    for j in 0..n {
        for r in 0..rows {
            let mut s = 0f64;
            for c in 0..cols {
                let w = crate::reference::weight(m, r, c) as f64
                    * crate::reference::scale(m, r, c / m.format().block_cols().max(1)) as f64;
                s += (w * x[j * cols + c] as f64).abs();
            }
            out[j * rows + r] = s as f32;
        }
    }
    out
}

/// The bound of a sum of `cols` f32 products in any order:
/// (cols + 64) · 2^-24 of Σ|w x|.
pub fn core_rel(cols: usize) -> f64 {
    (cols + 64) as f64 * 2f64.powi(-24)
}

/// `got` against `want`, output by output, within `rel` of the magnitudes
/// `mag` ([`magnitudes`]). Ok: the largest |Δ| / Σ|w x|. Err: the first
/// output past the bound, named.
pub fn compare(got: &[f32], want: &[f32], mag: &[f32], rel: f64) -> Result<f64, String> {
    if got.len() != want.len() || mag.len() != want.len() {
        return Err(format!(
            "{} outputs, expected {}",
            got.len(),
            want.len().min(mag.len())
        ));
    }
    let mut worst = 0f64;
    for (i, ((&g, &w), &m)) in got.iter().zip(want).zip(mag).enumerate() {
        let err = (g as f64 - w as f64).abs();
        let bound = rel * m as f64 + 1e-30;
        // A NaN fails too.
        if err.is_nan() || err > bound {
            return Err(format!(
                "output {i}: {g} where the CPU gives {w} (|Δ| {err:.3e} > bound {bound:.3e})"
            ));
        }
        worst = worst.max(err / (m as f64).max(1e-30));
    }
    Ok(worst)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_reference_passes_and_a_wrong_output_is_named() {
        let mut next = splitmix64(3);
        for f in [Format::F32, Format::Bf16, Format::Fp8, Format::Fp4] {
            let o = CheckMatrix::random(f, 130, 256, &mut next);
            let m = o.matrix().unwrap();
            let x: Vec<f32> = (0..2 * 256).map(|_| unit(next()) * 4.0).collect();
            let want = crate::reference::matmul(&m, &x, 2);
            let mag = magnitudes(&m, &x, 2);
            assert!(mag.iter().all(|&v| v > 0.0 && v.is_finite()), "{f}");
            assert_eq!(compare(&want, &want, &mag, core_rel(256)), Ok(0.0));
            let mut bad = want.clone();
            bad[131] += mag[131] * 1e-3;
            let e = compare(&bad, &want, &mag, core_rel(256)).unwrap_err();
            assert!(e.starts_with("output 131: "), "{f}: {e}");
            bad[131] = f32::NAN;
            assert!(compare(&bad, &want, &mag, core_rel(256)).is_err(), "{f}");
        }
        let o = CheckMatrix::random(Format::Fp4, 4, 33, &mut next);
        assert!(o.matrix().is_err());
    }
}
