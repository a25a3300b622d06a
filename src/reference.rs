//! Scalar reference of every kernel, in Rust, with exactly the operation order
//! the C kernels document (templates/matmul.c.tera, templates/attn.c.tera).
//! Every compiled variant must agree with it bit for bit (NaN with NaN).
//! Slow on purpose: clarity over speed.

use crate::formats;
use crate::kernels::{AttnArgs, Matrix, Weights};

/// The fixed reduction tree over 16 lanes: (l, l+8), (l, l+4), (l, l+2), (0, 1).
pub fn reduce16(a: &[f32; 16]) -> f32 {
    let mut t = [0f32; 8];
    for l in 0..8 {
        t[l] = a[l] + a[l + 8];
    }
    for l in 0..4 {
        t[l] += t[l + 4];
    }
    for l in 0..2 {
        t[l] += t[l + 2];
    }
    t[0] + t[1]
}

/// Weight element (r, c) decoded to f32.
pub fn weight(m: &Matrix, r: usize, c: usize) -> f32 {
    let cols = m.cols();
    match m.weights() {
        Weights::F32(w) => w[r * cols + c],
        Weights::Bf16(w) => formats::bf16_to_f32(w[r * cols + c]),
        Weights::Fp8 { w, .. } => formats::e4m3_to_f32(w[r * cols + c]),
        Weights::Fp4 { w, .. } => formats::e2m1_at(&w[r * cols / 2..(r + 1) * cols / 2], c),
    }
}

/// Scale of row r, block b (1.0 when the format has none).
pub fn scale(m: &Matrix, r: usize, b: usize) -> f32 {
    let cols = m.cols();
    match m.weights() {
        Weights::Fp8 { scale, .. } => {
            formats::e8m0_to_f32(scale[(r / 128) * cols.div_ceil(128) + b])
        }
        Weights::Fp4 { scale, .. } => formats::e8m0_to_f32(scale[r * (cols / 32) + b]),
        _ => 1.0,
    }
}

/// One output: row r of W times x.
pub fn row_dot(m: &Matrix, r: usize, x: &[f32]) -> f32 {
    let cols = m.cols();
    let block = m.format().block_cols();
    let mut acc = [0f32; 16];
    if matches!(m.weights(), Weights::Fp4 { .. }) {
        // 128-column chunks: lane l takes the chunk's columns 8l..8l+7 (all
        // in block 4q + l/4) into a partial from +0, then one scale FMA. A
        // lane whose block is past the row's end is left alone. Lanes are
        // independent, so block by block is the same order.
        for b in 0..cols / 32 {
            let q = b / 4;
            for (l, a) in acc.iter_mut().enumerate().skip(4 * (b % 4)).take(4) {
                let mut part = 0f32;
                for (c, &xc) in x.iter().enumerate().skip(128 * q + 8 * l).take(8) {
                    part = weight(m, r, c).mul_add(xc, part);
                }
                *a = part.mul_add(scale(m, r, b), *a);
            }
        }
    } else if block == 0 {
        for c in 0..cols {
            acc[c % 16] = weight(m, r, c).mul_add(x[c], acc[c % 16]);
        }
    } else {
        // FP8, per 128-column scale block: in each 32-column chunk lane l
        // takes the pair of columns 2l, 2l + 1 (a partial last chunk: the
        // pairs it has), in column order, into a block partial from +0.
        for b in 0..cols.div_ceil(block) {
            let mut part = [0f32; 16];
            let end = ((b + 1) * block).min(cols);
            for (c, &xc) in x.iter().enumerate().take(end).skip(b * block) {
                let l = (c % 32) / 2;
                part[l] = weight(m, r, c).mul_add(xc, part[l]);
            }
            let s = scale(m, r, b);
            for l in 0..16 {
                acc[l] = part[l].mul_add(s, acc[l]);
            }
        }
    }
    reduce16(&acc)
}

/// y = W x.
pub fn matvec(m: &Matrix, x: &[f32]) -> Vec<f32> {
    (0..m.rows()).map(|r| row_dot(m, r, x)).collect()
}

/// `Y[n][rows] = W X[n][cols]`.
pub fn matmul(m: &Matrix, x: &[f32], n: usize) -> Vec<f32> {
    let cols = m.cols();
    (0..n)
        .flat_map(|j| (0..m.rows()).map(move |r| (j, r)))
        .map(|(j, r)| row_dot(m, r, &x[j * cols..(j + 1) * cols]))
        .collect()
}

/// Dot of two f32 vectors in the lane order.
pub fn dot16(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 16];
    for c in 0..a.len() {
        acc[c % 16] = a[c].mul_add(b[c], acc[c % 16]);
    }
    reduce16(&acc)
}

/// DeepSeek V4's lightning-indexer scores of one query: for every entry e
/// (rows of `dim` floats), `Σ_h relu(q_h · k_e)·scale·w_h` over the heads in
/// order, each dot product [`dot16`] (entry first) and each step rounded on
/// its own: `s += (relu(d)·scale)·w_h` from +0. The engine's CPU path and
/// the GPU kernel (bs_cu_index_scores) both give exactly this.
pub fn index_scores(entries: &[f32], q: &[f32], w: &[f32], dim: usize, scale: f32) -> Vec<f32> {
    entries
        .chunks_exact(dim)
        .map(|e| {
            q.chunks_exact(dim)
                .zip(w)
                .fold(0f32, |s, (qh, &wh)| s + dot16(e, qh).max(0.0) * scale * wh)
        })
        .collect()
}

/// The softmax exp of the kernels (kernels/bs_common.h): same operations.
/// The coefficients are written as in the C source; both round to the same f32.
#[allow(clippy::excessive_precision)]
pub fn exp(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const C1: f32 = 0.693_359_375;
    const C2: f32 = -2.121_944_4e-4;
    const P: [f32; 6] = [
        1.987_569_15e-4,
        1.398_199_950_7e-3,
        8.333_451_907_3e-3,
        4.166_579_589_4e-2,
        1.666_666_545_9e-1,
        5.000_000_120_1e-1,
    ];
    // Same as the C `n < -126 ? -126 : n`, then `127 < n ? 127 : n` (NaN stays NaN).
    let n = (x * LOG2E).round_ties_even().clamp(-126.0, 127.0);
    let mut r = n.mul_add(-C1, x);
    r = n.mul_add(-C2, r);
    let mut p = P[0];
    for &c in &P[1..] {
        p = p.mul_add(r, c);
    }
    p = p.mul_add(r * r, r);
    p += 1.0;
    let k = if n.is_nan() { 0 } else { n as i32 };
    let two_n = f32::from_bits(((k + 127) as u32) << 23);
    if x < -87.0 {
        0.0
    } else {
        p * two_n
    }
}

/// Attention decode for one query, as the kernels define it.
pub fn attn_decode<'a>(a: &AttnArgs<'a>) -> Vec<f32> {
    let group = a.n_heads / a.n_kv_heads;
    let t0 = if a.window != 0 && a.t_len > a.window {
        a.t_len - a.window
    } else {
        0
    };
    let hd = a.head_dim;
    let mut out = vec![0f32; a.n_heads * hd];
    for h in 0..a.n_heads {
        let q = &a.q[h * hd..(h + 1) * hd];
        let off = (h / group) * a.kv_head_stride;
        let row =
            |buf: &'a [f32], t: usize| &buf[t * a.kv_stride + off..t * a.kv_stride + off + hd];
        let mut m = a.sinks.map(|s| s[h]).unwrap_or(f32::NEG_INFINITY);
        let scores: Vec<f32> = (t0..a.t_len)
            .map(|t| {
                let s = dot16(q, row(a.k, t)) * a.scale;
                if s > m {
                    m = s;
                }
                s
            })
            .collect();
        let p: Vec<f32> = scores.iter().map(|&s| exp(s - m)).collect();
        let mut lanes = [0f32; 16];
        for (i, &pi) in p.iter().enumerate() {
            lanes[i % 16] += pi;
        }
        let mut denom = reduce16(&lanes);
        if let Some(s) = a.sinks {
            denom += exp(s[h] - m);
        }
        for d in 0..hd {
            let mut acc = 0f32;
            for (i, t) in (t0..a.t_len).enumerate() {
                acc = p[i].mul_add(row(a.v, t)[d], acc);
            }
            out[h * hd + d] = acc / denom;
        }
    }
    out
}

/// One fp4×q8 output (templates/q8.c.tera): row r of FP4 W times quantized
/// activations, per block an exact integer dot product, then
/// acc[b mod 8] = fma(T_b, (e8m0(ws_b) · 0.5) · d_b, acc[b mod 8]) over the
/// blocks padded to a multiple of 8 with no-ops, and a fixed 8-lane tree.
pub fn q8_row_dot(
    m: &Matrix,
    r: usize,
    a: &crate::q8::Q8Act,
) -> Result<f32, crate::kernels::KernelError> {
    let Weights::Fp4 { w, scale } = m.weights() else {
        return Err(crate::kernels::KernelError::Shape(format!(
            "fp4×q8 takes FP4 weights, not {}",
            m.format()
        )));
    };
    let cols = m.cols();
    let nb = cols / 32;
    let row = &w[r * cols / 2..(r + 1) * cols / 2];
    let x2 = |code: u8| (formats::e2m1_to_f32(code) * 2.0) as i32;
    let mut acc = [0f32; 8];
    for b in 0..nb.div_ceil(8) * 8 {
        let (t, s) = if b < nb {
            let mut t = 0i32;
            for i in 0..16 {
                let byte = row[16 * b + i];
                t += x2(byte & 15) * a.q[32 * b + i] as i32
                    + x2(byte >> 4) * a.q[32 * b + 16 + i] as i32;
            }
            let s = (formats::e8m0_to_f32(scale[r * nb + b]) * 0.5) * a.d[b];
            (t, s)
        } else {
            (0, 0.0)
        };
        acc[b % 8] = (t as f32).mul_add(s, acc[b % 8]);
    }
    Ok(((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7])))
}
