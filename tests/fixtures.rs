//! The committed tiny reference models (fixtures/, built by
//! tools/make_fixtures.py with transformers): each loads, validates, is read
//! in place from the mapping, and its tokenizer reproduces transformers' ids
//! and chat template.

use bespoke::model::layout::{self, Naming};
use bespoke::model::ModelDir;
use bespoke::tokenizer::ChatMessage;
use serde_json::Value;
use std::path::{Path, PathBuf};

mod common;
use common::FIXTURES as MODELS;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures")
        .join(name)
}

fn json(path: &Path) -> Value {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn open(name: &str) -> ModelDir {
    ModelDir::open(&fixture(name)).unwrap_or_else(|e| panic!("fixture {name}: {e}"))
}

#[test]
fn every_fixture_loads_and_validates() {
    for name in MODELS {
        let m = open(name);
        // Only DeepSeek V4's MTP block (which the release ships and bespoke
        // does not run) may be left over.
        let unknown: Vec<&str> = m
            .unused()
            .into_iter()
            .filter(|n| !n.starts_with("mtp."))
            .collect();
        assert!(
            unknown.is_empty(),
            "{name}: tensors the layout does not know: {unknown:?}"
        );
        assert!(m.tokenizer.is_some(), "{name}: tokenizer.json");
        let families = [
            ("tiny-llama", "llama"),
            ("tiny-qwen2", "llama"),
            ("tiny-qwen3", "qwen3"),
            ("tiny-qwen3-moe", "qwen3_moe"),
            ("tiny-dsv4", "deepseek_v4"),
            ("tiny-dsv4-hf", "deepseek_v4"),
        ];
        let want = families.iter().find(|(n, _)| n == name).unwrap().1;
        assert_eq!(m.config.family.name(), want, "{name}");
    }
}

#[test]
fn weights_are_views_into_the_mapping() {
    for name in MODELS {
        let m = open(name);
        let mut borrowed = 0;
        for t in m.weights.names() {
            let v = m.weights.get(t).unwrap();
            assert!(
                m.weights.is_mapped(v.bytes),
                "{name}: {t} is not inside the file mapping"
            );
            if v.dtype().size() == 2 && v.is_aligned() {
                let s = v.u16s().unwrap();
                assert!(matches!(s, std::borrow::Cow::Borrowed(_)));
                borrowed += 1;
            }
        }
        assert!(borrowed > 0, "{name}: no 16-bit tensor was read in place");
    }
}

#[test]
fn dsv4_fixtures_cover_both_namings_and_all_attention_kinds() {
    let rel = open("tiny-dsv4");
    let hf = open("tiny-dsv4-hf");
    assert_eq!(rel.naming, Naming::Dsv4Release);
    assert_eq!(hf.naming, Naming::Hf);
    let v = rel.config.dsv4.as_ref().unwrap();
    assert!(
        v.fp8_dense && v.fp4_experts,
        "tiny-dsv4 is quantized like the release"
    );
    let kinds: Vec<_> = (0..rel.config.num_layers)
        .map(|l| layout::dsv4_attn_kind(v, l))
        .collect();
    for k in [
        layout::AttnKind::Sliding,
        layout::AttnKind::Csa,
        layout::AttnKind::Hca,
    ] {
        assert!(
            kinds.contains(&k),
            "tiny-dsv4 has no {k:?} layer: {kinds:?}"
        );
    }
    assert!(v.num_hash_layers >= 1 && v.num_hash_layers < rel.config.num_layers);
    assert!(v.index_n_heads >= 8);
    // Every release name (experts aside: fused in transformers; scales aside:
    // the HF fixture is unquantized) names a tensor of the HF fixture.
    let vh = hf.config.dsv4.as_ref().unwrap();
    assert_eq!(v.compress_ratios, vh.compress_ratios);
    let mut mapped = 0;
    for x in &rel.expected {
        if x.name.contains(".experts.") || x.name.ends_with(".scale") {
            continue;
        }
        let h = layout::dsv4_release_to_hf(&x.name);
        let t = hf
            .weights
            .get(&h)
            .unwrap_or_else(|| panic!("{} maps to {h}, absent from tiny-dsv4-hf", x.name));
        let r = rel.weights.get(&x.name).unwrap();
        assert_eq!(t.shape(), r.shape(), "{} / {h}", x.name);
        mapped += 1;
    }
    assert!(mapped > 50);
    // FP4 experts: I8 [out, in/2] + E8M0 [out, in/32].
    let w = rel.weights.get("layers.0.ffn.experts.0.w1.weight").unwrap();
    let s = rel.weights.get("layers.0.ffn.experts.0.w1.scale").unwrap();
    let (i, d) = (
        rel.config.moe.as_ref().unwrap().moe_intermediate_size,
        rel.config.hidden_size,
    );
    assert_eq!(w.shape(), &[i, d / 2]);
    assert_eq!(s.shape(), &[i, d / 32]);
}

#[test]
fn tokenizers_match_transformers() {
    let cases = json(&fixture("tokenizer_cases.json"));
    for name in MODELS {
        let m = open(name);
        let tok = m.tokenizer.as_ref().unwrap();
        // The reference prompts: ids exactly as transformers encoded them.
        let r = json(&fixture(name).join("ref.json"));
        for p in r["prompts"].as_array().unwrap() {
            let text = p["text"].as_str().unwrap();
            let ids = common::ids(&p["ids"]);
            assert_eq!(
                tok.encode(text, true).unwrap(),
                ids,
                "{name}: ids of {text:?}"
            );
        }
        // Round trips and the plain-encoding cases.
        for c in cases["cases"].as_array().unwrap() {
            let text = c["text"].as_str().unwrap();
            let ids = common::ids(&c["ids"]);
            assert_eq!(
                tok.encode(text, false).unwrap(),
                ids,
                "{name}: ids of {text:?}"
            );
            assert_eq!(
                tok.decode(&ids, false).unwrap(),
                text,
                "{name}: round trip of {text:?}"
            );
        }
        let chat = &cases["chat"];
        let messages: Vec<ChatMessage> = serde_json::from_value(chat["messages"].clone()).unwrap();
        let rendered = tok
            .apply_chat_template(&messages, chat["add_generation_prompt"].as_bool().unwrap())
            .unwrap();
        assert_eq!(
            rendered,
            chat["rendered"].as_str().unwrap(),
            "{name}: chat template"
        );
    }
}

/// DeepSeek V4's chat encoding through a tokenizer that has its special
/// tokens (the fixture's tokenizer plus DeepSeek V4's six special strings as
/// added tokens): every special string is one token, and the ids decode back
/// to the rendered prompt. The fixture's own tokenizer lacks them, and that
/// is refused by name.
#[test]
fn deepseek_v4_chat_encoding_tokenizes_its_special_tokens() {
    use bespoke::chat;
    use bespoke::tokenizer::Tokenizer;
    let src = fixture("tiny-dsv4");
    let msgs = [
        ChatMessage::new("system", "Be brief."),
        ChatMessage::new("user", "The old lighthouse"),
    ];
    let plain = Tokenizer::load(&src).unwrap();
    let err = chat::deepseek_v4_ids(&plain, &msgs, false).unwrap_err();
    assert!(
        err.contains(chat::DSV4_BOS) && err.contains("one token"),
        "{err}"
    );

    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("dsv4-chat-tokenizer");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let mut tj = json(&src.join("tokenizer.json"));
    let specials = [
        chat::DSV4_BOS,
        chat::DSV4_EOS,
        chat::DSV4_USER,
        chat::DSV4_ASSISTANT,
        chat::THINK_OPEN,
        chat::THINK_CLOSE,
    ];
    let base = plain.vocab_size() as u64;
    let added = tj["added_tokens"].as_array_mut().unwrap();
    for (i, s) in specials.iter().enumerate() {
        added.push(
            serde_json::json!({"id": base + i as u64, "content": s, "single_word": false,
            "lstrip": false, "rstrip": false, "normalized": false, "special": true}),
        );
    }
    std::fs::write(dir.join("tokenizer.json"), tj.to_string()).unwrap();
    let tok = Tokenizer::load(&dir).unwrap();
    let id = |s: &str| tok.token_to_id(s).unwrap();
    for thinking in [false, true] {
        let ids = chat::deepseek_v4_ids(&tok, &msgs, thinking).unwrap();
        let text = chat::deepseek_v4(&msgs, thinking).unwrap();
        let open = if thinking {
            chat::THINK_OPEN
        } else {
            chat::THINK_CLOSE
        };
        assert_eq!(ids[0], id(chat::DSV4_BOS));
        assert_eq!(ids[ids.len() - 2..], [id(chat::DSV4_ASSISTANT), id(open)]);
        assert_eq!(ids.iter().filter(|&&t| t == id(chat::DSV4_USER)).count(), 1);
        assert_eq!(tok.decode(&ids, false).unwrap(), text);
    }
}
