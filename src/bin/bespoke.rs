//! The `bespoke` command line.

use bespoke::kernels::Kernels;
use bespoke::{bench, plan, report, threads};
use clap::{Parser, Subcommand};
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(Parser)]
#[command(
    name = "bespoke",
    version,
    about = "Inference kernels generated at build time for one model and one machine",
    long_about = "bespoke generates matvec, small-batch matmul and attention kernels specialised \
                  on a model's shapes and weight formats (F32, BF16, FP8 E4M3 with UE8M0 128x128 \
                  scales, FP4 E2M1 with UE8M0 per-32 scales) for each ISA variant \
                  (scalar, AVX2, AVX-512, NEON), compiles them into this binary, and \
                  dispatches to the best one the CPU supports.\n\n\
                  Environment: BESPOKE_KERNELS=scalar|avx2|avx512|neon|neon_base forces a variant; \
                  BESPOKE_SPECIALISED=off runs every matrix on the generic kernels (same numbers; \
                  `bench e2e --vs-generic` times both); BESPOKE_THREADS=N sets the thread count; \
                  in a `cuda` build, BESPOKE_CUDA=off stays on the CPU and BESPOKE_CUDA=emu runs the \
                  CUDA kernels on the CPU emulator, and BESPOKE_CUDA_LAYERS=off runs a Llama-family \
                  model's forwards on the GPU block by block rather than with every layer there."
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Show what this build generated: models and shapes specialised, ISA
    /// variants compiled, which one dispatch picks on this CPU and why; with
    /// --model, which of that model's matrices get a specialised kernel.
    Plan {
        /// A model directory (or its config.json) to check against this build.
        /// May be given more than once.
        #[arg(long, value_name = "DIR")]
        model: Vec<PathBuf>,
        /// Print the build plan as JSON instead of tables.
        #[arg(long)]
        json: bool,
        /// Worker threads (default: BESPOKE_THREADS, else physical cores).
        #[arg(long, value_name = "N")]
        threads: Option<usize>,
    },
    /// Generate text: load the model, prefill the prompt in chunks, decode
    /// with the KV cache, stream the text to stdout and the timings to stderr.
    /// With no arguments, runs the bundled tiny model on a default prompt.
    ///
    /// Sampling follows transformers: greedy unless generation_config.json
    /// sets do_sample (then its temperature / top-k / top-p) or a sampling
    /// flag is given here.
    Run {
        #[command(flatten)]
        args: bespoke::commands::RunArgs,
        /// Worker threads (default: BESPOKE_THREADS, else physical cores).
        #[arg(long, value_name = "N")]
        threads: Option<usize>,
    },
    /// Run one full forward over a sequence and print the argmax (the
    /// predicted next token) at every position — the teacher-forcing check
    /// against a reference implementation.
    Score {
        #[command(flatten)]
        args: bespoke::commands::ScoreArgs,
        /// Worker threads (default: BESPOKE_THREADS, else physical cores).
        #[arg(long, value_name = "N")]
        threads: Option<usize>,
    },
    /// Validate a model directory and summarise it: family and key config
    /// values, every tensor (name, dtype, shape, how bespoke reads it), bytes
    /// by format, shards, tokenizer. Exits non-zero with the first problem
    /// (missing or misshapen tensor, malformed safetensors, bad config,
    /// unreadable tokenizer). Run this first on a freshly downloaded model.
    Inspect {
        /// The model directory (config.json, *.safetensors, tokenizer.json).
        #[arg(long, value_name = "DIR")]
        model: PathBuf,
        /// Leave out the per-tensor table.
        #[arg(long)]
        brief: bool,
        /// Print the summary as JSON.
        #[arg(long)]
        json: bool,
        /// Also count the codes of every FP8 (F8_E4M3) tensor: how many are
        /// subnormal, zero or NaN. Reads all of them (the whole FP8 part
        /// of the checkpoint, from disk the first time). Subnormal codes
        /// cost the FP8 "s" tiles about 100 cycles a vector on Intel cores
        /// (see BESPOKE_FP8_SCALED)
        #[arg(long)]
        fp8_codes: bool,
    },
    /// Benchmarks.
    Bench {
        #[command(subcommand)]
        what: BenchWhat,
    },
}

#[derive(Subcommand)]
enum BenchWhat {
    /// Whole-model speed: prefill and decode tok/s and time to first token
    /// at 1 thread and all threads, the read bandwidth measured in the same
    /// run, and the fraction of it decode reaches (weight bytes read per
    /// token × tok/s ÷ bandwidth). Weights stay memory-mapped; use a model
    /// larger than the last-level cache for a meaningful fraction. Before
    /// timing, the weights are read once into the page cache when they fit
    /// in the memory available; otherwise a note says that the timings
    /// include disk reads.
    E2e {
        /// The model directory (default: the bundled fixtures/tiny-llama).
        #[arg(long, value_name = "DIR")]
        model: Option<PathBuf>,
        /// Prompt length in tokens (a fixed, deterministic sequence of ids).
        #[arg(long, value_name = "P", default_value_t = 128)]
        prompt_len: usize,
        /// Tokens to generate (greedy).
        #[arg(long, value_name = "N", default_value_t = 32)]
        gen: usize,
        /// Prompt tokens per prefill step (see `run --chunk`; the same default).
        #[arg(long, value_name = "N", value_parser = bespoke::commands::parse_chunk)]
        chunk: Option<usize>,
        /// Thread count for the "all threads" runs (default: physical cores).
        #[arg(long, value_name = "N")]
        threads: Option<usize>,
        /// One repeat and a small bandwidth buffer (smoke tests).
        #[arg(long)]
        quick: bool,
        /// What specialisation buys, end to end: also run every repeat on the
        /// generic kernels only (the same numbers, bit for bit), alternated
        /// with the specialised runs, and print specialised ÷ generic. Needs
        /// a build made for the model (BESPOKE_MODEL=DIR cargo build
        /// --release); the runs are as long again.
        #[arg(long)]
        vs_generic: bool,
        /// Also write the results as JSON to FILE.
        #[arg(long, value_name = "FILE")]
        json: Option<PathBuf>,
        #[command(flatten)]
        num: bespoke::commands::NumericsArgs,
    },
    /// The ratio table between two `bench kernels --json` files (or two
    /// `bench e2e --json` files): two builds, two machines, two commits.
    /// A is the baseline; a ratio is B's speed over A's (> 1: B is faster).
    Compare {
        /// The baseline results file.
        a: PathBuf,
        /// The results file compared against it.
        b: PathBuf,
    },
    /// Time every FP4 / FP8 / BF16 matvec this build specialised at DeepSeek V4
    /// Flash expert shapes and the fixture's shapes, and the attention-decode
    /// kernel at its shapes, per ISA variant, specialised and generic, 1
    /// thread and all threads, weights (keys and values) cache-resident and
    /// streamed from memory, each next to a plain read timed beside it (of
    /// memory for streamed weights, of as many bytes held in cache for
    /// resident ones).
    Kernels {
        /// Thread count for the "all threads" runs (default: physical cores).
        #[arg(long, value_name = "N")]
        threads: Option<usize>,
        /// A short run (fewer repeats, smaller streaming buffers) for smoke tests.
        #[arg(long)]
        quick: bool,
        /// Also write the results as JSON to FILE.
        #[arg(long, value_name = "FILE")]
        json: Option<PathBuf>,
        /// Time every matrix of this model (a directory or its config.json)
        /// instead of the default set; specialised where the build made a
        /// kernel for the shape, else generic only.
        #[arg(long, value_name = "DIR", conflicts_with = "shapes")]
        model: Option<PathBuf>,
        /// A built-in shape set instead of the default one: `dsv4-flash`
        /// (every matrix of DeepSeek V4 Flash, from its config.json) or
        /// `dsv4-pro` (DeepSeek V4 Pro). The default set is the Flash expert
        /// shapes plus the fixtures' shapes.
        #[arg(long, value_name = "SET", value_parser = ["dsv4-flash", "dsv4-pro"])]
        shapes: Option<String>,
        /// Also draw specialised vs generic GB/s per kernel, ISA, thread count
        /// and residency, with the read each row is set against marked, as
        /// an SVG chart.
        #[arg(long, value_name = "FILE.svg")]
        plot: Option<PathBuf>,
        /// Only kernels whose format is one of these (comma-separated: f32, bf16,
        /// fp8, fp4, fp4q8 — the fp4×q8 variant: FP4 weights times
        /// activations rounded to int8 per 32 columns, quantization included —
        /// bf16dot — BF16 weights times activations rounded to BF16, on
        /// AVX512_BF16 CPUs, rounding included — fp8dot, the same for
        /// FP8 weights — amx, BF16 weights times activations rounded to
        /// BF16 on AMX tiles (Intel CPUs with AMX-BF16; meant for --tokens
        /// 16 and more), rounding and packing included — fp4amx, FP4
        /// weights decoded to BF16 times activations rounded to BF16 on
        /// AMX tiles (--fp4-act amx), decoding, rounding and packing
        /// included — fp8amx, the same for FP8 weights (--fp8-act amx) —
        /// and attn, the
        /// attention-decode kernel at the shape set's attention shapes, one
        /// query against --context positions).
        /// Default: bf16,fp8,fp4,fp4q8,bf16dot,fp8dot,attn, and amx with
        /// --tokens 8 or more (where --bf16-act amx uses it), fp8amx and
        /// fp4amx with --tokens 3 or more (where --fp8-act amx and --fp4-act
        /// amx use them).
        #[arg(long, value_name = "LIST")]
        formats: Option<String>,
        /// Positions in the KV cache of the attn cases (keys and values f32,
        /// all read per call; GB/s counts them). Default: 4096, or 512 with
        /// --quick.
        #[arg(long, value_name = "N")]
        context: Option<usize>,
        /// Only these ISA variants (comma-separated, e.g. `avx512` or
        /// `avx2,avx512`). Default: every compiled variant this CPU runs.
        #[arg(long, value_name = "LIST")]
        isa: Option<String>,
        /// Place every weight matrix this many bytes past a 64-byte boundary
        /// (a multiple of 8 below 64). A tensor memory-mapped from a
        /// safetensors file lies wherever the file puts it, only 8-aligned
        /// for certain; row loads that straddle cache lines can cost
        /// streamed kernels a few percent to a fifth of their speed.
        #[arg(long, value_name = "BYTES", default_value_t = 0)]
        weight_offset: usize,
        /// Make this fraction of the FP8 weights' codes subnormal (0 to
        /// 0.5; e.g. 0.001). The default weights are Gaussian, scaled as a
        /// checkpoint's blocks are, and hold almost none; a block whose
        /// largest weight is an outlier holds more. On cores that take a
        /// microcode assist for a subnormal multiply-add operand this is
        /// what BESPOKE_FP8_SCALED=auto guards against
        #[arg(long, value_name = "FRACTION", default_value_t = 0.0)]
        fp8_subnormal: f64,
        /// Tokens per call: 1 (the default) times the matvec kernels, as
        /// decode runs them; N > 1 the matmul kernels Y = W·X with N columns
        /// of X, as prefill runs them (the engine's step is 256 tokens, 1024
        /// where a MoE model's routed experts run on amx), up
        /// to 1024. Each case's GFLOP/s is also set against a compute roof
        /// measured in the same run: independent chains of the kernel's
        /// multiply-add instruction (f32 FMA per ISA, VDPBF16PS for
        /// bf16dot and fp8dot), the `% peak` column.
        #[arg(long, value_name = "N", default_value_t = 1)]
        tokens: usize,
    },
    /// The CUDA kernels on this machine's GPU (`cuda` builds): per shape and
    /// format, the CUDA-core matvec (generic and specialised) and matmul, and
    /// every tensor-core path the loaded image has, with time per call, GB/s
    /// of weights against the card's peak memory bandwidth, and GFLOP/s;
    /// then the attention kernels (decode, a prefill step's causal launch,
    /// and DeepSeek V4's row lists) at the set's attention shapes over 4096
    /// keys (1024 with --quick), GB/s of keys and values.
    Gpu {
        /// Time every matrix of this model instead of the default set.
        #[arg(long, value_name = "DIR", conflicts_with = "shapes")]
        model: Option<PathBuf>,
        /// A built-in shape set: `dsv4-flash` or `dsv4-pro` (as for `bench kernels`).
        #[arg(long, value_name = "SET", value_parser = ["dsv4-flash", "dsv4-pro"])]
        shapes: Option<String>,
        /// Formats (comma-separated: f32, bf16, fp8, fp4). Default: bf16,fp8,fp4.
        #[arg(long, value_name = "LIST")]
        formats: Option<String>,
        /// Fewer repeats (smoke tests).
        #[arg(long)]
        quick: bool,
        /// Also write the results as JSON to FILE.
        #[arg(long, value_name = "FILE")]
        json: Option<PathBuf>,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("bespoke: error: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli) -> Result<(), String> {
    match cli.command {
        Command::Plan {
            model,
            json,
            threads: t,
        } => {
            let p = report::build_plan();
            if json {
                println!(
                    "{}",
                    serde_json::to_string_pretty(&p).map_err(|e| e.to_string())?
                );
                return Ok(());
            }
            let n = threads::init(threads::resolve(t)?);
            let choice = Kernels::from_env();
            println!(
                "bespoke {} — kernel plan of this build\n",
                env!("CARGO_PKG_VERSION")
            );
            print!("{}", report::build_report(&p));
            println!();
            print!("{}", report::variants_report(&choice, n));
            print!("{}", report::cuda_report(&p));
            let kernels = choice.map_err(|e| e.to_string())?.kernels;
            for dir in model {
                let cfg = plan::load_config(&dir).map_err(|e| e.to_string())?;
                let planned = plan::plan_model(&cfg).map_err(|e| e.to_string())?;
                println!();
                print!("{}", report::model_report(&planned, &kernels));
            }
            Ok(())
        }
        Command::Run { args, threads: t } => {
            threads::init(threads::resolve(t)?);
            bespoke::commands::run(args)
        }
        Command::Score { args, threads: t } => {
            threads::init(threads::resolve(t)?);
            bespoke::commands::score(args)
        }
        Command::Inspect {
            model,
            brief,
            json,
            fp8_codes,
        } => {
            let m = bespoke::model::ModelDir::open(&model).map_err(|e| e.to_string())?;
            let codes = fp8_codes.then(|| {
                eprintln!("counting the codes of every FP8 tensor…");
                bespoke::inspect::fp8_codes(&m)
            });
            if json {
                let mut v = bespoke::inspect::json(&m);
                if let Some(c) = &codes {
                    v["fp8_codes"] = serde_json::to_value(c).map_err(|e| e.to_string())?;
                }
                println!(
                    "{}",
                    serde_json::to_string_pretty(&v).map_err(|e| e.to_string())?
                );
            } else {
                print!("{}", bespoke::inspect::text(&m, brief));
                if let Some(c) = &codes {
                    println!("{}", bespoke::inspect::fp8_codes_line(c));
                }
            }
            Ok(())
        }
        Command::Bench {
            what:
                BenchWhat::E2e {
                    model,
                    prompt_len,
                    gen,
                    chunk,
                    threads: t,
                    quick,
                    vs_generic,
                    json,
                    num,
                },
        } => {
            let n = threads::resolve(t)?;
            let dir = model.unwrap_or_else(bespoke::commands::default_model);
            let opts = bespoke::bench_e2e::E2eOptions {
                prompt_len,
                gen,
                threads: n,
                quick,
                chunk,
                vs_generic,
                num,
            };
            let r = bespoke::bench_e2e::e2e(&dir, &opts)?;
            if let Some(path) = json {
                let text = serde_json::to_string_pretty(&r).map_err(|e| e.to_string())?;
                std::fs::write(&path, text).map_err(|e| format!("{}: {e}", path.display()))?;
                eprintln!("wrote {}", path.display());
            }
            Ok(())
        }
        Command::Bench {
            what:
                BenchWhat::Gpu {
                    model,
                    shapes,
                    formats,
                    quick,
                    json,
                },
        } => {
            let set = bench::ShapeSet::from_args(model, shapes.as_deref());
            let mut fs = Vec::new();
            for f in formats.as_deref().unwrap_or("bf16,fp8,fp4").split(',') {
                let f = f.trim();
                fs.push(plan::Format::parse(f).ok_or_else(|| {
                    format!("--formats: unknown format {f:?} (f32, bf16, fp8, fp4)")
                })?);
            }
            let r = bespoke::bench_gpu::bench_gpu(&set, &fs, quick)?;
            print!("{}", bespoke::bench_gpu::table(&r));
            if let Some(path) = json {
                let text = serde_json::to_string_pretty(&r).map_err(|e| e.to_string())?;
                std::fs::write(&path, text).map_err(|e| format!("{}: {e}", path.display()))?;
                eprintln!("wrote {}", path.display());
            }
            Ok(())
        }
        Command::Bench {
            what: BenchWhat::Compare { a, b },
        } => {
            let (a, b) = (
                bespoke::bench_compare::load(&a)?,
                bespoke::bench_compare::load(&b)?,
            );
            print!("{}", bespoke::bench_compare::compare(&a, &b)?);
            Ok(())
        }
        Command::Bench {
            what:
                BenchWhat::Kernels {
                    threads: t,
                    quick,
                    json,
                    plot,
                    model,
                    shapes,
                    formats,
                    isa,
                    weight_offset,
                    fp8_subnormal,
                    tokens,
                    context,
                },
        } => {
            let n = threads::init(threads::resolve(t)?);
            let list = formats.unwrap_or_else(|| {
                let mut all = "bf16,fp8,fp4,fp4q8,bf16dot,fp8dot,attn".to_string();
                if tokens >= bespoke::bf16act::AMX_MIN_TOKENS {
                    all.push_str(",amx");
                }
                if tokens >= bespoke::bf16act::AMX_FP8_MIN_TOKENS {
                    all.push_str(",fp8amx");
                }
                if tokens >= bespoke::bf16act::AMX_FP4_MIN_TOKENS {
                    all.push_str(",fp4amx");
                }
                all
            });
            let mut formats = Vec::new();
            let (mut fp4_q8, mut bf16dot, mut fp8dot, mut attention) = (false, false, false, false);
            let (mut amx, mut fp8_amx, mut fp4_amx) = (false, false, false);
            for s in list.split(',').map(str::trim).filter(|s| !s.is_empty()) {
                match s {
                    "fp4q8" => fp4_q8 = true,
                    "bf16dot" => bf16dot = true,
                    "fp8dot" => fp8dot = true,
                    "amx" => amx = true,
                    "fp8amx" => fp8_amx = true,
                    "fp4amx" => fp4_amx = true,
                    "attn" => attention = true,
                    _ => formats.push(plan::Format::parse(s).ok_or_else(|| {
                        format!(
                            "--formats: unknown format {s:?} (f32, bf16, fp8, fp4, fp4q8, bf16dot, fp8dot, amx, fp8amx, fp4amx, attn)"
                        )
                    })?),
                }
            }
            let shapes = bench::ShapeSet::from_args(model, shapes.as_deref());
            let mut isas = Vec::new();
            for s in isa
                .iter()
                .flat_map(|l| l.split(','))
                .map(str::trim)
                .filter(|s| !s.is_empty())
            {
                isas.push(plan::Isa::parse(s).ok_or_else(|| {
                    let names: Vec<&str> = plan::ISAS.iter().map(|i| i.name()).collect();
                    format!(
                        "--isa: unknown ISA variant {s:?} (one of {})",
                        names.join(", ")
                    )
                })?);
            }
            let opts = bench::Options {
                threads: n,
                quick,
                formats,
                fp4_q8,
                bf16dot,
                fp8dot,
                amx,
                fp8_amx,
                fp4_amx,
                shapes,
                isas,
                weight_offset,
                fp8_subnormal,
                tokens,
                attention,
                context,
            };
            let results = bench::kernels(&opts)?;
            if let Some(path) = json {
                let text = serde_json::to_string_pretty(&results).map_err(|e| e.to_string())?;
                std::fs::write(&path, text).map_err(|e| format!("{}: {e}", path.display()))?;
                eprintln!("wrote {}", path.display());
            }
            if let Some(path) = plot {
                std::fs::write(&path, bespoke::bench_plot::svg(&results))
                    .map_err(|e| format!("{}: {e}", path.display()))?;
                eprintln!("wrote {}", path.display());
            }
            Ok(())
        }
    }
}
