//! DeepSeek V4 (Flash, Pro): one forward pass matching transformers'
//! `modeling_deepseek_v4.py` (5.23) in f32.
//!
//! What sets the architecture apart, and where this file follows it:
//! * The residual is `hc_mult` parallel streams (manifold-constrained hyper
//!   connections). Before each sub-block the streams are collapsed with
//!   sigmoid weights; after it they are re-expanded and mixed through a
//!   Sinkhorn-projected (doubly stochastic) matrix. See `Dsv4Model::hc_weights`.
//! * Attention is multi-query with one shared K=V head, per-head sink logits,
//!   interleaved RoPE on the trailing `qk_rope_head_dim` dims (undone on the
//!   output, because V carries it too), and a grouped low-rank output.
//! * The keys of a query are its sliding window plus compressed entries: on
//!   HCA layers every entry emitted so far, on CSA layers the lightning
//!   indexer's top-k of them. See `Compressor` and `CompState::push`.
//! * MoE with sqrt(softplus) scores; the first layers route by a fixed
//!   token-id table; routed and shared experts both clamp their SwiGLU.
//!
//! Matrix products go through the generated kernels (FP8 / FP4 read in
//! place); the glue is plain Rust. Every step is computed per token from that
//! token's own values in a fixed order, so decoding token by token through
//! [`Dsv4Cache`] gives bit for bit the logits of a full recompute.

use super::{rms_norm, scratch, vector, EngineError, Mat, Rope};
use crate::kernels::{AttnArgs, Kernels, Matrix, Weights};
use crate::model::layout::{dsv4_attn_kind, dsv4_release_to_hf, AttnKind, Naming};
use crate::model::ModelDir;
use crate::plan::config::{Dsv4Config, Family, RopeScaling};
use rayon::prelude::*;

/// Interleaved RoPE (pairs 2i, 2i+1) on the trailing `dim` values of a vector.
struct IRope {
    dim: usize,
    inv_freq: Vec<f32>,
    scaling: f32,
}

impl IRope {
    fn new(dim: usize, theta: f64, scaling: &RopeScaling, max_pos: usize) -> IRope {
        let r = Rope::new(dim, theta, scaling, max_pos);
        IRope {
            dim,
            inv_freq: r.inv_freq,
            scaling: r.attention_scaling,
        }
    }

    /// (cos, sin) of each pair at `pos`, as transformers computes them: the
    /// angle pos·inv_freq in f32, then cos / sin times the attention scaling.
    fn table(&self, pos: usize, out: &mut Vec<(f32, f32)>) {
        out.clear();
        let p = pos as f32;
        for &f in &self.inv_freq {
            let a = p * f;
            out.push((a.cos() * self.scaling, a.sin() * self.scaling));
        }
    }

    /// x·cos + rotate_half(x)·sin on the trailing rope slice, rotate_half
    /// mapping a pair (a, b) to (−b, a). `inverse` negates sin (rotation by
    /// −pos), which transformers applies to the attention output.
    fn rotate(&self, x: &mut [f32], t: &[(f32, f32)], inverse: bool) {
        let n = x.len();
        let r = &mut x[n - self.dim..];
        for (pair, &(c, s)) in r.chunks_exact_mut(2).zip(t) {
            let s = if inverse { -s } else { s };
            let (a, b) = (pair[0], pair[1]);
            pair[0] = a * c + (-b) * s;
            pair[1] = b * c + a * s;
        }
    }
}

/// x · rsqrt(mean(x²) + eps), no weight (q_b_norm and the HC input norm).
fn rms_unweighted(x: &mut [f32], eps: f32) {
    let ss: f32 = x.iter().map(|v| v * v).sum();
    let inv = 1.0 / (ss / x.len() as f32 + eps).sqrt();
    x.iter_mut().for_each(|v| *v *= inv);
}

#[inline]
fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// torch's softplus (beta 1, threshold 20).
#[inline]
fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}

/// Indices of the `k` largest values, largest first (ties to the lower index).
fn top_k(vals: &[f32], k: usize) -> Vec<usize> {
    let mut order: Vec<usize> = (0..vals.len()).collect();
    let cmp = |a: &usize, b: &usize| vals[*b].total_cmp(&vals[*a]).then(a.cmp(b));
    if k < order.len() {
        order.select_nth_unstable_by(k, cmp);
        order.truncate(k);
    }
    order.sort_by(cmp);
    order
}

/// One query of the lightning indexer against its compressed entries.
struct IndexQuery<'a> {
    /// The visible entries, [visible, id] (id = the indexer's head_dim).
    entries: &'a [f32],
    /// The query's heads, [ih, id].
    q: &'a [f32],
    /// The query's head weights, [ih] (already times ih^-½).
    w: &'a [f32],
    /// id^-½.
    scale: f32,
}

/// The indexer's score of every visible entry e for one query:
/// `score_e = Σ_h relu(q_h · k_e)·scale·w_h`, heads in order. The dot
/// products are one F32 matmul (entries as the matrix' rows, the heads as
/// its tokens: `dots[h][e]`), so they run on the SIMD kernels and the
/// threads, in the kernels' defined order; at long contexts this is the
/// largest per-token cost of a CSA layer after the weights (64 heads × 128
/// dimensions per entry, an entry every 4 tokens).
fn index_scores(
    k: &Kernels,
    iq: IndexQuery,
    dots: &mut Vec<f32>,
    scores: &mut Vec<f32>,
) -> Result<(), EngineError> {
    let (ih, id) = (iq.w.len(), iq.q.len() / iq.w.len().max(1));
    let visible = iq.entries.len() / id.max(1);
    let m = Matrix::new(visible, id, Weights::F32(iq.entries))?;
    // The matmul writes every element: grow the buffer, never clear it.
    if dots.len() < ih * visible {
        dots.resize(ih * visible, 0.0);
    }
    let dots = &mut dots[..ih * visible];
    k.matmul(&m, iq.q, ih, dots)?;
    scores.clear();
    scores.resize(visible, 0.0);
    // Each entry's sum over the heads, in head order, entries split among
    // the threads (at 16384 entries this pass reads 4 MiB of dots).
    const PART: usize = 2048;
    let dots = &*dots;
    scores
        .par_chunks_mut(PART)
        .enumerate()
        .for_each(|(p, part)| {
            let e0 = p * PART;
            for (h, &wh) in iq.w.iter().enumerate() {
                let dh = &dots[h * visible + e0..h * visible + e0 + part.len()];
                for (s, &d) in part.iter_mut().zip(dh) {
                    *s += d.max(0.0) * iq.scale * wh;
                }
            }
        });
    Ok(())
}

/// One hyper-connection: `fn` [(2+hc)·hc, hc·D], `base` [(2+hc)·hc], `scale` [3].
struct Hc<'m> {
    fn_: Mat<'m>,
    base: Vec<f32>,
    scale: Vec<f32>,
}

/// One hyper connection's weights for n tokens: `pre` [n, hc] collapses the
/// streams, `post` [n, hc] expands the sub-block's output, `comb` [n, hc, hc]
/// mixes the old streams.
struct HcMix {
    pre: Vec<f32>,
    post: Vec<f32>,
    comb: Vec<f32>,
}

/// A compressor: per window of `ratio` tokens, a softmax (per channel, over
/// the window's tokens) of `wgate·x + ape[pos % ratio]` weights `wkv·x`; the
/// pooled vector is normed and roped at the window's first position. With
/// `overlap` (CSA) the projections are twice as wide: channels [0, dim) of
/// window w−1 and [dim, 2·dim) of window w pool together into entry w.
struct Compressor<'m> {
    wkv: Mat<'m>,
    wgate: Mat<'m>,
    /// [ratio, width]
    ape: Vec<f32>,
    norm: Vec<f32>,
    ratio: usize,
    dim: usize,
    overlap: bool,
}

impl Compressor<'_> {
    fn width(&self) -> usize {
        if self.overlap {
            2 * self.dim
        } else {
            self.dim
        }
    }
}

/// The lightning indexer of a CSA layer: its own overlapping compressor at
/// `index_head_dim`, a query projection from the q low-rank vector and
/// per-head weights from the attention input.
struct Indexer<'m> {
    comp: Compressor<'m>,
    wq_b: Mat<'m>,
    weights_proj: Mat<'m>,
}

/// wo_a: per group its own row block, or (an FP8 matrix whose groups do not
/// start on scale-block boundaries) the whole matrix, of which each group
/// keeps its rows.
enum WoA<'m> {
    Groups(Vec<Mat<'m>>),
    Whole(Mat<'m>),
}

struct Moe<'m> {
    gate: Mat<'m>,
    /// Selection bias of score-routed layers.
    bias: Option<Vec<f32>>,
    /// Hash-routed layers: [vocab, top_k] expert ids.
    tid2eid: Option<Vec<usize>>,
    /// Per expert [gate (w1), up (w3), down (w2)].
    experts: Vec<[Mat<'m>; 3]>,
    shared: Option<[Mat<'m>; 3]>,
}

struct Layer<'m> {
    kind: AttnKind,
    attn_hc: Hc<'m>,
    ffn_hc: Hc<'m>,
    attn_norm: Vec<f32>,
    ffn_norm: Vec<f32>,
    wq_a: Mat<'m>,
    q_norm: Vec<f32>,
    wq_b: Mat<'m>,
    wkv: Mat<'m>,
    kv_norm: Vec<f32>,
    wo_a: WoA<'m>,
    wo_b: Mat<'m>,
    sinks: Vec<f32>,
    comp: Option<Compressor<'m>>,
    indexer: Option<Indexer<'m>>,
    moe: Moe<'m>,
}

/// A compressor's running state for one sequence.
struct CompState {
    /// Projected kv and gate (+ ape) rows of the open window, [ratio, width].
    cur_kv: Vec<f32>,
    cur_gate: Vec<f32>,
    /// The same for the last closed window (the overlap layout reads its
    /// first `dim` channels into the next entry).
    prev_kv: Vec<f32>,
    prev_gate: Vec<f32>,
    /// Emitted entries, [count, dim]; entry w covers positions
    /// w·ratio .. (w+1)·ratio − 1.
    entries: Vec<f32>,
}

impl CompState {
    fn new(c: &Compressor) -> CompState {
        let n = c.ratio * c.width();
        CompState {
            cur_kv: vec![0.0; n],
            cur_gate: vec![0.0; n],
            prev_kv: vec![0.0; n],
            prev_gate: vec![0.0; n],
            entries: Vec::new(),
        }
    }

    fn count(&self, dim: usize) -> usize {
        self.entries.len() / dim
    }

    /// Add the token at `pos` (its projected kv and gate rows). When it
    /// closes a window ((pos+1) % ratio == 0) the window's entry is emitted
    /// at once: entry w is visible to queries at positions ≥ (w+1)·ratio − 1,
    /// the token that closes it included (transformers' causal bound
    /// w < (pos+1) // ratio).
    fn push(
        &mut self,
        c: &Compressor,
        rope: &IRope,
        (kv, gate): (&[f32], &[f32]),
        pos: usize,
        eps: f32,
        tbl: &mut Vec<(f32, f32)>,
    ) {
        let (w, dim, r) = (c.width(), c.dim, c.ratio);
        let slot = pos % r;
        self.cur_kv[slot * w..(slot + 1) * w].copy_from_slice(kv);
        for ((g, &x), &a) in self.cur_gate[slot * w..(slot + 1) * w]
            .iter_mut()
            .zip(gate)
            .zip(&c.ape[slot * w..(slot + 1) * w])
        {
            *g = x + a;
        }
        if slot + 1 < r {
            return;
        }
        let win = pos / r;
        // Slots of the pooled window: with overlap, window w−1's first half
        // (absent for w = 0: transformers gives those slots gate −inf, kv 0,
        // i.e. weight 0) then window w's second half; else window w.
        let mut out = vec![0.0f32; dim];
        let mut g = Vec::with_capacity(2 * r);
        let mut v = Vec::with_capacity(2 * r);
        for (ch, o) in out.iter_mut().enumerate() {
            g.clear();
            v.clear();
            if c.overlap {
                if win > 0 {
                    for s in 0..r {
                        g.push(self.prev_gate[s * w + ch]);
                        v.push(self.prev_kv[s * w + ch]);
                    }
                }
                for s in 0..r {
                    g.push(self.cur_gate[s * w + dim + ch]);
                    v.push(self.cur_kv[s * w + dim + ch]);
                }
            } else {
                for s in 0..r {
                    g.push(self.cur_gate[s * w + ch]);
                    v.push(self.cur_kv[s * w + ch]);
                }
            }
            // Softmax over the slots (f32), then the weighted sum in slot order.
            let m = g.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
            g.iter_mut().for_each(|x| *x = (*x - m).exp());
            let sum: f32 = g.iter().sum();
            *o = v.iter().zip(&g).map(|(kv, e)| kv * (e / sum)).sum();
        }
        rms_norm(&mut out, &c.norm, eps);
        rope.table(win * r, tbl);
        rope.rotate(&mut out, tbl, false);
        self.entries.extend_from_slice(&out);
        std::mem::swap(&mut self.cur_kv, &mut self.prev_kv);
        std::mem::swap(&mut self.cur_gate, &mut self.prev_gate);
    }
}

struct LayerState {
    /// K=V rows of the last positions, position p at row p % ring, where
    /// ring = min(sliding_window, capacity) + GPU_QUERIES: the rows a query reads stay for
    /// the next GPU_QUERIES positions, so a group of queries sent to the GPU
    /// together (or taken back to the CPU if that fails) still finds them.
    window: Vec<f32>,
    comp: Option<CompState>,
    index: Option<CompState>,
}

impl LayerState {
    /// The keys (= values) of one query from its row list (see
    /// [`Dsv4Cache`]'s `gpu`), in order, into `keys` (cleared first).
    fn keys_into(&self, rows: &[i32], ring: usize, hd: usize, keys: &mut Vec<f32>) {
        keys.clear();
        for &r in rows {
            let r = r as usize;
            let src = match (r.checked_sub(ring), &self.comp) {
                (Some(e), Some(cs)) => &cs.entries[e * hd..(e + 1) * hd],
                _ => &self.window[r * hd..(r + 1) * hd],
            };
            keys.extend_from_slice(src);
        }
    }
}

/// The state of one sequence: sliding-window KV rows, compressor buffers
/// and emitted compressed entries per layer.
pub struct Dsv4Cache {
    layers: Vec<LayerState>,
    /// Tokens already processed.
    pub len: usize,
    pub capacity: usize,
    /// With a VRAM tier: the same key rows on the GPU, where this sequence's
    /// attention then runs, and the indexers' entries, where their scores
    /// are computed (bit for bit the CPU's, so the top-k, made on the CPU,
    /// picks the same entries). Row r of a layer is window row r below the
    /// ring, compressed entry r − ring above it. The CPU rows are always
    /// kept, so a failed GPU call falls back without losing anything.
    gpu: Option<Box<crate::gpu::RowKv>>,
}

impl Dsv4Cache {
    /// Whether this sequence's attention runs on the GPU.
    pub fn attention_on_gpu(&self) -> bool {
        self.gpu.is_some()
    }

    /// Move this sequence's attention (and indexers) to the CPU: its rows
    /// on the GPU are freed (the CPU keeps them all).
    pub fn detach_gpu(&mut self) {
        self.gpu = None;
    }

    /// Whether the lightning indexers score on the GPU (every CSA layer's
    /// entries kept there); None where the model has no indexer.
    pub fn indexer_on_gpu(&self) -> Option<bool> {
        let mut csa = self
            .layers
            .iter()
            .enumerate()
            .filter(|(_, l)| l.index.is_some())
            .peekable();
        csa.peek()?;
        Some(csa.all(|(i, _)| self.gpu.as_ref().is_some_and(|g| g.has_index(i))))
    }
}

/// Rows of the window ring ([`LayerState::window`]) of a cache for
/// `capacity` tokens: no query sees more than min(window, capacity) rows.
fn ring(window: usize, capacity: usize) -> usize {
    window.min(capacity) + crate::gpu::GPU_QUERIES
}

pub struct Dsv4Model<'m> {
    pub model: &'m ModelDir,
    pub kernels: Kernels,
    embed: Mat<'m>,
    head: Mat<'m>,
    norm: Vec<f32>,
    hc_head: Hc<'m>,
    layers: Vec<Layer<'m>>,
    /// Sliding-only layers' rope ("main": rope_theta, unscaled).
    rope_main: IRope,
    /// Compressed layers, their compressors and indexers ("compress":
    /// compress_rope_theta with the configured scaling, YaRN in V4).
    rope_comp: IRope,
    eps: f32,
    hc_eps: f32,
    d: usize,
    heads: usize,
    head_dim: usize,
    vocab: usize,
    hc: usize,
    sinkhorn_iters: usize,
    window: usize,
    o_groups: usize,
    o_rank: usize,
    index_heads: usize,
    index_dim: usize,
    index_topk: usize,
    top_k: usize,
    routed_scale: f32,
    swiglu_limit: f32,
    /// Whose numerics to follow where transformers and DeepSeek's own
    /// inference code differ (default: transformers, the oracle).
    pub numerics: Numerics,
    /// Routed-expert selections per layer (the VRAM tier's input).
    pub usage: crate::placement::UsageCounter,
}

/// Where transformers' `DeepseekV4ForCausalLM` and DeepSeek's reference
/// inference code (`inference/model.py` in the release) compute differently.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Numerics {
    /// transformers: f32 activations into every product; the shared expert's
    /// SwiGLU clamped at swiglu_limit like the routed experts'.
    #[default]
    Transformers,
    /// DeepSeek's code: activations quantized to FP8 (E4M3, power-of-two
    /// scale per 128 columns) before every FP8 / FP4 product
    /// ([`super::fp8_act_quant`]); the shared expert unclamped. (Its BF16
    /// activations, FP8 KV cache and FP4 indexer are not simulated.)
    DeepSeek,
}

fn bad(msg: String) -> EngineError {
    EngineError::Unsupported(msg)
}

impl<'m> Dsv4Model<'m> {
    pub fn new(model: &'m ModelDir, kernels: Kernels) -> Result<Dsv4Model<'m>, EngineError> {
        let c = &model.config;
        if c.family != Family::DeepseekV4 {
            return Err(bad(format!("{} is not a deepseek_v4 model", c.model_type)));
        }
        let v: &Dsv4Config = c
            .dsv4
            .as_ref()
            .ok_or_else(|| bad("deepseek_v4 config without its V4 fields".into()))?;
        let moe_cfg = c
            .moe
            .as_ref()
            .ok_or_else(|| bad("deepseek_v4 config without its MoE fields".into()))?;
        let (d, h, hd) = (c.hidden_size, c.num_heads, c.head_dim);
        let rd = v.qk_rope_head_dim;
        if rd > hd || rd > v.index_head_dim || rd % 2 != 0 {
            return Err(bad(format!("qk_rope_head_dim {rd} must be even and at most head_dim {hd} and index_head_dim {}", v.index_head_dim)));
        }
        if h % v.o_groups != 0 || v.compress_ratios.len() < c.num_layers {
            return Err(bad(
                "o_groups must divide the heads and compress_ratios cover every layer".into(),
            ));
        }
        // Release names are the reference; HF-named checkpoints map them.
        let name = |release: &str| match model.naming {
            Naming::Hf => dsv4_release_to_hf(release),
            _ => release.to_string(),
        };
        let load = |release: &str| Mat::load(model, &name(release));
        let vec = |release: &str, len: usize| vector(model, &name(release), len);
        let hc = v.hc_mult;
        let mix = (2 + hc) * hc;
        let load_hc = |fn_: &str,
                       base: &str,
                       scale: &str,
                       rows: usize,
                       n_scale: usize|
         -> Result<Hc<'m>, EngineError> {
            let f = load(fn_)?;
            if f.rows != rows || f.cols != hc * d {
                return Err(bad(format!(
                    "{}: expected [{rows}, {}], found [{}, {}]",
                    f.name,
                    hc * d,
                    f.rows,
                    f.cols
                )));
            }
            Ok(Hc {
                fn_: f,
                base: vec(base, rows)?,
                scale: vec(scale, n_scale)?,
            })
        };
        let head_name = name("head.weight");
        let head = if !model.weights.contains(&head_name) && c.tie_word_embeddings {
            load("embed.weight")?
        } else {
            load("head.weight")?
        };
        let (n_e, inter, top_k) = (
            moe_cfg.num_experts,
            moe_cfg.moe_intermediate_size,
            moe_cfg.top_k,
        );
        let mut layers = Vec::with_capacity(c.num_layers);
        for l in 0..c.num_layers {
            let p = format!("layers.{l}");
            let a = format!("{p}.attn");
            let kind = dsv4_attn_kind(v, l);
            let ratio = v.compress_ratios[l];
            let load_comp =
                |prefix: &str, dim: usize, overlap: bool| -> Result<Compressor<'m>, EngineError> {
                    let width = if overlap { 2 * dim } else { dim };
                    let wkv = load(&format!("{prefix}.wkv.weight"))?;
                    let wgate = load(&format!("{prefix}.wgate.weight"))?;
                    for m in [&wkv, &wgate] {
                        if m.rows != width || m.cols != d {
                            return Err(bad(format!(
                                "{}: expected [{width}, {d}], found [{}, {}]",
                                m.name, m.rows, m.cols
                            )));
                        }
                    }
                    Ok(Compressor {
                        wkv,
                        wgate,
                        ape: vec(&format!("{prefix}.ape"), ratio * width)?,
                        norm: vec(&format!("{prefix}.norm.weight"), dim)?,
                        ratio,
                        dim,
                        overlap,
                    })
                };
            let (comp, indexer) = match kind {
                AttnKind::Sliding => (None, None),
                AttnKind::Hca => (
                    Some(load_comp(&format!("{a}.compressor"), hd, false)?),
                    None,
                ),
                AttnKind::Csa => {
                    let ix = format!("{a}.indexer");
                    let indexer = Indexer {
                        comp: load_comp(&format!("{ix}.compressor"), v.index_head_dim, true)?,
                        wq_b: load(&format!("{ix}.wq_b.weight"))?,
                        weights_proj: load(&format!("{ix}.weights_proj.weight"))?,
                    };
                    (
                        Some(load_comp(&format!("{a}.compressor"), hd, true)?),
                        Some(indexer),
                    )
                }
            };
            let wo_a_name = name(&format!("{a}.wo_a.weight"));
            let wo_a = {
                let mut groups = Vec::with_capacity(v.o_groups);
                for g in 0..v.o_groups {
                    match Mat::load_rows(model, &wo_a_name, g * v.o_lora_rank, v.o_lora_rank)? {
                        Some(m) => groups.push(m),
                        None => break,
                    }
                }
                if groups.len() == v.o_groups {
                    WoA::Groups(groups)
                } else {
                    WoA::Whole(Mat::load(model, &wo_a_name)?)
                }
            };
            let f = format!("{p}.ffn");
            let hash = l < v.num_hash_layers;
            let tid2eid = if hash {
                let t = name(&format!("{f}.gate.tid2eid"));
                let view = model
                    .weights
                    .get(&t)
                    .ok_or_else(|| bad(format!("tensor {t:?} is missing")))?;
                let ids = view.i64s()?;
                if ids.len() != c.vocab_size * top_k {
                    return Err(bad(format!(
                        "{t}: expected {} × {top_k} expert ids, found {}",
                        c.vocab_size,
                        ids.len()
                    )));
                }
                let ids: Result<Vec<usize>, EngineError> =
                    ids.iter()
                        .map(|&e| {
                            usize::try_from(e).ok().filter(|&e| e < n_e).ok_or_else(|| {
                                bad(format!("{t}: expert id {e} is outside 0..{n_e}"))
                            })
                        })
                        .collect();
                Some(ids?)
            } else {
                None
            };
            let gate_up = format!("model.layers.{l}.mlp.experts.gate_up_proj");
            let fused = model.weights.contains(&gate_up);
            let mut experts = Vec::with_capacity(n_e);
            for e in 0..n_e {
                experts.push(if fused {
                    let down = format!("model.layers.{l}.mlp.experts.down_proj");
                    [
                        Mat::load_slice(model, &gate_up, e, 0, inter)?,
                        Mat::load_slice(model, &gate_up, e, inter, inter)?,
                        Mat::load_slice(model, &down, e, 0, d)?,
                    ]
                } else {
                    let x = format!("{f}.experts.{e}");
                    [
                        load(&format!("{x}.w1.weight"))?,
                        load(&format!("{x}.w3.weight"))?,
                        load(&format!("{x}.w2.weight"))?,
                    ]
                });
            }
            let shared = if moe_cfg.n_shared_experts > 0 {
                let x = format!("{f}.shared_experts");
                Some([
                    load(&format!("{x}.w1.weight"))?,
                    load(&format!("{x}.w3.weight"))?,
                    load(&format!("{x}.w2.weight"))?,
                ])
            } else {
                None
            };
            let moe = Moe {
                gate: load(&format!("{f}.gate.weight"))?,
                bias: if hash {
                    None
                } else {
                    Some(vec(&format!("{f}.gate.bias"), n_e)?)
                },
                tid2eid,
                experts,
                shared,
            };
            layers.push(Layer {
                kind,
                attn_hc: load_hc(
                    &format!("{p}.hc_attn_fn"),
                    &format!("{p}.hc_attn_base"),
                    &format!("{p}.hc_attn_scale"),
                    mix,
                    3,
                )?,
                ffn_hc: load_hc(
                    &format!("{p}.hc_ffn_fn"),
                    &format!("{p}.hc_ffn_base"),
                    &format!("{p}.hc_ffn_scale"),
                    mix,
                    3,
                )?,
                attn_norm: vec(&format!("{p}.attn_norm.weight"), d)?,
                ffn_norm: vec(&format!("{p}.ffn_norm.weight"), d)?,
                wq_a: load(&format!("{a}.wq_a.weight"))?,
                q_norm: vec(&format!("{a}.q_norm.weight"), v.q_lora_rank)?,
                wq_b: load(&format!("{a}.wq_b.weight"))?,
                wkv: load(&format!("{a}.wkv.weight"))?,
                kv_norm: vec(&format!("{a}.kv_norm.weight"), hd)?,
                wo_a,
                wo_b: load(&format!("{a}.wo_b.weight"))?,
                sinks: vec(&format!("{a}.attn_sink"), h)?,
                comp,
                indexer,
                moe,
            });
        }
        let experts_per_layer: Vec<usize> = layers.iter().map(|l| l.moe.experts.len()).collect();
        Ok(Dsv4Model {
            usage: crate::placement::UsageCounter::new(&experts_per_layer),
            model,
            kernels,
            embed: load("embed.weight")?,
            head,
            norm: vec("norm.weight", d)?,
            hc_head: load_hc("hc_head_fn", "hc_head_base", "hc_head_scale", hc, 1)?,
            layers,
            rope_main: IRope::new(
                rd,
                c.rope_theta,
                &RopeScaling::None,
                c.max_position_embeddings,
            ),
            rope_comp: IRope::new(
                rd,
                v.compress_rope_theta,
                &c.rope_scaling,
                c.max_position_embeddings,
            ),
            eps: c.rms_norm_eps as f32,
            hc_eps: v.hc_eps as f32,
            d,
            heads: h,
            head_dim: hd,
            vocab: c.vocab_size,
            hc,
            sinkhorn_iters: v.hc_sinkhorn_iters,
            window: v.sliding_window,
            o_groups: v.o_groups,
            o_rank: v.o_lora_rank,
            index_heads: v.index_n_heads,
            index_dim: v.index_head_dim,
            index_topk: v.index_topk,
            top_k,
            routed_scale: v.routed_scaling_factor as f32,
            swiglu_limit: v.swiglu_limit as f32,
            numerics: Numerics::Transformers,
        })
    }

    /// Weight bytes (weights + scales) one decoded token reads: every layer's
    /// attention projections (with its compressor / indexer projections),
    /// both hyper-connection mixers, the router gate, the shared expert and
    /// top_k / n_routed of all routed experts (the expected value under
    /// uniform routing), plus the final hyper-connection and the head. The
    /// embedding row lookup and small vectors (norms, biases, ape) are not
    /// counted.
    pub fn bytes_per_token(&self) -> u64 {
        let comp_bytes = |c: &Compressor<'_>| c.wkv.bytes() + c.wgate.bytes();
        let mut total = self.head.bytes() + self.hc_head.fn_.bytes();
        for l in &self.layers {
            total += l.attn_hc.fn_.bytes() + l.ffn_hc.fn_.bytes();
            total += l.wq_a.bytes() + l.wq_b.bytes() + l.wkv.bytes() + l.wo_b.bytes();
            total += match &l.wo_a {
                WoA::Groups(g) => g.iter().map(|m| m.bytes()).sum::<u64>(),
                WoA::Whole(m) => m.bytes(),
            };
            if let Some(c) = &l.comp {
                total += comp_bytes(c);
            }
            if let Some(ix) = &l.indexer {
                total += comp_bytes(&ix.comp) + ix.wq_b.bytes() + ix.weights_proj.bytes();
            }
            total += l.moe.gate.bytes();
            if let Some(s) = &l.moe.shared {
                total += s.iter().map(|m| m.bytes()).sum::<u64>();
            }
            // top_k of the n_e experts' bytes (none when there are none)
            let n_e = l.moe.experts.len() as u64;
            let all: u64 = l
                .moe
                .experts
                .iter()
                .flat_map(|e| e.iter())
                .map(|m| m.bytes())
                .sum();
            total += (all * (self.top_k as u64).min(n_e))
                .checked_div(n_e)
                .unwrap_or(0);
        }
        total
    }

    pub fn vocab(&self) -> usize {
        self.vocab
    }

    /// Every matrix product's weights, as the VRAM tier places them: dense
    /// items (attention, compressors, indexers, mixers, routers, shared
    /// experts, the head) and routed experts.
    pub fn placement_items(&self) -> Vec<(crate::placement::Item, Vec<&Mat<'m>>)> {
        use crate::placement::Item;
        let mut items = Vec::new();
        let routed: std::collections::HashSet<*const Mat<'m>> = self
            .layers
            .iter()
            .flat_map(|l| l.moe.experts.iter().flatten())
            .map(|m| m as *const _)
            .collect();
        for m in self.mats() {
            if std::ptr::eq(m, &self.embed) || routed.contains(&(m as *const Mat<'m>)) {
                continue;
            }
            items.push((
                Item::Dense {
                    name: m.name.clone(),
                    bytes: m.bytes(),
                },
                vec![m],
            ));
        }
        for (li, l) in self.layers.iter().enumerate() {
            for (e, ms) in l.moe.experts.iter().enumerate() {
                items.push((
                    Item::Expert {
                        layer: li,
                        expert: e,
                        bytes: ms.iter().map(|m| m.bytes()).sum(),
                    },
                    ms.iter().collect(),
                ));
            }
        }
        items
    }

    fn mats(&self) -> Vec<&Mat<'m>> {
        let mut all = vec![&self.embed, &self.head, &self.hc_head.fn_];
        for l in &self.layers {
            all.extend([
                &l.attn_hc.fn_,
                &l.ffn_hc.fn_,
                &l.wq_a,
                &l.wq_b,
                &l.wkv,
                &l.wo_b,
                &l.moe.gate,
            ]);
            match &l.wo_a {
                WoA::Groups(g) => all.extend(g.iter()),
                WoA::Whole(m) => all.push(m),
            }
            for c in l.comp.iter().chain(l.indexer.as_ref().map(|i| &i.comp)) {
                all.extend([&c.wkv, &c.wgate]);
            }
            if let Some(i) = &l.indexer {
                all.extend([&i.wq_b, &i.weights_proj]);
            }
            all.extend(l.moe.experts.iter().flatten());
            all.extend(l.moe.shared.iter().flatten());
        }
        all
    }

    /// Whether every matrix is read in place from the mapping.
    pub fn weights_in_place(&self) -> bool {
        self.mats().iter().all(|m| m.in_place())
    }

    /// The key rows a sequence of `capacity` tokens keeps per layer on the
    /// GPU ([`Dsv4Cache`]'s `gpu`): the window ring, then one row per
    /// compressed entry; and the most keys a query attends to (its window
    /// plus, on CSA layers, the indexer's top-k; on HCA layers every entry).
    fn row_kv_geo(&self, capacity: usize) -> crate::gpu::RowKvGeo {
        let ring = ring(self.window, capacity);
        let mut max_keys = self.window.min(capacity);
        let layer_rows = self
            .layers
            .iter()
            .map(|l| {
                let entries = l.comp.as_ref().map_or(0, |c| capacity / c.ratio);
                let seen = match l.indexer {
                    Some(_) => entries.min(self.index_topk),
                    None => entries,
                };
                max_keys = max_keys.max(self.window.min(capacity) + seen);
                ring + entries
            })
            .collect();
        // The indexers' entries, where the model has CSA layers.
        let layer_entries: Vec<usize> = self
            .layers
            .iter()
            .map(|l| l.indexer.as_ref().map_or(0, |ix| capacity / ix.comp.ratio))
            .collect();
        let index = layer_entries
            .iter()
            .any(|&e| e > 0)
            .then_some(crate::gpu::IndexGeo {
                layer_entries,
                heads: self.index_heads,
                dim: self.index_dim,
            });
        crate::gpu::RowKvGeo {
            layer_rows,
            n_heads: self.heads,
            head_dim: self.head_dim,
            max_keys,
            index,
        }
    }

    /// What attention on the GPU sets aside: the key rows of a sequence of
    /// min(context, GPU_KV_TOKENS) tokens.
    pub fn gpu_attention(&self) -> crate::gpu::GpuAttention {
        crate::gpu::GpuAttention::for_context(self.model.config.max_position_embeddings, |t| {
            self.row_kv_geo(t).bytes()
        })
    }

    /// An empty cache for up to `capacity` tokens (checked against the
    /// context). With a VRAM tier whose KV reservation holds it, its
    /// attention runs on the GPU.
    pub fn new_cache(&self, capacity: usize) -> Result<Dsv4Cache, EngineError> {
        let limit = self.model.config.max_position_embeddings;
        if capacity > limit {
            return Err(EngineError::Context {
                needed: capacity,
                limit,
                hint: String::new(),
            });
        }
        let layers = self
            .layers
            .iter()
            .map(|l| LayerState {
                window: vec![0.0; ring(self.window, capacity) * self.head_dim],
                comp: l.comp.as_ref().map(CompState::new),
                index: l.indexer.as_ref().map(|i| CompState::new(&i.comp)),
            })
            .collect();
        let gpu = if self.kernels.tier() != 0 {
            let shape = crate::plan::AttnShape {
                head_dim: self.head_dim,
                n_heads: self.heads,
                n_kv_heads: 1,
            };
            let specialised = self.kernels.attn_kernel(shape).shape.is_some();
            let sinks: Vec<&[f32]> = self.layers.iter().map(|l| &l.sinks[..]).collect();
            crate::gpu::RowKv::new(
                self.kernels.tier(),
                self.row_kv_geo(capacity),
                &sinks,
                specialised,
            )
            .map_err(super::gpu_refused)
            .ok()
            .map(Box::new)
        } else {
            None
        };
        Ok(Dsv4Cache {
            layers,
            len: 0,
            capacity,
            gpu,
        })
    }

    /// Per token: `pre` [hc], `post` [hc] and `comb` [hc, hc] of one hyper
    /// connection, as transformers computes them:
    /// * mixes = fn · (x / rms(x)) over the flattened streams (unweighted RMS, rms_norm_eps);
    /// * pre = sigmoid(mix·scale₀ + base) + hc_eps; post = 2·sigmoid(mix·scale₁ + base);
    /// * comb = softmax over each row of (mix·scale₂ + base) + hc_eps, then ONE
    ///   column normalisation, then (iters − 1) × (row, column)
    ///   normalisations, every denominator + hc_eps.
    fn hc_weights(&self, hc: &Hc, x: &[f32], n: usize) -> Result<HcMix, EngineError> {
        let (s, w) = (self.hc, self.hc * self.d);
        let mix = (2 + s) * s;
        let mut normed = scratch::copy_of(x);
        for row in normed.chunks_exact_mut(w) {
            rms_unweighted(row, self.eps);
        }
        let mut mixes = vec![0.0f32; n * mix];
        hc.fn_
            .apply_q(&self.kernels, &normed, n, &mut mixes, self.aq())?;
        let (b, sc, eps) = (&hc.base, &hc.scale, self.hc_eps);
        let mut pre = vec![0.0f32; n * s];
        let mut post = vec![0.0f32; n * s];
        let mut comb = vec![0.0f32; n * s * s];
        for t in 0..n {
            let m = &mixes[t * mix..(t + 1) * mix];
            for i in 0..s {
                pre[t * s + i] = sigmoid(m[i] * sc[0] + b[i]) + eps;
                post[t * s + i] = 2.0 * sigmoid(m[s + i] * sc[1] + b[s + i]);
            }
            let c = &mut comb[t * s * s..(t + 1) * s * s];
            for (i, row) in c.chunks_exact_mut(s).enumerate() {
                for (j, v) in row.iter_mut().enumerate() {
                    *v = m[2 * s + i * s + j] * sc[2] + b[2 * s + i * s + j];
                }
                let mx = row.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
                row.iter_mut().for_each(|v| *v = (*v - mx).exp());
                let sum: f32 = row.iter().sum();
                row.iter_mut().for_each(|v| *v = *v / sum + eps);
            }
            let cols = |c: &mut [f32]| {
                for j in 0..s {
                    let sum: f32 = (0..s).map(|i| c[i * s + j]).sum::<f32>() + eps;
                    (0..s).for_each(|i| c[i * s + j] /= sum);
                }
            };
            let rows = |c: &mut [f32]| {
                for row in c.chunks_exact_mut(s) {
                    let sum: f32 = row.iter().sum::<f32>() + eps;
                    row.iter_mut().for_each(|v| *v /= sum);
                }
            };
            cols(c);
            for _ in 1..self.sinkhorn_iters {
                rows(c);
                cols(c);
            }
        }
        Ok(HcMix { pre, post, comb })
    }

    /// Σ_i pre_i · stream_i per token: [n, hc, D] → [n, D].
    fn collapse(&self, pre: &[f32], x: &[f32], n: usize) -> scratch::Buf {
        let (s, d) = (self.hc, self.d);
        let mut y = scratch::stale(n * d);
        for t in 0..n {
            let out = &mut y[t * d..(t + 1) * d];
            for i in 0..s {
                let p = pre[t * s + i];
                let xs = &x[(t * s + i) * d..(t * s + i + 1) * d];
                if i == 0 {
                    out.iter_mut().zip(xs).for_each(|(o, v)| *o = p * v);
                } else {
                    out.iter_mut().zip(xs).for_each(|(o, v)| *o += p * v);
                }
            }
        }
        y
    }

    /// Streams after a sub-block: new_k = post_k · f + Σ_j comb[j, k] · old_j
    /// (comb read transposed, as transformers does).
    fn expand(&self, post: &[f32], comb: &[f32], x: &mut [f32], f: &[f32], n: usize) {
        let (s, d) = (self.hc, self.d);
        let mut new = vec![0.0f32; s * d];
        for t in 0..n {
            let old = &x[t * s * d..(t + 1) * s * d];
            let c = &comb[t * s * s..(t + 1) * s * s];
            let ft = &f[t * d..(t + 1) * d];
            for k in 0..s {
                let pk = post[t * s + k];
                for e in 0..d {
                    let mut acc = 0.0f32;
                    for j in 0..s {
                        acc += c[j * s + k] * old[j * d + e];
                    }
                    new[k * d + e] = pk * ft[e] + acc;
                }
            }
            x[t * s * d..(t + 1) * s * d].copy_from_slice(&new);
        }
    }

    /// Run `tokens` (appended at cache.len) through the model. Returns the
    /// logits of every position when `all_logits`, else of the last one.
    pub fn forward(
        &self,
        cache: &mut Dsv4Cache,
        tokens: &[u32],
        all_logits: bool,
    ) -> Result<Vec<f32>, EngineError> {
        let n = tokens.len();
        if n == 0 {
            return Ok(Vec::new());
        }
        super::check_room(cache.len, cache.capacity, n)?;
        if cache.layers.len() != self.layers.len() {
            return Err(bad("this cache belongs to another model".into()));
        }
        let (d, s) = (self.d, self.hc);
        // The residual: hc copies of the embedding per token.
        let mut x = scratch::stale(n * s * d);
        let mut row = vec![0.0f32; d];
        for (t, &id) in tokens.iter().enumerate() {
            if id as usize >= self.vocab {
                return Err(EngineError::BadToken {
                    id,
                    vocab: self.vocab,
                });
            }
            self.embed.row_f32(id as usize, &mut row);
            for i in 0..s {
                x[(t * s + i) * d..(t * s + i + 1) * d].copy_from_slice(&row);
            }
        }
        let pos0 = cache.len;
        for (li, (layer, state)) in self.layers.iter().zip(cache.layers.iter_mut()).enumerate() {
            let HcMix { pre, post, comb } = self.hc_weights(&layer.attn_hc, &x, n)?;
            let mut a = self.collapse(&pre, &x, n);
            rms_norm(&mut a, &layer.attn_norm, self.eps);
            let o = self.attention(layer, state, (li, &mut cache.gpu), &a, n, pos0)?;
            self.expand(&post, &comb, &mut x, &o, n);

            let HcMix { pre, post, comb } = self.hc_weights(&layer.ffn_hc, &x, n)?;
            let mut f = self.collapse(&pre, &x, n);
            rms_norm(&mut f, &layer.ffn_norm, self.eps);
            let o = self.moe(li, &layer.moe, &f, tokens)?;
            self.expand(&post, &comb, &mut x, &o, n);
        }
        cache.len += n;

        // hc_head: sigmoid collapse weights (no Sinkhorn), then norm and head.
        let first = if all_logits { 0 } else { n - 1 };
        let m = n - first;
        let xs = &x[first * s * d..];
        let mut normed = scratch::copy_of(xs);
        for r in normed.chunks_exact_mut(s * d) {
            rms_unweighted(r, self.eps);
        }
        let mut mixes = vec![0.0f32; m * s];
        self.hc_head
            .fn_
            .apply_q(&self.kernels, &normed, m, &mut mixes, self.aq())?;
        let pre: Vec<f32> = mixes
            .chunks_exact(s)
            .flat_map(|r| {
                r.iter().enumerate().map(|(i, &v)| {
                    sigmoid(v * self.hc_head.scale[0] + self.hc_head.base[i]) + self.hc_eps
                })
            })
            .collect();
        let mut y = self.collapse(&pre, xs, m);
        rms_norm(&mut y, &self.norm, self.eps);
        let mut logits = vec![0.0f32; m * self.vocab];
        self.head
            .apply_q(&self.kernels, &y, m, &mut logits, self.aq())?;
        Ok(logits)
    }

    /// The attention sub-block for `n` tokens at pos0.. (input `a`, already
    /// normed): returns [n, D].
    fn attention(
        &self,
        l: &Layer,
        st: &mut LayerState,
        (li, gpu): (usize, &mut Option<Box<crate::gpu::RowKv>>),
        a: &[f32],
        n: usize,
        pos0: usize,
    ) -> Result<scratch::Buf, EngineError> {
        let k = &self.kernels;
        let (d, h, hd) = (self.d, self.heads, self.head_dim);
        let rope = if l.kind == AttnKind::Sliding {
            &self.rope_main
        } else {
            &self.rope_comp
        };
        let qr = l.wq_a.rows;
        let (ih, id) = (self.index_heads, self.index_dim);
        // Every projection of `a` at once (queued together on the GPU where
        // all are resident): q_residual = wq_a a, kv, and the compressor's
        // and the indexer's kv, gate and head weights.
        let mut q_res = scratch::stale(n * qr);
        let mut kv = scratch::stale(n * hd);
        let pair = |c: &Compressor| (scratch::stale(n * c.width()), scratch::stale(n * c.width()));
        let mut comp_proj = l.comp.as_ref().map(pair);
        let mut ix_proj = l
            .indexer
            .as_ref()
            .map(|ix| (pair(&ix.comp), vec![0.0f32; n * ih]));
        {
            let mut mats: Vec<&Mat> = vec![&l.wq_a, &l.wkv];
            let mut ys: Vec<&mut [f32]> = vec![&mut q_res[..], &mut kv[..]];
            if let (Some(c), Some((kvp, gp))) = (&l.comp, comp_proj.as_mut()) {
                mats.extend([&c.wkv, &c.wgate]);
                ys.extend([&mut kvp[..], &mut gp[..]]);
            }
            if let (Some(ix), Some(((ikv, ig), iw))) = (&l.indexer, ix_proj.as_mut()) {
                mats.extend([&ix.comp.wkv, &ix.comp.wgate, &ix.weights_proj]);
                ys.extend([&mut ikv[..], &mut ig[..], &mut iw[..]]);
            }
            Mat::apply_list(k, &mats, &[a], n, &mut ys, self.aq())?;
        }
        // q_residual is normed, then shared with the indexer.
        rms_norm(&mut q_res, &l.q_norm, self.eps);
        let mut q = scratch::stale(n * h * hd);
        let mut iq = l.indexer.as_ref().map(|_| scratch::stale(n * ih * id));
        match (&l.indexer, iq.as_mut()) {
            (Some(ix), Some(iq)) => Mat::apply_list(
                k,
                &[&l.wq_b, &ix.wq_b],
                &[&q_res],
                n,
                &mut [&mut q[..], &mut iq[..]],
                self.aq(),
            )?,
            _ => l.wq_b.apply_q(k, &q_res, n, &mut q, self.aq())?,
        }
        rms_norm(&mut kv, &l.kv_norm, self.eps);
        let mut tbl = Vec::new();
        for t in 0..n {
            rope.table(pos0 + t, &mut tbl);
            for head in q[t * h * hd..(t + 1) * h * hd].chunks_exact_mut(hd) {
                rms_unweighted(head, self.eps);
                rope.rotate(head, &tbl, false);
            }
            rope.rotate(&mut kv[t * hd..(t + 1) * hd], &tbl, false);
        }
        let index_proj = match (ix_proj, iq) {
            (Some(((ikv, ig), mut iw)), Some(mut iq)) => {
                for t in 0..n {
                    self.rope_comp.table(pos0 + t, &mut tbl);
                    for head in iq[t * ih * id..(t + 1) * ih * id].chunks_exact_mut(id) {
                        self.rope_comp.rotate(head, &tbl, false);
                    }
                }
                let wscale = (ih as f64).powf(-0.5) as f32;
                iw.iter_mut().for_each(|v| *v *= wscale);
                Some((ikv, ig, iq, iw))
            }
            _ => None,
        };
        let scale = (hd as f64).powf(-0.5) as f32;
        let softmax_scale = (id as f64).powf(-0.5) as f32;
        // The cache's ring (sized for its capacity by new_cache).
        let (w, ring) = (self.window, st.window.len() / hd);
        let mut att = scratch::stale(n * h * hd);
        let mut keys: Vec<f32> = Vec::new();
        let mut scores: Vec<f32> = Vec::new();
        let mut dots: Vec<f32> = Vec::new();
        // Each query's keys as rows (below `ring`: window row, above:
        // compressed entry row − ring), offs[j]..offs[j+1] for query g0 + j.
        // Queries go in groups: one at a time on the CPU, up to GPU_QUERIES
        // on the GPU (the ring keeps a group's window rows). A group first
        // takes its tokens into the window and the compressors, then the
        // indexer scores the queries that choose (all of them in one launch
        // on the GPU), then each query's row list is made, then attention.
        let mut rows: Vec<i32> = Vec::new();
        let mut offs: Vec<i32> = vec![0];
        // Per query of the group: the compressed entries it sees.
        let mut visible: Vec<usize> = Vec::with_capacity(crate::gpu::GPU_QUERIES);
        // The group's indexer scores from the GPU: query j's at
        // gscores[soffs[j]..soffs[j+1]] (empty for a query that takes every entry).
        let (mut gscores, mut soffs): (Vec<f32>, Vec<i32>) = (Vec::new(), vec![0]);
        let mut sent = st.comp.as_ref().map_or(0, |cs| cs.count(hd));
        let mut isent = st.index.as_ref().map_or(0, |is| is.count(id));
        let mut g0 = 0;
        while g0 < n {
            let g1 = match gpu {
                Some(_) => (g0 + crate::gpu::GPU_QUERIES).min(n),
                None => g0 + 1,
            };
            visible.clear();
            for t in g0..g1 {
                let p = pos0 + t;
                st.window[(p % ring) * hd..(p % ring + 1) * hd]
                    .copy_from_slice(&kv[t * hd..(t + 1) * hd]);
                if let (Some(c), Some(cs), Some((ckv, cg))) =
                    (&l.comp, st.comp.as_mut(), &comp_proj)
                {
                    let cw = c.width();
                    cs.push(
                        c,
                        &self.rope_comp,
                        (&ckv[t * cw..(t + 1) * cw], &cg[t * cw..(t + 1) * cw]),
                        p,
                        self.eps,
                        &mut tbl,
                    );
                }
                if let (Some(ix), Some(is), Some((ikv, ig, _, _))) =
                    (&l.indexer, st.index.as_mut(), &index_proj)
                {
                    let cw = ix.comp.width();
                    is.push(
                        &ix.comp,
                        &self.rope_comp,
                        (&ikv[t * cw..(t + 1) * cw], &ig[t * cw..(t + 1) * cw]),
                        p,
                        self.eps,
                        &mut tbl,
                    );
                }
                visible.push(st.comp.as_ref().map_or(0, |cs| cs.count(hd)));
            }
            let chooses = |v: usize| v > self.index_topk;
            // The indexer on the GPU: its new entries, then the scores of
            // the group's choosing queries in one launch.
            let mut scored_on_gpu = false;
            if let (Some(m), Some(is), Some((_, _, iq, iw))) =
                (gpu.as_mut(), &st.index, &index_proj)
            {
                if m.has_index(li) {
                    let now = is.count(id);
                    soffs.truncate(1);
                    for &v in &visible {
                        let last = soffs[soffs.len() - 1];
                        soffs.push(last + if chooses(v) { v as i32 } else { 0 });
                    }
                    let res = m
                        .write_index(li, isent, &is.entries[isent * id..now * id])
                        .and_then(|()| {
                            m.index_scores(
                                li,
                                &iq[g0 * ih * id..g1 * ih * id],
                                &iw[g0 * ih..g1 * ih],
                                &soffs,
                                softmax_scale,
                                &mut gscores,
                            )
                        });
                    isent = now;
                    match res {
                        Ok(()) => scored_on_gpu = true,
                        Err(e) => {
                            super::gpu_failed(&e);
                            *gpu = None;
                        }
                    }
                }
            }
            // Keys: the sliding window (positions p−w+1 ..= p, in order),
            // then the compressed entries the query sees or its indexer picked.
            for (j, t) in (g0..g1).enumerate() {
                let p = pos0 + t;
                let lo = (p + 1).saturating_sub(w);
                rows.extend((lo..=p).map(|j| (j % ring) as i32));
                if st.comp.is_none() {
                    offs.push(rows.len() as i32);
                    continue;
                }
                let vis = visible[j];
                let mut chosen = match (&st.index, &index_proj) {
                    (Some(_), Some(_)) if chooses(vis) && scored_on_gpu => top_k(
                        &gscores[soffs[j] as usize..soffs[j + 1] as usize],
                        self.index_topk,
                    ),
                    (Some(is), Some((_, _, iq, iw))) if chooses(vis) => {
                        index_scores(
                            k,
                            IndexQuery {
                                entries: &is.entries[..vis * id],
                                q: &iq[t * ih * id..(t + 1) * ih * id],
                                w: &iw[t * ih..(t + 1) * ih],
                                scale: softmax_scale,
                            },
                            &mut dots,
                            &mut scores,
                        )?;
                        top_k(&scores, self.index_topk)
                    }
                    // HCA, or a CSA query that sees no more than top-k
                    // entries: all of them.
                    _ => (0..vis).collect(),
                };
                chosen.sort_unstable();
                rows.extend(chosen.into_iter().map(|e| (ring + e) as i32));
                offs.push(rows.len() as i32);
            }
            // Queries g0 .. g1: on the GPU (their new rows first), else or
            // if that fails on the CPU.
            let qs = &q[g0 * h * hd..g1 * h * hd];
            let out = &mut att[g0 * h * hd..g1 * h * hd];
            let on_gpu = match gpu.as_mut() {
                Some(m) => {
                    let now = st.comp.as_ref().map_or(0, |cs| cs.count(hd));
                    let sent_now = sent;
                    let res = (|| {
                        // Window rows of positions pos0+g0 .. pos0+g1: one
                        // run, or two where the ring wraps.
                        let (mut at, end) = (pos0 + g0, pos0 + g1);
                        while at < end {
                            let slot = at % ring;
                            let len = (ring - slot).min(end - at);
                            m.write(li, slot, &st.window[slot * hd..(slot + len) * hd])?;
                            at += len;
                        }
                        if let Some(cs) = &st.comp {
                            m.write(li, ring + sent_now, &cs.entries[sent_now * hd..now * hd])?;
                        }
                        m.attend(li, qs, &rows, &offs, scale, out)
                    })();
                    sent = now;
                    match res {
                        Ok(()) => true,
                        Err(e) => {
                            super::gpu_failed(&e);
                            *gpu = None;
                            false
                        }
                    }
                }
                None => false,
            };
            if !on_gpu {
                for ((qj, oj), se) in qs
                    .chunks_exact(h * hd)
                    .zip(out.chunks_exact_mut(h * hd))
                    .zip(offs.windows(2))
                {
                    st.keys_into(&rows[se[0] as usize..se[1] as usize], ring, hd, &mut keys);
                    let args = AttnArgs {
                        q: qj,
                        k: &keys,
                        v: &keys,
                        sinks: Some(&l.sinks),
                        n_heads: h,
                        n_kv_heads: 1,
                        head_dim: hd,
                        kv_stride: hd,
                        kv_head_stride: hd,
                        t_len: keys.len() / hd,
                        window: 0,
                        scale,
                    };
                    k.attn_decode(&args, oj)?;
                }
            }
            rows.clear();
            offs.truncate(1);
            g0 = g1;
        }
        // V = K carries rope: rotate each output back by −p.
        for (t, out) in att.chunks_exact_mut(h * hd).enumerate() {
            rope.table(pos0 + t, &mut tbl);
            for head in out.chunks_exact_mut(hd) {
                rope.rotate(head, &tbl, true);
            }
        }
        // Grouped wo_a: group g reads heads g·H/G .. (g+1)·H/G − 1.
        let (g_n, r) = (self.o_groups, self.o_rank);
        let in_g = h * hd / g_n;
        let mut z = scratch::stale(n * g_n * r);
        let gather = |g: usize, xg: &mut [f32]| {
            for t in 0..n {
                xg[t * in_g..(t + 1) * in_g]
                    .copy_from_slice(&att[t * h * hd + g * in_g..t * h * hd + (g + 1) * in_g]);
            }
        };
        match &l.wo_a {
            WoA::Groups(ms) => {
                // Every group's input first, then the products at once
                // (queued together on the GPU where all are resident).
                let xgs: Vec<scratch::Buf> = (0..ms.len())
                    .map(|g| {
                        let mut xg = scratch::stale(n * in_g);
                        gather(g, &mut xg);
                        xg
                    })
                    .collect();
                let mut ygs: Vec<scratch::Buf> = ms.iter().map(|_| scratch::stale(n * r)).collect();
                let mats: Vec<&Mat> = ms.iter().collect();
                let xs: Vec<&[f32]> = xgs.iter().map(|b| &b[..]).collect();
                let mut ys: Vec<&mut [f32]> = ygs.iter_mut().map(|b| &mut b[..]).collect();
                Mat::apply_list(k, &mats, &xs, n, &mut ys, self.aq())?;
                for (g, yg) in ygs.iter().enumerate() {
                    for t in 0..n {
                        z[(t * g_n + g) * r..(t * g_n + g + 1) * r]
                            .copy_from_slice(&yg[t * r..(t + 1) * r]);
                    }
                }
            }
            WoA::Whole(m) => {
                let mut xg = scratch::stale(n * in_g);
                let mut yg = scratch::stale(n * g_n * r);
                for g in 0..g_n {
                    gather(g, &mut xg);
                    m.apply_q(k, &xg, n, &mut yg, self.aq())?;
                    for t in 0..n {
                        z[(t * g_n + g) * r..(t * g_n + g + 1) * r]
                            .copy_from_slice(&yg[(t * g_n + g) * r..(t * g_n + g + 1) * r]);
                    }
                }
            }
        }
        let mut o = scratch::stale(n * d);
        l.wo_b.apply_q(k, &z, n, &mut o, self.aq())?;
        Ok(o)
    }

    /// The MoE sub-block: routed experts (hash- or score-selected) plus the
    /// shared expert. Returns [n, D].
    fn moe(
        &self,
        li: usize,
        m: &Moe,
        x: &[f32],
        tokens: &[u32],
    ) -> Result<scratch::Buf, EngineError> {
        let k = &self.kernels;
        let (d, n) = (self.d, tokens.len());
        let e_n = m.experts.len();
        let mut logits = vec![0.0f32; n * e_n];
        m.gate.apply_q(k, x, n, &mut logits, self.aq())?;
        let mut chosen: Vec<Vec<(usize, f32)>> = vec![Vec::new(); e_n];
        let mut biased = vec![0.0f32; e_n];
        for t in 0..n {
            let scores: Vec<f32> = logits[t * e_n..(t + 1) * e_n]
                .iter()
                .map(|&v| softplus(v).sqrt())
                .collect();
            let idx: Vec<usize> = match (&m.tid2eid, &m.bias) {
                // Hash layers: a fixed table indexed by the token id.
                (Some(tab), _) => tab
                    [tokens[t] as usize * self.top_k..(tokens[t] as usize + 1) * self.top_k]
                    .to_vec(),
                (None, Some(b)) => {
                    biased
                        .iter_mut()
                        .zip(scores.iter().zip(b))
                        .for_each(|(o, (s, bb))| *o = s + bb);
                    top_k(&biased, self.top_k)
                }
                (None, None) => top_k(&scores, self.top_k),
            };
            // Always renormalised over the chosen experts, then scaled
            // (transformers does not consult norm_topk_prob here).
            let sum: f32 = idx.iter().map(|&e| scores[e]).sum::<f32>() + 1e-20;
            for &e in &idx {
                chosen[e].push((t, scores[e] / sum * self.routed_scale));
            }
        }
        let mut out = scratch::zeroed(n * d);
        // Experts in index order, each over its tokens (transformers' order),
        // then the shared expert (on the GPU queued with the routed ones).
        let shared = m.shared.as_ref().map(|mats| super::SharedExpert {
            mats,
            limit: match self.numerics {
                Numerics::Transformers => Some(self.swiglu_limit),
                Numerics::DeepSeek => None,
            },
        });
        super::add_routed_experts(
            k,
            &chosen,
            x,
            d,
            &mut out,
            &self.usage,
            li,
            &m.experts,
            Some(self.swiglu_limit),
            self.aq(),
            shared,
        )?;
        Ok(out)
    }

    /// Whether activations are FP8-quantized before FP8 / FP4 products.
    fn aq(&self) -> bool {
        self.numerics == Numerics::DeepSeek
    }
}

impl crate::generate::CausalLm for Dsv4Model<'_> {
    type Cache = Dsv4Cache;
    fn vocab(&self) -> usize {
        Dsv4Model::vocab(self)
    }
    fn new_cache(&self, capacity: usize) -> Result<Dsv4Cache, EngineError> {
        Dsv4Model::new_cache(self, capacity)
    }
    fn forward(
        &self,
        cache: &mut Dsv4Cache,
        tokens: &[u32],
        all_logits: bool,
    ) -> Result<Vec<f32>, EngineError> {
        Dsv4Model::forward(self, cache, tokens, all_logits)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Pseudo-random values in [-1, 1) (a fixed LCG: no test dependency).
    fn values(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed;
        (0..n)
            .map(|_| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
            })
            .collect()
    }

    /// The indexer's scores against their definition in f64, with buffers
    /// reused from a larger call, across a head-sum part boundary.
    #[test]
    fn index_scores_match_their_definition() {
        let k = Kernels::best();
        let (ih, id) = (8, 32);
        let (q, w) = (values(ih * id, 1), values(ih, 2));
        let (mut dots, mut scores) = (Vec::new(), Vec::new());
        for visible in [5000, 2049, 7] {
            let entries = values(visible * id, visible as u64);
            let iq = IndexQuery {
                entries: &entries,
                q: &q,
                w: &w,
                scale: 0.125,
            };
            index_scores(&k, iq, &mut dots, &mut scores).unwrap();
            assert_eq!(scores.len(), visible);
            for (e, &got) in scores.iter().enumerate() {
                let ke = &entries[e * id..(e + 1) * id];
                let (mut want, mut mag) = (0.0f64, 0.0f64);
                for (h, qh) in q.chunks_exact(id).enumerate() {
                    let dot: f64 = qh.iter().zip(ke).map(|(&a, &b)| a as f64 * b as f64).sum();
                    let abs: f64 = qh
                        .iter()
                        .zip(ke)
                        .map(|(&a, &b)| (a as f64 * b as f64).abs())
                        .sum();
                    want += dot.max(0.0) * 0.125 * w[h] as f64;
                    mag += abs * 0.125 * (w[h] as f64).abs();
                }
                let tol = mag * (id + ih + 4) as f64 * f32::EPSILON as f64;
                assert!(
                    (got as f64 - want).abs() <= tol,
                    "visible {visible}, entry {e}: {got} against {want} (tolerance {tol:e})"
                );
            }
            // And bit for bit the reference's order, which the GPU kernel
            // (bs_cu_index_scores) follows too: the same top-k either way.
            let exact = crate::reference::index_scores(&entries, &q, &w, id, 0.125);
            for (e, (a, b)) in scores.iter().zip(&exact).enumerate() {
                assert_eq!(
                    a.to_bits(),
                    b.to_bits(),
                    "visible {visible}, entry {e}: {a} vs the reference {b}"
                );
            }
        }
    }
}
