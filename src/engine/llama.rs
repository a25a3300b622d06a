//! Llama (Llama, SmolLM2, Qwen2), Qwen3 and Qwen3-MoE: one forward pass,
//! matching transformers' modeling code in f32.

use super::{rms_norm, swiglu, vector, EngineError, Mat, Rope};
use crate::kernels::{AttnArgs, Kernels};
use crate::model::ModelDir;
use crate::plan::config::Family;

enum Mlp<'m> {
    Dense {
        gate: Mat<'m>,
        up: Mat<'m>,
        down: Mat<'m>,
    },
    Moe {
        router: Mat<'m>,
        experts: Vec<[Mat<'m>; 3]>,
        top_k: usize,
        norm_topk_prob: bool,
    },
}

struct Layer<'m> {
    in_norm: Vec<f32>,
    post_norm: Vec<f32>,
    q: Mat<'m>,
    k: Mat<'m>,
    v: Mat<'m>,
    o: Mat<'m>,
    /// q, k, v (and o for Llama's attention_bias) biases.
    bias: [Option<Vec<f32>>; 4],
    /// Qwen3's per-head RMSNorm weights on q and k.
    qk_norm: Option<(Vec<f32>, Vec<f32>)>,
    mlp: Mlp<'m>,
}

/// The KV cache of one sequence: per layer, `[kv_head][position][head_dim]`
/// for `capacity` positions. KV-head-major, so that attention, which takes
/// a KV head's group of query heads at a time, reads that head's rows as
/// one contiguous run (position-major, each row of head_dim floats sat
/// kv_heads × head_dim apart, and the hardware prefetchers fetched few of
/// them ahead).
pub struct KvCache {
    k: Vec<Vec<f32>>,
    v: Vec<Vec<f32>>,
    /// Tokens already in the cache.
    pub len: usize,
    pub capacity: usize,
    /// With a VRAM tier: the same keys and values on the GPU, where this
    /// sequence's attention then runs. The CPU copy above is always kept,
    /// so a failed GPU call falls back without losing anything.
    gpu: Option<Box<crate::gpu::KvMirror>>,
}

impl KvCache {
    /// Whether this sequence's attention runs on the GPU.
    pub fn attention_on_gpu(&self) -> bool {
        self.gpu.is_some()
    }

    /// Move this sequence's attention to the CPU: its keys and values on
    /// the GPU are freed (the CPU copy holds them all).
    pub fn detach_gpu(&mut self) {
        self.gpu = None;
    }

    /// Write layer `li`'s keys and values `k`, `v` (rows of kv_heads ×
    /// head_dim, position-major) at positions pos0.. into the CPU copy.
    fn store(&mut self, li: usize, pos0: usize, k: &[f32], v: &[f32], hd: usize) {
        let cap = self.capacity;
        if cap == 0 || hd == 0 {
            return;
        }
        let kvw = self.k[li].len() / cap;
        for (dst, src) in [(&mut self.k[li], k), (&mut self.v[li], v)] {
            for (i, row) in src.chunks_exact(kvw).enumerate() {
                for (g, head) in row.chunks_exact(hd).enumerate() {
                    let at = (g * cap + pos0 + i) * hd;
                    dst[at..at + hd].copy_from_slice(head);
                }
            }
        }
    }

    /// Bytes a cache for `ctx` tokens takes.
    pub fn bytes_for(layers: usize, kv_width: usize, ctx: usize) -> u64 {
        2 * layers as u64 * kv_width as u64 * ctx as u64 * 4
    }
}

pub struct LlamaModel<'m> {
    pub model: &'m ModelDir,
    pub kernels: Kernels,
    embed: Mat<'m>,
    head: Mat<'m>,
    norm: Vec<f32>,
    layers: Vec<Layer<'m>>,
    rope: Rope,
    eps: f32,
    d: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    vocab: usize,
    /// Routed-expert selections per layer (MoE models; the VRAM tier's input).
    pub usage: crate::placement::UsageCounter,
    /// A dense model's norm weights and biases on the GPU, for forwards with
    /// every layer there ([`LlamaModel::forward_on_gpu`]): uploaded by the
    /// first forward that can run so; None if that failed.
    #[cfg(feature = "cuda")]
    gpu_vectors: std::sync::OnceLock<Option<crate::gpu::DenseVectors>>,
}

impl<'m> LlamaModel<'m> {
    pub fn new(model: &'m ModelDir, kernels: Kernels) -> Result<LlamaModel<'m>, EngineError> {
        let c = &model.config;
        if c.family == Family::DeepseekV4 {
            return Err(EngineError::Unsupported(
                "deepseek_v4 runs on its own engine".into(),
            ));
        }
        if c.sliding_window.is_some() {
            return Err(EngineError::Unsupported(
                "use_sliding_window is set in config.json; sliding-window Qwen layers are not supported yet".into(),
            ));
        }
        let (d, hd) = (c.hidden_size, c.head_dim);
        let embed = Mat::load(model, "model.embed_tokens.weight")?;
        let head = if c.tie_word_embeddings && !model.weights.contains("lm_head.weight") {
            Mat::load(model, "model.embed_tokens.weight")?
        } else {
            Mat::load(model, "lm_head.weight")?
        };
        let fused = model
            .weights
            .names()
            .any(|n| n.ends_with(".mlp.experts.gate_up_proj"));
        let mut layers = Vec::with_capacity(c.num_layers);
        for l in 0..c.num_layers {
            let p = format!("model.layers.{l}");
            let a = format!("{p}.self_attn");
            let bias = |proj: &str, len: usize| -> Result<Option<Vec<f32>>, EngineError> {
                let name = format!("{a}.{proj}.bias");
                if model.weights.contains(&name) {
                    vector(model, &name, len).map(Some)
                } else {
                    Ok(None)
                }
            };
            let qk_norm = if matches!(c.family, Family::Qwen3 | Family::Qwen3Moe) {
                Some((
                    vector(model, &format!("{a}.q_norm.weight"), hd)?,
                    vector(model, &format!("{a}.k_norm.weight"), hd)?,
                ))
            } else {
                None
            };
            let sparse = c.moe.as_ref().filter(|m| !m.dense_layers.contains(&l));
            let mlp = match sparse {
                None => Mlp::Dense {
                    gate: Mat::load(model, &format!("{p}.mlp.gate_proj.weight"))?,
                    up: Mat::load(model, &format!("{p}.mlp.up_proj.weight"))?,
                    down: Mat::load(model, &format!("{p}.mlp.down_proj.weight"))?,
                },
                Some(moe) => {
                    let i = moe.moe_intermediate_size;
                    let mut experts = Vec::with_capacity(moe.num_experts);
                    for e in 0..moe.num_experts {
                        experts.push(if fused {
                            let gu = format!("{p}.mlp.experts.gate_up_proj");
                            let dn = format!("{p}.mlp.experts.down_proj");
                            [
                                Mat::load_slice(model, &gu, e, 0, i)?,
                                Mat::load_slice(model, &gu, e, i, i)?,
                                Mat::load_slice(model, &dn, e, 0, d)?,
                            ]
                        } else {
                            let x = format!("{p}.mlp.experts.{e}");
                            [
                                Mat::load(model, &format!("{x}.gate_proj.weight"))?,
                                Mat::load(model, &format!("{x}.up_proj.weight"))?,
                                Mat::load(model, &format!("{x}.down_proj.weight"))?,
                            ]
                        });
                    }
                    Mlp::Moe {
                        router: Mat::load(model, &format!("{p}.mlp.gate.weight"))?,
                        experts,
                        top_k: moe.top_k,
                        norm_topk_prob: moe.norm_topk_prob,
                    }
                }
            };
            layers.push(Layer {
                in_norm: vector(model, &format!("{p}.input_layernorm.weight"), d)?,
                post_norm: vector(model, &format!("{p}.post_attention_layernorm.weight"), d)?,
                q: Mat::load(model, &format!("{a}.q_proj.weight"))?,
                k: Mat::load(model, &format!("{a}.k_proj.weight"))?,
                v: Mat::load(model, &format!("{a}.v_proj.weight"))?,
                o: Mat::load(model, &format!("{a}.o_proj.weight"))?,
                bias: [
                    bias("q_proj", c.num_heads * hd)?,
                    bias("k_proj", c.num_kv_heads * hd)?,
                    bias("v_proj", c.num_kv_heads * hd)?,
                    bias("o_proj", d)?,
                ],
                qk_norm,
                mlp,
            });
        }
        let experts_per_layer: Vec<usize> = layers
            .iter()
            .map(|l| match &l.mlp {
                Mlp::Moe { experts, .. } => experts.len(),
                Mlp::Dense { .. } => 0,
            })
            .collect();
        Ok(LlamaModel {
            usage: crate::placement::UsageCounter::new(&experts_per_layer),
            model,
            kernels,
            embed,
            head,
            norm: vector(model, "model.norm.weight", d)?,
            layers,
            rope: Rope::new(hd, c.rope_theta, &c.rope_scaling, c.max_position_embeddings),
            eps: c.rms_norm_eps as f32,
            d,
            heads: c.num_heads,
            kv_heads: c.num_kv_heads,
            head_dim: hd,
            vocab: c.vocab_size,
            #[cfg(feature = "cuda")]
            gpu_vectors: std::sync::OnceLock::new(),
        })
    }

    /// Every matrix product's weights, as the VRAM tier places them: dense
    /// items (attention, dense MLPs, routers, the head) and routed experts.
    pub fn placement_items(&self) -> Vec<(crate::placement::Item, Vec<&Mat<'m>>)> {
        use crate::placement::Item;
        let dense = |m: &'_ Mat<'m>| Item::Dense {
            name: m.name.clone(),
            bytes: m.bytes(),
        };
        let mut items = Vec::new();
        for (li, l) in self.layers.iter().enumerate() {
            for m in [&l.q, &l.k, &l.v, &l.o] {
                items.push((dense(m), vec![m]));
            }
            match &l.mlp {
                Mlp::Dense { gate, up, down } => {
                    for m in [gate, up, down] {
                        items.push((dense(m), vec![m]));
                    }
                }
                Mlp::Moe {
                    router, experts, ..
                } => {
                    items.push((dense(router), vec![router]));
                    for (e, ms) in experts.iter().enumerate() {
                        let bytes = ms.iter().map(|m| m.bytes()).sum();
                        items.push((
                            Item::Expert {
                                layer: li,
                                expert: e,
                                bytes,
                            },
                            ms.iter().collect(),
                        ));
                    }
                }
            }
        }
        items.push((dense(&self.head), vec![&self.head]));
        items
    }

    pub fn vocab(&self) -> usize {
        self.vocab
    }

    /// Whether every matrix is read in place from the mapping.
    pub fn weights_in_place(&self) -> bool {
        let mut all = self.embed.in_place() && self.head.in_place();
        for l in &self.layers {
            all &= [&l.q, &l.k, &l.v, &l.o].iter().all(|m| m.in_place());
            match &l.mlp {
                Mlp::Dense { gate, up, down } => {
                    all &= gate.in_place() && up.in_place() && down.in_place()
                }
                Mlp::Moe {
                    router, experts, ..
                } => all &= router.in_place() && experts.iter().flatten().all(|m| m.in_place()),
            }
        }
        all
    }

    /// Weight bytes one decoded token reads: every layer's attention and MLP
    /// (for MoE, the router plus top-k of the experts on average) and the
    /// head; the embedding row is negligible.
    pub fn bytes_per_token(&self) -> u64 {
        let mut b = self.head.bytes();
        for l in &self.layers {
            b += l.q.bytes() + l.k.bytes() + l.v.bytes() + l.o.bytes();
            b += match &l.mlp {
                Mlp::Dense { gate, up, down } => gate.bytes() + up.bytes() + down.bytes(),
                Mlp::Moe {
                    router,
                    experts,
                    top_k,
                    ..
                } => {
                    let all: u64 = experts.iter().flatten().map(|m| m.bytes()).sum();
                    router.bytes() + all * *top_k as u64 / experts.len().max(1) as u64
                }
            };
        }
        b
    }

    /// What attention on the GPU sets aside: a KV mirror
    /// ([`crate::gpu::KvMirror`]) for min(context, GPU_KV_TOKENS) positions.
    pub fn gpu_attention(&self) -> crate::gpu::GpuAttention {
        crate::gpu::GpuAttention::for_context(self.model.config.max_position_embeddings, |t| {
            crate::gpu::kv_mirror_bytes(
                self.layers.len(),
                self.heads,
                self.kv_heads,
                self.head_dim,
                t,
            )
        })
    }

    /// An empty cache for up to `capacity` tokens (checked against the
    /// context). With a VRAM tier whose KV reservation holds it, its
    /// attention runs on the GPU.
    pub fn new_cache(&self, capacity: usize) -> Result<KvCache, EngineError> {
        let limit = self.model.config.max_position_embeddings;
        if capacity > limit {
            return Err(EngineError::Context {
                needed: capacity,
                limit,
                hint: String::new(),
            });
        }
        let w = self.kv_heads * self.head_dim;
        let gpu = if self.kernels.tier() != 0 {
            let shape = crate::plan::AttnShape {
                head_dim: self.head_dim,
                n_heads: self.heads,
                n_kv_heads: self.kv_heads,
            };
            let specialised = self.kernels.attn_kernel(shape).shape.is_some();
            crate::gpu::KvMirror::new(
                self.kernels.tier(),
                self.layers.len(),
                self.heads,
                self.kv_heads,
                self.head_dim,
                capacity,
                specialised,
            )
            .map_err(super::gpu_refused)
            .ok()
            .map(Box::new)
        } else {
            None
        };
        Ok(KvCache {
            gpu,
            k: (0..self.layers.len())
                .map(|_| vec![0.0; capacity * w])
                .collect(),
            v: (0..self.layers.len())
                .map(|_| vec![0.0; capacity * w])
                .collect(),
            len: 0,
            capacity,
        })
    }

    /// Run `tokens` (appended at cache.len) through the model. Returns the
    /// logits of every position when `all_logits`, else of the last one.
    pub fn forward(
        &self,
        cache: &mut KvCache,
        tokens: &[u32],
        all_logits: bool,
    ) -> Result<Vec<f32>, EngineError> {
        let n = tokens.len();
        if n == 0 {
            return Ok(Vec::new());
        }
        super::check_room(cache.len, cache.capacity, n)?;
        let (d, hd, h, kvh) = (self.d, self.head_dim, self.heads, self.kv_heads);
        let k = &self.kernels;
        let mut x = vec![0.0f32; n * d];
        for (i, &t) in tokens.iter().enumerate() {
            if t as usize >= self.vocab {
                return Err(EngineError::BadToken {
                    id: t,
                    vocab: self.vocab,
                });
            }
            self.embed.row_f32(t as usize, &mut x[i * d..(i + 1) * d]);
        }
        let pos0 = cache.len;
        let kvw = kvh * hd;
        // Each position's rotation, computed once for every head and layer.
        let mut rope_tbl = vec![0.0f32; n * hd];
        for (i, tbl) in rope_tbl.chunks_exact_mut(hd).enumerate() {
            self.rope.table(pos0 + i, tbl);
        }
        #[cfg(feature = "cuda")]
        if let Some(logits) = self.forward_on_gpu(cache, &x, &rope_tbl, all_logits)? {
            return Ok(logits);
        }
        let mut hbuf = vec![0.0f32; n * d];
        let mut q = vec![0.0f32; n * h * hd];
        let mut kk = vec![0.0f32; n * kvw];
        let mut vv = vec![0.0f32; n * kvw];
        let mut att = vec![0.0f32; n * h * hd];
        let mut o = vec![0.0f32; n * d];
        let scale = 1.0 / (hd as f32).sqrt();
        for (li, layer) in self.layers.iter().enumerate() {
            hbuf.copy_from_slice(&x);
            rms_norm(&mut hbuf, &layer.in_norm, self.eps);
            // q, k and v share their input (queued together on the GPU).
            Mat::apply_list(
                k,
                &[&layer.q, &layer.k, &layer.v],
                &[&hbuf],
                n,
                &mut [&mut q[..], &mut kk[..], &mut vv[..]],
                false,
            )?;
            for (buf, b) in [
                (&mut q, &layer.bias[0]),
                (&mut kk, &layer.bias[1]),
                (&mut vv, &layer.bias[2]),
            ] {
                if let Some(b) = b {
                    for row in buf.chunks_exact_mut(b.len()) {
                        row.iter_mut().zip(b).for_each(|(v, bb)| *v += bb);
                    }
                }
            }
            if let Some((qn, kn)) = &layer.qk_norm {
                rms_norm(&mut q, qn, self.eps);
                rms_norm(&mut kk, kn, self.eps);
            }
            for (i, tbl) in rope_tbl.chunks_exact(hd).enumerate() {
                for head in q[i * h * hd..(i + 1) * h * hd].chunks_exact_mut(hd) {
                    self.rope.rotate(head, tbl);
                }
                for head in kk[i * kvw..(i + 1) * kvw].chunks_exact_mut(hd) {
                    self.rope.rotate(head, tbl);
                }
            }
            let cap = cache.capacity;
            cache.store(li, pos0, &kk, &vv, hd);
            if let Some(m) = cache.gpu.as_mut() {
                if let Err(e) = m.append(li, pos0, &kk, &vv) {
                    super::gpu_failed(&e);
                    cache.gpu = None;
                }
            }
            // On the GPU: every query of the step in one call (query i over
            // positions 0 ..= pos0 + i); else, or if that fails, on the CPU.
            let on_gpu = match cache
                .gpu
                .as_mut()
                .map(|m| m.attend(li, &q, pos0 + 1, scale, &mut att))
            {
                Some(Ok(())) => true,
                Some(Err(e)) => {
                    super::gpu_failed(&e);
                    cache.gpu = None;
                    false
                }
                None => false,
            };
            for i in (0..n).filter(|_| !on_gpu) {
                let out = &mut att[i * h * hd..(i + 1) * h * hd];
                let args = AttnArgs {
                    q: &q[i * h * hd..(i + 1) * h * hd],
                    k: &cache.k[li],
                    v: &cache.v[li],
                    sinks: None,
                    n_heads: h,
                    n_kv_heads: kvh,
                    head_dim: hd,
                    kv_stride: hd,
                    kv_head_stride: cap * hd,
                    t_len: pos0 + i + 1,
                    window: 0,
                    scale,
                };
                k.attn_decode(&args, out)?;
            }
            layer.o.apply(k, &att, n, &mut o)?;
            if let Some(b) = &layer.bias[3] {
                for row in o.chunks_exact_mut(d) {
                    row.iter_mut().zip(b).for_each(|(v, bb)| *v += bb);
                }
            }
            x.iter_mut().zip(&o).for_each(|(a, b)| *a += b);
            hbuf.copy_from_slice(&x);
            rms_norm(&mut hbuf, &layer.post_norm, self.eps);
            self.mlp(li, &layer.mlp, &hbuf, n, &mut o)?;
            x.iter_mut().zip(&o).for_each(|(a, b)| *a += b);
        }
        cache.len += n;
        let rows: &mut [f32] = if all_logits {
            &mut x
        } else {
            &mut x[(n - 1) * d..]
        };
        rms_norm(rows, &self.norm, self.eps);
        let m = rows.len() / d;
        let mut logits = vec![0.0f32; m * self.vocab];
        self.head.apply(k, rows, m, &mut logits)?;
        Ok(logits)
    }

    /// The forward with every layer on the GPU
    /// ([`crate::gpu::KvMirror::layers_forward`]): for a model whose
    /// attention runs there and whose every layer matrix (q, k, v, o and
    /// the dense MLP, or the MoE router) is resident, each taking f32
    /// activations for this many tokens; routed experts run where they are
    /// ([`GpuRouting`]). The embeddings `x` go up once and the logits (or,
    /// with the head on the CPU, the normalised last rows) and the new keys
    /// and values, for the CPU's copy of the cache, come back once (and an
    /// MoE layer's router logits in between). Ok(None): not so here, or the
    /// GPU failed (said once; the sequence's attention then goes back to the
    /// CPU), and the CPU path runs the step.
    #[cfg(feature = "cuda")]
    fn forward_on_gpu(
        &self,
        cache: &mut KvCache,
        x: &[f32],
        rope_tbl: &[f32],
        all_logits: bool,
    ) -> Result<Option<Vec<f32>>, EngineError> {
        use crate::gpu::{LayerFfn, LayerMats};
        let (k, d) = (&self.kernels, self.d);
        let n = x.len() / d;
        let Some(mirror) = cache
            .gpu
            .as_mut()
            .filter(|_| crate::gpu::whole_layers_enabled())
        else {
            return Ok(None);
        };
        let resident = |m: &Mat| -> Result<Option<crate::gpu::DevProduct>, EngineError> {
            Ok(k.gpu_product(&m.matrix()?, n))
        };
        let mut mats = Vec::with_capacity(self.layers.len());
        for l in &self.layers {
            let (Some(q), Some(kk), Some(v), Some(o)) = (
                resident(&l.q)?,
                resident(&l.k)?,
                resident(&l.v)?,
                resident(&l.o)?,
            ) else {
                return Ok(None);
            };
            let ffn = match &l.mlp {
                Mlp::Dense { gate, up, down } => {
                    match (resident(gate)?, resident(up)?, resident(down)?) {
                        (Some(g), Some(u), Some(dn)) => LayerFfn::Dense([g, u, dn]),
                        _ => return Ok(None),
                    }
                }
                Mlp::Moe {
                    router, experts, ..
                } => match resident(router)? {
                    Some(r) => LayerFfn::Moe {
                        router: r,
                        inter: experts.first().map_or(0, |e| e[0].rows),
                    },
                    None => return Ok(None),
                },
            };
            mats.push(LayerMats {
                attn: [q, kk, v, o],
                ffn,
            });
        }
        let vecs = self.gpu_vectors.get_or_init(|| {
            let layers: Vec<crate::gpu::LayerVectors> = self
                .layers
                .iter()
                .map(|l| crate::gpu::LayerVectors {
                    in_norm: &l.in_norm,
                    post_norm: &l.post_norm,
                    qk_norm: l.qk_norm.as_ref().map(|(q, k)| (&q[..], &k[..])),
                    bias: [0, 1, 2, 3].map(|i| l.bias[i].as_deref()),
                })
                .collect();
            let geo = crate::gpu::DenseGeo {
                d,
                heads: self.heads,
                kv_heads: self.kv_heads,
                head_dim: self.head_dim,
                rope_dim: self.rope.dim,
                eps: self.eps,
                scale: 1.0 / (self.head_dim as f32).sqrt(),
            };
            crate::gpu::gpu()
                .map_err(str::to_string)
                .and_then(|g| g.dense_vectors(geo, &layers, &self.norm))
                .map_err(|e| super::gpu_layers_failed(&e))
                .ok()
        });
        let Some(vecs) = vecs else {
            return Ok(None);
        };
        let rows = if all_logits { n } else { 1 };
        let head = k.gpu_product(&self.head.matrix()?, rows);
        let (layers, kvw, hd) = (
            self.layers.len(),
            self.kv_heads * self.head_dim,
            self.head_dim,
        );
        let mut kv = vec![0.0f32; layers * 2 * n * kvw];
        let pos0 = cache.len;
        let host = GpuRouting {
            model: self,
            counted: Default::default(),
        };
        match mirror.layers_forward(
            vecs,
            &mats,
            Some(&host),
            head.as_ref(),
            x,
            rope_tbl,
            pos0,
            rows,
            &mut kv,
        ) {
            Ok(out) => {
                // The experts' usage counts once the forward has run whole:
                // a failed one is run again on the CPU, which counts it.
                for (layer, e, tokens) in host.counted.into_inner().unwrap_or_default() {
                    self.usage.record(layer, e, tokens);
                }
                for (li, lkv) in kv.chunks_exact(2 * n * kvw).enumerate() {
                    let (kk, vv) = lkv.split_at(n * kvw);
                    cache.store(li, pos0, kk, vv, hd);
                }
                cache.len += n;
                if head.is_some() {
                    return Ok(Some(out));
                }
                let mut logits = vec![0.0f32; rows * self.vocab];
                self.head.apply(k, &out, rows, &mut logits)?;
                Ok(Some(logits))
            }
            Err(e) => {
                super::gpu_layers_failed(&e);
                cache.gpu = None;
                Ok(None)
            }
        }
    }

    fn mlp(
        &self,
        li: usize,
        mlp: &Mlp,
        x: &[f32],
        n: usize,
        out: &mut [f32],
    ) -> Result<(), EngineError> {
        let k = &self.kernels;
        let d = self.d;
        match mlp {
            Mlp::Dense { gate, up, down } => swiglu(k, [gate, up, down], x, n, None, false, out),
            Mlp::Moe {
                router,
                experts,
                top_k,
                norm_topk_prob,
            } => {
                let e = experts.len();
                let mut logits = vec![0.0f32; n * e];
                router.apply(k, x, n, &mut logits)?;
                let chosen = choose_experts(&logits, e, *top_k, *norm_topk_prob);
                out[..n * d].fill(0.0);
                // Experts in index order, each over its group of tokens at once
                // (transformers adds them in the same order).
                super::add_routed_experts(
                    k,
                    &chosen,
                    x,
                    d,
                    out,
                    &self.usage,
                    li,
                    experts,
                    None,
                    false,
                    None,
                )
            }
        }
    }
}

/// Per token (a row of `logits`, one per expert): softmax over the
/// experts, the top k (ties to the lower index), and with `norm_topk_prob`
/// their probabilities renormalised. Per expert, its tokens in order with
/// their weights.
fn choose_experts(
    logits: &[f32],
    e: usize,
    top_k: usize,
    norm_topk_prob: bool,
) -> Vec<Vec<(usize, f32)>> {
    let mut chosen: Vec<Vec<(usize, f32)>> = vec![Vec::new(); e];
    for (t, row) in logits.chunks_exact(e).enumerate() {
        let max = row.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
        let exps: Vec<f32> = row.iter().map(|v| (v - max).exp()).collect();
        let sum: f32 = exps.iter().sum();
        let probs: Vec<f32> = exps.iter().map(|v| v / sum).collect();
        let mut order: Vec<usize> = (0..e).collect();
        // Descending probability; ties to the lower expert index.
        order.sort_by(|&a, &b| probs[b].total_cmp(&probs[a]).then(a.cmp(&b)));
        let top = &order[..top_k];
        let denom: f32 = if norm_topk_prob {
            top.iter().map(|&i| probs[i]).sum()
        } else {
            1.0
        };
        for &i in top {
            chosen[i].push((t, probs[i] / denom));
        }
    }
    chosen
}

/// An MoE model's routing in a forward on the GPU: the router's logits
/// come back, and the experts are chosen as the CPU path chooses them
/// (usage noted, and counted when the forward succeeds); the resident ones
/// run on the GPU, the others here.
#[cfg(feature = "cuda")]
struct GpuRouting<'a, 'm> {
    model: &'a LlamaModel<'m>,
    /// (layer, expert, tokens) routed so far in this forward.
    counted: std::sync::Mutex<Vec<(usize, usize, usize)>>,
}

#[cfg(feature = "cuda")]
impl crate::gpu::MoeHost for GpuRouting<'_, '_> {
    fn route(
        &self,
        layer: usize,
        logits: &[f32],
        n: usize,
    ) -> Result<Vec<crate::gpu::RoutedExpert>, String> {
        let Some(Mlp::Moe {
            experts,
            top_k,
            norm_topk_prob,
            ..
        }) = self.model.layers.get(layer).map(|l| &l.mlp)
        else {
            return Err(format!("layer {layer} has no routed experts"));
        };
        if logits.len() != n * experts.len() {
            return Err(format!(
                "layer {layer}: {} router logits for {n} tokens of {} experts",
                logits.len(),
                experts.len()
            ));
        }
        let k = &self.model.kernels;
        let mut out = Vec::new();
        for (e, tokens) in choose_experts(logits, experts.len(), *top_k, *norm_topk_prob)
            .into_iter()
            .enumerate()
        {
            if tokens.is_empty() {
                continue;
            }
            if let Ok(mut c) = self.counted.lock() {
                c.push((layer, e, tokens.len()));
            }
            let [g, u, dn] = &experts[e];
            let (g, u, dn) = (
                g.matrix().map_err(|e| e.to_string())?,
                u.matrix().map_err(|e| e.to_string())?,
                dn.matrix().map_err(|e| e.to_string())?,
            );
            let mats = k.ffn_mats([&g, &u, &dn], tokens.len(), false);
            out.push(crate::gpu::RoutedExpert {
                expert: e,
                tokens,
                mats,
            });
        }
        Ok(out)
    }

    fn run_expert(
        &self,
        layer: usize,
        expert: usize,
        x: &[f32],
        y: &mut [f32],
    ) -> Result<(), String> {
        let Some(Mlp::Moe { experts, .. }) = self.model.layers.get(layer).map(|l| &l.mlp) else {
            return Err(format!("layer {layer} has no routed experts"));
        };
        let [g, u, dn] = experts
            .get(expert)
            .ok_or_else(|| format!("layer {layer} has no expert {expert}"))?;
        let n = x.len() / self.model.d;
        super::swiglu_products(&self.model.kernels, [g, u, dn], x, n, None, false, y)
            .map_err(|e| e.to_string())
    }
}
