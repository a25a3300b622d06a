//! The engines: forward passes over the generated kernels. Matrix and
//! attention work goes through [`Kernels`]; the glue (norms, RoPE, routing)
//! is plain Rust in f32. Weights are read in place from the model's mapping.

pub mod dsv4;
pub mod llama;
pub mod scratch;

use crate::kernels::{KernelError, Kernels, Matrix, Weights};
use crate::model::layout::Kind;
use crate::model::{ModelDir, ModelError};
use crate::plan::config::RopeScaling;
use crate::safetensors::{Dtype, ViewError};
use std::borrow::Cow;

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("{0}")]
    Model(#[from] ModelError),
    #[error("{0}")]
    Kernel(#[from] KernelError),
    #[error("{0}")]
    View(#[from] ViewError),
    #[error("{0}")]
    Unsupported(String),
    #[error("the sequence would be {needed} tokens, past this model's context of {limit} (max_position_embeddings in config.json){hint}")]
    Context {
        needed: usize,
        limit: usize,
        hint: String,
    },
    #[error("token id {id} is outside the vocabulary (vocab_size {vocab})")]
    BadToken { id: u32, vocab: usize },
}

/// Refuse to append `n` tokens to a cache holding `len` of `capacity`.
pub fn check_room(len: usize, capacity: usize, n: usize) -> Result<(), EngineError> {
    if len + n > capacity {
        return Err(EngineError::Context {
            needed: len + n,
            limit: capacity,
            hint: " (the cache was sized for fewer tokens)".into(),
        });
    }
    Ok(())
}

/// Feed `tokens` to `forward` in chunks of `chunk`; every position's logits
/// when `all_logits`, else the last chunk's last position.
pub fn prefill_chunks(
    tokens: &[u32],
    chunk: usize,
    all_logits: bool,
    mut forward: impl FnMut(&[u32], bool) -> Result<Vec<f32>, EngineError>,
) -> Result<Vec<f32>, EngineError> {
    let mut out = Vec::new();
    let pieces: Vec<&[u32]> = tokens.chunks(chunk.max(1)).collect();
    for (i, piece) in pieces.iter().enumerate() {
        let logits = forward(piece, all_logits)?;
        if all_logits {
            out.extend_from_slice(&logits);
        } else if i + 1 == pieces.len() {
            out = logits;
        }
    }
    Ok(out)
}

/// A shared expert for [`add_routed_experts`]: gate, up and down, and its
/// SwiGLU clamp.
pub struct SharedExpert<'a, 'm> {
    pub mats: &'a [Mat<'m>; 3],
    pub limit: Option<f32>,
}

/// The experts' part of an MoE block: `out` (n × d) gets, for every routed
/// expert in index order that any token chose (`chosen[e]`: its tokens and
/// their weights, in token order), the SwiGLU of `experts[e]` (gate, up,
/// down; clamped at `limit`; activations FP8-quantized with `act_quant`)
/// run once over its g tokens' rows of `x` at once, each row added back
/// scaled by its weight (transformers adds the experts in the same order);
/// then the `shared` expert's SwiGLU of all of `x`, added unweighted.
/// Each routed expert's use is recorded in `usage` for layer `layer`.
///
/// With a VRAM tier, the experts whose three matrices are all resident (the
/// shared one included) run whole on the GPU, queued together
/// (`gpu::tier::ffn_start`: one upload and one copy back each, no wait
/// between their products, one wait for all), while the others run on the
/// CPU; a GPU failure sends its experts to the CPU (said once). Either way
/// the outputs are added in the same order.
#[allow(clippy::too_many_arguments)]
pub fn add_routed_experts(
    k: &Kernels,
    chosen: &[Vec<(usize, f32)>],
    x: &[f32],
    d: usize,
    out: &mut [f32],
    usage: &crate::placement::UsageCounter,
    layer: usize,
    experts: &[[Mat; 3]],
    limit: Option<f32>,
    act_quant: bool,
    shared: Option<SharedExpert>,
) -> Result<(), EngineError> {
    let gather = |group: &[(usize, f32)], xe: &mut Vec<f32>| {
        xe.clear();
        for &(t, _) in group {
            xe.extend_from_slice(&x[t * d..(t + 1) * d]);
        }
    };
    let add = |group: &[(usize, f32)], ye: &[f32], out: &mut [f32]| {
        for (j, &(t, w)) in group.iter().enumerate() {
            for (o, y) in out[t * d..(t + 1) * d]
                .iter_mut()
                .zip(&ye[j * d..(j + 1) * d])
            {
                *o += y * w;
            }
        }
    };
    let n = x.len() / d.max(1);
    // The shared expert's output, added after the routed ones.
    let add_shared = |y: &[f32], out: &mut [f32]| {
        out[..n * d].iter_mut().zip(y).for_each(|(o, v)| *o += v);
    };
    #[cfg(feature = "cuda")]
    if k.tier() != 0 {
        let active: Vec<usize> = (0..chosen.len())
            .filter(|&e| !chosen[e].is_empty())
            .collect();
        // Which experts run whole on the GPU (all three matrices resident).
        let mut on_gpu = vec![false; active.len()];
        let mut mats = Vec::new();
        for (i, &e) in active.iter().enumerate() {
            let [g, u, dn] = &experts[e];
            let (g, u, dn) = (g.matrix()?, u.matrix()?, dn.matrix()?);
            if let Some(m) = k.ffn_mats([&g, &u, &dn], chosen[e].len(), act_quant) {
                mats.push(m);
                on_gpu[i] = true;
            }
        }
        let shared_mats = match &shared {
            Some(sh) => {
                let [g, u, dn] = sh.mats;
                let (g, u, dn) = (g.matrix()?, u.matrix()?, dn.matrix()?);
                k.ffn_mats([&g, &u, &dn], n, act_quant)
            }
            None => None,
        };
        if !mats.is_empty() || shared_mats.is_some() {
            for &e in &active {
                usage.record(layer, e, chosen[e].len());
            }
            let gpu_experts: Vec<usize> = (0..active.len()).filter(|&i| on_gpu[i]).collect();
            // Their tokens' rows, kept in case the GPU fails.
            let xs: Vec<Vec<f32>> = gpu_experts
                .iter()
                .map(|&i| {
                    let mut xe = Vec::new();
                    gather(&chosen[active[i]], &mut xe);
                    xe
                })
                .collect();
            let mut jobs: Vec<crate::gpu::FfnJob> = mats
                .into_iter()
                .zip(&xs)
                .zip(&gpu_experts)
                .map(|((mats, x), &i)| crate::gpu::FfnJob {
                    mats,
                    x,
                    n: chosen[active[i]].len(),
                    limit,
                })
                .collect();
            let shared_on_gpu = shared_mats.is_some();
            if let (Some(mats), Some(sh)) = (shared_mats, &shared) {
                jobs.push(crate::gpu::FfnJob {
                    mats,
                    x,
                    n,
                    limit: sh.limit,
                });
            }
            let batch = crate::gpu::tier::ffn_start(&jobs);
            drop(jobs);
            // The other experts on the CPU meanwhile.
            let mut ys: Vec<Vec<f32>> = vec![Vec::new(); active.len()];
            let cpu = |i: usize, x: &[f32], ys: &mut Vec<Vec<f32>>| -> Result<(), EngineError> {
                let e = active[i];
                let [g, u, dn] = &experts[e];
                ys[i] = vec![0.0; chosen[e].len() * d];
                swiglu_products(
                    k,
                    [g, u, dn],
                    x,
                    chosen[e].len(),
                    limit,
                    act_quant,
                    &mut ys[i],
                )
            };
            let shared_cpu = |y: &mut Vec<f32>| -> Result<(), EngineError> {
                if let Some(sh) = &shared {
                    let [g, u, dn] = sh.mats;
                    *y = vec![0.0; n * d];
                    swiglu_products(k, [g, u, dn], x, n, sh.limit, act_quant, y)?;
                }
                Ok(())
            };
            let mut xe = Vec::new();
            for i in (0..active.len()).filter(|&i| !on_gpu[i]) {
                gather(&chosen[active[i]], &mut xe);
                cpu(i, &xe, &mut ys)?;
            }
            let mut ysh = Vec::new();
            if !shared_on_gpu {
                shared_cpu(&mut ysh)?;
            }
            match batch.and_then(|b| crate::gpu::tier::ffn_finish(k.tier(), b)) {
                Ok(mut done) => {
                    if shared_on_gpu {
                        ysh = done.pop().unwrap_or_default();
                    }
                    for (&i, y) in gpu_experts.iter().zip(done) {
                        ys[i] = y;
                    }
                }
                Err(e) => {
                    ffn_failed(&e);
                    for (&i, x) in gpu_experts.iter().zip(&xs) {
                        cpu(i, x, &mut ys)?;
                    }
                    if shared_on_gpu {
                        shared_cpu(&mut ysh)?;
                    }
                }
            }
            for (i, &e) in active.iter().enumerate() {
                add(&chosen[e], &ys[i], out);
            }
            if shared.is_some() {
                add_shared(&ysh, out);
            }
            return Ok(());
        }
    }
    let (mut xe, mut ye) = (Vec::new(), Vec::new());
    for (e, group) in chosen.iter().enumerate() {
        if group.is_empty() {
            continue;
        }
        usage.record(layer, e, group.len());
        gather(group, &mut xe);
        ye.resize(group.len() * d, 0.0);
        let [g, u, dn] = &experts[e];
        swiglu(k, [g, u, dn], &xe, group.len(), limit, act_quant, &mut ye)?;
        add(group, &ye, out);
    }
    if let Some(sh) = &shared {
        let [g, u, dn] = sh.mats;
        ye.resize(n * d, 0.0);
        swiglu(k, [g, u, dn], x, n, sh.limit, act_quant, &mut ye)?;
        add_shared(&ye, out);
    }
    Ok(())
}

/// A weight matrix [rows, cols] read from the model, in place when aligned.
pub struct Mat<'m> {
    pub name: String,
    pub rows: usize,
    pub cols: usize,
    data: MatData<'m>,
    /// FP8: whether the codes hold no NaN, scanned on first use (one read of
    /// the weights) so that every later product may skip the kernels' check
    /// (`Matrix::with_fp8_scan_result`).
    fp8_clean: std::sync::OnceLock<bool>,
}

enum MatData<'m> {
    F32(Cow<'m, [f32]>),
    Bf16(Cow<'m, [u16]>),
    Fp8 { w: &'m [u8], scale: &'m [u8] },
    Fp4 { w: &'m [u8], scale: &'m [u8] },
}

impl<'m> Mat<'m> {
    /// The tensor `name` as a [rows, cols] matrix: F32, BF16, or FP8 / FP4
    /// with the scale tensor the model's layout pairs with it. (F16 is not a
    /// kernel format and is refused by name.)
    pub fn load(m: &'m ModelDir, name: &str) -> Result<Mat<'m>, EngineError> {
        let missing = |n: &str| {
            EngineError::Unsupported(format!(
                "tensor {n:?} is missing (validated layouts should not allow this)"
            ))
        };
        let t = m.weights.get(name).ok_or_else(|| missing(name))?;
        let shape = t.shape();
        let (rows, mut cols) = match shape {
            [r, c] => (*r, *c),
            _ => {
                return Err(EngineError::Unsupported(format!(
                    "tensor {name:?} is {shape:?}, expected a matrix"
                )))
            }
        };
        let kind = m.expected.iter().find(|x| x.name == name).map(|x| &x.kind);
        let data = match (t.dtype(), kind) {
            (Dtype::F8E4M3, Some(Kind::Fp8 { scale, .. })) => {
                let s = m.weights.get(scale).ok_or_else(|| missing(scale))?;
                MatData::Fp8 { w: t.u8s()?, scale: s.u8s()? }
            }
            (Dtype::I8 | Dtype::U8, Some(Kind::Fp4 { scale })) => {
                let s = m.weights.get(scale).ok_or_else(|| missing(scale))?;
                cols *= 2;
                MatData::Fp4 { w: t.u8s()?, scale: s.u8s()? }
            }
            (Dtype::F32, _) => MatData::F32(t.f32s()?),
            (Dtype::BF16, _) => MatData::Bf16(t.u16s()?),
            (other, _) => {
                return Err(EngineError::Unsupported(format!(
                    "tensor {name:?} is {other}; the kernels read F32, BF16, FP8 E4M3 and FP4 E2M1 (with their UE8M0 scales)"
                )))
            }
        };
        Ok(Mat::checked(name.to_string(), rows, cols, data)?)
    }

    /// A block of `rows` rows starting at `row0` of a 3-D tensor [E, R, C]
    /// flattened (fused experts): rows row0..row0+rows of expert `e`.
    pub fn load_slice(
        m: &'m ModelDir,
        name: &str,
        e: usize,
        row0: usize,
        rows: usize,
    ) -> Result<Mat<'m>, EngineError> {
        let t = m
            .weights
            .get(name)
            .ok_or_else(|| EngineError::Unsupported(format!("tensor {name:?} is missing")))?;
        let (n_e, r_e, cols) = match t.shape() {
            [a, b, c] => (*a, *b, *c),
            s => {
                return Err(EngineError::Unsupported(format!(
                    "tensor {name:?} is {s:?}, expected [experts, rows, cols]"
                )))
            }
        };
        if e >= n_e || row0 + rows > r_e {
            return Err(EngineError::Unsupported(format!(
                "{name:?}: slice out of range"
            )));
        }
        let start = (e * r_e + row0) * cols;
        let end = start + rows * cols;
        let data = match t.dtype() {
            Dtype::F32 => MatData::F32(match t.f32s()? {
                Cow::Borrowed(s) => Cow::Borrowed(&s[start..end]),
                Cow::Owned(v) => Cow::Owned(v[start..end].to_vec()),
            }),
            Dtype::BF16 => MatData::Bf16(match t.u16s()? {
                Cow::Borrowed(s) => Cow::Borrowed(&s[start..end]),
                Cow::Owned(v) => Cow::Owned(v[start..end].to_vec()),
            }),
            other => {
                return Err(EngineError::Unsupported(format!(
                    "tensor {name:?} is {other}; expected F32 or BF16"
                )))
            }
        };
        Ok(Mat::checked(
            format!("{name}[{e}][{row0}..{}]", row0 + rows),
            rows,
            cols,
            data,
        )?)
    }

    /// Rows `row0..row0+rows` of the matrix `name` as a matrix of their own,
    /// still read in place. F32, BF16 and FP4 (one scale row per weight row)
    /// cut anywhere; FP8 only where the cut starts on a 128-row scale block
    /// boundary (`Ok(None)` otherwise: the caller keeps the whole matrix).
    pub fn load_rows(
        m: &'m ModelDir,
        name: &str,
        row0: usize,
        rows: usize,
    ) -> Result<Option<Mat<'m>>, EngineError> {
        let full = Mat::load(m, name)?;
        if rows == 0 || row0 + rows > full.rows {
            return Err(EngineError::Unsupported(format!(
                "{name:?}: rows {row0}..{} are outside its {} rows",
                row0 + rows,
                full.rows
            )));
        }
        let c = full.cols;
        let (a, b) = (row0 * c, (row0 + rows) * c);
        let data = match full.data {
            MatData::F32(v) => MatData::F32(match v {
                Cow::Borrowed(s) => Cow::Borrowed(&s[a..b]),
                Cow::Owned(v) => Cow::Owned(v[a..b].to_vec()),
            }),
            MatData::Bf16(v) => MatData::Bf16(match v {
                Cow::Borrowed(s) => Cow::Borrowed(&s[a..b]),
                Cow::Owned(v) => Cow::Owned(v[a..b].to_vec()),
            }),
            MatData::Fp4 { w, scale } => {
                let sc = c / 32;
                MatData::Fp4 {
                    w: &w[a / 2..b / 2],
                    scale: &scale[row0 * sc..(row0 + rows) * sc],
                }
            }
            MatData::Fp8 { w, scale } => {
                const BLOCK: usize = 128;
                if row0 % BLOCK != 0 {
                    return Ok(None);
                }
                let sc = c.div_ceil(BLOCK);
                let s0 = row0 / BLOCK;
                MatData::Fp8 {
                    w: &w[a..b],
                    scale: &scale[s0 * sc..(s0 + rows.div_ceil(BLOCK)) * sc],
                }
            }
        };
        Ok(Some(Mat::checked(
            format!("{name}[{row0}..{}]", row0 + rows),
            rows,
            c,
            data,
        )?))
    }

    /// A matrix over `data`, its lengths checked once, up front (its FP8
    /// codes are scanned later, on the first [`Mat::matrix`]).
    fn checked(
        name: String,
        rows: usize,
        cols: usize,
        data: MatData<'m>,
    ) -> Result<Mat<'m>, KernelError> {
        let mat = Mat {
            name,
            rows,
            cols,
            data,
            fp8_clean: std::sync::OnceLock::new(),
        };
        mat.matrix_unscanned()?;
        Ok(mat)
    }

    /// The matrix for the kernels; an FP8 one carries the answer of a scan
    /// of its codes for NaN, made on the first call and kept.
    pub fn matrix(&self) -> Result<Matrix<'_>, KernelError> {
        let m = self.matrix_unscanned()?;
        Ok(match self.data {
            MatData::Fp8 { w, .. } => m.with_fp8_scan_result(
                *self
                    .fp8_clean
                    .get_or_init(|| crate::kernels::fp8_codes_clean(w)),
            ),
            _ => m,
        })
    }

    /// [`Mat::matrix`] without the FP8 scan (length checks, sizes).
    fn matrix_unscanned(&self) -> Result<Matrix<'_>, KernelError> {
        let w = match &self.data {
            MatData::F32(v) => Weights::F32(v),
            MatData::Bf16(v) => Weights::Bf16(v),
            MatData::Fp8 { w, scale } => Weights::Fp8 { w, scale },
            MatData::Fp4 { w, scale } => Weights::Fp4 { w, scale },
        };
        Matrix::new(self.rows, self.cols, w)
    }

    /// FP8 or FP4 weights (what DeepSeek's reference code multiplies after
    /// quantizing the activations to FP8).
    pub fn quantized(&self) -> bool {
        matches!(self.data, MatData::Fp8 { .. } | MatData::Fp4 { .. })
    }

    /// `ys[i] = mats[i] · X` where `xs` holds one X for all (q, k and v) or
    /// one X each ([`Kernels::matmul_list`]: queued together on the GPU
    /// where all are resident); with `act_quant`, as [`Mat::apply_q`] takes
    /// each.
    pub fn apply_list(
        k: &Kernels,
        mats: &[&Mat],
        xs: &[&[f32]],
        n: usize,
        ys: &mut [&mut [f32]],
        act_quant: bool,
    ) -> Result<(), KernelError> {
        let fits = mats.len() == ys.len() && (xs.len() == 1 || xs.len() == mats.len());
        if act_quant && fits && mats.iter().any(|m| m.quantized()) {
            // Queued together on the GPU, the device making DeepSeek's
            // activations, where it can; else product by product.
            #[cfg(feature = "cuda")]
            if mats.len() > 1 {
                let ms = mats
                    .iter()
                    .map(|m| m.matrix())
                    .collect::<Result<Vec<_>, _>>()?;
                let refs: Vec<&Matrix> = ms.iter().collect();
                if k.gpu_list(&refs, xs, n, ys, true) {
                    return Ok(());
                }
            }
            for (i, (m, y)) in mats.iter().zip(ys.iter_mut()).enumerate() {
                m.apply_q(k, xs[if xs.len() == 1 { 0 } else { i }], n, y, true)?;
            }
            return Ok(());
        }
        let ms = mats
            .iter()
            .map(|m| m.matrix())
            .collect::<Result<Vec<_>, _>>()?;
        let refs: Vec<&Matrix> = ms.iter().collect();
        k.matmul_list(&refs, xs, n, ys)
    }

    /// [`Mat::apply`], with the activations first put through
    /// [`fp8_act_quant`] when `act_quant` is set and the weights are FP8 or
    /// FP4 (DeepSeek's reference behaviour).
    pub fn apply_q(
        &self,
        k: &Kernels,
        x: &[f32],
        n: usize,
        y: &mut [f32],
        act_quant: bool,
    ) -> Result<(), KernelError> {
        if act_quant && self.quantized() {
            self.apply(k, &fp8_act_quant(x, self.cols), n, y)
        } else {
            self.apply(k, x, n, y)
        }
    }

    /// Bytes of weights and scales one pass over the matrix reads.
    pub fn bytes(&self) -> u64 {
        self.matrix_unscanned().map_or(0, |m| m.bytes() as u64)
    }

    /// Whether the weights are borrowed from the file mapping (not copied).
    pub fn in_place(&self) -> bool {
        match &self.data {
            MatData::F32(v) => matches!(v, Cow::Borrowed(_)),
            MatData::Bf16(v) => matches!(v, Cow::Borrowed(_)),
            _ => true,
        }
    }

    /// Row `r` as f32 (embedding lookup).
    pub fn row_f32(&self, r: usize, out: &mut [f32]) {
        let c = self.cols;
        match &self.data {
            MatData::F32(v) => out.copy_from_slice(&v[r * c..(r + 1) * c]),
            MatData::Bf16(v) => {
                for (o, &b) in out.iter_mut().zip(&v[r * c..(r + 1) * c]) {
                    *o = f32::from_bits((b as u32) << 16);
                }
            }
            // Embeddings are never quantized in the supported checkpoints.
            MatData::Fp8 { .. } | MatData::Fp4 { .. } => out.fill(f32::NAN),
        }
    }

    /// `Y[n][rows] = W X[n][cols]`.
    pub fn apply(
        &self,
        k: &Kernels,
        x: &[f32],
        n: usize,
        y: &mut [f32],
    ) -> Result<(), KernelError> {
        let m = self.matrix()?;
        if n == 1 {
            k.matvec(&m, x, y)
        } else {
            k.matmul(&m, x, n, y)
        }
    }
}

/// A 1-D float tensor (norm weights, biases) as f32.
pub fn vector(m: &ModelDir, name: &str, len: usize) -> Result<Vec<f32>, EngineError> {
    let t = m
        .weights
        .get(name)
        .ok_or_else(|| EngineError::Unsupported(format!("tensor {name:?} is missing")))?;
    let v = t.to_f32_vec()?;
    if v.len() != len {
        return Err(EngineError::Unsupported(format!(
            "tensor {name:?} has {} values, expected {len}",
            v.len()
        )));
    }
    Ok(v)
}

/// RMSNorm of each `w.len()`-wide row of `x` in place: x / sqrt(mean(x²) + eps) * w
/// (transformers' order: normalise in f32, then scale by the weight).
pub fn rms_norm(x: &mut [f32], w: &[f32], eps: f32) {
    let d = w.len();
    let norm = |row: &mut [f32]| {
        let ss: f32 = row.iter().map(|v| v * v).sum();
        let inv = 1.0 / (ss / d as f32 + eps).sqrt();
        for (v, &g) in row.iter_mut().zip(w) {
            *v = g * (*v * inv);
        }
    };
    // A prefill step's rows across the threads (each row is normalised
    // alone, so the split changes nothing); its sum is one chain of
    // dependent additions, as long as the row.
    if d > 0 && crate::threads::split_elementwise(x.len()) {
        use rayon::prelude::*;
        x.par_chunks_exact_mut(d).for_each(norm);
    } else {
        x.chunks_exact_mut(d).for_each(norm);
    }
}

/// x · sigmoid(x), as torch's silu.
#[inline]
pub fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// down(silu(gate·x) ⊙ up·x) for n tokens. With `limit` L (DeepSeek V4's
/// swiglu_limit) the gate is capped at L and up clamped to [−L, L] first.
/// With a VRAM tier holding all three matrices it runs whole on the GPU
/// (one upload, one copy back: `gpu::tier::ffn_start`); else, or
/// if that fails (said once), product by product.
pub fn swiglu(
    k: &Kernels,
    mats: [&Mat; 3],
    x: &[f32],
    n: usize,
    limit: Option<f32>,
    act_quant: bool,
    out: &mut [f32],
) -> Result<(), EngineError> {
    #[cfg(feature = "cuda")]
    if k.tier() != 0 {
        let [g, u, d] = mats;
        let (g, u, d) = (g.matrix()?, u.matrix()?, d.matrix()?);
        if let Some(mats) = k.ffn_mats([&g, &u, &d], n, act_quant) {
            let job = crate::gpu::FfnJob { mats, x, n, limit };
            let rows = d.rows();
            match crate::gpu::tier::ffn_start(&[job])
                .and_then(|b| crate::gpu::tier::ffn_finish(k.tier(), b))
            {
                Ok(y) if y.len() == 1 && y[0].len() == n * rows => {
                    out[..n * rows].copy_from_slice(&y[0]);
                    return Ok(());
                }
                Ok(_) => ffn_failed("the GPU gave back another length"),
                Err(e) => ffn_failed(&e),
            }
        }
    }
    swiglu_products(k, mats, x, n, limit, act_quant, out)
}

/// A SwiGLU block on the GPU failed: said once, and it runs product by
/// product.
#[cfg(feature = "cuda")]
fn ffn_failed(e: &str) {
    static SAID: std::sync::Once = std::sync::Once::new();
    SAID.call_once(|| {
        eprintln!("CUDA: a SwiGLU block on the GPU failed ({e}); running it product by product")
    });
}

/// [`swiglu`] product by product (each product still on the GPU where its
/// matrix is resident).
pub(super) fn swiglu_products(
    k: &Kernels,
    [gate, up, down]: [&Mat; 3],
    x: &[f32],
    n: usize,
    limit: Option<f32>,
    act_quant: bool,
    out: &mut [f32],
) -> Result<(), EngineError> {
    let i = gate.rows;
    // gate·x and up·x in buffers kept per thread across calls: fresh ones
    // (2 × 2.75 MiB a layer at 128 tokens of a 5632-wide MLP) can come from
    // the kernel as zeroed pages, one fault per 4 KiB (page faults had about
    // 1 % of a 1-thread prefill's samples under perf). A nested
    // call on the same thread (a rayon worker taking another task while it
    // waits) finds them in use and allocates its own.
    thread_local! {
        static GU: std::cell::RefCell<(Vec<f32>, Vec<f32>)> = const { std::cell::RefCell::new((Vec::new(), Vec::new())) };
    }
    let mut body = |g: &mut Vec<f32>, u: &mut Vec<f32>| -> Result<(), EngineError> {
        // Every element is written by the products below; resize only
        // zero-fills what the buffers never held.
        g.resize(n * i, 0.0);
        u.resize(n * i, 0.0);
        let (g, u) = (&mut g[..n * i], &mut u[..n * i]);
        gate.apply_q(k, x, n, g, act_quant)?;
        up.apply_q(k, x, n, u, act_quant)?;
        swiglu_act(g, u, limit);
        down.apply_q(k, g, n, &mut out[..n * down.rows], act_quant)?;
        Ok(())
    };
    GU.with(|c| match c.try_borrow_mut() {
        Ok(mut b) => {
            let (g, u) = &mut *b;
            body(g, u)
        }
        Err(_) => body(&mut Vec::new(), &mut Vec::new()),
    })
}

/// g = silu(g) * u element by element (with DeepSeek V4's clamps at
/// `limit`: g above it, u outside ±it).
fn swiglu_act(g: &mut [f32], u: &[f32], limit: Option<f32>) {
    let act = |g: &mut [f32], u: &[f32]| match limit {
        None => g.iter_mut().zip(u).for_each(|(a, b)| *a = silu(*a) * b),
        Some(lim) => {
            for (a, &b) in g.iter_mut().zip(u) {
                let gv = if *a > lim { lim } else { *a };
                let uv = if b > lim {
                    lim
                } else if b < -lim {
                    -lim
                } else {
                    b
                };
                *a = silu(gv) * uv;
            }
        }
    };
    // Element by element, so how it is split cannot change a value. Prefill
    // splits it across the threads: done by one, an exp per element, it had
    // about 2.5 % of the samples of a 2-thread 256-token prefill on the Zen
    // 4 VM (perf), all on one thread while the other waited.
    if crate::threads::split_elementwise(g.len()) {
        use rayon::prelude::*;
        g.par_chunks_mut(crate::threads::PAR_ELEMENTWISE_CHUNK)
            .zip(u.par_chunks(crate::threads::PAR_ELEMENTWISE_CHUNK))
            .for_each(|(g, u)| act(g, u));
    } else {
        act(g, u);
    }
}

/// FP8 activation quantization as DeepSeek's inference code simulates it
/// before every FP8 / FP4 matrix product: each row of `x` ([n, cols]) in
/// blocks of 128 columns (the last block may be shorter), scale = the
/// block's largest magnitude (at least 1e-4) / 448 rounded up to a power of
/// two (UE8M0), each value divided by it, clamped to ±448, rounded to the
/// nearest E4M3 value and multiplied back. NaN stays NaN.
pub fn fp8_act_quant(x: &[f32], cols: usize) -> Vec<f32> {
    use crate::formats::{e4m3_to_f32, f32_to_e4m3};
    let mut out = x.to_vec();
    if cols == 0 {
        return out;
    }
    for row in out.chunks_mut(cols) {
        for block in row.chunks_mut(128) {
            let amax = block.iter().fold(0.0f32, |m, v| m.max(v.abs())).max(1e-4);
            // 2^ceil(log2(amax / 448)), exactly: amax / 448 is a positive
            // normal float, its power of two rounded up when it has a mantissa.
            let s = amax / 448.0;
            let bits = s.to_bits();
            let pow = if bits & 0x007F_FFFF == 0 {
                s
            } else {
                f32::from_bits((bits & 0x7F80_0000) + 0x0080_0000)
            };
            for v in block.iter_mut() {
                let q = (*v / pow).clamp(-448.0, 448.0);
                *v = e4m3_to_f32(f32_to_e4m3(q)) * pow;
            }
        }
    }
    out
}

/// Rotary position embedding tables for half-split ("rotate_half") RoPE.
pub struct Rope {
    /// Rotated dims (head_dim, or less with a partial factor).
    pub dim: usize,
    pub inv_freq: Vec<f32>,
    /// Multiplies cos and sin (YaRN's attention factor; 1 otherwise).
    pub attention_scaling: f32,
}

impl Rope {
    /// The inverse frequencies transformers computes for `scaling`.
    pub fn new(dim: usize, theta: f64, scaling: &RopeScaling, max_pos: usize) -> Rope {
        let base = theta as f32;
        let half = dim / 2;
        let mut inv: Vec<f32> = (0..half)
            .map(|i| 1.0 / base.powf((2 * i) as f32 / dim as f32))
            .collect();
        let mut attention_scaling = 1.0f32;
        match *scaling {
            RopeScaling::None | RopeScaling::Dynamic { .. } => {}
            RopeScaling::Linear { factor } => inv.iter_mut().for_each(|f| *f /= factor as f32),
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            } => {
                let old = original_max_position_embeddings as f32;
                let (factor, low, high) = (
                    factor as f32,
                    low_freq_factor as f32,
                    high_freq_factor as f32,
                );
                let low_wavelen = old / low;
                let high_wavelen = old / high;
                for f in inv.iter_mut() {
                    let wavelen = 2.0 * std::f32::consts::PI / *f;
                    if wavelen > low_wavelen {
                        *f /= factor;
                    } else if wavelen >= high_wavelen {
                        let smooth = (old / wavelen - low) / (high - low);
                        *f = (1.0 - smooth) * *f / factor + smooth * *f;
                    }
                }
            }
            RopeScaling::Yarn {
                factor,
                original_max_position_embeddings,
                beta_fast,
                beta_slow,
                mscale,
                mscale_all_dim,
                attention_factor,
            } => {
                let get_mscale = |scale: f64, m: f64| {
                    if scale <= 1.0 {
                        1.0
                    } else {
                        0.1 * m * scale.ln() + 1.0
                    }
                };
                attention_scaling = match attention_factor {
                    Some(a) => a as f32,
                    None => match (mscale, mscale_all_dim) {
                        (Some(m), Some(ma)) => {
                            (get_mscale(factor, m) / get_mscale(factor, ma)) as f32
                        }
                        _ => get_mscale(factor, 1.0) as f32,
                    },
                };
                let orig = original_max_position_embeddings as f64;
                let d = dim as f64;
                let correction = |rot: f64| {
                    (d * (orig / (rot * 2.0 * std::f64::consts::PI)).ln()) / (2.0 * theta.ln())
                };
                let low = correction(beta_fast).floor().max(0.0);
                let high = correction(beta_slow).ceil().min(d - 1.0);
                let high = if low == high { high + 0.001 } else { high };
                for (i, f) in inv.iter_mut().enumerate() {
                    let ramp = ((i as f64 - low) / (high - low)).clamp(0.0, 1.0) as f32;
                    let extrapolation = 1.0 - ramp;
                    let interpolated = *f / factor as f32;
                    *f = interpolated * (1.0 - extrapolation) + *f * extrapolation;
                }
            }
        }
        let _ = max_pos;
        Rope {
            dim,
            inv_freq: inv,
            attention_scaling,
        }
    }

    /// The cosines and sines at `pos`, `dim` values: [cos; dim/2] then
    /// [sin; dim/2], each times the attention scaling. One table serves
    /// every head and layer at that position (`rotate`).
    pub fn table(&self, pos: usize, tbl: &mut [f32]) {
        let half = self.dim / 2;
        let p = pos as f32;
        let (cos, sin) = tbl[..2 * half].split_at_mut(half);
        for i in 0..half {
            let f = p * self.inv_freq[i];
            cos[i] = f.cos() * self.attention_scaling;
            sin[i] = f.sin() * self.attention_scaling;
        }
    }

    /// Rotate one head vector (its first `dim` values) by a `table`.
    pub fn rotate(&self, x: &mut [f32], tbl: &[f32]) {
        let half = self.dim / 2;
        let (cos, sin) = tbl[..2 * half].split_at(half);
        for i in 0..half {
            let (c, s) = (cos[i], sin[i]);
            let (a, b) = (x[i], x[i + half]);
            x[i] = a * c - b * s;
            x[i + half] = b * c + a * s;
        }
    }
}

#[cfg(test)]
mod act_quant_tests {
    use super::fp8_act_quant;

    #[test]
    fn values_land_on_the_scaled_e4m3_grid() {
        // amax 448 -> scale 1: E4M3 values stay, others round to the grid.
        let mut x = vec![0.0f32; 128];
        x[0] = 448.0;
        x[1] = -3.0;
        x[2] = 3.1; // between 3.0 and 3.25: rounds to 3.0
        x[3] = 5e-4; // below half of E4M3's smallest subnormal 2^-9: rounds to 0
        let q = fp8_act_quant(&x, 128);
        assert_eq!(&q[..4], &[448.0, -3.0, 3.0, 0.0]);
        // amax 1.0 -> scale 2^ceil(log2(1/448)) = 2^-8: 1.0 = 256 * 2^-8 exact,
        // 0.3 -> 76.8 -> 80 (E4M3 step 8 at 64..128) -> 0.3125.
        let q = fp8_act_quant(&[1.0, 0.3, -0.3], 3);
        assert_eq!(q, vec![1.0, 0.3125, -0.3125]);
        // Each 128-column block has its own scale; each row too.
        let mut x = vec![1.0f32; 256];
        x[200] = 1000.0;
        let q = fp8_act_quant(&x, 256);
        assert_eq!(q[0], 1.0);
        assert_eq!(q[200], 1024.0); // 1000 / 4 = 250 -> 256 (step 16) -> 1024
        assert_eq!(q[201], 1.0);
        // Zeros stay zero, NaN stays NaN.
        let q = fp8_act_quant(&[0.0, f32::NAN], 2);
        assert_eq!(q[0], 0.0);
        assert!(q[1].is_nan());
    }

    #[test]
    fn relative_error_is_e4m3s() {
        let mut s = 12345u64;
        let x: Vec<f32> = (0..4096)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                (s % 20001) as f32 / 10000.0 - 1.0
            })
            .collect();
        let q = fp8_act_quant(&x, 4096);
        let err: f32 = x
            .iter()
            .zip(&q)
            .map(|(a, b)| (a - b) * (a - b))
            .sum::<f32>()
            .sqrt();
        let norm: f32 = x.iter().map(|a| a * a).sum::<f32>().sqrt();
        let rel = err / norm;
        assert!(rel > 0.005 && rel < 0.04, "relative error {rel}");
    }
}

#[cfg(test)]
mod swiglu_tests {
    use super::{silu, swiglu_act};
    use crate::threads::PAR_ELEMENTWISE_MIN;

    /// Above the size where prefill splits it across threads, the result
    /// is what one thread computes element by element, clamped or not.
    #[test]
    fn split_across_threads_changes_nothing() {
        let n = PAR_ELEMENTWISE_MIN + 12_345;
        let g0: Vec<f32> = (0..n)
            .map(|i| ((i * 7919) % 2001) as f32 / 100.0 - 10.0)
            .collect();
        let u: Vec<f32> = (0..n)
            .map(|i| ((i * 104_729) % 1999) as f32 / 90.0 - 11.0)
            .collect();
        for limit in [None, Some(7.0f32)] {
            let want: Vec<f32> = g0
                .iter()
                .zip(&u)
                .map(|(&g, &u)| match limit {
                    None => silu(g) * u,
                    Some(l) => silu(g.min(l)) * u.clamp(-l, l),
                })
                .collect();
            let mut g = g0.clone();
            crate::threads::pool(2).install(|| swiglu_act(&mut g, &u, limit));
            assert!(
                g.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()),
                "limit {limit:?}"
            );
        }
    }
}

/// A GPU attention call failed: said once, and that sequence's attention
/// goes back to the CPU (its own copy of the keys is complete).
fn gpu_failed(e: &str) {
    static SAID: std::sync::Once = std::sync::Once::new();
    SAID.call_once(|| eprintln!("CUDA: attention on the GPU failed ({e}); running it on the CPU"));
}

/// A forward with every layer on the GPU failed: said once, and the step
/// (and the sequence's attention from then on) runs on the CPU.
#[cfg(feature = "cuda")]
fn gpu_layers_failed(e: &str) {
    static SAID: std::sync::Once = std::sync::Once::new();
    SAID.call_once(|| eprintln!("CUDA: a forward on the GPU failed ({e}); running it on the CPU"));
}

/// A sequence's keys could not go to the GPU (no room left in the tier's KV
/// reservation, sizes the kernels cannot take, out of memory): said once,
/// and its attention runs on the CPU.
fn gpu_refused(e: String) {
    static SAID: std::sync::Once = std::sync::Once::new();
    SAID.call_once(|| eprintln!("CUDA: attention on the CPU: {e}"));
}
