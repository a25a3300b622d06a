//! The Llama / Qwen3 / Qwen3-MoE engine against transformers (fixtures'
//! ref.json): teacher-forcing argmax at every position and 24 greedy tokens,
//! for every kernel variant this CPU runs; chunked prefill and KV-cache
//! decode equal to a full recompute.

mod common;

use bespoke::engine::llama::LlamaModel;
use bespoke::kernels::Kernels;
use bespoke::model::ModelDir;
use common::{check_context_and_token_errors, check_model, fixture};
use serde_json::Value;
use std::path::Path;

#[test]
fn tiny_llama_matches_transformers() {
    check_model("tiny-llama");
}

#[test]
fn tiny_qwen2_matches_transformers() {
    // q/k/v biases and YaRN RoPE scaling.
    check_model("tiny-qwen2");
}

#[test]
fn tiny_qwen3_matches_transformers() {
    check_model("tiny-qwen3");
}

#[test]
fn tiny_qwen3_moe_matches_transformers() {
    check_model("tiny-qwen3-moe");
}

#[test]
fn context_and_token_errors() {
    let (m, _) = fixture("tiny-llama");
    let eng = LlamaModel::new(&m, Kernels::best()).unwrap();
    let c = check_context_and_token_errors(&eng, m.config.max_position_embeddings);
    // Nothing was appended by the refused calls.
    assert_eq!(c.len, 0);
}

/// RoPE frequencies for every scaling variant, against transformers
/// (fixtures/rope_cases.json from tools/make_rope_cases.py).
#[test]
fn rope_scaling_matches_transformers() {
    use bespoke::engine::Rope;
    use bespoke::plan::ModelConfig;
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/rope_cases.json");
    let cases: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    for c in cases["cases"].as_array().unwrap() {
        let hd = c["head_dim"].as_u64().unwrap() as usize;
        let cfg = serde_json::json!({
            "model_type": "llama", "hidden_size": hd * 4, "num_attention_heads": 4, "head_dim": hd,
            "max_position_embeddings": c["max_position_embeddings"], "rope_parameters": c["rope_parameters"],
        });
        let cfg = ModelConfig::from_json("rope case", &cfg).unwrap();
        let rope = Rope::new(
            hd,
            cfg.rope_theta,
            &cfg.rope_scaling,
            cfg.max_position_embeddings,
        );
        let want: Vec<f64> = c["inv_freq"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_f64().unwrap())
            .collect();
        assert_eq!(rope.inv_freq.len(), want.len(), "{}", c["name"]);
        for (i, (&got, &w)) in rope.inv_freq.iter().zip(&want).enumerate() {
            let rel = ((got as f64 - w) / w).abs();
            assert!(
                rel < 2e-6,
                "{}: inv_freq[{i}] = {got}, transformers {w}",
                c["name"]
            );
        }
        let s = c["attention_scaling"].as_f64().unwrap();
        assert!(
            (rope.attention_scaling as f64 - s).abs() < 1e-6,
            "{}: attention scaling {} vs {s}",
            c["name"],
            rope.attention_scaling
        );
    }
}

/// A real checkpoint, when `BESPOKE_TEST_MODEL_DIR` names one (e.g.
/// SmolLM2-135M or Qwen3-0.6B): greedy text from a factual prompt must hold
/// the known continuation. `BESPOKE_TEST_PROMPT` / `BESPOKE_TEST_EXPECT`
/// override the prompt ("The capital of France is") and the expected text
/// ("Paris"). Without the variable there is nothing to run (CI has no
/// model hub), and the test says so.
#[test]
fn real_checkpoint_is_coherent() {
    let Some(dir) = std::env::var_os("BESPOKE_TEST_MODEL_DIR") else {
        eprintln!("BESPOKE_TEST_MODEL_DIR is not set: no real checkpoint to run");
        return;
    };
    let prompt =
        std::env::var("BESPOKE_TEST_PROMPT").unwrap_or_else(|_| "The capital of France is".into());
    let expect = std::env::var("BESPOKE_TEST_EXPECT").unwrap_or_else(|_| "Paris".into());
    let m = ModelDir::open(Path::new(&dir)).unwrap();
    let tok = m
        .tokenizer
        .as_ref()
        .expect("the checkpoint's tokenizer.json");
    let eng = LlamaModel::new(&m, Kernels::best()).unwrap();
    let ids = tok.encode(&prompt, true).unwrap();
    let opts = bespoke::generate::GenOptions {
        max_new_tokens: 16,
        sampling: bespoke::sample::SamplingParams::greedy(),
        ignore_eos: false,
        stop: Vec::new(),
        chunk: 64,
        eos: bespoke::generate::eos_ids(&m),
    };
    let g = bespoke::generate::generate(&eng, Some(tok), &ids, &opts, |_| {}).unwrap();
    eprintln!("{prompt}{}", g.text);
    assert!(
        g.text.contains(&expect),
        "expected {expect:?} in the continuation of {prompt:?}: {:?}",
        g.text
    );
}

/// `BESPOKE_SPECIALISED=off` / `bench e2e --vs-generic`: the generic
/// kernels give the specialised ones' logits bit for bit, whole model,
/// prefill (matmul, several steps) and decode (matvec, attention), for every
/// variant this CPU runs and the fp4×q8 / bf16dot / fp8dot activations
/// where they apply (the numerics contract: a kernel's shape is only a constant).
#[test]
fn generic_kernels_give_the_specialised_logits_bit_for_bit() {
    use bespoke::bf16act::Bf16Act;
    use bespoke::generate::{AnyModel, CausalLm};
    use bespoke::q8::Fp4Act;
    for name in ["tiny-llama", "tiny-qwen3-moe", "tiny-dsv4"] {
        let (m, r) = fixture(name);
        let prompt = common::ids(&r["prompts"][0]["ids"]);
        for base in common::variants() {
            let mut ks = vec![base];
            if name == "tiny-dsv4" {
                ks.push(base.with_fp4_act(Fp4Act::Q8).unwrap());
                ks.extend(base.with_fp8_act(Bf16Act::Bf16));
            } else if let Ok(k) = base.with_bf16_act(Bf16Act::Bf16) {
                ks.push(k);
            }
            for k in ks {
                let what = format!(
                    "{name} / {} / {:?} / {:?} / fp8 {:?}",
                    k.isa(),
                    k.fp4_act(),
                    k.bf16_act(),
                    k.fp8_act()
                );
                let (hit, total) = bespoke::commands::specialisation(&m, &k);
                assert!(
                    hit > 0,
                    "{what}: none of {total} matrices specialised (the default BESPOKE_MODEL plans the fixtures)"
                );
                let (off, _) = bespoke::commands::specialisation(&m, &k.with_specialised(false));
                assert_eq!(off, 0, "{what}");
                let logits = |spec: bool| {
                    let mut eng = AnyModel::load(&m, k).unwrap();
                    eng.set_specialised(spec);
                    let mut cache = CausalLm::new_cache(&eng, prompt.len() + 3).unwrap();
                    let mut all = CausalLm::prefill(&eng, &mut cache, &prompt, 5, true).unwrap();
                    for t in [3, 17, 42] {
                        all.extend(CausalLm::prefill(&eng, &mut cache, &[t], 1, false).unwrap());
                    }
                    all
                };
                let (a, b) = (logits(true), logits(false));
                assert_eq!(a.len(), b.len(), "{what}");
                let differ = a
                    .iter()
                    .zip(&b)
                    .filter(|(x, y)| x.to_bits() != y.to_bits())
                    .count();
                assert_eq!(differ, 0, "{what}: {differ} of {} logits differ", a.len());
            }
        }
    }
}

/// The prefill step when `--chunk` is not given: 256, or 1024 where a MoE
/// model's routed experts run on the amx kernels (their weights are decoded
/// once a step for the few tokens routed to each, so longer steps share
/// that work); dense models, and MoE models whose experts stay on the f32
/// kernels, keep 256 whatever else runs on amx.
#[test]
fn default_prefill_chunk() {
    use bespoke::bf16act::Bf16Act;
    use bespoke::generate::{AnyModel, AMX_MOE_CHUNK, DEFAULT_CHUNK};
    use bespoke::plan::Format;
    use bespoke::q8::Fp4Act;
    let best = Kernels::best();
    // (kernels, what): every amx option alone, where this CPU has AMX
    let mut amx: Vec<(Kernels, Format)> = Vec::new();
    match Kernels::amx_available() {
        Ok(()) => {
            amx.push((best.with_bf16_act(Bf16Act::Amx).unwrap(), Format::Bf16));
            amx.push((best.with_fp8_act(Bf16Act::Amx).unwrap(), Format::Fp8));
            amx.push((best.with_fp4_act(Fp4Act::Amx).unwrap(), Format::Fp4));
        }
        Err(why) => eprintln!("amx not available here ({why}): only the f32 defaults checked"),
    }
    for (name, experts) in [
        ("tiny-llama", None),
        ("tiny-qwen3-moe", Some(Format::Bf16)),
        ("tiny-dsv4", Some(Format::Fp4)),
    ] {
        let (m, _) = fixture(name);
        let eng = AnyModel::load(&m, best).unwrap();
        assert_eq!(eng.expert_format(), experts, "{name}");
        assert_eq!(eng.default_chunk(), DEFAULT_CHUNK, "{name}, f32 kernels");
        for &(k, on) in &amx {
            let eng = AnyModel::load(&m, k).unwrap();
            let want = if experts == Some(on) {
                AMX_MOE_CHUNK
            } else {
                DEFAULT_CHUNK
            };
            assert_eq!(eng.default_chunk(), want, "{name}, {} on amx", on.name());
        }
    }
}
