//! The Llama / Qwen3 / Qwen3-MoE engine against transformers (fixtures'
//! ref.json): teacher-forcing argmax at every position and 24 greedy tokens,
//! for every kernel variant this CPU runs; chunked prefill and KV-cache
//! decode equal to a full recompute.

use bespoke::engine::llama::LlamaModel;
use bespoke::kernels::{Kernels, COMPILED_ISAS};
use bespoke::model::ModelDir;
use bespoke::sample::argmax;
use serde_json::Value;
use std::path::Path;

fn fixture(name: &str) -> (ModelDir, Value) {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures").join(name);
    let m = ModelDir::open(&dir).unwrap_or_else(|e| panic!("{name}: {e}"));
    let r: Value = serde_json::from_str(&std::fs::read_to_string(dir.join("ref.json")).unwrap()).unwrap();
    (m, r)
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

/// Every compiled variant this CPU can run (BESPOKE_KERNELS is not consulted:
/// the loop covers them all).
fn variants() -> Vec<Kernels> {
    COMPILED_ISAS.iter().filter_map(|&isa| Kernels::with_isa(isa).ok()).collect()
}

fn argmaxes(logits: &[f32], vocab: usize) -> Vec<u32> {
    logits.chunks_exact(vocab).map(argmax).collect()
}

fn check_model(name: &str) {
    let (m, r) = fixture(name);
    let n_new = r["greedy_new_tokens"].as_u64().unwrap() as usize;
    for k in variants() {
        let eng = LlamaModel::new(&m, k).unwrap();
        assert!(eng.weights_in_place(), "{name}: weights must be read from the mapping");
        let vocab = eng.vocab();
        for (pi, p) in r["prompts"].as_array().unwrap().iter().enumerate() {
            let what = format!("{name} / {} / {}", k.isa(), p["name"]);
            let prompt = ids(&p["ids"]);
            let mut cache = eng.new_cache(prompt.len() + n_new).unwrap();
            // Teacher forcing, prefill in 64-token chunks (the long prompt crosses one).
            let logits = eng.prefill(&mut cache, &prompt, 64, true).unwrap();
            assert_eq!(argmaxes(&logits, vocab), ids(&p["argmax"]), "{what}: teacher-forcing argmax");
            if pi == 0 {
                let want: Vec<f32> = r["last_logits"].as_array().unwrap().iter().map(|v| v.as_f64().unwrap() as f32).collect();
                let got = &logits[logits.len() - vocab..];
                let diff = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
                assert!(diff < 2e-3, "{what}: last logits differ from transformers by {diff}");
            }
            // Greedy decode through the KV cache.
            let mut next = argmax(&logits[logits.len() - vocab..]);
            let mut out = vec![next];
            let mut last = Vec::new();
            while out.len() < n_new {
                last = eng.forward(&mut cache, &[next], false).unwrap();
                next = argmax(&last);
                out.push(next);
            }
            assert_eq!(out, ids(&p["greedy"]), "{what}: greedy tokens");
            // The cached decode's last logits equal a full recompute, bit for
            // bit, with the prefill in odd-sized chunks.
            let mut all = prompt.clone();
            all.extend_from_slice(&out[..n_new - 1]);
            let mut fresh = eng.new_cache(all.len()).unwrap();
            let full = eng.prefill(&mut fresh, &all, 7, false).unwrap();
            assert_eq!(full, last, "{what}: KV-cache decode differs from a full recompute");
        }
    }
}

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
    let limit = m.config.max_position_embeddings;
    let e = eng.new_cache(limit + 1).err().unwrap().to_string();
    assert!(e.contains(&format!("{}", limit + 1)) && e.contains("max_position_embeddings"), "{e}");
    let mut c = eng.new_cache(4).unwrap();
    let e = eng.forward(&mut c, &[1, 2, 3, 4, 5], false).unwrap_err().to_string();
    assert!(e.contains("5 tokens"), "{e}");
    let e = eng.forward(&mut c, &[9999], false).unwrap_err().to_string();
    assert!(e.contains("9999") && e.contains("vocab"), "{e}");
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
        let rope = Rope::new(hd, cfg.rope_theta, &cfg.rope_scaling, cfg.max_position_embeddings);
        let want: Vec<f64> = c["inv_freq"].as_array().unwrap().iter().map(|v| v.as_f64().unwrap()).collect();
        assert_eq!(rope.inv_freq.len(), want.len(), "{}", c["name"]);
        for (i, (&got, &w)) in rope.inv_freq.iter().zip(&want).enumerate() {
            let rel = ((got as f64 - w) / w).abs();
            assert!(rel < 2e-6, "{}: inv_freq[{i}] = {got}, transformers {w}", c["name"]);
        }
        let s = c["attention_scaling"].as_f64().unwrap();
        assert!((rope.attention_scaling as f64 - s).abs() < 1e-6, "{}: attention scaling {} vs {s}", c["name"], rope.attention_scaling);
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
    let prompt = std::env::var("BESPOKE_TEST_PROMPT").unwrap_or_else(|_| "The capital of France is".into());
    let expect = std::env::var("BESPOKE_TEST_EXPECT").unwrap_or_else(|_| "Paris".into());
    let m = ModelDir::open(Path::new(&dir)).unwrap();
    let tok = m.tokenizer.as_ref().expect("the checkpoint's tokenizer.json");
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
    assert!(g.text.contains(&expect), "expected {expect:?} in the continuation of {prompt:?}: {:?}", g.text);
}
