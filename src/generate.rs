//! Text generation over any engine: chunked prefill, KV-cache decode,
//! sampling, stop conditions, streaming and timings.

use crate::engine::EngineError;
use crate::model::ModelDir;
use crate::sample::{Sampler, SamplingParams};
use crate::tokenizer::Tokenizer;
use std::time::Instant;

/// What an engine offers the generation loop.
pub trait CausalLm {
    type Cache;
    fn vocab(&self) -> usize;
    /// An empty KV cache for up to `capacity` tokens.
    fn new_cache(&self, capacity: usize) -> Result<Self::Cache, EngineError>;
    /// Run `tokens` (appended at the cache's end) through the model in one
    /// step: every position's logits when `all_logits`, else the last one's.
    fn forward(
        &self,
        cache: &mut Self::Cache,
        tokens: &[u32],
        all_logits: bool,
    ) -> Result<Vec<f32>, EngineError>;
    /// Append `tokens` in steps of `chunk` (each through the small-batch
    /// matmul kernels); all positions' logits or the last one's.
    fn prefill(
        &self,
        cache: &mut Self::Cache,
        tokens: &[u32],
        chunk: usize,
        all_logits: bool,
    ) -> Result<Vec<f32>, EngineError> {
        crate::engine::prefill_chunks(tokens, chunk, all_logits, |piece, all| {
            self.forward(cache, piece, all)
        })
    }
}

impl<'m> CausalLm for crate::engine::llama::LlamaModel<'m> {
    type Cache = crate::engine::llama::KvCache;
    fn vocab(&self) -> usize {
        crate::engine::llama::LlamaModel::vocab(self)
    }
    fn new_cache(&self, capacity: usize) -> Result<Self::Cache, EngineError> {
        crate::engine::llama::LlamaModel::new_cache(self, capacity)
    }
    fn forward(
        &self,
        cache: &mut Self::Cache,
        tokens: &[u32],
        all_logits: bool,
    ) -> Result<Vec<f32>, EngineError> {
        crate::engine::llama::LlamaModel::forward(self, cache, tokens, all_logits)
    }
}

/// Prompt tokens per prefill step by default (`--chunk`).
pub const DEFAULT_CHUNK: usize = 256;

/// The default step where a MoE model's routed experts run on the amx
/// kernels (see [`AnyModel::default_chunk`]).
pub const AMX_MOE_CHUNK: usize = 1024;

/// Any engine, chosen by the model's family. (One per process: boxing the
/// larger variant would save nothing.)
#[allow(clippy::large_enum_variant)]
pub enum AnyModel<'m> {
    Llama(crate::engine::llama::LlamaModel<'m>),
    Dsv4(crate::engine::dsv4::Dsv4Model<'m>),
}

/// An engine's VRAM tier lives as long as the engine: its device copies
/// go with it, and engines in one process (tests run in parallel, a host
/// serving two models) keep tiers of their own.
impl Drop for AnyModel<'_> {
    fn drop(&mut self) {
        let t = self.kernels().tier();
        if t != 0 {
            crate::gpu::release_tier(t);
        }
    }
}

pub enum AnyCache {
    Llama(crate::engine::llama::KvCache),
    Dsv4(crate::engine::dsv4::Dsv4Cache),
}

impl AnyCache {
    /// Whether this sequence's attention runs on the GPU (a VRAM tier whose
    /// KV reservation holds its cache).
    pub fn attention_on_gpu(&self) -> bool {
        match self {
            AnyCache::Llama(c) => c.attention_on_gpu(),
            AnyCache::Dsv4(c) => c.attention_on_gpu(),
        }
    }

    /// Move this sequence's attention to the CPU, freeing what it holds on
    /// the GPU (the CPU keeps a whole copy): what a failed GPU call does,
    /// and what a caller does to give the tier's KV room to another
    /// sequence.
    pub fn detach_gpu(&mut self) {
        match self {
            AnyCache::Llama(c) => c.detach_gpu(),
            AnyCache::Dsv4(c) => c.detach_gpu(),
        }
    }

    /// Whether DeepSeek V4's lightning indexers score on the GPU; None for
    /// a model without them.
    pub fn indexer_on_gpu(&self) -> Option<bool> {
        match self {
            AnyCache::Llama(_) => None,
            AnyCache::Dsv4(c) => c.indexer_on_gpu(),
        }
    }
}

impl<'m> AnyModel<'m> {
    /// The engine for `model`'s family.
    pub fn load(
        model: &'m ModelDir,
        kernels: crate::kernels::Kernels,
    ) -> Result<AnyModel<'m>, EngineError> {
        Ok(match model.config.family {
            crate::plan::Family::DeepseekV4 => {
                AnyModel::Dsv4(crate::engine::dsv4::Dsv4Model::new(model, kernels)?)
            }
            _ => AnyModel::Llama(crate::engine::llama::LlamaModel::new(model, kernels)?),
        })
    }

    /// Whether every weight is read in place from the file mapping.
    pub fn weights_in_place(&self) -> bool {
        match self {
            AnyModel::Llama(m) => m.weights_in_place(),
            AnyModel::Dsv4(m) => m.weights_in_place(),
        }
    }

    /// What attention on the GPU sets aside for this model.
    pub fn gpu_attention(&self) -> crate::gpu::GpuAttention {
        match self {
            AnyModel::Llama(m) => m.gpu_attention(),
            AnyModel::Dsv4(m) => m.gpu_attention(),
        }
    }

    /// Send products on matrices resident in VRAM tier `id` to the GPU (the
    /// tier set before, if any, is released: see the `Drop` below).
    pub fn set_tier(&mut self, id: u32) {
        let old = self.kernels().tier();
        if old != 0 && old != id {
            crate::gpu::release_tier(old);
        }
        match self {
            AnyModel::Llama(m) => m.kernels = m.kernels.with_tier(id),
            AnyModel::Dsv4(m) => m.kernels = m.kernels.with_tier(id),
        }
    }

    /// Use the build's shape-specialised kernels (`true`) or only the
    /// generic ones (see [`crate::kernels::Kernels::with_specialised`]).
    pub fn set_specialised(&mut self, on: bool) {
        match self {
            AnyModel::Llama(m) => m.kernels = m.kernels.with_specialised(on),
            AnyModel::Dsv4(m) => m.kernels = m.kernels.with_specialised(on),
        }
    }

    /// Routed-expert selections so far (all zero for dense models).
    pub fn usage(&self) -> &crate::placement::UsageCounter {
        match self {
            AnyModel::Llama(m) => &m.usage,
            AnyModel::Dsv4(m) => &m.usage,
        }
    }

    /// The matrices the VRAM tier can place (see [`crate::placement`]).
    pub fn placement_items(&self) -> Vec<(crate::placement::Item, Vec<&crate::engine::Mat<'m>>)> {
        match self {
            AnyModel::Llama(m) => m.placement_items(),
            AnyModel::Dsv4(m) => m.placement_items(),
        }
    }

    /// The kernels the engine runs on.
    pub fn kernels(&self) -> &crate::kernels::Kernels {
        match self {
            AnyModel::Llama(m) => &m.kernels,
            AnyModel::Dsv4(m) => &m.kernels,
        }
    }

    /// The weight format of the routed experts (`None`: a dense model).
    pub fn expert_format(&self) -> Option<crate::plan::Format> {
        self.placement_items()
            .into_iter()
            .filter(|(item, _)| matches!(item, crate::placement::Item::Expert { .. }))
            .find_map(|(_, mats)| {
                mats.first()
                    .and_then(|m| m.matrix().ok())
                    .map(|m| m.format())
            })
    }

    /// Prompt tokens per prefill step where none is asked for (`--chunk`):
    /// [`DEFAULT_CHUNK`], or [`AMX_MOE_CHUNK`] where the routed experts go to
    /// the amx kernels. Each step decodes every expert's weights once into
    /// tiles for the few tokens routed to it, so longer steps share that
    /// decoding among more tokens; the f32 kernels gain nothing from it.
    pub fn default_chunk(&self) -> usize {
        match self.expert_format() {
            Some(f) if self.kernels().amx_min_tokens(f).is_some() => AMX_MOE_CHUNK,
            _ => DEFAULT_CHUNK,
        }
    }

    /// Weight bytes one decoded token reads, where the engine can say.
    pub fn bytes_per_token(&self) -> Option<u64> {
        match self {
            AnyModel::Llama(m) => Some(m.bytes_per_token()),
            AnyModel::Dsv4(m) => Some(m.bytes_per_token()),
        }
    }
}

impl CausalLm for AnyModel<'_> {
    type Cache = AnyCache;
    fn vocab(&self) -> usize {
        match self {
            AnyModel::Llama(m) => CausalLm::vocab(m),
            AnyModel::Dsv4(m) => CausalLm::vocab(m),
        }
    }
    fn new_cache(&self, capacity: usize) -> Result<AnyCache, EngineError> {
        Ok(match self {
            AnyModel::Llama(m) => AnyCache::Llama(CausalLm::new_cache(m, capacity)?),
            AnyModel::Dsv4(m) => AnyCache::Dsv4(CausalLm::new_cache(m, capacity)?),
        })
    }
    fn forward(
        &self,
        cache: &mut AnyCache,
        tokens: &[u32],
        all_logits: bool,
    ) -> Result<Vec<f32>, EngineError> {
        match (self, cache) {
            (AnyModel::Llama(m), AnyCache::Llama(c)) => CausalLm::forward(m, c, tokens, all_logits),
            (AnyModel::Dsv4(m), AnyCache::Dsv4(c)) => CausalLm::forward(m, c, tokens, all_logits),
            _ => Err(EngineError::Unsupported(
                "a cache made by another engine".into(),
            )),
        }
    }
}

#[derive(Debug, Clone)]
pub struct GenOptions {
    pub max_new_tokens: usize,
    pub sampling: SamplingParams,
    pub ignore_eos: bool,
    /// Stop as soon as the generated text contains one of these.
    pub stop: Vec<String>,
    /// Prefill chunk size (tokens per small-batch matmul call).
    pub chunk: usize,
    /// Token ids that end generation (unless `ignore_eos`).
    pub eos: Vec<u32>,
}

#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct Timings {
    pub prompt_tokens: usize,
    pub new_tokens: usize,
    /// Prompt in, first new token out (prefill + the first sample).
    pub ttft_s: f64,
    pub prefill_s: f64,
    pub decode_s: f64,
    pub prefill_tok_s: f64,
    /// New tokens after the first, per second of decode.
    pub decode_tok_s: f64,
}

#[derive(Debug, Clone, serde::Serialize)]
pub struct Generation {
    pub prompt_ids: Vec<u32>,
    pub new_ids: Vec<u32>,
    pub text: String,
    /// "eos", "stop", "length".
    pub stop_reason: String,
    pub timings: Timings,
}

/// The end-of-sequence ids: generation_config.json, else config.json, else
/// the tokenizer's eos_token.
pub fn eos_ids(model: &ModelDir) -> Vec<u32> {
    if let Some(g) = &model.generation {
        if !g.eos_token_ids.is_empty() {
            return g.eos_token_ids.clone();
        }
    }
    if !model.config.eos_token_ids.is_empty() {
        return model.config.eos_token_ids.clone();
    }
    model
        .tokenizer
        .as_ref()
        .and_then(|t| t.special_token("eos_token").and_then(|s| t.token_to_id(s)))
        .into_iter()
        .collect()
}

/// Sampling defaults as transformers applies them: greedy unless
/// generation_config.json sets do_sample, then its temperature / top-k / top-p.
pub fn default_sampling(model: &ModelDir) -> SamplingParams {
    let mut p = SamplingParams::greedy();
    if let Some(g) = &model.generation {
        if g.do_sample == Some(true) {
            let d = SamplingParams::default();
            p.temperature = g.temperature.map_or(d.temperature, |t| t as f32);
            p.top_k = g.top_k.unwrap_or(d.top_k);
            p.top_p = g.top_p.map_or(d.top_p, |t| t as f32);
        }
        if let Some(r) = g.repetition_penalty {
            p.repetition_penalty = r as f32;
        }
    }
    p
}

/// Generate after `prompt`. `on_text` receives the text as it grows (whole
/// characters only; never the stop string).
pub fn generate<E: CausalLm>(
    eng: &E,
    tok: Option<&Tokenizer>,
    prompt: &[u32],
    opts: &GenOptions,
    mut on_text: impl FnMut(&str),
) -> Result<Generation, EngineError> {
    let mut sampler = Sampler::new(opts.sampling.clone()).map_err(EngineError::Unsupported)?;
    if prompt.is_empty() {
        return Err(EngineError::Unsupported(
            "the prompt is empty: give at least one token".into(),
        ));
    }
    let mut cache = eng.new_cache(prompt.len() + opts.max_new_tokens)?;
    let mut history = prompt.to_vec();
    let mut new_ids = Vec::new();
    let mut text = String::new();
    let mut emitted = 0usize;
    let mut stop_reason = "length";
    let t0 = Instant::now();
    let mut logits = eng.prefill(&mut cache, prompt, opts.chunk, false)?;
    let prefill_s = t0.elapsed().as_secs_f64();
    let mut ttft_s = 0.0;
    let mut t_first = t0;
    while new_ids.len() < opts.max_new_tokens {
        let next = sampler.sample(&mut logits, &history);
        if new_ids.is_empty() {
            t_first = Instant::now();
            ttft_s = t0.elapsed().as_secs_f64();
        }
        if !opts.ignore_eos && opts.eos.contains(&next) {
            stop_reason = "eos";
            break;
        }
        new_ids.push(next);
        history.push(next);
        if let Some(t) = tok {
            let full = t
                .decode(&new_ids, true)
                .map_err(|e| EngineError::Unsupported(e.to_string()))?;
            if let Some(at) = opts.stop.iter().filter_map(|s| full.find(s.as_str())).min() {
                text = full[..at].to_string();
                if let Some(rest) = text.get(emitted..) {
                    on_text(rest);
                }
                stop_reason = "stop";
                break;
            }
            // Hold back a trailing partial character (byte-level BPE).
            if !full.ends_with('\u{FFFD}') {
                if let Some(rest) = full.get(emitted..) {
                    // Keep back a possible stop-string prefix.
                    let hold = opts
                        .stop
                        .iter()
                        .map(|s| {
                            (1..s.len())
                                .rev()
                                .find(|&k| full.ends_with(&s[..k]) && s.is_char_boundary(k))
                                .unwrap_or(0)
                        })
                        .max()
                        .unwrap_or(0);
                    let upto = rest.len().saturating_sub(hold);
                    if upto > 0 && rest.is_char_boundary(upto) {
                        on_text(&rest[..upto]);
                        emitted += upto;
                    }
                }
            }
            text = full;
        }
        if new_ids.len() == opts.max_new_tokens {
            break;
        }
        logits = eng.prefill(&mut cache, &[next], 1, false)?;
    }
    if stop_reason != "stop" {
        if let Some(rest) = text.get(emitted..) {
            if !rest.is_empty() {
                on_text(rest);
            }
        }
    }
    let decode_s = if new_ids.len() > 1 {
        t_first.elapsed().as_secs_f64()
    } else {
        0.0
    };
    let timings = Timings {
        prompt_tokens: prompt.len(),
        new_tokens: new_ids.len(),
        ttft_s,
        prefill_s,
        decode_s,
        prefill_tok_s: prompt.len() as f64 / prefill_s.max(1e-9),
        decode_tok_s: if new_ids.len() > 1 {
            (new_ids.len() - 1) as f64 / decode_s.max(1e-9)
        } else {
            0.0
        },
    };
    Ok(Generation {
        prompt_ids: prompt.to_vec(),
        new_ids,
        text,
        stop_reason: stop_reason.into(),
        timings,
    })
}
