//! `bespoke run` and `bespoke score`: load, report, generate / score.

use crate::engine::llama::KvCache;
use crate::generate::{self, AnyModel, CausalLm, GenOptions, Generation};
use crate::inspect::human_bytes;
use crate::kernels::Kernels;
use crate::model::layout::Kind;
use crate::model::ModelDir;
use crate::plan::{Family, Format};
use crate::sample::{argmax, SamplingParams};
use crate::tokenizer::ChatMessage;
use serde_json::json;
use std::io::Write;
use std::path::{Path, PathBuf};

/// The bundled default model: `fixtures/tiny-llama` under the current
/// directory, else in the source tree this binary was built from.
pub fn default_model() -> PathBuf {
    let local = Path::new("fixtures/tiny-llama");
    if local.join("config.json").exists() {
        local.to_path_buf()
    } else {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/tiny-llama")
    }
}

/// Parse "1,2,3" (spaces allowed).
pub fn parse_ids(flag: &str, s: &str) -> Result<Vec<u32>, String> {
    s.split(',')
        .map(str::trim)
        .filter(|t| !t.is_empty())
        .map(|t| {
            t.parse::<u32>()
                .map_err(|_| format!("{flag}: {t:?} is not a token id (expected e.g. 1,2,3)"))
        })
        .collect()
}

/// Open the model and pick the kernels; prints the one-line load summary.
pub fn load(dir: &Path) -> Result<(ModelDir, Kernels, String), String> {
    let t = std::time::Instant::now();
    let model = ModelDir::open(dir).map_err(|e| e.to_string())?;
    let choice = Kernels::from_env().map_err(|e| e.to_string())?;
    let secs = t.elapsed().as_secs_f64();
    Ok((
        model,
        choice.kernels,
        format!("{} (opened in {:.0} ms)", choice.reason, secs * 1e3),
    ))
}

/// Family, parameters, bytes by format, KV cache for `ctx` tokens.
pub fn summary(m: &ModelDir, ctx: usize) -> String {
    let c = &m.config;
    let by: Vec<String> = m
        .bytes_by_format()
        .iter()
        .map(|(k, b)| format!("{k} {}", human_bytes(*b)))
        .collect();
    let kv = KvCache::bytes_for(c.num_layers, c.num_kv_heads * c.head_dim, ctx);
    let unused = m.unused();
    let skipped = match unused.iter().filter(|n| n.starts_with("mtp.")).count() {
        0 if unused.is_empty() => String::new(),
        0 => format!("; {} unused tensors ignored", unused.len()),
        mtp => format!("; MTP block skipped ({mtp} tensors, not run)"),
    };
    format!(
        "{}: {}, {:.2}M params, weights {}, KV cache {} for {ctx} tokens{skipped}",
        m.dir.display(),
        c.family.name(),
        m.parameters() as f64 / 1e6,
        by.join(" + "),
        human_bytes(kv)
    )
}

/// How many of the model's matrices have a kernel specialised on their
/// shape in this build (the rest run the generic kernels).
pub fn specialisation(m: &ModelDir, k: &Kernels) -> (usize, usize) {
    let mut hit = 0;
    let mut total = 0;
    for x in &m.expected {
        let (fmt, rows, cols) = match (&x.kind, x.shape.as_slice()) {
            (Kind::Float, [r, c]) => (Format::Bf16, *r, *c),
            (Kind::Fp8 { .. }, [r, c]) => (Format::Fp8, *r, *c),
            (Kind::Fp4 { .. }, [r, c]) => (Format::Fp4, *r, 2 * *c),
            _ => continue,
        };
        let fmt = match (fmt, m.weights.get(&x.name).map(|t| t.dtype())) {
            (Format::Bf16, Some(crate::safetensors::Dtype::F32)) => Format::F32,
            (f, _) => f,
        };
        total += 1;
        if k.mat_kernel(fmt, rows, cols).shape.is_some() {
            hit += 1;
        }
    }
    (hit, total)
}

fn banner(m: &ModelDir, k: &Kernels, reason: &str, ctx: usize) {
    eprintln!("{}", summary(m, ctx));
    let (hit, total) = specialisation(m, k);
    let note = if !k.specialised() {
        "every matrix on the generic kernels".to_string()
    } else if hit == total {
        "all specialised for this model".to_string()
    } else if hit == 0 {
        "none specialised (this build was made for other models; generic kernels run. Rebuild with BESPOKE_MODEL=<dir> to specialise)".to_string()
    } else {
        format!("{hit} of {total} matrices specialised, the rest generic")
    };
    eprintln!("kernels: {} — {reason}; {note}", k.isa());
    if cfg!(feature = "cuda") {
        eprintln!("{}", crate::gpu::status_line());
    }
    if k.fp4_act() == crate::q8::Fp4Act::Q8 && has_format(m, "FP4") {
        eprintln!(
            "fp4×q8: FP4 products use int8 activations (--fp4-act q8): faster, not token-exact"
        );
    }
    if k.bf16_act() == crate::bf16act::Bf16Act::Bf16 && has_format(m, "BF16") {
        eprintln!(
            "bf16dot: BF16 products use BF16 activations (--bf16-act bf16): faster prefill, not token-exact"
        );
    }
    if k.fp8_act() == crate::bf16act::Bf16Act::Bf16 && has_format(m, "FP8") {
        eprintln!("fp8dot: FP8 products use BF16 activations (--fp8-act bf16): not token-exact");
    }
    for f in [Format::Bf16, Format::Fp8, Format::Fp4] {
        let name = f.name().to_uppercase();
        if let Some(min) = k.amx_min_tokens(f).filter(|_| has_format(m, &name)) {
            eprintln!(
                "amx: {name} products of {min}+ tokens (prefill) on AMX tiles with BF16 activations (--{}-act amx): faster prefill, not token-exact; fewer (decode) stay f32",
                f.name()
            );
        }
    }
}

/// `--chunk`: a whole number of tokens, 1 or more.
pub fn parse_chunk(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(n) if n >= 1 => Ok(n),
        _ => Err(format!(
            "expected a number of tokens, 1 or more (got {s:?})"
        )),
    }
}

/// The prefill step: `asked` (`--chunk`), else the engine's default, which
/// is said (when `say`) where it is not the usual one and a prompt of
/// `tokens` tokens would take more than one usual step.
pub fn prefill_chunk(eng: &AnyModel, asked: Option<usize>, tokens: usize, say: bool) -> usize {
    asked.unwrap_or_else(|| {
        let n = eng.default_chunk();
        if say && n != generate::DEFAULT_CHUNK && tokens > generate::DEFAULT_CHUNK {
            eprintln!(
                "prefill: steps of {n} tokens, as the routed experts run on the amx kernels (--chunk to change)"
            );
        }
        n
    })
}

/// `--numerics`: see [`crate::engine::dsv4::Numerics`].
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum NumericsArg {
    Transformers,
    Deepseek,
}

/// The numerics options shared by `run`, `score` and `bench e2e`.
#[derive(clap::Args, Debug, Clone, Copy)]
pub struct NumericsArgs {
    /// DeepSeek V4 only: whose numerics to follow where they differ.
    /// `transformers` (default, the oracle): f32 activations, the shared
    /// expert clamped at swiglu_limit. `deepseek` (DeepSeek's inference
    /// code): activations quantized to FP8 before every FP8/FP4 product,
    /// the shared expert unclamped.
    #[arg(long, value_name = "WHOSE", value_enum, default_value_t = NumericsArg::Transformers)]
    pub numerics: NumericsArg,
    /// How FP4 weights (DeepSeek V4's routed experts) meet their activations.
    /// `f32` (default): exact f32 products, bit-identical to the scalar
    /// reference. `q8`: the fp4×q8 kernels — activations rounded to int8 per
    /// 32 columns (scale max|x|/127), integer dot products; faster, but not
    /// token-exact (the error bound is in src/q8.rs and tested). `amx`:
    /// products of 3 or more tokens (prefill, and each expert's batch of
    /// tokens) on Intel AMX tiles, the weights decoded to BF16 (exact) and
    /// the activations rounded to BF16; one or two tokens (decode) through the
    /// f32 kernels; not token-exact (definition in templates/amx.c.tera,
    /// tested). Needs AMX-BF16 (Sapphire Rapids and later) and Linux 5.16+.
    #[arg(long, value_name = "ACT", value_enum, default_value_t = crate::q8::Fp4Act::F32)]
    pub fp4_act: crate::q8::Fp4Act,
    /// How BF16 weights meet their activations. `f32` (default): exact f32
    /// products, bit-identical to the scalar reference. `bf16`: the bf16dot
    /// kernels — activations rounded to BF16, VDPBF16PS pair products (twice
    /// the f32 FMA's multiply-adds: faster prefill, as llama.cpp computes
    /// BF16 models); not token-exact (the definition and error bound are in
    /// src/bf16act.rs and tested). Needs a CPU with AVX512_BF16 (Zen 4 and
    /// later, Cooper Lake, Sapphire Rapids and later). `amx`: products of 8
    /// or more tokens (prefill) on Intel AMX tiles (TDPBF16PS), activations
    /// rounded to BF16, 4-5x the default's prefill on a Xeon with AMX;
    /// fewer tokens (decode) through the f32 kernels; not token-exact
    /// (definition and error bound in src/bf16act.rs, tested). Needs a CPU
    /// with AMX-BF16 (Sapphire Rapids and later) and Linux 5.16 or later.
    #[arg(long, value_name = "ACT", value_enum, default_value_t = crate::bf16act::Bf16Act::F32)]
    pub bf16_act: crate::bf16act::Bf16Act,
    /// How FP8 weights (DeepSeek V4's dense matrices) meet their
    /// activations. `f32` (default): exact f32 products, bit-identical to the
    /// scalar reference. `bf16`: the fp8dot kernels — each E4M3 weight is
    /// exactly a BF16 value, the activations are rounded to BF16, VDPBF16PS
    /// pair products per 128-column scale block; not token-exact (definition
    /// and error bound in src/bf16act.rs, tested). Needs AVX512_BF16, as
    /// `--bf16-act bf16` does. `amx`: products of 3 or more tokens (prefill)
    /// on Intel AMX tiles, each weight times its block's scale decoded once
    /// per call to a BF16 value (exact), activations rounded to BF16 (exact
    /// too under `--numerics deepseek`, whose activations are FP8 values
    /// times a power of two); fewer tokens
    /// (decode) through the f32 kernels; not token-exact (the sums' order
    /// differs). Needs AMX-BF16, as `--bf16-act amx` does.
    #[arg(long, value_name = "ACT", value_enum, default_value_t = crate::bf16act::Bf16Act::F32)]
    pub fp8_act: crate::bf16act::Bf16Act,
    /// `cuda` builds with a GPU: the VRAM budget in GiB for what is put on
    /// the GPU: dense matrices first; then room for a KV cache of 4096
    /// tokens (or the model's context), where a sequence that fits keeps
    /// its keys and runs its attention; then the most used routed experts
    /// of each layer, counted in `<model>/.bespoke/expert-usage.json`. Default: the
    /// GPU's free memory less 1 GiB. 0 keeps everything on the CPU.
    /// Products on the GPU take f32 activations on the CUDA cores; under
    /// --bf16-act, --fp8-act or --fp4-act other than f32, a prefill product
    /// (2 tokens or more) takes the tensor cores of the same numerics (BF16
    /// mma.sync; INT8 mma.sync for --fp4-act q8, the CPU's fp4×q8 exactly).
    #[arg(long, value_name = "GB")]
    pub vram: Option<f64>,
}

/// Save the routed-expert counts next to the model (MoE models; not with
/// BESPOKE_USAGE=off), so the next run's VRAM tier knows the hot experts.
pub fn save_usage(m: &ModelDir, eng: &AnyModel) {
    let counts = eng.usage().snapshot();
    if counts.iter().all(|l| l.is_empty())
        || std::env::var("BESPOKE_USAGE").is_ok_and(|v| v.eq_ignore_ascii_case("off"))
    {
        return;
    }
    match crate::placement::save_usage(&m.dir, counts) {
        Ok(p) => eprintln!("expert usage: saved to {}", p.display()),
        Err(e) => eprintln!("note: expert usage not saved: {e}"),
    }
}

/// The kernels with the numerics options' activation variants applied
/// (an error when `--bf16-act bf16` cannot run here).
pub fn numerics_kernels(k: Kernels, num: &NumericsArgs) -> Result<Kernels, String> {
    k.with_fp4_act(num.fp4_act)
        .and_then(|k| k.with_bf16_act(num.bf16_act))
        .and_then(|k| k.with_fp8_act(num.fp8_act))
        .map_err(|e| e.to_string())
}

/// Whether the model holds weights in a format whose name starts `prefix`.
fn has_format(m: &ModelDir, prefix: &str) -> bool {
    m.bytes_by_format()
        .iter()
        .any(|(f, _)| f.starts_with(prefix))
}

/// The engine for a model, with the numerics options applied.
pub fn engine<'m>(m: &'m ModelDir, k: Kernels, num: NumericsArgs) -> Result<AnyModel<'m>, String> {
    let k = numerics_kernels(k, &num)?;
    if num.fp4_act != crate::q8::Fp4Act::F32 && !has_format(m, "FP4") {
        eprintln!(
            "note: --fp4-act {} changes nothing here: this model has no FP4 weights",
            num.fp4_act.name()
        );
    }
    if num.fp8_act != crate::bf16act::Bf16Act::F32 && !has_format(m, "FP8") {
        eprintln!(
            "note: --fp8-act {} changes nothing here: this model has no FP8 weights",
            num.fp8_act.name()
        );
    }
    if num.bf16_act != crate::bf16act::Bf16Act::F32 && !has_format(m, "BF16") {
        eprintln!(
            "note: --bf16-act {} changes nothing here: this model has no BF16 weights",
            num.bf16_act.name()
        );
    }
    let mut eng = AnyModel::load(m, k).map_err(|e| e.to_string())?;
    let experts: Vec<usize> = eng.usage().snapshot().iter().map(Vec::len).collect();
    if experts.iter().any(|&e| e > 0) {
        match crate::placement::load_usage(&m.dir, &experts) {
            Ok(Some(u)) => eng.usage().add(&u),
            Ok(None) => {}
            Err(e) => eprintln!("note: expert usage not loaded: {e}"),
        }
    }
    if let Some(v) = num.vram {
        if !(v >= 0.0 && v.is_finite()) {
            return Err(format!("--vram {v}: expected a size in GiB, 0 or more"));
        }
    }
    match crate::gpu::place_model(&mut eng, num.vram) {
        Ok(Some(line)) => eprintln!("{line}"),
        Ok(None) => {}
        Err(e) => eprintln!("CUDA: VRAM tier not used: {e}; running on the CPU"),
    }
    if num.numerics == NumericsArg::Deepseek {
        match &mut eng {
            AnyModel::Dsv4(d) => d.numerics = crate::engine::dsv4::Numerics::DeepSeek,
            _ => {
                return Err(format!(
                    "--numerics deepseek applies to DeepSeek V4 models; this one is {:?}",
                    m.config.model_type
                ))
            }
        }
    }
    Ok(eng)
}

#[derive(clap::Args, Debug)]
pub struct RunArgs {
    /// The model directory (default: the bundled fixtures/tiny-llama).
    #[arg(long, value_name = "DIR")]
    pub model: Option<PathBuf>,
    /// Prompt text (tokenized with the model's tokenizer, BOS added as the tokenizer does).
    #[arg(long, value_name = "TEXT", conflicts_with = "prompt_ids")]
    pub prompt: Option<String>,
    /// The prompt as token ids, e.g. 1,415,2087.
    #[arg(long, value_name = "IDS")]
    pub prompt_ids: Option<String>,
    /// Wrap the prompt in the model's chat template (as a user message, with the assistant turn opened).
    #[arg(long)]
    pub chat: bool,
    /// With --chat: a system message before the prompt.
    #[arg(long, value_name = "TEXT", requires = "chat")]
    pub system: Option<String>,
    /// With --chat: open the reply in thinking mode. DeepSeek V4: `<think>`
    /// (its encoding's thinking mode) instead of `</think>` (chat mode, the
    /// default); chat templates that read `enable_thinking` (Qwen3) get true.
    #[arg(long, requires = "chat", conflicts_with = "no_think")]
    pub think: bool,
    /// With --chat: templates that read `enable_thinking` (Qwen3) get false.
    /// (DeepSeek V4 is in chat mode unless --think is given.)
    #[arg(long, requires = "chat")]
    pub no_think: bool,
    /// Stop after this many new tokens (default: generation_config.json's max_new_tokens, else 64).
    #[arg(long, value_name = "N")]
    pub max_new_tokens: Option<usize>,
    /// Always take the most likely token (overrides generation_config.json).
    #[arg(long, conflicts_with_all = ["temperature", "top_k", "top_p"])]
    pub greedy: bool,
    /// Sample at this temperature (0 = greedy).
    #[arg(long, value_name = "T")]
    pub temperature: Option<f32>,
    /// Sample among the K most likely tokens (0 = all).
    #[arg(long, value_name = "K")]
    pub top_k: Option<usize>,
    /// Sample from the smallest set of tokens whose probability reaches P (1 = all).
    #[arg(long, value_name = "P")]
    pub top_p: Option<f32>,
    /// Penalise tokens already in the sequence (1 = off; transformers' rule).
    #[arg(long, value_name = "R")]
    pub repetition_penalty: Option<f32>,
    /// Seed of the sampler (same seed, same output).
    #[arg(long, value_name = "S")]
    pub seed: Option<u64>,
    /// Stop when the text contains this string (may be repeated; the string is not printed).
    #[arg(long, value_name = "TEXT")]
    pub stop: Vec<String>,
    /// Keep going past the end-of-sequence token.
    #[arg(long)]
    pub ignore_eos: bool,
    /// Prompt tokens per prefill step (small-batch matmul width). Every step
    /// reads every weight once, so larger steps prefill faster (256 against
    /// 64: 10-14 % on a 2-vCPU Zen 5) at the cost of activations held for
    /// that many tokens. Default: 256; 1024 where a MoE model's routed
    /// experts run on the amx kernels (--fp4-act amx on DeepSeek V4,
    /// --bf16-act amx on a BF16 Qwen3-MoE): each step decodes every expert's
    /// weights once for the few tokens routed to it, so longer steps share
    /// that work (a 1024-token prompt on a DeepSeek V4 Flash-shaped
    /// checkpoint with --fp4-act amx --fp8-act amx: 1.5-1.7x the prefill of
    /// steps of 256, for about 0.4 GiB more activations).
    #[arg(long, value_name = "N", value_parser = crate::commands::parse_chunk)]
    pub chunk: Option<usize>,
    #[command(flatten)]
    pub num: NumericsArgs,
    /// Print one JSON object on stdout: prompt_ids, new_ids, text, stop_reason, kernels, timings.
    #[arg(long)]
    pub json: bool,
}

pub const DEFAULT_PROMPT: &str = "The old lighthouse";

pub fn run(a: RunArgs) -> Result<(), String> {
    let dir = a.model.clone().unwrap_or_else(default_model);
    let (m, k, reason) = load(&dir)?;
    let tok = m.tokenizer.as_ref();
    let prompt_ids = match (&a.prompt, &a.prompt_ids) {
        (Some(_), Some(_)) => return Err("give --prompt or --prompt-ids, not both".into()),
        (_, Some(ids)) => parse_ids("--prompt-ids", ids)?,
        (p, None) => {
            let tok = tok.ok_or("this model has no tokenizer.json: use --prompt-ids")?;
            let text = p.clone().unwrap_or_else(|| DEFAULT_PROMPT.to_string());
            if a.chat {
                let mut msgs = Vec::new();
                if let Some(s) = &a.system {
                    msgs.push(ChatMessage::new("system", s));
                }
                msgs.push(ChatMessage::new("user", &text));
                if m.config.family == Family::DeepseekV4 {
                    crate::chat::deepseek_v4_ids(tok, &msgs, a.think)?
                } else {
                    let thinking = match (a.think, a.no_think) {
                        (true, _) => Some(true),
                        (_, true) => Some(false),
                        _ => None,
                    };
                    let rendered = tok
                        .apply_chat_template_with(&msgs, true, thinking)
                        .map_err(|e| e.to_string())?;
                    // The template writes any BOS itself.
                    tok.encode(&rendered, false).map_err(|e| e.to_string())?
                }
            } else {
                tok.encode(&text, true).map_err(|e| e.to_string())?
            }
        }
    };
    if a.chat && a.prompt_ids.is_some() {
        return Err("--chat applies to --prompt text, not --prompt-ids".into());
    }
    let gen_default = m
        .generation
        .as_ref()
        .and_then(|g| g.max_new_tokens)
        .unwrap_or(64);
    let max_new = a.max_new_tokens.unwrap_or(gen_default);
    let limit = m.config.max_position_embeddings;
    if prompt_ids.len() + max_new > limit {
        return Err(format!(
            "the prompt ({} tokens) plus --max-new-tokens {max_new} is {} tokens, past this model's context of {limit} (max_position_embeddings); shorten the prompt or lower --max-new-tokens",
            prompt_ids.len(),
            prompt_ids.len() + max_new
        ));
    }
    let mut sampling = generate::default_sampling(&m);
    if a.greedy {
        sampling = SamplingParams {
            repetition_penalty: sampling.repetition_penalty,
            ..SamplingParams::greedy()
        };
    } else if a.temperature.is_some() || a.top_k.is_some() || a.top_p.is_some() {
        if sampling.is_greedy() {
            sampling = SamplingParams {
                repetition_penalty: sampling.repetition_penalty,
                ..SamplingParams::default()
            };
        }
        if let Some(t) = a.temperature {
            sampling.temperature = t;
        }
        if let Some(t) = a.top_k {
            sampling.top_k = t;
        }
        if let Some(t) = a.top_p {
            sampling.top_p = t;
        }
    }
    if let Some(r) = a.repetition_penalty {
        sampling.repetition_penalty = r;
    }
    if let Some(s) = a.seed {
        sampling.seed = s;
    }
    sampling.validate()?;
    let k = numerics_kernels(k, &a.num)?;
    let eng = engine(&m, k, a.num)?;
    banner(&m, &k, &reason, prompt_ids.len() + max_new);
    let opts = GenOptions {
        max_new_tokens: max_new,
        sampling,
        ignore_eos: a.ignore_eos,
        stop: a.stop.clone(),
        chunk: prefill_chunk(&eng, a.chunk, prompt_ids.len(), true),
        eos: generate::eos_ids(&m),
    };
    let stream = !a.json && tok.is_some();
    let mut stdout = std::io::stdout();
    if stream && a.prompt.is_some() && !a.chat {
        let _ = write!(stdout, "{}", a.prompt.as_deref().unwrap_or(""));
    } else if stream && a.prompt.is_none() && a.prompt_ids.is_none() {
        let _ = write!(stdout, "{DEFAULT_PROMPT}");
    }
    let g: Generation = generate::generate(&eng, tok, &prompt_ids, &opts, |piece| {
        if stream {
            let _ = write!(stdout, "{piece}");
            let _ = stdout.flush();
        }
    })
    .map_err(|e| e.to_string())?;
    let t = &g.timings;
    if a.json {
        let v = json!({
            "prompt_ids": g.prompt_ids,
            "new_ids": g.new_ids,
            "text": g.text,
            "stop_reason": g.stop_reason,
            "kernels": k.isa().name(),
            "fp4_act": k.fp4_act().name(),
            "bf16_act": k.bf16_act().name(),
            "fp8_act": k.fp8_act().name(),
            "timings": t,
        });
        println!("{v}");
    } else {
        if stream {
            println!();
        } else {
            println!(
                "{}",
                g.new_ids
                    .iter()
                    .map(|i| i.to_string())
                    .collect::<Vec<_>>()
                    .join(",")
            );
        }
    }
    eprintln!(
        "prompt {} tokens; time to first token {:.1} ms; prefill {:.1} tok/s; decode {} tokens at {:.1} tok/s; stopped: {}; threads {}",
        t.prompt_tokens,
        t.ttft_s * 1e3,
        t.prefill_tok_s,
        t.new_tokens,
        t.decode_tok_s,
        g.stop_reason,
        rayon::current_num_threads()
    );
    if let Some(line) = crate::gpu::work_line(eng.kernels().tier()) {
        eprintln!("{line}");
    }
    save_usage(&m, &eng);
    Ok(())
}

#[derive(clap::Args, Debug)]
pub struct ScoreArgs {
    /// The model directory (default: the bundled fixtures/tiny-llama).
    #[arg(long, value_name = "DIR")]
    pub model: Option<PathBuf>,
    /// The sequence as token ids, e.g. 1,415,2087.
    #[arg(long, value_name = "IDS", conflicts_with = "text")]
    pub ids: Option<String>,
    /// The sequence as text (tokenized with the model's tokenizer).
    #[arg(long, value_name = "TEXT")]
    pub text: Option<String>,
    /// Also print logits: `last` = the last position's.
    #[arg(long, value_name = "WHICH", value_parser = ["last"])]
    pub logits: Option<String>,
    /// Prompt tokens per prefill step (see `run --chunk`; the same default).
    #[arg(long, value_name = "N", value_parser = crate::commands::parse_chunk)]
    pub chunk: Option<usize>,
    #[command(flatten)]
    pub num: NumericsArgs,
    /// Print {"ids", "argmax", "last_logits"?} as JSON.
    #[arg(long)]
    pub json: bool,
}

pub fn score(a: ScoreArgs) -> Result<(), String> {
    let dir = a.model.clone().unwrap_or_else(default_model);
    let (m, k, reason) = load(&dir)?;
    let tok = m.tokenizer.as_ref();
    let ids = match (&a.ids, &a.text) {
        (Some(_), Some(_)) => return Err("give --ids or --text, not both".into()),
        (Some(ids), None) => parse_ids("--ids", ids)?,
        (None, Some(text)) => tok
            .ok_or("this model has no tokenizer.json: use --ids")?
            .encode(text, true)
            .map_err(|e| e.to_string())?,
        (None, None) => {
            return Err("give the sequence to score with --ids 1,2,3 or --text TEXT".into())
        }
    };
    if ids.is_empty() {
        return Err("nothing to score: the sequence is empty".into());
    }
    let k = numerics_kernels(k, &a.num)?;
    let eng = engine(&m, k, a.num)?;
    if !a.json {
        banner(&m, &k, &reason, ids.len());
    }
    let mut cache = eng.new_cache(ids.len()).map_err(|e| e.to_string())?;
    let logits = eng
        .prefill(
            &mut cache,
            &ids,
            prefill_chunk(&eng, a.chunk, ids.len(), !a.json),
            true,
        )
        .map_err(|e| e.to_string())?;
    if let Some(line) = crate::gpu::work_line(eng.kernels().tier()) {
        eprintln!("{line}");
    }
    let vocab = eng.vocab();
    let am: Vec<u32> = logits.chunks_exact(vocab).map(argmax).collect();
    let last = &logits[logits.len() - vocab..];
    if a.json {
        let mut v = json!({"ids": ids, "argmax": am, "kernels": k.isa().name(), "fp4_act": k.fp4_act().name(), "bf16_act": k.bf16_act().name(), "fp8_act": k.fp8_act().name()});
        if a.logits.is_some() {
            v["last_logits"] = json!(last);
        }
        println!("{v}");
        return Ok(());
    }
    let show = |id: u32| {
        tok.and_then(|t| t.decode(&[id], false).ok())
            .map(|s| format!("{s:?}"))
            .unwrap_or_default()
    };
    println!(
        "{:>5} {:>7} {:<16} {:>7} predicted",
        "pos", "id", "token", "argmax"
    );
    for (i, (&t, &p)) in ids.iter().zip(&am).enumerate() {
        println!("{i:>5} {t:>7} {:<16} {p:>7} {}", show(t), show(p));
    }
    if a.logits.is_some() {
        let s: Vec<String> = last.iter().map(|v| format!("{v}")).collect();
        println!("last logits: [{}]", s.join(", "));
    }
    Ok(())
}
