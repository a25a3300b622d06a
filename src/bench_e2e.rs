//! `bespoke bench e2e`: prefill and decode speed of a whole model at 1 thread
//! and all threads, next to the machine's read bandwidth measured in the same
//! run, and the fraction of it decode reaches.

use crate::bench::{llc_bytes, read_bandwidth, read_buffer};
use crate::generate::CausalLm;
use crate::kernels::Kernels;
use crate::model::ModelDir;
use crate::sample::argmax;
use serde::Serialize;
use std::path::Path;
use std::time::Instant;

pub struct E2eOptions {
    pub prompt_len: usize,
    pub gen: usize,
    pub threads: usize,
    pub quick: bool,
    /// Prompt tokens per prefill step (`None`: the engine's default, see
    /// [`crate::generate::AnyModel::default_chunk`]).
    pub chunk: Option<usize>,
    /// Also time the model on the generic kernels only, each repeat beside
    /// the specialised one (`--vs-generic`).
    pub vs_generic: bool,
    /// `--numerics`, `--fp4-act`, `--bf16-act`, `--fp8-act` and `--vram`, as
    /// for `run`.
    pub num: crate::commands::NumericsArgs,
}

#[derive(Serialize)]
pub struct E2eRun {
    pub threads: usize,
    pub read_gb_per_s: f64,
    pub prefill_tok_s: f64,
    pub ttft_ms: f64,
    pub decode_tok_s: f64,
    /// Weight bytes read per decoded token × decode tok/s ÷ read bandwidth.
    /// None when the engine cannot say how many bytes a token reads.
    pub decode_bandwidth_fraction: Option<f64>,
    /// With `--vs-generic`: the same runs on the generic kernels only, their
    /// repeats alternated with the specialised ones.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub generic: Option<E2eTimes>,
}

/// Medians of one kernel choice's repeats.
#[derive(Serialize, Clone, Copy)]
pub struct E2eTimes {
    pub prefill_tok_s: f64,
    pub ttft_ms: f64,
    pub decode_tok_s: f64,
}

#[derive(Serialize)]
pub struct E2eResults {
    pub model: String,
    pub family: String,
    pub kernels: String,
    /// "f32", "q8" (the fp4×q8 variant) or "amx".
    pub fp4_act: String,
    /// "f32", "bf16" (the bf16dot variant) or "amx".
    pub bf16_act: String,
    /// "f32", "bf16" (the fp8dot variant) or "amx".
    pub fp8_act: String,
    pub specialised_matrices: (usize, usize),
    pub cpu: String,
    pub llc_bytes: usize,
    pub weight_bytes: u64,
    pub bytes_per_decode_token: Option<u64>,
    pub prompt_len: usize,
    pub gen: usize,
    pub chunk: usize,
    /// Whether the weights were read into the page cache before timing
    /// (they fit in the memory available); if not, the timings include
    /// disk reads.
    pub weights_paged_in: bool,
    pub runs: Vec<E2eRun>,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

pub fn e2e(dir: &Path, opts: &E2eOptions) -> Result<E2eResults, String> {
    let m = ModelDir::open(dir).map_err(|e| e.to_string())?;
    let k = crate::commands::numerics_kernels(
        Kernels::from_env().map_err(|e| e.to_string())?.kernels,
        &opts.num,
    )?;
    if opts.vs_generic && !k.specialised() {
        return Err(
            "--vs-generic sets the specialised kernels against the generic ones: \
                    unset BESPOKE_SPECIALISED=off"
                .into(),
        );
    }
    let mut eng = crate::commands::engine(&m, k, opts.num)?;
    let chunk = crate::commands::prefill_chunk(&eng, opts.chunk, opts.prompt_len, false);
    let vocab = eng.vocab();
    let ctx = opts.prompt_len + opts.gen;
    if ctx > m.config.max_position_embeddings {
        return Err(format!(
            "--prompt-len {} + --gen {} exceeds the model's context ({})",
            opts.prompt_len, opts.gen, m.config.max_position_embeddings
        ));
    }
    // A deterministic prompt of ordinary (non-special) ids.
    let prompt: Vec<u32> = (0..opts.prompt_len)
        .map(|i| (7 + (i * 7919) % (vocab - 7)) as u32)
        .collect();
    let llc = llc_bytes();
    let stream_bytes = if opts.quick {
        2 * llc
    } else {
        (4 * llc).max(256 << 20)
    };
    let reps = if opts.quick { 1 } else { 3 };
    let per_token = eng.bytes_per_token();
    eprintln!(
        "{}: {} weights, {} read per decoded token; prompt {} tokens (chunk {}), {} generated; {} repeats",
        m.dir.display(),
        crate::inspect::human_bytes(m.weights.data_bytes()),
        per_token.map_or("(not known for this engine)".into(), crate::inspect::human_bytes),
        opts.prompt_len,
        chunk,
        opts.gen,
        reps
    );
    let mut counts = vec![1];
    if opts.threads > 1 {
        counts.push(opts.threads);
    }
    let (hit, total) = crate::commands::specialisation(&m, &k);
    if opts.vs_generic && hit == 0 {
        eprintln!(
            "note: this build specialised none of the model's {total} matrices, so --vs-generic \
             times the generic kernels against themselves; build with BESPOKE_MODEL={} to specialise",
            m.dir.display()
        );
    }
    let paged_in = page_in(&m);
    let read_buf = read_buffer(stream_bytes);
    let mut runs = Vec::new();
    for &t in &counts {
        let pool = crate::threads::pool(t);
        let run = pool.install(|| -> Result<E2eRun, String> {
            let bw = read_bandwidth(&read_buf, if opts.quick { 3 } else { 7 }).gb_per_s;
            // [specialised, generic] samples; with --vs-generic the two
            // alternate, in the order AB BA AB …, so that drift of a shared
            // machine falls on both alike.
            let mut samples = [Samples::default(), Samples::default()];
            for rep in 0..reps {
                let order: &[bool] = match (opts.vs_generic, rep % 2) {
                    (false, _) => &[true],
                    (true, 0) => &[true, false],
                    (true, _) => &[false, true],
                };
                for &spec in order {
                    eng.set_specialised(spec);
                    samples[usize::from(!spec)].time(&eng, &prompt, chunk, opts.gen, ctx)?;
                }
            }
            eng.set_specialised(true);
            let s = samples[0].medians();
            let r = E2eRun {
                threads: t,
                read_gb_per_s: bw,
                prefill_tok_s: s.prefill_tok_s,
                ttft_ms: s.ttft_ms,
                decode_tok_s: s.decode_tok_s,
                decode_bandwidth_fraction: per_token.map(|b| b as f64 * s.decode_tok_s / (bw * 1e9)),
                generic: opts.vs_generic.then(|| samples[1].medians()),
            };
            eprintln!(
                "threads {:>2}: read {:6.1} GB/s | prefill {:9.1} tok/s, first token {:8.1} ms | decode {:8.1} tok/s = {} of read bandwidth",
                t,
                r.read_gb_per_s,
                r.prefill_tok_s,
                r.ttft_ms,
                r.decode_tok_s,
                r.decode_bandwidth_fraction.map_or("n/a".to_string(), |f| format!("{:5.1} %", 100.0 * f))
            );
            if let Some(g) = &r.generic {
                let ratio = |a: f64, b: f64| if b > 0.0 { format!("{:.3}×", a / b) } else { "n/a".into() };
                eprintln!(
                    "   generic kernels only:       prefill {:9.1} tok/s, first token {:8.1} ms | decode {:8.1} tok/s\n   \
                     specialised ÷ generic:      prefill {}, decode {}",
                    g.prefill_tok_s,
                    g.ttft_ms,
                    g.decode_tok_s,
                    ratio(r.prefill_tok_s, g.prefill_tok_s),
                    ratio(r.decode_tok_s, g.decode_tok_s),
                );
            }
            Ok(r)
        })?;
        runs.push(run);
    }
    if let Some(line) = crate::gpu::work_line(eng.kernels().tier()) {
        eprintln!("{line}");
    }
    Ok(E2eResults {
        model: m.dir.display().to_string(),
        family: m.config.family.name().into(),
        kernels: k.isa().name().into(),
        fp4_act: k.fp4_act().name().into(),
        bf16_act: k.bf16_act().name().into(),
        fp8_act: k.fp8_act().name().into(),
        specialised_matrices: (hit, total),
        cpu: crate::cpu::cpu_name(),
        llc_bytes: llc,
        weight_bytes: m.weights.data_bytes(),
        bytes_per_decode_token: per_token,
        prompt_len: opts.prompt_len,
        gen: opts.gen,
        chunk,
        weights_paged_in: paged_in,
        runs,
    })
}

/// Bytes of memory the system can still give (Linux: `MemAvailable` in
/// /proc/meminfo), if known.
fn mem_available() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// Before timing: read the weights once into the page cache where they fit
/// in the memory available (a run right after a build, or after other big
/// files, would otherwise time its first repeat's disk reads), and say so;
/// where they do not fit, say that the timings include disk reads. Returns
/// whether it read them.
fn page_in(m: &ModelDir) -> bool {
    let bytes = m.weights.data_bytes();
    let human = crate::inspect::human_bytes;
    match mem_available() {
        Some(avail) if bytes > avail / 10 * 9 => {
            eprintln!(
                "note: the weights ({}) do not fit in the memory available ({}): the operating \
                 system reads them from disk as tokens need them, and the timings include those \
                 reads",
                human(bytes),
                human(avail)
            );
            false
        }
        _ => {
            let t = std::time::Instant::now();
            let mapped = m.weights.page_in();
            eprintln!(
                "weights paged in: {} in {:.1} s",
                human(mapped),
                t.elapsed().as_secs_f64()
            );
            true
        }
    }
}

/// One kernel choice's timings over the repeats.
#[derive(Default)]
struct Samples {
    prefill: Vec<f64>,
    ttft: Vec<f64>,
    decode: Vec<f64>,
}

impl Samples {
    /// Prefill the prompt into a fresh cache, then decode greedily.
    fn time(
        &mut self,
        eng: &crate::generate::AnyModel<'_>,
        prompt: &[u32],
        chunk: usize,
        gen: usize,
        ctx: usize,
    ) -> Result<(), String> {
        let vocab = eng.vocab();
        let mut cache = eng.new_cache(ctx).map_err(|e| e.to_string())?;
        let t0 = Instant::now();
        let logits = eng
            .prefill(&mut cache, prompt, chunk, false)
            .map_err(|e| e.to_string())?;
        let mut next = argmax(&logits[logits.len() - vocab..]);
        let first = t0.elapsed().as_secs_f64();
        let t1 = Instant::now();
        for _ in 1..gen {
            let l = eng
                .prefill(&mut cache, &[next], 1, false)
                .map_err(|e| e.to_string())?;
            next = argmax(&l);
        }
        let d = t1.elapsed().as_secs_f64();
        self.prefill.push(prompt.len() as f64 / first);
        self.ttft.push(first * 1e3);
        if gen > 1 {
            self.decode.push((gen - 1) as f64 / d);
        }
        Ok(())
    }

    fn medians(&self) -> E2eTimes {
        E2eTimes {
            prefill_tok_s: median(self.prefill.clone()),
            ttft_ms: median(self.ttft.clone()),
            decode_tok_s: if self.decode.is_empty() {
                0.0
            } else {
                median(self.decode.clone())
            },
        }
    }
}
