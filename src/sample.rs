//! Next-token sampling for text generation.
//!
//! The pipeline mirrors Hugging Face transformers' logits processors, in the
//! same order (repetition penalty, temperature, top-k, top-p, then a draw), so
//! that a given set of flags means the same thing here as in `generate()`.
//! The PRNG is our own so a seed gives the same tokens on every platform.

/// Sampling settings; see [`Default`] for the transformers-compatible defaults.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// Softmax temperature; 0 means greedy (argmax).
    pub temperature: f32,
    /// Keep only the `top_k` most likely tokens; 0 disables.
    pub top_k: usize,
    /// Nucleus sampling mass in (0, 1]; 1.0 disables.
    pub top_p: f32,
    /// CTRL-style penalty for tokens already seen; 1.0 disables, must be > 0.
    pub repetition_penalty: f32,
    /// PRNG seed; same seed and inputs give the same tokens.
    pub seed: u64,
}

impl Default for SamplingParams {
    /// transformers' `GenerationConfig` defaults (with sampling turned on).
    fn default() -> Self {
        SamplingParams {
            temperature: 1.0,
            top_k: 50,
            top_p: 1.0,
            repetition_penalty: 1.0,
            seed: 0,
        }
    }
}

impl SamplingParams {
    /// Deterministic argmax decoding; every warper off.
    pub fn greedy() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_k: 0,
            ..Self::default()
        }
    }

    /// True when the choice is always the argmax: temperature 0, or top-k of 1.
    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0 || self.top_k == 1
    }

    /// Checks ranges; messages name the CLI flag so users know what to fix.
    pub fn validate(&self) -> Result<(), String> {
        let t = self.temperature;
        if !t.is_finite() || t < 0.0 {
            return Err(format!("--temperature must be finite and >= 0, got {t}"));
        }
        let p = self.top_p;
        if !(p > 0.0 && p <= 1.0) {
            return Err(format!("--top-p must be in (0, 1], got {p}"));
        }
        let r = self.repetition_penalty;
        if !r.is_finite() || r <= 0.0 {
            return Err(format!("--repetition-penalty must be > 0, got {r}"));
        }
        Ok(())
    }
}

/// SplitMix64: tiny, fast, statistically fine for sampling, and defined purely
/// by integer arithmetic, so it is bit-identical across platforms.
#[derive(Debug, Clone)]
struct Rng(u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1) from the top 53 bits (exactly representable in f64).
    fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }
}

/// Stateful sampler: holds the PRNG so successive calls continue one stream.
#[derive(Debug, Clone)]
pub struct Sampler {
    params: SamplingParams,
    rng: Rng,
}

impl Sampler {
    /// Validates `params` and seeds the PRNG from `params.seed`.
    pub fn new(params: SamplingParams) -> Result<Sampler, String> {
        params.validate()?;
        let rng = Rng(params.seed);
        Ok(Sampler { params, rng })
    }

    /// The validated settings this sampler runs with.
    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Chooses the next token from `logits` (one per vocab entry). `history` is
    /// every token so far (prompt + generated), for the repetition penalty.
    /// `logits` is used as scratch and left modified.
    pub fn sample(&mut self, logits: &mut [f32], history: &[u32]) -> u32 {
        if logits.is_empty() {
            return 0;
        }
        let p = &self.params;
        if p.repetition_penalty != 1.0 {
            apply_repetition_penalty(logits, history, p.repetition_penalty);
        }
        // transformers applies the penalty before the greedy argmax too.
        if p.is_greedy() {
            return argmax(logits);
        }
        // NaN would poison every softmax below: treat it as impossible. +inf
        // logits take all the mass in the limit, shared evenly.
        let has_inf = logits.contains(&f32::INFINITY);
        for l in logits.iter_mut() {
            if l.is_nan() || (has_inf && *l != f32::INFINITY) {
                *l = f32::NEG_INFINITY;
            } else if has_inf {
                *l = 0.0;
            }
        }
        if p.temperature != 1.0 {
            // Shift by the max first (softmax, top-k and top-p are all
            // shift-invariant) so a tiny temperature can only underflow to
            // -inf, never overflow to +inf and lose the ordering.
            let m = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            if m.is_finite() {
                let t = p.temperature;
                logits.iter_mut().for_each(|l| *l = (*l - m) / t);
            }
        }
        if p.top_k > 0 && p.top_k < logits.len() {
            apply_top_k(logits, p.top_k);
        }
        if p.top_p < 1.0 {
            apply_top_p(logits, p.top_p as f64);
        }
        let u = self.rng.next_f64();
        draw(logits, u)
    }
}

/// Index of the largest logit; ties go to the lowest index (like
/// `torch.argmax`). NaNs are skipped; all-NaN (or empty) gives 0.
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best: Option<(usize, f32)> = None;
    for (i, &v) in logits.iter().enumerate() {
        if !v.is_nan() && best.map_or(true, |(_, b)| v > b) {
            best = Some((i, v));
        }
    }
    best.map_or(0, |(i, _)| i as u32)
}

/// CTRL penalty as in transformers: each distinct seen token is made less
/// likely, dividing positive logits and multiplying negative ones so the
/// effect always points down. Out-of-vocab ids are ignored.
fn apply_repetition_penalty(logits: &mut [f32], history: &[u32], penalty: f32) {
    let mut seen = vec![false; logits.len()];
    for &id in history {
        let i = id as usize;
        if i >= logits.len() || seen[i] {
            continue;
        }
        seen[i] = true;
        let l = &mut logits[i];
        *l = if *l < 0.0 { *l * penalty } else { *l / penalty };
    }
}

/// Masks everything below the k-th largest logit. Ties at the boundary all
/// survive, matching transformers' `logits < topk.values[..., -1]` filter.
fn apply_top_k(logits: &mut [f32], k: usize) {
    let mut vals = logits.to_vec();
    // Descending; NaNs were already replaced, so total_cmp orders reals.
    let (_, kth, _) = vals.select_nth_unstable_by(k - 1, |a, b| b.total_cmp(a));
    let threshold = *kth;
    for l in logits.iter_mut() {
        if *l < threshold {
            *l = f32::NEG_INFINITY;
        }
    }
}

/// Nucleus filter as in transformers: sort ascending, drop tokens whose
/// cumulative probability is <= 1 - top_p, and always keep the most likely.
/// Masked (-inf) tokens have zero mass, so only finite ones need sorting.
fn apply_top_p(logits: &mut [f32], top_p: f64) {
    let mut idx: Vec<usize> = (0..logits.len())
        .filter(|&i| logits[i].is_finite())
        .collect();
    if idx.len() <= 1 {
        return;
    }
    idx.sort_by(|&a, &b| logits[a].total_cmp(&logits[b]));
    let max = logits[idx[idx.len() - 1]] as f64;
    let exps: Vec<f64> = idx
        .iter()
        .map(|&i| (logits[i] as f64 - max).exp())
        .collect();
    let sum: f64 = exps.iter().sum();
    let cutoff = 1.0 - top_p;
    let mut cum = 0.0;
    for (j, (&i, &e)) in idx.iter().zip(&exps).enumerate() {
        cum += e / sum;
        if j + 1 < idx.len() && cum <= cutoff {
            logits[i] = f32::NEG_INFINITY;
        }
    }
}

/// Inverse-CDF draw from softmax(logits) in index order, computed in f64.
/// Falls back to argmax when nothing finite remains.
fn draw(logits: &[f32], u: f64) -> u32 {
    let max = logits
        .iter()
        .copied()
        .filter(|l| l.is_finite())
        .fold(f32::NEG_INFINITY, f32::max);
    if max == f32::NEG_INFINITY {
        return argmax(logits);
    }
    let max = max as f64;
    let weight = |l: f32| {
        if l.is_finite() {
            (l as f64 - max).exp()
        } else {
            0.0
        }
    };
    let sum: f64 = logits.iter().map(|&l| weight(l)).sum();
    let target = u * sum;
    let mut cum = 0.0;
    let mut last = 0;
    for (i, &l) in logits.iter().enumerate() {
        let w = weight(l);
        if w > 0.0 {
            cum += w;
            last = i;
            if target < cum {
                return i as u32;
            }
        }
    }
    // Rounding left `cum` a hair below `target`: take the last live token.
    last as u32
}
