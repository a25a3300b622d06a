//! The `bespoke` binary: plan tables, --model checks, JSON, errors, bench.

mod common;
use common::bespoke_command;

/// A command line's words (none of them holds a space).
fn words(line: &str) -> Vec<&str> {
    line.split_whitespace().collect()
}

/// A path in the temporary directory, unique to this test process.
fn tmp(prefix: &str, name: &str) -> String {
    std::env::temp_dir()
        .join(format!("bespoke-{prefix}-{}-{name}", std::process::id()))
        .to_str()
        .unwrap()
        .to_string()
}

fn run(args: &[&str]) -> (bool, String, String) {
    run_env(args, &[])
}

/// [`run`] with these environment variables set.
fn run_env(args: &[&str], env: &[(&str, &str)]) -> (bool, String, String) {
    let out = bespoke_command()
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .env_remove("BESPOKE_KERNELS")
        .env_remove("BESPOKE_SPECIALISED")
        .env_remove("BESPOKE_FP8_SCALED")
        .envs(env.iter().copied())
        .output()
        .expect("run bespoke");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into(),
        String::from_utf8_lossy(&out.stderr).into(),
    )
}

#[test]
fn plan_shows_build_variants_and_dispatch() {
    let (ok, out, err) = run(&["plan"]);
    assert!(ok, "{err}");
    for needle in [
        "specialised matrix kernels",
        "specialised attention-decode kernels",
        "kernel variants compiled into this binary",
        "dispatch uses:",
        "generic (run-time shape) kernels",
        "CUDA:",
        "threads:",
    ] {
        assert!(out.contains(needle), "missing {needle:?} in:\n{out}");
    }
    // The BF16-activation kernels, one line per weight format, where built.
    if !bespoke::kernels::BF16DOT_KERNELS.is_empty() {
        for needle in [
            "bf16dot (--bf16-act bf16: BF16 weights",
            "fp8dot (--fp8-act bf16: FP8 weights",
        ] {
            assert!(out.contains(needle), "missing {needle:?} in:\n{out}");
        }
    }
}

/// The CUDA side of `plan`: in a `cuda` build with a toolkit, the archs and
/// tensor-core paths; with no GPU or driver (CI), the one-line reason the
/// binary runs on the CPU; without the feature, that it is not built with CUDA.
#[test]
fn plan_shows_the_cuda_side() {
    let (ok, out, err) = run(&["plan"]);
    assert!(ok, "{err}");
    let line = out
        .lines()
        .find(|l| l.starts_with("CUDA:"))
        .unwrap_or_default();
    if !cfg!(feature = "cuda") {
        assert!(line.contains("not built with CUDA"), "{out}");
        return;
    }
    if out.contains("CUDA build: toolkit") {
        for needle in ["sm_", "mma.sync BF16", "wgmma", "CUDA-core kernels"] {
            assert!(out.contains(needle), "missing {needle:?} in:\n{out}");
        }
    } else {
        assert!(
            out.contains("CUDA build: no GPU kernels were built: nvcc not found"),
            "{out}"
        );
    }
    assert!(
        line.contains("running on the CPU") || line.contains("kernels from the"),
        "{line}"
    );
    // The kill switch.
    let out = bespoke_command()
        .arg("plan")
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .env("BESPOKE_CUDA", "off")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("CUDA: running on the CPU: BESPOKE_CUDA=off"),
        "{text}"
    );
}

#[test]
fn plan_for_a_model_says_specialised_or_generic() {
    let (ok, out, err) = run(&["plan", "--model", "fixtures/tiny-llama"]);
    assert!(ok, "{err}");
    assert!(
        out.contains("model.layers.*.self_attn.q_proj") && out.contains("specialised"),
        "{out}"
    );
    // A model the build was not specialised for runs on generic kernels, and says how to fix that.
    let (ok, out, err) = run(&["plan", "--model", "tests/configs/qwen3-small.json"]);
    assert!(ok, "{err}");
    assert!(
        out.contains("generic") && out.contains("BESPOKE_MODEL="),
        "{out}"
    );
}

#[test]
fn plan_errors_name_the_file() {
    let (ok, _, err) = run(&["plan", "--model", "tests/configs/unknown-type"]);
    assert!(!ok);
    assert!(
        err.contains("tests/configs/unknown-type/config.json") && err.contains("gpt_neox"),
        "{err}"
    );
    let (ok, _, err) = run(&["plan", "--model", "no/such/dir"]);
    assert!(!ok && err.contains("no/such/dir/config.json"), "{err}");
    let (ok, _, err) = run(&["plan", "--threads", "0"]);
    assert!(!ok && err.contains("--threads"), "{err}");
}

#[test]
fn plan_json_is_the_build_plan() {
    let (ok, out, err) = run(&["plan", "--json"]);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).expect("valid JSON");
    assert!(v["mat_shapes"].as_array().is_some_and(|a| !a.is_empty()));
    assert!(v["isas"]
        .as_array()
        .is_some_and(|a| a.iter().any(|i| i == "Scalar")));
}

/// `bench kernels --quick` on the fixture's shapes: valid JSON and SVG, twice,
/// then `bench compare` of the two runs (and its errors).
#[test]
fn bench_kernels_quick_json_plot_and_compare() {
    let tmp = |name: &str| tmp("bench", name);
    let (a, b, svg) = (tmp("a.json"), tmp("b.json"), tmp("a.svg"));
    for (path, formats) in [(&a, "bf16,fp4q8"), (&b, "bf16,fp4")] {
        let mut args = vec![
            "bench",
            "kernels",
            "--quick",
            "--threads",
            "1",
            "--formats",
            formats,
            "--json",
            path,
        ];
        if path == &a {
            args.extend(["--plot", svg.as_str()]);
        }
        let (ok, out, err) = run(&args);
        assert!(ok, "{err}");
        assert!(out.contains("summary"), "{out}");
        let v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        let ks = v["kernels"].as_array().unwrap();
        assert!(!ks.is_empty());
        assert!(ks
            .iter()
            .all(|k| k["median_us"].as_f64().is_some_and(|t| t > 0.0)));
        assert!(v["bandwidth"][0]["gb_per_s"]
            .as_f64()
            .is_some_and(|g| g > 0.0));
        if path == &a {
            assert!(ks.iter().any(|k| k["format"] == "fp4q8"), "fp4q8 rows");
        }
        // Each row's read: memory for streamed weights, the same bytes in
        // cache (with vector loads where the CPU has them) for resident ones.
        for k in ks {
            let (read, gb) = (
                k["read"].as_str().unwrap(),
                k["read_gb_per_s"].as_f64().unwrap(),
            );
            assert!(gb > 0.0, "{k}");
            let frac = k["gb_per_s"].as_f64().unwrap() / gb;
            assert!(
                (k["bandwidth_fraction"].as_f64().unwrap() - frac).abs() <= 1e-9 * frac,
                "{k}"
            );
            match k["residency"].as_str().unwrap() {
                "stream" => assert!(read.starts_with("memory, "), "{k}"),
                "cache" => {
                    assert!(read.starts_with("cache, "), "{k}");
                    #[cfg(target_arch = "x86_64")]
                    if std::arch::is_x86_feature_detected!("avx2") {
                        assert!(read.contains("avx2") || read.contains("avx512"), "{k}");
                    }
                    #[cfg(target_arch = "aarch64")]
                    assert_eq!(read, "cache, neon loads");
                }
                r => panic!("residency {r}"),
            }
        }
    }
    // The chart: well-formed enough to hold one bar per measurement.
    let text = std::fs::read_to_string(&svg).unwrap();
    assert!(text.starts_with("<svg") && text.trim_end().ends_with("</svg>"));
    let va: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&a).unwrap()).unwrap();
    assert_eq!(
        text.matches("<rect x=").count() - 2,
        va["kernels"].as_array().unwrap().len(),
        "bars (+2 legend keys)"
    );
    // One tick a row (specialised and generic share one): the read it was set against.
    let rows = va["kernels"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|k| k["kernel"] == "generic")
        .count();
    assert_eq!(
        text.matches(r#"stroke="black""#).count(),
        rows,
        "read ticks"
    );
    // Compare: the shared bf16 rows are matched; the others listed per file.
    let (ok, out, err) = run(&["bench", "compare", &a, &b]);
    assert!(ok, "{err}");
    assert!(
        out.contains("geometric mean ratio") && out.contains("bf16"),
        "{out}"
    );
    assert!(
        out.contains("only in") && out.contains("fp4q8") && out.contains("fp4 "),
        "{out}"
    );
    // A file with itself: every ratio is exactly 1.
    let (ok, out, _) = run(&["bench", "compare", &a, &a]);
    assert!(
        ok && out.contains("geometric mean ratio 1.000x") && !out.contains("only in"),
        "{out}"
    );
    // A file from before rows named their read (every % bw of the memory
    // read): the cache-resident rows' % bw are flagged as not comparable.
    let mut old = va.clone();
    for k in old["kernels"].as_array_mut().unwrap() {
        k.as_object_mut().unwrap().remove("read");
    }
    std::fs::write(tmp("old.json"), old.to_string()).unwrap();
    let (ok, out, err) = run(&["bench", "compare", &tmp("old.json"), &a]);
    assert!(ok, "{err}");
    assert_eq!(
        out.matches("note: some rows' % bw are of different reads")
            .count(),
        1,
        "{out}"
    );
    assert!(out.contains("B cache, "), "{out}");
    std::fs::remove_file(tmp("old.json")).ok();
    // Errors name the file and what was expected.
    let (ok, _, err) = run(&["bench", "compare", &a, "Cargo.toml"]);
    assert!(
        !ok && err.contains("Cargo.toml") && err.contains("not JSON"),
        "{err}"
    );
    std::fs::write(tmp("x.json"), "{\"runs\": []}").unwrap();
    let (ok, _, err) = run(&["bench", "compare", &a, &tmp("x.json")]);
    assert!(!ok && err.contains("like with like"), "{err}");
    for p in [a, b, svg, tmp("x.json")] {
        std::fs::remove_file(p).ok();
    }
}

/// `bench kernels --formats amx,fp8amx,fp4amx` on DeepSeek V4's shapes
/// (BF16, FP8 and FP4 matrices): rows for each, beside the f32 kernels of
/// the same matrices, where the CPU has AMX; else a line says why not.
#[test]
fn bench_kernels_amx_formats() {
    let path = tmp("bench", "amx.json");
    let (ok, out, err) = run(&words(&format!(
        "bench kernels --quick --threads 1 --model fixtures/tiny-dsv4 --tokens 3 \
         --formats bf16,fp8,fp4,amx,fp8amx,fp4amx --json {path}"
    )));
    assert!(ok, "{err}");
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let formats: Vec<&str> = v["kernels"]
        .as_array()
        .unwrap()
        .iter()
        .map(|k| k["format"].as_str().unwrap())
        .collect();
    for f in ["bf16", "fp8", "fp4"] {
        assert!(formats.contains(&f), "{f}: {formats:?}");
    }
    match bespoke::kernels::Kernels::amx_available() {
        Ok(()) => {
            for f in ["amx", "fp8amx", "fp4amx"] {
                assert!(formats.contains(&f), "{f}: {formats:?}");
            }
            assert!(out.contains("fp8 with f32 activations"), "{out}");
        }
        Err(why) => {
            for f in ["amx", "fp8amx", "fp4amx"] {
                assert!(err.contains(&format!("{f} not timed: {why}")), "{err}");
            }
        }
    }
    std::fs::remove_file(path).ok();
}

/// `bench kernels --model DIR` times that model's shapes; `--shapes
/// dsv4-flash` every matrix of the built-in Flash config.
#[test]
fn bench_kernels_shape_sets() {
    let path =
        std::env::temp_dir().join(format!("bespoke-bench-shapes-{}.json", std::process::id()));
    let p = path.to_str().unwrap();
    let shapes = |args: &[&str]| {
        let mut a = vec!["bench", "kernels", "--quick", "--threads", "1", "--json", p];
        a.extend_from_slice(args);
        let (ok, _, err) = run(&a);
        assert!(ok, "{err}");
        let v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        let mut s: Vec<(String, u64, u64)> = v["kernels"]
            .as_array()
            .unwrap()
            .iter()
            .map(|k| {
                (
                    k["format"].as_str().unwrap().to_string(),
                    k["rows"].as_u64().unwrap(),
                    k["cols"].as_u64().unwrap(),
                )
            })
            .collect();
        s.sort();
        s.dedup();
        (s, err)
    };
    // tiny-qwen3: hidden 64, vocab 512, BF16
    let (s, _) = shapes(&["--model", "fixtures/tiny-qwen3", "--formats", "bf16"]);
    assert!(s.iter().all(|(f, _, _)| f == "bf16"), "{s:?}");
    assert!(s.contains(&("bf16".into(), 512, 64)), "the LM head: {s:?}");
    assert!(
        !s.iter().any(|(_, r, c)| (*r, *c) == (2048, 4096)),
        "no Flash shapes: {s:?}"
    );
    let (s, _) = shapes(&["--shapes", "dsv4-flash", "--formats", "f32"]);
    assert_eq!(s, vec![("f32".into(), 4, 16384), ("f32".into(), 24, 16384)]);
    // Pro: hidden 7168 (the mHC mixes are 24 × 4·7168)
    let (s, _) = shapes(&["--shapes", "dsv4-pro", "--formats", "f32"]);
    assert_eq!(s, vec![("f32".into(), 4, 28672), ("f32".into(), 24, 28672)]);
    let (_, err) = shapes(&["--shapes", "dsv4-flash", "--formats", "f32,bf16"]);
    assert!(
        err.contains("skipped head") && err.contains("129280"),
        "{err}"
    );
    let (ok, _, err) = run(&words("bench kernels --quick --model /nonexistent-model"));
    assert!(!ok && err.contains("/nonexistent-model"), "{err}");
    let (ok, _, err) = run(&words(
        "bench kernels --quick --shapes dsv4-flash --model fixtures/tiny-llama",
    ));
    assert!(!ok && err.contains("cannot be used with"), "{err}");
    std::fs::remove_file(&path).ok();
}

/// `bench kernels --formats attn`: the attention kernel at the model's
/// shape, specialised and generic per variant, GB/s of keys and values
/// read; `bench compare` matches those rows; a bad `--context` is refused.
#[test]
fn bench_kernels_attention() {
    let tmp = |name: &str| tmp("bench-attn", name);
    let a = tmp("a.json");
    // tiny-qwen3: 4 heads over 2 KV heads of 32
    let (ok, out, err) = run(&words(&format!(
        "bench kernels --quick --threads 1 --model fixtures/tiny-qwen3 --formats attn --context 40 --json {a}"
    )));
    assert!(ok, "{err}");
    assert!(out.contains("4h/2kv×32 @40"), "{out}");
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&a).unwrap()).unwrap();
    let ks = v["kernels"].as_array().unwrap();
    assert!(!ks.is_empty());
    for k in ks {
        assert_eq!(k["format"], "attn", "{k}");
        assert_eq!(
            (k["rows"].as_u64(), k["cols"].as_u64()),
            (Some(4), Some(32)),
            "{k}"
        );
        assert_eq!(k["attn"]["kv_heads"].as_u64(), Some(2), "{k}");
        assert_eq!(k["attn"]["context"].as_u64(), Some(40), "{k}");
        // 2 × 40 positions × 2 KV heads × 32 floats
        let bytes = 2.0 * 40.0 * 2.0 * 32.0 * 4.0;
        let gb = k["gb_per_s"].as_f64().unwrap();
        let us = k["median_us"].as_f64().unwrap();
        assert!((gb - bytes / us / 1e3).abs() <= 1e-6 * gb, "{k}");
    }
    for isa in ["scalar", "avx2", "avx512", "neon"] {
        let ran =
            bespoke::kernels::Kernels::with_isa(bespoke::plan::Isa::parse(isa).unwrap()).is_ok();
        if ran
            && bespoke::kernels::COMPILED_ISAS
                .iter()
                .any(|i| i.name() == isa)
        {
            assert!(
                ks.iter()
                    .any(|k| k["isa"] == isa && k["kernel"] == "generic"),
                "{isa}"
            );
        }
    }
    let (ok, out, err) = run(&["bench", "compare", &a, &a]);
    assert!(
        ok && out.contains("4h/2kv×32 @40") && out.contains("geometric mean ratio 1.000x"),
        "{out}{err}"
    );
    let (ok, _, err) = run(&words("bench kernels --quick --formats attn --context 0"));
    assert!(!ok && err.contains("--context 0"), "{err}");
    std::fs::remove_file(&a).ok();
}

#[test]
fn help_explains_the_commands() {
    let (ok, out, _) = run(&["--help"]);
    assert!(
        ok && out.contains("plan") && out.contains("bench") && out.contains("BESPOKE_KERNELS"),
        "{out}"
    );
}

#[test]
fn inspect_every_fixture() {
    for name in common::FIXTURES {
        let dir = format!("fixtures/{name}");
        let (ok, out, err) = run(&["inspect", "--model", &dir]);
        assert!(ok, "inspect {dir} failed: {err}");
        assert!(out.contains("ok: every tensor"), "{out}");
        assert!(
            out.contains("by format") && out.contains("tokenizer "),
            "{out}"
        );
        let (ok, out, err) = run(&["inspect", "--model", &dir, "--json"]);
        assert!(ok, "{err}");
        let v: serde_json::Value = serde_json::from_str(&out).expect("inspect --json prints JSON");
        assert!(v["tensors"].as_array().is_some_and(|t| !t.is_empty()));
    }
    let (_, out, _) = run(&["inspect", "--model", "fixtures/tiny-dsv4"]);
    assert!(
        out.contains("DeepSeek V4 release names")
            && out.contains("FP4 E2M1")
            && out.contains("FP8 E4M3"),
        "{out}"
    );
    let (_, out, _) = run(&words("inspect --model fixtures/tiny-dsv4-hf --brief"));
    assert!(
        out.contains("Hugging Face transformers names") && !out.contains("read as"),
        "{out}"
    );
}

/// `inspect` counts the matrices off a 64-byte line as the file lays them
/// out: worked out here from the header alone (8 + header length + the
/// tensor's begin offset), against what the tool read from the mapping.
#[test]
fn inspect_reports_matrix_alignment() {
    for name in ["tiny-llama", "tiny-dsv4"] {
        let (_, n, header) = safetensors_file(name);
        let (mut count, mut want) = (0u64, serde_json::Map::new());
        for (k, t) in header.as_object().unwrap() {
            if k == "__metadata__"
                || t["shape"].as_array().unwrap().len() != 2
                || t["dtype"] == "F8_E8M0"
            {
                continue;
            }
            count += 1;
            let off = (8 + n as u64 + t["data_offsets"][0].as_u64().unwrap()) % 64;
            if off != 0 {
                let e = want.entry(off.to_string()).or_insert(serde_json::json!(0));
                *e = serde_json::json!(e.as_u64().unwrap() + 1);
            }
        }
        let (ok, out, err) = run(&["inspect", "--model", &format!("fixtures/{name}"), "--json"]);
        assert!(ok, "{err}");
        let v: serde_json::Value = serde_json::from_str(&out).unwrap();
        assert_eq!(v["matrices"]["count"], count, "{name}");
        assert_eq!(
            v["matrices"]["off_line_by_offset"],
            serde_json::Value::Object(want),
            "{name}"
        );
        let (_, text, _) = run(&["inspect", "--model", &format!("fixtures/{name}")]);
        let off: u64 = v["matrices"]["off_line_by_offset"]
            .as_object()
            .unwrap()
            .values()
            .map(|c| c.as_u64().unwrap())
            .sum();
        assert!(
            text.contains(&format!(
                "alignment   {off} of {count} matrices start off a 64-byte line"
            )),
            "{text}"
        );
    }
}

#[test]
fn inspect_errors_name_the_problem() {
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("cli-inspect-broken");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(
        dir.join("config.json"),
        r#"{"model_type": "llama", "hidden_size": 16, "num_attention_heads": 2}"#,
    )
    .unwrap();
    // Header length pointing past the end of the file.
    let mut bytes = 4096u64.to_le_bytes().to_vec();
    bytes.extend_from_slice(b"{}");
    std::fs::write(dir.join("model.safetensors"), bytes).unwrap();
    let d = dir.to_str().unwrap();
    let (ok, _, err) = run(&["inspect", "--model", d]);
    assert!(!ok);
    assert!(
        err.contains("model.safetensors") && err.contains("runs past the end"),
        "{err}"
    );
    assert!(!err.contains("panicked"), "{err}");
    let (ok, _, err) = run(&["inspect", "--model", "/nonexistent/model"]);
    assert!(!ok && err.contains("not a directory"), "{err}");
}

#[test]
fn run_with_no_arguments_uses_the_bundled_model() {
    let (ok, out, err) = run(&["run", "--max-new-tokens", "5"]);
    assert!(ok, "{err}");
    assert!(out.starts_with("The old lighthouse"), "{out}");
    for needle in [
        "tiny-llama",
        "params",
        "KV cache",
        "kernels:",
        "time to first token",
        "prefill",
        "decode",
    ] {
        assert!(
            err.contains(needle),
            "stderr should mention {needle:?}: {err}"
        );
    }
}

/// Prompt `index` of a fixture's ref.json and its ids as `1,2,3`.
fn ref_prompt(model: &str, index: usize) -> (serde_json::Value, String) {
    let (_, r) = common::fixture(model);
    let p = r["prompts"][index].clone();
    let ids: Vec<String> = p["ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.to_string())
        .collect();
    (p, ids.join(","))
}

/// `score --json --logits last` on a fixture with extra flags: (ok, stdout,
/// stderr).
fn score_last(model: &str, ids: &str, extra: &[&str]) -> (bool, String, String) {
    let dir = format!("fixtures/{model}");
    let mut a = vec![
        "score", "--model", &dir, "--ids", ids, "--json", "--logits", "last",
    ];
    a.extend_from_slice(extra);
    run(&a)
}

/// A `score --json` output and its last logits.
fn last_logits(out: &str) -> (serde_json::Value, Vec<f64>) {
    let v: serde_json::Value = serde_json::from_str(out).unwrap();
    let logits = v["last_logits"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap())
        .collect();
    (v, logits)
}

/// The largest difference between two logit vectors.
fn max_dist(a: &[f64], b: &[f64]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f64::max)
}

/// [`ref_prompt`], and the `run --json` object of 24 greedy tokens from it.
fn greedy_run_json(model: &str, index: usize) -> (serde_json::Value, String, serde_json::Value) {
    let (p, ids) = ref_prompt(model, index);
    let dir = format!("fixtures/{model}");
    let (ok, out, err) = run(&[
        "run",
        "--model",
        &dir,
        "--prompt-ids",
        &ids,
        "--max-new-tokens",
        "24",
        "--ignore-eos",
        "--greedy",
        "--json",
    ]);
    assert!(ok, "{err}");
    let v = serde_json::from_str(out.trim()).expect("one JSON object");
    (p, ids, v)
}

/// `run --json` (a stable interface): greedy tokens equal the reference.
#[test]
fn run_json_matches_the_reference_greedy_tokens() {
    let (p, _, v) = greedy_run_json("tiny-qwen3", 1);
    assert_eq!(v["new_ids"], p["greedy"]);
    assert_eq!(v["prompt_ids"], p["ids"]);
    assert!(v["timings"]["decode_tok_s"].as_f64().unwrap() > 0.0);
    assert!(v["text"].is_string());
    // The same through --prompt text.
    let (ok, out, _) = run(&[
        "run",
        "--model",
        "fixtures/tiny-qwen3",
        "--prompt",
        p["text"].as_str().unwrap(),
        "--max-new-tokens",
        "24",
        "--ignore-eos",
        "--json",
    ]);
    assert!(ok);
    let v2: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(v2["new_ids"], p["greedy"]);
    // Sampling is reproducible by seed.
    let args = [
        "run",
        "--temperature",
        "1.0",
        "--top-k",
        "40",
        "--seed",
        "7",
        "--max-new-tokens",
        "12",
        "--ignore-eos",
        "--json",
    ];
    let new_ids = |out: &str| {
        serde_json::from_str::<serde_json::Value>(out.trim()).unwrap()["new_ids"].clone()
    };
    let (_, a, _) = run(&args);
    let (_, b, _) = run(&args);
    assert_eq!(new_ids(&a), new_ids(&b));
}

#[test]
fn score_prints_argmax_at_every_position() {
    let (p, ids) = ref_prompt("tiny-qwen3-moe", 2);
    let (ok, out, err) = run(&[
        "score",
        "--model",
        "fixtures/tiny-qwen3-moe",
        "--ids",
        &ids,
        "--json",
        "--logits",
        "last",
    ]);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(v["argmax"], p["argmax"]);
    assert_eq!(v["last_logits"].as_array().unwrap().len(), 512);
    let (ok, out, _) = run(&[
        "score",
        "--model",
        "fixtures/tiny-llama",
        "--text",
        "The old river is",
    ]);
    assert!(
        ok && out.contains("argmax") && out.lines().count() >= 5,
        "{out}"
    );
}

#[test]
fn run_and_score_errors_are_clear() {
    let cases: &[(&[&str], &str)] = &[
        (&["run", "--prompt-ids", "1,x,3"], "\"x\" is not a token id"),
        (&["run", "--prompt-ids", "1,9999"], "9999"),
        (
            &["run", "--max-new-tokens", "100000"],
            "max_position_embeddings",
        ),
        (&["run", "--top-p", "1.5"], "--top-p"),
        (&["run", "--temperature=-1"], "--temperature"),
        (&["score"], "--ids"),
        (&["run", "--model", "/nonexistent"], "not a directory"),
    ];
    for (args, needle) in cases {
        let (ok, _, err) = run(args);
        assert!(!ok, "{args:?} should fail");
        assert!(
            err.contains(needle),
            "{args:?}: expected {needle:?} in {err}"
        );
        assert!(!err.contains("panicked"), "{err}");
    }
}

#[test]
fn bench_e2e_quick_writes_json() {
    let path = std::env::temp_dir().join(format!("bespoke-e2e-{}.json", std::process::id()));
    let p = path.to_str().unwrap();
    let (ok, _, err) = run(&[words("bench e2e --model fixtures/tiny-qwen3-moe --quick --prompt-len 70 --gen 4 --threads 2 --json"), vec![p]].concat());
    assert!(ok, "{err}");
    assert!(
        err.contains("decode") && err.contains("% of read bandwidth"),
        "{err}"
    );
    // The tiny model fits in memory: read into the page cache first.
    assert!(err.contains("weights paged in:"), "{err}");
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let runs = v["runs"].as_array().unwrap();
    assert_eq!(runs.len(), 2);
    for r in runs {
        assert!(
            r["decode_tok_s"].as_f64().unwrap() > 0.0 && r["prefill_tok_s"].as_f64().unwrap() > 0.0
        );
        assert!(r["read_gb_per_s"].as_f64().unwrap() > 0.0);
    }
    assert!(v["bytes_per_decode_token"].as_u64().unwrap() > 0);
    assert_eq!(v["fp4_act"], "f32");
    assert_eq!(v["weights_paged_in"], true);
    assert_eq!(v["chunk"], 256, "the default prefill step");
    let (ok, out, err) = run(&["bench", "compare", p, p]);
    assert!(
        ok && out.contains("decode") && out.contains("1.00x"),
        "{out}{err}"
    );
    // DeepSeek V4 too, with its bytes per token (FP8/FP4 weights + scales).
    let (ok, _, err) = run(&words(
        "bench e2e --model fixtures/tiny-dsv4 --quick --prompt-len 20 --gen 3 --threads 1",
    ));
    assert!(
        ok && err.contains("read per decoded token") && err.contains("% of read bandwidth"),
        "{err}"
    );
    std::fs::remove_file(&path).ok();
}

/// Without `--chunk`, a MoE model whose routed experts run on the amx
/// kernels prefills in steps of 1024 tokens, and says so where a prompt
/// would have taken more than one step of 256; other runs, and any run with
/// `--chunk`, keep quiet. (Which step each engine picks: engine.rs,
/// default_prefill_chunk.)
#[test]
fn amx_moe_prefill_step() {
    let ids: Vec<String> = (0..300).map(|i| (7 + i * 13 % 500).to_string()).collect();
    let ids = ids.join(",");
    let says = "prefill: steps of 1024 tokens";
    let score = |extra: &[&str]| {
        let (ok, _, err) = run(&[
            &["score", "--model", "fixtures/tiny-qwen3-moe", "--ids", &ids][..],
            extra,
        ]
        .concat());
        assert!(ok, "{err}");
        err
    };
    assert!(!score(&[]).contains(says));
    match bespoke::kernels::Kernels::amx_available() {
        Err(why) => eprintln!("amx not available here ({why}): checked the f32 run only"),
        Ok(()) => {
            let err = score(&["--bf16-act", "amx"]);
            assert!(err.contains(says), "{err}");
            assert!(!score(&["--bf16-act", "amx", "--chunk", "256"]).contains(says));
        }
    }
    let (ok, _, err) = run(&[
        "score",
        "--model",
        "fixtures/tiny-qwen3-moe",
        "--ids",
        "1,2",
        "--chunk",
        "0",
    ]);
    assert!(!ok && err.contains("1 or more"), "{err}");
}

/// `run` and `score` on DeepSeek V4 (release naming, FP8/FP4): the
/// reference greedy tokens and argmax, through the stable JSON interfaces.
#[test]
fn deepseek_v4_runs_and_scores() {
    let (p, ids, v) = greedy_run_json("tiny-dsv4", 2);
    assert_eq!(v["new_ids"], p["greedy"]);
    let (ok, out, err) = run(&[
        "score",
        "--model",
        "fixtures/tiny-dsv4",
        "--ids",
        &ids,
        "--json",
    ]);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(v["argmax"], p["argmax"]);
}

#[test]
fn stop_strings_end_generation_and_are_not_printed() {
    let args = ["run", "--max-new-tokens", "24", "--ignore-eos", "--json"];
    let (ok, out, err) = run(&args);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    let text = v["text"].as_str().unwrap().to_string();
    let chars: Vec<char> = text.chars().collect();
    assert!(chars.len() > 12, "{text:?}");
    let stop: String = chars[8..11].iter().collect();
    let want = &text[..text.find(&stop).unwrap()];
    let (ok, out, _) = run(&[
        "run",
        "--max-new-tokens",
        "24",
        "--ignore-eos",
        "--json",
        "--stop",
        &stop,
    ]);
    assert!(ok);
    let s: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(s["text"].as_str().unwrap(), want);
    assert_eq!(s["stop_reason"], "stop");
    // Streamed: the prompt, then exactly the text before the stop string.
    let (ok, out, _) = run(&[
        "run",
        "--max-new-tokens",
        "24",
        "--ignore-eos",
        "--stop",
        &stop,
    ]);
    assert!(ok);
    assert_eq!(out, format!("The old lighthouse{want}\n"));
}

/// `--chat` on DeepSeek V4 uses its own encoding, which needs its special
/// tokens: the fixture's tokenizer (shared with the other tiny models) has
/// none, and the run says so instead of splitting them into pieces.
#[test]
fn deepseek_v4_chat_needs_its_special_tokens() {
    let (ok, _, err) = run(&words("run --model fixtures/tiny-dsv4 --chat --prompt hi"));
    assert!(!ok);
    assert!(
        err.contains("chat encoding needs") && err.contains("begin▁of▁sentence"),
        "{err}"
    );
    let (ok, _, err) = run(&words("run --think --prompt hi"));
    assert!(!ok && err.contains("--chat"), "{err}");
}

/// An activation variant of DeepSeek V4's quantized matrices, `flag value`
/// (its kernels `label`): on tiny-dsv4 `score` names it under `key`, the
/// logits move a little — less than DeepSeek's FP8 activations move them —
/// and `run` says it is not token-exact; on tiny-llama, which has no such
/// weights, it changes nothing and says so.
fn check_dsv4_act_variant(flag: &str, value: &str, key: &str, label: &str) {
    let (_, ids) = ref_prompt("tiny-dsv4", 1);
    let score = |extra: &[&str]| {
        let (ok, out, err) = score_last("tiny-dsv4", &ids, extra);
        assert!(ok, "{extra:?}: {err}");
        last_logits(&out)
    };
    let (v32, l32) = score(&[]);
    let (vv, lv) = score(&[flag, value]);
    let (_, lds) = score(&["--numerics", "deepseek"]);
    assert_eq!(v32[key], "f32");
    assert_eq!(vv[key], value);
    assert!(lv.iter().all(|x| x.is_finite()));
    let (dv, dds) = (max_dist(&l32, &lv), max_dist(&l32, &lds));
    assert!(dv > 0.0, "{flag} {value} changed nothing");
    assert!(
        dv < dds,
        "{label} moved the logits by {dv}, FP8 activations by {dds}"
    );
    let two = "--max-new-tokens=2";
    let (ok, _, err) = run(&["run", "--model", "fixtures/tiny-dsv4", flag, value, two]);
    assert!(
        ok && err.contains(label) && err.contains("not token-exact"),
        "{err}"
    );
    let (ok, _, err) = run(&["run", "--model", "fixtures/tiny-llama", flag, value, two]);
    assert!(
        ok && err.contains("changes nothing")
            && !err.contains("not token-exact")
            && !err.contains(&format!("{label}:")),
        "{err}"
    );
}

/// `--fp4-act q8` (the fp4×q8 kernels for DeepSeek V4's FP4 experts): int8
/// activations, see check_dsv4_act_variant; any other value is refused.
#[test]
fn fp4_act_q8_flag() {
    check_dsv4_act_variant("--fp4-act", "q8", "fp4_act", "fp4×q8");
    let (ok, _, err) = run(&["run", "--fp4-act", "q4"]);
    assert!(!ok && err.contains("q8"), "{err}");
}

/// `--fp8-act bf16` (the fp8dot kernels for DeepSeek V4's FP8 dense
/// matrices): BF16 activations, see check_dsv4_act_variant, where the CPU
/// has AVX512_BF16; where it cannot run, a clear error.
#[test]
fn fp8_act_flag() {
    if let Err(why) = bespoke::kernels::Kernels::bf16dot_available() {
        let (_, ids) = ref_prompt("tiny-dsv4", 1);
        let (ok, _, err) = score_last("tiny-dsv4", &ids, &["--fp8-act", "bf16"]);
        assert!(
            !ok && err.contains("--fp8-act bf16 needs the fp8dot kernels") && err.contains(&why),
            "{err}"
        );
        eprintln!("fp8dot not available here ({why}): checked the error");
        return;
    }
    check_dsv4_act_variant("--fp8-act", "bf16", "fp8_act", "fp8dot");
}

/// `score` outputs with `--bf16-act f32` and with `--bf16-act act`: the
/// flag is reported, the logits move (BF16 activations) but little, and at
/// least 90 % of the greedy choices stay.
fn check_bf16_act_logits(out32: &str, out: &str, act: &str) {
    check_act_logits("bf16_act", out32, out, act)
}

/// The same for the option whose JSON key is `key` (`bf16_act`, `fp4_act`).
fn check_act_logits(key: &str, out32: &str, out: &str, act: &str) {
    let (v32, l32) = last_logits(out32);
    let (v, l) = last_logits(out);
    assert_eq!(v32[key], "f32");
    assert_eq!(v[key], act);
    assert!(l.iter().all(|x| x.is_finite()));
    let dist = max_dist(&l32, &l);
    let scale = l32.iter().map(|x| x.abs()).fold(0.0, f64::max);
    let flag = key.replace('_', "-");
    assert!(dist > 0.0, "--{flag} {act} changed nothing");
    assert!(
        dist < 0.05 * scale,
        "--{flag} {act} moved the logits by {dist} (largest |logit| {scale})"
    );
    let am = |v: &serde_json::Value| v["argmax"].as_array().unwrap().clone();
    let (a32, a) = (am(&v32), am(&v));
    let same = a32.iter().zip(&a).filter(|(x, y)| x == y).count();
    assert!(
        same * 10 >= a32.len() * 9,
        "greedy choices: {same} of {} the same",
        a32.len()
    );
}

/// `--bf16-act bf16` (the bf16dot kernels for BF16 matrices) runs where the
/// CPU has AVX512_BF16, says so, and moves the logits a little (BF16
/// activations) without changing most greedy choices; where it cannot run,
/// it is a clear error, not a silent fallback.
#[test]
fn bf16_act_flag() {
    let (_, ids) = ref_prompt("tiny-llama", 0);
    let score = |extra: &[&str]| score_last("tiny-llama", &ids, extra);
    let (ok, out32, err) = score(&[]);
    assert!(ok, "{err}");
    let (ok, out16, err) = score(&["--bf16-act", "bf16"]);
    match bespoke::kernels::Kernels::bf16dot_available() {
        Err(why) => {
            assert!(
                !ok && err.contains("--bf16-act bf16 needs the bf16dot kernels")
                    && err.contains(&why),
                "{err}"
            );
            eprintln!("bf16dot not available here ({why}): checked the error");
        }
        Ok(()) => {
            assert!(ok, "{err}");
            check_bf16_act_logits(&out32, &out16, "bf16");
            let (ok, _, err) = run(&words(
                "run --model fixtures/tiny-llama --bf16-act bf16 --max-new-tokens 2",
            ));
            assert!(
                ok && err.contains("bf16dot") && err.contains("not token-exact"),
                "{err}"
            );
        }
    }
    let (ok, _, err) = run(&["run", "--bf16-act", "f16"]);
    assert!(!ok && err.contains("bf16"), "{err}");
}

/// `--bf16-act amx` (BF16 prefill on AMX tiles) runs where the CPU has
/// AMX-BF16, says so, moves the logits a little without changing most
/// greedy choices, and leaves one-token decode as it was; where it cannot
/// run, a clear error.
#[test]
fn bf16_act_amx_flag() {
    // 19 tokens: a prefill the amx kernels take (8 or more).
    let (_, ids) = ref_prompt("tiny-llama", 1);
    let score = |extra: &[&str]| score_last("tiny-llama", &ids, extra);
    let (ok, out32, err) = score(&[]);
    assert!(ok, "{err}");
    let (ok, outx, err) = score(&["--bf16-act", "amx"]);
    match bespoke::kernels::Kernels::amx_available() {
        Err(why) => {
            assert!(
                !ok && err.contains("--bf16-act amx needs the amx kernels") && err.contains(&why),
                "{err}"
            );
            eprintln!("amx not available here ({why}): checked the error");
        }
        Ok(()) => {
            assert!(ok, "{err}");
            check_bf16_act_logits(&out32, &outx, "amx");
            let (ok, _, err) = run(&words(
                "run --model fixtures/tiny-llama --bf16-act amx --max-new-tokens 2",
            ));
            assert!(
                ok && err.contains("amx") && err.contains("not token-exact"),
                "{err}"
            );
        }
    }
}

/// `flag amx` (`--fp4-act` or `--fp8-act`: FP4 or FP8 products of 3+
/// tokens on AMX tiles) runs on DeepSeek V4 where the CPU has AMX-BF16,
/// says so (`says`) and moves the logits a little (JSON key `key`); where
/// it cannot run, a clear error.
fn check_dsv4_amx_flag(flag: &str, key: &str, says: &str) {
    let (_, ids) = ref_prompt("tiny-dsv4", 1);
    let score = |extra: &[&str]| score_last("tiny-dsv4", &ids, extra);
    let (ok, out32, err) = score(&[]);
    assert!(ok, "{err}");
    let (ok, outx, err) = score(&[flag, "amx"]);
    match bespoke::kernels::Kernels::amx_available() {
        Err(why) => {
            assert!(
                !ok && err.contains(&format!("{flag} amx needs the amx kernels"))
                    && err.contains(&why),
                "{err}"
            );
            eprintln!("amx not available here ({why}): checked the error");
        }
        Ok(()) => {
            assert!(ok, "{err}");
            let (ok, _, err) = run(&words(&format!(
                "run --model fixtures/tiny-dsv4 {flag} amx --max-new-tokens 2"
            )));
            assert!(ok && err.contains(says), "{err}");
            check_act_logits(key, &out32, &outx, "amx");
        }
    }
}

/// `--fp4-act amx`: see check_dsv4_amx_flag.
#[test]
fn fp4_act_amx_flag() {
    check_dsv4_amx_flag("--fp4-act", "fp4_act", "amx: FP4 products");
}

/// `--fp8-act amx` (DeepSeek V4's FP8 dense matrices): see
/// check_dsv4_amx_flag.
#[test]
fn fp8_act_amx_flag() {
    check_dsv4_amx_flag("--fp8-act", "fp8_act", "amx: FP8 products");
}

/// `--numerics deepseek` follows DeepSeek's inference code on DeepSeek V4
/// (FP8 activations into FP8/FP4 products): it runs, changes the logits, and
/// is refused for other families.
#[test]
fn deepseek_numerics_flag() {
    let args = |n: &str| {
        vec![
            "score",
            "--model",
            "fixtures/tiny-dsv4",
            "--ids",
            "1,17,42,99,5",
            "--json",
            "--logits",
            "last",
            "--numerics",
            n,
        ]
        .into_iter()
        .map(String::from)
        .collect::<Vec<_>>()
    };
    let get = |n: &str| {
        let a = args(n);
        let (ok, out, err) = run(&a.iter().map(String::as_str).collect::<Vec<_>>());
        assert!(ok, "{err}");
        let v: serde_json::Value = serde_json::from_str(&out).unwrap();
        v["last_logits"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap())
            .collect::<Vec<f64>>()
    };
    let (t, d) = (get("transformers"), get("deepseek"));
    assert_eq!(t.len(), d.len());
    assert!(d.iter().all(|x| x.is_finite()));
    assert!(
        t.iter().zip(&d).any(|(a, b)| a != b),
        "FP8 activations changed nothing"
    );
    let (ok, _, err) = run(&words("score --ids 1,2 --numerics deepseek"));
    assert!(!ok && err.contains("applies to DeepSeek V4"), "{err}");
}

/// `bench gpu` with no GPU (or no CUDA in the build) says why and fails.
#[test]
fn bench_gpu_without_a_gpu_says_why() {
    let out = bespoke_command()
        .args(["bench", "gpu", "--quick"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    if cfg!(feature = "cuda") && out.status.success() {
        return; // a machine with a GPU: tests/gpu.rs covers it
    }
    assert!(!out.status.success());
    let want = if cfg!(feature = "cuda") {
        "bench gpu: no NVIDIA driver library"
    } else {
        "this build has no CUDA"
    };
    assert!(err.contains(want), "{err}");
}

/// Routed-expert usage is counted and saved next to the model, and adds up
/// across runs; BESPOKE_USAGE=off leaves no file.
#[test]
fn expert_usage_is_saved_next_to_the_model() {
    let dir = common::fixture_copy("tiny-qwen3-moe", "usage-cli");
    let run = |usage_off: bool| {
        let mut c = bespoke_command();
        c.args([
            "run",
            "--model",
            dir.to_str().unwrap(),
            "--prompt-ids",
            "1,2,3,4",
            "--max-new-tokens",
            "3",
        ]);
        if usage_off {
            c.env("BESPOKE_USAGE", "off");
        }
        let out = c.output().unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stderr).to_string()
    };
    let file = dir.join(".bespoke/expert-usage.json");
    run(true);
    assert!(!file.exists());
    let err = run(false);
    assert!(err.contains("expert usage: saved to"), "{err}");
    let counts = |p: &std::path::Path| -> Vec<Vec<u64>> {
        let v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap();
        serde_json::from_value(v["counts"].clone()).unwrap()
    };
    let first = counts(&file);
    // 6 forwarded tokens (4 prompt + 2 decode steps) × top_k per MoE layer.
    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    let top_k = cfg["num_experts_per_tok"].as_u64().unwrap();
    for l in first.iter().filter(|l| !l.is_empty()) {
        assert_eq!(l.iter().sum::<u64>(), 6 * top_k, "{first:?}");
    }
    run(false);
    let second = counts(&file);
    for (a, b) in first.iter().zip(&second) {
        for (x, y) in a.iter().zip(b) {
            assert_eq!(2 * x, *y, "greedy runs route the same: counts double");
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// `bench kernels --isa` times only the variants named; `--weight-offset`
/// moves the weights off the 64-byte boundary (and is recorded); bad values
/// of either are clear errors.
#[test]
fn bench_kernels_isa_and_weight_offset() {
    let path = std::env::temp_dir().join(format!("bespoke-bench-isa-{}.json", std::process::id()));
    let p = path.to_str().unwrap();
    let (ok, _, err) = run(&[words("bench kernels --quick --threads 1 --formats fp8 --isa scalar --weight-offset 24 --fp8-subnormal 0.01 --json"), vec![p]].concat());
    assert!(ok, "{err}");
    assert!(err.contains("24 bytes past a 64-byte boundary"), "{err}");
    assert!(err.contains("0.01 of the codes subnormal"), "{err}");
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    assert_eq!(v["weight_offset"], 24);
    assert_eq!(v["fp8_subnormal"], 0.01);
    // Which ISAs' FP8 "s" tiles ran: those of AVX2 and AVX-512 that the
    // build has, each on or off.
    let scaled = v["fp8_scaled"].as_object().unwrap();
    assert!(
        scaled
            .iter()
            .all(|(isa, on)| ["avx2", "avx512"].contains(&isa.as_str()) && on.is_boolean()),
        "{scaled:?}"
    );
    let ks = v["kernels"].as_array().unwrap();
    assert!(
        !ks.is_empty() && ks.iter().all(|k| k["isa"] == "scalar"),
        "{ks:?}"
    );
    assert!(ks
        .iter()
        .all(|k| k["read_gb_per_s"].as_f64().is_some_and(|g| g > 0.0)));
    std::fs::remove_file(&path).ok();
    for (args, needle) in [
        (["--isa", "avx9"], "unknown ISA variant \"avx9\""),
        (
            ["--weight-offset", "12"],
            "--weight-offset 12: expected a multiple of 8 below 64",
        ),
        (["--weight-offset", "64"], "--weight-offset 64"),
        (
            ["--fp8-subnormal", "0.6"],
            "--fp8-subnormal 0.6: expected a fraction from 0 to 0.5",
        ),
    ] {
        let mut a = vec![
            "bench",
            "kernels",
            "--quick",
            "--threads",
            "1",
            "--formats",
            "fp8",
        ];
        a.extend_from_slice(&args);
        let (ok, _, err) = run(&a);
        assert!(!ok && err.contains(needle), "{args:?}: {err}");
    }
}

/// `bench kernels --tokens N`: the matmul kernels with N tokens per call,
/// GFLOP/s counted for all N, and each set against the compute roof of its
/// instruction measured in the same run (none for the scalar variant).
#[test]
fn bench_kernels_tokens_and_compute_roof() {
    let path =
        std::env::temp_dir().join(format!("bespoke-bench-tokens-{}.json", std::process::id()));
    let p = path.to_str().unwrap();
    let (ok, out, err) = run(&[
        words("bench kernels --quick --threads 1 --formats bf16 --tokens 3 --json"),
        vec![p],
    ]
    .concat());
    assert!(ok, "{err}");
    assert!(out.contains("% peak") && out.contains(" ×3 "), "{out}");
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    assert_eq!(v["tokens"], 3);
    let peaks = v["peaks"].as_array().unwrap();
    let ks = v["kernels"].as_array().unwrap();
    assert!(!ks.is_empty());
    let mut with_roof = 0;
    for k in ks {
        assert_eq!(k["tokens"], 3, "{k}");
        let (rows, cols) = (k["rows"].as_f64().unwrap(), k["cols"].as_f64().unwrap());
        let (us, gflop) = (
            k["median_us"].as_f64().unwrap(),
            k["gflop_per_s"].as_f64().unwrap(),
        );
        let want = 2.0 * rows * cols * 3.0 / us / 1e3;
        assert!(
            (gflop - want).abs() <= 1e-9 * want,
            "{k}: {gflop} GFLOP/s, want {want}"
        );
        let isa = k["isa"].as_str().unwrap();
        match isa {
            "scalar" => assert!(k["peak_fraction"].is_null(), "{k}"),
            _ => {
                let probe = format!("{isa} f32 fma");
                let roof = peaks
                    .iter()
                    .find(|r| r["probe"] == probe.as_str() && r["threads"] == 1)
                    .unwrap_or_else(|| panic!("no {probe} roof in {peaks:?}"));
                let g = roof["gflop_per_s"].as_f64().unwrap();
                assert!(g > 0.0, "{roof}");
                assert_eq!(k["peak_gflop_per_s"].as_f64(), Some(g), "{k}");
                let f = k["peak_fraction"].as_f64().unwrap();
                assert!((f - gflop / g).abs() <= 1e-9 * f, "{k}");
                with_roof += 1;
            }
        }
    }
    // Every x86-64 CI machine runs avx2; aarch64 ones neon.
    if cfg!(any(target_arch = "x86_64", target_arch = "aarch64")) {
        assert!(with_roof > 0, "no kernel set against a roof: {ks:?}");
    }
    let (ok, out, err) = run(&["bench", "compare", p, p]);
    assert!(ok && out.contains("×3"), "{out}{err}");
    std::fs::remove_file(&path).ok();
    for n in ["0", "1025"] {
        let (ok, _, err) = run(&["bench", "kernels", "--quick", "--tokens", n]);
        assert!(
            !ok && err.contains(&format!("--tokens {n}: expected 1")),
            "--tokens {n}: {err}"
        );
    }
}

/// A fixture's model.safetensors: its bytes, the header's length and the
/// header (data starts at 8 + that length).
fn safetensors_file(name: &str) -> (Vec<u8>, usize, serde_json::Value) {
    let file = std::fs::read(format!("fixtures/{name}/model.safetensors")).unwrap();
    let n = u64::from_le_bytes(file[..8].try_into().unwrap()) as usize;
    let header = serde_json::from_slice(&file[8..8 + n]).unwrap();
    (file, n, header)
}

/// `inspect --fp8-codes` counts the FP8 codes by kind: against a count
/// made here from the file (header, then every F8_E4M3 tensor's bytes), in
/// the JSON and the text; a model without FP8 tensors says so.
#[test]
fn inspect_counts_fp8_codes() {
    let (file, n, header) = safetensors_file("tiny-dsv4");
    let (mut tensors, mut codes, mut sub, mut zero, mut nan) = (0u64, 0u64, 0u64, 0u64, 0u64);
    for (k, t) in header.as_object().unwrap() {
        if k == "__metadata__" || t["dtype"] != "F8_E4M3" {
            continue;
        }
        tensors += 1;
        let (a, b) = (
            t["data_offsets"][0].as_u64().unwrap() as usize,
            t["data_offsets"][1].as_u64().unwrap() as usize,
        );
        for &c in &file[8 + n + a..8 + n + b] {
            codes += 1;
            match c & 0x7F {
                0 => zero += 1,
                1..=7 => sub += 1,
                0x7F => nan += 1,
                _ => {}
            }
        }
    }
    assert!(
        tensors > 0 && sub > 0,
        "the fixture has FP8 tensors with subnormal codes"
    );
    let (ok, out, err) = run(&words(
        "inspect --model fixtures/tiny-dsv4 --json --fp8-codes",
    ));
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let c = &v["fp8_codes"];
    assert_eq!(
        (
            c["tensors"].as_u64(),
            c["codes"].as_u64(),
            c["subnormal"].as_u64(),
            c["zero"].as_u64(),
            c["nan"].as_u64()
        ),
        (Some(tensors), Some(codes), Some(sub), Some(zero), Some(nan)),
        "{c}"
    );
    let (ok, out, err) = run(&words(
        "inspect --model fixtures/tiny-dsv4 --brief --fp8-codes",
    ));
    assert!(ok, "{err}");
    assert!(
        out.contains(&format!("in {tensors} tensors: {sub} subnormal")),
        "{out}"
    );
    let (ok, out, _) = run(&words(
        "inspect --model fixtures/tiny-llama --brief --fp8-codes",
    ));
    assert!(ok && out.contains("no F8_E4M3 tensor"), "{out}");
    let (_, out, _) = run(&words("inspect --model fixtures/tiny-dsv4 --json"));
    assert!(
        out.contains("\"tensors\"") && !out.contains("fp8_codes"),
        "only with --fp8-codes"
    );
}

/// `BESPOKE_FP8_SCALED=on|off` chooses the FP8 "s" tiles: the DeepSeek V4
/// fixture (FP8 attention and shared experts) writes the same text either
/// way, `plan` says which ran and why, and a bad value is a clear error.
#[test]
fn fp8_scaled_env() {
    let args = words("run --model fixtures/tiny-dsv4 --max-new-tokens 4 --threads 1");
    let mut texts = Vec::new();
    for v in ["on", "off"] {
        let (ok, out, err) = run_env(
            &args,
            &[("BESPOKE_FP8_SCALED", v), ("BESPOKE_USAGE", "off")],
        );
        assert!(ok, "{v}: {err}");
        texts.push(out);
        let (ok, out, err) = run_env(&["plan"], &[("BESPOKE_FP8_SCALED", v)]);
        assert!(ok, "{err}");
        if bespoke::kernels::COMPILED_ISAS.contains(&bespoke::plan::Isa::Avx2) {
            assert!(
                out.contains(&format!("avx2 {v}"))
                    && out.contains(&format!("BESPOKE_FP8_SCALED={v}")),
                "{out}"
            );
        }
    }
    assert_eq!(
        texts[0], texts[1],
        "the \"s\" tiles on and off must give the same text"
    );
    let (ok, _, err) = run_env(&args, &[("BESPOKE_FP8_SCALED", "maybe")]);
    assert!(!ok);
    assert!(
        err.contains("BESPOKE_FP8_SCALED=\"maybe\"") && err.contains("expected `auto`"),
        "{err}"
    );
    assert!(!err.contains("panicked"), "{err}");
}

/// `BESPOKE_SPECIALISED=off` runs every matrix on the generic kernels (the
/// same text; the banner and `plan` say so); a bad value is a clear error.
/// `bench e2e --vs-generic` times both, alternated, and writes both.
#[test]
fn specialised_off_and_bench_e2e_vs_generic() {
    let off = [("BESPOKE_SPECIALISED", "off")];
    let (ok, out, err) = run_env(&["run", "--max-new-tokens", "5"], &off);
    assert!(ok, "{err}");
    let (ok2, out2, err2) = run(&["run", "--max-new-tokens", "5"]);
    assert!(ok2, "{err2}");
    assert_eq!(
        out, out2,
        "generic and specialised kernels must give the same text"
    );
    assert!(err.contains("every matrix on the generic kernels"), "{err}");
    assert!(err2.contains("all specialised for this model"), "{err2}");
    let (ok, out, err) = run_env(&["plan", "--model", "fixtures/tiny-llama"], &off);
    assert!(ok, "{err}");
    assert!(
        out.contains("generic kernels only (BESPOKE_SPECIALISED=off)")
            && out.contains("BESPOKE_SPECIALISED=off: every matrix runs on the generic kernels"),
        "{out}"
    );
    let (ok, _, err) = run_env(
        &["run", "--max-new-tokens", "2"],
        &[("BESPOKE_SPECIALISED", "sometimes")],
    );
    assert!(!ok);
    assert!(
        err.contains("BESPOKE_SPECIALISED=\"sometimes\"") && err.contains("expected `on`"),
        "{err}"
    );
    assert!(!err.contains("panicked"), "{err}");

    let path = std::env::temp_dir().join(format!("bespoke-e2e-vsg-{}.json", std::process::id()));
    let p = path.to_str().unwrap();
    let args = [
        "bench",
        "e2e",
        "--quick",
        "--vs-generic",
        "--prompt-len",
        "40",
        "--gen",
        "4",
        "--threads",
        "2",
        "--json",
        p,
    ];
    let (ok, _, err) = run(&args);
    assert!(ok, "{err}");
    assert!(err.contains("specialised ÷ generic"), "{err}");
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let _ = std::fs::remove_file(&path);
    let (hit, total) = (
        v["specialised_matrices"][0].as_u64().unwrap(),
        v["specialised_matrices"][1].as_u64().unwrap(),
    );
    assert!(hit == total && total > 0, "{v}");
    let runs = v["runs"].as_array().unwrap();
    assert_eq!(runs.len(), 2);
    for r in runs {
        for key in ["prefill_tok_s", "decode_tok_s", "ttft_ms"] {
            assert!(r["generic"][key].as_f64().unwrap() > 0.0, "{key}: {r}");
        }
    }
    let (ok, _, err) = run_env(&args, &off);
    assert!(
        !ok && err.contains("--vs-generic") && err.contains("BESPOKE_SPECIALISED=off"),
        "{err}"
    );
}
