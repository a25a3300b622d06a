//! The fp4×q8 variant's activations: x rounded to int8 per 32-column block,
//! laid out for the kernels in templates/q8.c.tera.
//!
//! This is a separately named variant (DESIGN.md, numerics contract), off
//! unless asked for (`--fp4-act q8`, `BESPOKE_FP4_ACT=q8`): FP4 weights times
//! these int8 activations give products that are exact integers per block,
//! which the SIMD units multiply-add several times faster than decoding FP4
//! to f32. The price is the rounding of x. Per block b of 32 columns,
//! d_b = max|x| / 127 and q = round_ties_even(x · 127 / max|x|) in [-127, 127]
//! (computed in f64, d_b then rounded to f32), so |x − q·d_b| ≤ d_b / 2 up to
//! the f32 rounding of d_b (relative 2⁻²⁴, or 2⁻¹⁴⁹ when d_b is subnormal);
//! [`Q8Act::error_bound`] turns that into a bound on each output.

use crate::kernels::KernelError;
use crate::linevec::LineVec;

/// Columns per activation block (the FP4 scale block).
pub const BLOCK: usize = 32;

/// Selects the FP4 matvec variant for engines (`--fp4-act`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum Fp4Act {
    /// f32 activations: bit-identical to the scalar reference (the default).
    #[default]
    F32,
    /// int8 activations per 32 columns (the fp4×q8 kernels).
    Q8,
    /// Products of 3 or more tokens (prefill, and the experts' token
    /// batches) on AMX tiles: the weights decoded to BF16, activations
    /// rounded to BF16 (the amx kernels; Intel CPUs with AMX-BF16); one
    /// or two tokens (decode) through the f32 kernels, bit-identical to
    /// the reference.
    Amx,
}

impl Fp4Act {
    pub fn name(self) -> &'static str {
        match self {
            Fp4Act::F32 => "f32",
            Fp4Act::Q8 => "q8",
            Fp4Act::Amx => "amx",
        }
    }
}

/// Quantized activations for one input vector. Built only by
/// [`Q8Act::quantize`], so the three arrays always agree.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Q8Act {
    /// [cols]: per block, the quantized even columns, then the odd ones.
    pub(crate) q: LineVec<i8>,
    /// [cols / 32]: the scale d_b of each block (NaN when the block holds a
    /// NaN or infinity: every output that reads it is then NaN).
    pub(crate) d: LineVec<f32>,
    /// [cols / 32]: each block's sum of q (the x86 kernels offset the
    /// weights to unsigned and take the offset back with it).
    pub(crate) sum: LineVec<i32>,
}

/// `y.round_ties_even()` as an integer, for |y| < 2^31: y + 1.5·2^52 lies
/// where the f64 spacing is 1, so the addition rounds y to an integer, ties
/// to even (1.5·2^52 is even, and Rust's rounding is always to nearest,
/// ties to even), and that integer is the sum's bits less the constant's.
/// The same as `y.round_ties_even() as i32`, but without the call to libm's
/// `rint` that x86-64 without SSE4.1 makes for `round_ties_even`, in plain
/// integer and f64 operations the compiler can put in vectors: on the Intel
/// Xeon VM (Granite Rapids class) 4096 columns took 18 µs to quantize with
/// `round_ties_even` (a tenth of a 2-thread FP4 matvec of 4096 columns
/// streamed) and take 6-8 µs with this and the block loop below.
#[inline(always)]
fn rint_small(y: f64) -> i32 {
    const M: f64 = 6_755_399_441_055_744.0;
    ((y + M).to_bits() as i64 - M.to_bits() as i64) as i32
}

impl Q8Act {
    pub fn cols(&self) -> usize {
        self.q.len()
    }
    /// `[cols]`: per 32-column block, the even columns' int8 values, then the odd ones'.
    pub fn q(&self) -> &[i8] {
        &self.q
    }
    /// [cols / 32]: each block's scale.
    pub fn d(&self) -> &[f32] {
        &self.d
    }

    /// The activations as these codes stand for them, q · d, in column
    /// order (out: `cols` values).
    pub fn dequantize_into(&self, out: &mut [f32]) {
        for (b, (qb, ob)) in self
            .q
            .chunks_exact(BLOCK)
            .zip(out.chunks_exact_mut(BLOCK))
            .enumerate()
        {
            let d = self.d[b];
            for (c, o) in ob.iter_mut().enumerate() {
                // Even columns first in a block, then the odd ones.
                let i = if c % 2 == 0 { c / 2 } else { BLOCK / 2 + c / 2 };
                *o = qb[i] as f32 * d;
            }
        }
    }

    /// Quantize x (its length a multiple of 32).
    pub fn quantize(x: &[f32]) -> Result<Q8Act, KernelError> {
        let mut a = Q8Act::default();
        a.quantize_from(x)?;
        Ok(a)
    }

    /// Quantize x into these buffers (reused across calls).
    pub fn quantize_from(&mut self, x: &[f32]) -> Result<(), KernelError> {
        if x.len() % BLOCK != 0 {
            return Err(KernelError::Shape(format!(
                "fp4×q8 activations: {} columns is not a multiple of {BLOCK}",
                x.len()
            )));
        }
        self.q.reset(x.len());
        self.d.reset(x.len() / BLOCK);
        self.sum.reset(x.len() / BLOCK);
        for (((xb, qb), d), sum) in x
            .chunks_exact(BLOCK)
            .zip(self.q.chunks_exact_mut(BLOCK))
            .zip(self.d.iter_mut())
            .zip(self.sum.iter_mut())
        {
            // The largest |x| of the block, and whether any x is an
            // infinity or a NaN (|x| > f32::MAX or unordered).
            let (mut amax, mut bad) = (0.0f32, false);
            for &v in xb {
                let a = v.abs();
                bad |= a.is_nan() | (a > f32::MAX);
                amax = if a > amax { a } else { amax };
            }
            if bad {
                *d = f32::NAN;
                qb.fill(0);
                *sum = 0;
                continue;
            }
            if amax == 0.0 {
                *d = 0.0;
                qb.fill(0);
                *sum = 0;
                continue;
            }
            // In f64, where neither amax / 127 nor x / d can underflow or
            // overflow; d is then rounded to f32 once. q = x·(127 / amax)
            // rounded to the nearest integer, ties to even, clamped to ±127
            // (|x| <= amax, so it is within 127 and a rounding error).
            let d64 = amax as f64 / 127.0;
            *d = d64 as f32;
            let inv = 127.0 / amax as f64;
            let mut qi = [0i32; BLOCK];
            for (q, &v) in qi.iter_mut().zip(xb) {
                *q = rint_small(v as f64 * inv).clamp(-127, 127);
            }
            for i in 0..BLOCK / 2 {
                qb[i] = qi[2 * i] as i8;
                qb[BLOCK / 2 + i] = qi[2 * i + 1] as i8;
            }
            *sum = qi.iter().sum();
        }
        Ok(())
    }

    /// The dequantized activations, in column order (for error bounds).
    pub fn dequantize(&self) -> Vec<f32> {
        let mut x = vec![0.0f32; self.q.len()];
        for (b, (xb, qb)) in x
            .chunks_exact_mut(BLOCK)
            .zip(self.q.chunks_exact(BLOCK))
            .enumerate()
        {
            for i in 0..BLOCK / 2 {
                xb[2 * i] = qb[i] as f32 * self.d[b];
                xb[2 * i + 1] = qb[BLOCK / 2 + i] as f32 * self.d[b];
            }
        }
        x
    }

    /// A bound on |y_q8 − y_f32| for one output, given that row's weights
    /// decoded to f32 (scales applied) in column order: the rounding of x,
    /// Σ_b (d_b / 2)·Σ_{c∈b} |w_c|, plus f32 accumulation in both kernels,
    /// 2·cols·2⁻²⁴·Σ|w_c·x_c| + the same for the dequantized x.
    pub fn error_bound(&self, w_row: &[f32], x: &[f32]) -> f64 {
        let xq = self.dequantize();
        let mut round = 0.0f64;
        let mut mass = 0.0f64;
        for (b, d) in self.d.iter().enumerate() {
            let cols = b * BLOCK..(b + 1) * BLOCK;
            let wsum: f64 = w_row[cols.clone()].iter().map(|w| w.abs() as f64).sum();
            // d_b / 2, plus 127 times d_b's own rounding error.
            round += wsum
                * ((*d as f64) * (0.5 + 127.0 * f64::powi(2.0, -24))
                    + 127.0 * f64::powi(2.0, -149));
            for c in cols {
                mass +=
                    (w_row[c] as f64 * x[c] as f64).abs() + (w_row[c] as f64 * xq[c] as f64).abs();
            }
        }
        round + 2.0 * w_row.len() as f64 * f64::powi(2.0, -24) * mass
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_and_rounding() {
        let x: Vec<f32> = (0..64).map(|i| i as f32 - 20.0).collect();
        let a = Q8Act::quantize(&x).unwrap();
        assert_eq!(*a.d, [20.0 / 127.0, 43.0 / 127.0]);
        // even columns first, then odd ones; the block's largest value is ±127
        assert_eq!(a.q[0], -127);
        assert_eq!(a.q[16], (-19.0f64 / (20.0f64 / 127.0)).round() as i8);
        assert_eq!(a.q[63], 127);
        for (v, w) in a.dequantize().iter().zip(&x) {
            let d = if (w + 20.0) < 32.0 { a.d[0] } else { a.d[1] };
            assert!((v - w).abs() <= d * 0.5 * (1.0 + 1e-5), "{v} vs {w}");
        }
    }

    /// The quantizer against its definition written plainly (f64
    /// `round_ties_even`, clamped), bit for bit: ties both ways (blocks whose
    /// largest |x| is 127, so x·127/amax = x), subnormals, f32::MAX, -0 and
    /// random values over many magnitudes.
    #[test]
    fn quantize_matches_its_definition() {
        fn plain(x: &[f32]) -> (Vec<i8>, Vec<u32>, Vec<i32>) {
            let (mut q, mut d, mut sum) = (vec![0i8; x.len()], Vec::new(), Vec::new());
            for (b, xb) in x.chunks_exact(BLOCK).enumerate() {
                let amax = xb.iter().fold(0.0f32, |m, v| {
                    if v.is_finite() {
                        m.max(v.abs())
                    } else {
                        f32::INFINITY
                    }
                });
                if !amax.is_finite() || amax == 0.0 {
                    d.push(if amax == 0.0 { 0.0f32 } else { f32::NAN }.to_bits());
                    sum.push(0);
                    continue;
                }
                d.push(((amax as f64 / 127.0) as f32).to_bits());
                let inv = 127.0 / amax as f64;
                let qv: Vec<i8> = xb
                    .iter()
                    .map(|&v| (v as f64 * inv).round_ties_even().clamp(-127.0, 127.0) as i8)
                    .collect();
                for i in 0..BLOCK / 2 {
                    q[b * BLOCK + i] = qv[2 * i];
                    q[b * BLOCK + BLOCK / 2 + i] = qv[2 * i + 1];
                }
                sum.push(qv.iter().map(|&v| v as i32).sum());
            }
            (q, d, sum)
        }
        let mut x: Vec<f32> = Vec::new();
        // ties: amax 127, halves both sides of even and odd integers
        x.extend((0..32).map(|i| {
            if i == 0 {
                127.0
            } else {
                (i as f32 - 16.0) + 0.5
            }
        }));
        x.extend((0..32).map(|i| if i == 5 { -127.0 } else { -(i as f32) * 1.5 }));
        // subnormals with a normal amax, and a block of subnormals only
        x.extend((0..32).map(|i| {
            if i == 0 {
                1.0
            } else {
                f32::from_bits(i as u32 * 977)
            }
        }));
        x.extend((0..32).map(|i| f32::from_bits(1 + i as u32 * 31)));
        // the largest finite values, -0 and zeros
        x.extend((0..32).map(|i| match i % 4 {
            0 => f32::MAX,
            1 => -f32::MAX,
            2 => -0.0,
            _ => f32::MAX / (i as f32),
        }));
        // random values, each block at its own magnitude
        let mut state = 0x9e3779b97f4a7c15u64;
        for b in 0..64 {
            let scale = 2f32.powi(b - 32);
            for _ in 0..32 {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                x.push(((state >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * scale);
            }
        }
        let a = Q8Act::quantize(&x).unwrap();
        let (q, d, sum) = plain(&x);
        assert_eq!(&*a.q, &q[..]);
        assert_eq!(a.d.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), d);
        assert_eq!(&*a.sum, &sum[..]);
        // the ties went to even: x[1] = -14.5 (odd column 1, at q[16]),
        // x[2] = -13.5 (q[1]), x[3] = -12.5 (q[17])
        assert_eq!((a.q[16], a.q[1], a.q[17]), (-14, -14, -12));
    }

    #[test]
    fn zeros_tiny_and_non_finite_blocks() {
        let mut x = vec![0.0f32; 96];
        x[40] = f32::from_bits(1); // the smallest subnormal
        x[70] = f32::NAN;
        let a = Q8Act::quantize(&x).unwrap();
        assert_eq!(a.d[0], 0.0);
        assert!(a.q[..32].iter().all(|&q| q == 0));
        assert!(a.d[1] >= 0.0 && a.d[1] < 1e-44);
        assert!(a.d[2].is_nan() && a.q[64..].iter().all(|&q| q == 0));
        let e = Q8Act::quantize(&[1.0; 33]).unwrap_err().to_string();
        assert!(
            e.contains("33 columns") && e.contains("multiple of 32"),
            "{e}"
        );
    }
}
