//! Test helpers: a deterministic generator and awkward inputs.
#![allow(dead_code)]

/// SplitMix64: deterministic, no dependency.
pub struct Rng(pub u64);

impl Rng {
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }
    /// Uniform in [-1, 1).
    pub fn unit(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
    /// An f32 activation: mostly ordinary values, sometimes zeros, -0,
    /// subnormals, large values and the largest finite ones.
    pub fn activation(&mut self) -> f32 {
        match self.below(40) {
            0 => 0.0,
            1 => -0.0,
            2 => {
                f32::from_bits(1 + self.below(0x7F_FFFF) as u32)
                    * if self.below(2) == 0 { 1.0 } else { -1.0 }
            }
            3 => self.unit() * 1e30,
            4 => f32::MIN_POSITIVE * self.unit(),
            5 => {
                if self.below(2) == 0 {
                    f32::MAX
                } else {
                    f32::MIN
                }
            }
            _ => self.unit() * 4.0,
        }
    }
    /// `n` activations, every kind of `activation`; in vectors longer than
    /// 16 the large ones (about 1e30, and the largest finite) are kept with
    /// probability 1 / 8n, so that nearly all vectors have none: one vector
    /// meets every row of a matrix, and one such value can take every
    /// output to ±inf (see `keep_extreme`).
    pub fn activations(&mut self, n: usize) -> Vec<f32> {
        (0..n)
            .map(|_| loop {
                let a = self.activation();
                if a.abs() < 1e20 || n <= 16 || self.below(8 * n as u64) == 0 {
                    break a;
                }
            })
            .collect()
    }
    /// Whether to keep a value that overflows a sum it meets (a largest
    /// finite activation or weight, a NaN code or scale, a scale of 2^127)
    /// among `n` in a row: always in rows of up to 2 (where every kind of
    /// input is wanted densely), with probability 2 / n in longer ones, so
    /// that most rows of any width meet none. Kept at the dense
    /// rate everywhere, nearly every output of a row of a hundred columns
    /// or more is ±inf or NaN, and comparing those says little about the
    /// sums.
    pub fn keep_extreme(&mut self, n: usize) -> bool {
        self.below(n.max(2) as u64) < 2
    }
    /// A UE8M0 scale byte: mostly moderate, sometimes extreme or NaN (0xFF).
    pub fn scale_byte(&mut self) -> u8 {
        match self.below(50) {
            0 => 0xFF,
            1 => 0,
            2 => 254,
            3 => 1,
            _ => 118 + self.below(16) as u8,
        }
    }
    /// A scale byte of one of `n` blocks in a row: the NaN and 2^127 ones
    /// thinned out as `keep_extreme` says.
    pub fn scale_byte_of(&mut self, n: usize) -> u8 {
        loop {
            let b = self.scale_byte();
            if (b != 0xFF && b != 254) || self.keep_extreme(n) {
                break b;
            }
        }
    }
}

/// Bitwise equality, with any NaN equal to any NaN.
pub fn same(a: f32, b: f32) -> bool {
    a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
}

/// First index where two outputs differ, with both values.
pub fn first_diff(a: &[f32], b: &[f32]) -> Option<(usize, f32, f32)> {
    assert_eq!(a.len(), b.len(), "output lengths differ");
    a.iter()
        .zip(b)
        .position(|(x, y)| !same(*x, *y))
        .map(|i| (i, a[i], b[i]))
}

// ---- Engines against the fixtures' ref.json ----

use bespoke::generate::{AnyModel, CausalLm};
use bespoke::kernels::{Kernels, COMPILED_ISAS};
use bespoke::model::ModelDir;
use bespoke::sample::argmax;
use serde_json::Value;
use std::path::Path;

/// Every committed fixture model (fixtures/, from tools/make_fixtures.py).
pub const FIXTURES: &[&str] = &[
    "tiny-llama",
    "tiny-qwen2",
    "tiny-qwen3",
    "tiny-qwen3-moe",
    "tiny-dsv4",
    "tiny-dsv4-hf",
];

/// A fixture directory, opened, with its ref.json.
pub fn fixture(name: &str) -> (ModelDir, Value) {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures")
        .join(name);
    let m = ModelDir::open(&dir).unwrap_or_else(|e| panic!("{name}: {e}"));
    let r: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("ref.json")).unwrap()).unwrap();
    (m, r)
}

/// A fresh copy of fixture `name`'s files in a temporary directory of its
/// own (`tag` and the process id name it), for a test that writes next to
/// the model (expert usage); the caller removes it.
#[allow(dead_code)] // not every test binary copies a fixture
pub fn fixture_copy(name: &str, tag: &str) -> std::path::PathBuf {
    let src = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures")
        .join(name);
    let dir = std::env::temp_dir().join(format!("bespoke-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    for e in std::fs::read_dir(&src).unwrap().flatten() {
        if e.file_type().unwrap().is_file() {
            std::fs::copy(e.path(), dir.join(e.file_name())).unwrap();
        }
    }
    dir
}

pub fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

/// Every compiled kernel variant this CPU can run.
pub fn variants() -> Vec<Kernels> {
    COMPILED_ISAS
        .iter()
        .filter_map(|&isa| Kernels::with_isa(isa).ok())
        .collect()
}

pub fn argmaxes(logits: &[f32], vocab: usize) -> Vec<u32> {
    logits.chunks_exact(vocab).map(argmax).collect()
}

/// The errors every engine gives for a cache past the context limit, a call
/// past its cache's capacity and a token id past the vocabulary (see
/// tests/engine.rs and tests/dsv4.rs). Returns the cache those calls were
/// refused on, for the caller to check that nothing was appended.
pub fn check_context_and_token_errors<M: CausalLm>(eng: &M, limit: usize) -> M::Cache {
    let e = eng.new_cache(limit + 1).err().unwrap().to_string();
    assert!(
        e.contains(&format!("{}", limit + 1)) && e.contains("max_position_embeddings"),
        "{e}"
    );
    let mut c = eng.new_cache(4).unwrap();
    let e = eng
        .prefill(&mut c, &[1, 2, 3, 4, 5], 256, false)
        .unwrap_err()
        .to_string();
    assert!(e.contains("5 tokens"), "{e}");
    let e = eng
        .prefill(&mut c, &[9999], 256, false)
        .unwrap_err()
        .to_string();
    assert!(e.contains("9999") && e.contains("vocab"), "{e}");
    c
}

/// Token-exact checks of one fixture against its ref.json, for every kernel
/// variant this CPU runs (see tests/engine.rs and tests/dsv4.rs).
pub fn check_model(name: &str) {
    let (m, r) = fixture(name);
    let n_new = r["greedy_new_tokens"].as_u64().unwrap() as usize;
    let ks = variants();
    assert!(!ks.is_empty(), "no kernel variant runs on this CPU");
    for k in ks {
        #[allow(unused_mut)]
        let mut eng = AnyModel::load(&m, k).unwrap();
        // tools/gpu-check.sh: the same oracle checks with the weights in VRAM.
        #[cfg(feature = "cuda")]
        if let Ok(v) = std::env::var("BESPOKE_TEST_VRAM") {
            let line = bespoke::gpu::place_model(
                &mut eng,
                Some(v.parse().expect("BESPOKE_TEST_VRAM: GiB")),
            )
            .expect("VRAM tier");
            eprintln!("{name}: {}", line.unwrap_or_default());
        }
        assert!(
            eng.weights_in_place(),
            "{name}: weights must be read from the mapping"
        );
        let vocab = CausalLm::vocab(&eng);
        for (pi, p) in r["prompts"].as_array().unwrap().iter().enumerate() {
            let what = format!("{name} / {} / {}", k.isa(), p["name"]);
            let prompt = ids(&p["ids"]);
            let mut cache = CausalLm::new_cache(&eng, prompt.len() + n_new).unwrap();
            // With the VRAM tier, attention runs on the GPU too, and so do
            // DeepSeek V4's indexers.
            #[cfg(feature = "cuda")]
            if std::env::var("BESPOKE_TEST_VRAM").is_ok() {
                assert!(cache.attention_on_gpu(), "{what}: attention on the GPU");
                assert_eq!(
                    cache.indexer_on_gpu(),
                    name.contains("dsv4").then_some(true),
                    "{what}: the indexers on the GPU"
                );
            }
            // Teacher forcing, prefill in 64-token chunks (the long prompt crosses one).
            let logits = CausalLm::prefill(&eng, &mut cache, &prompt, 64, true).unwrap();
            assert_eq!(
                argmaxes(&logits, vocab),
                ids(&p["argmax"]),
                "{what}: teacher-forcing argmax"
            );
            if pi == 0 {
                let want: Vec<f32> = r["last_logits"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|v| v.as_f64().unwrap() as f32)
                    .collect();
                let got = &logits[logits.len() - vocab..];
                let diff = got
                    .iter()
                    .zip(&want)
                    .map(|(a, b)| (a - b).abs())
                    .fold(0.0f32, f32::max);
                assert!(
                    diff < 2e-3,
                    "{what}: last logits differ from transformers by {diff}"
                );
            }
            // Greedy decode through the cache, one token per forward.
            let mut next = argmax(&logits[logits.len() - vocab..]);
            let mut out = vec![next];
            let mut last = Vec::new();
            while out.len() < n_new {
                last = CausalLm::prefill(&eng, &mut cache, &[next], 1, false).unwrap();
                next = argmax(&last);
                out.push(next);
            }
            assert_eq!(out, ids(&p["greedy"]), "{what}: greedy tokens");
            // The CPU's copy of the cache is whole after steps on the GPU (a
            // dense model's come back from a forward with every layer there):
            // the prompt and two tokens on the GPU, the rest on the CPU, give
            // the same tokens and logits within 1e-3.
            #[cfg(feature = "cuda")]
            if std::env::var("BESPOKE_TEST_VRAM").is_ok() {
                let mut half = CausalLm::new_cache(&eng, prompt.len() + n_new).unwrap();
                let mut l = CausalLm::prefill(&eng, &mut half, &prompt, 64, false).unwrap();
                let mut next = argmax(&l);
                let mut got = vec![next];
                while got.len() < n_new {
                    if got.len() == 3 {
                        assert!(half.attention_on_gpu(), "{what}: attention on the GPU");
                        half.detach_gpu();
                    }
                    l = CausalLm::prefill(&eng, &mut half, &[next], 1, false).unwrap();
                    next = argmax(&l);
                    got.push(next);
                }
                assert!(
                    !half.attention_on_gpu(),
                    "{what}: attention back on the CPU"
                );
                assert_eq!(got, out, "{what}: greedy tokens, the GPU then the CPU");
                let dist = l
                    .iter()
                    .zip(&last)
                    .map(|(a, b)| (a - b).abs())
                    .fold(0.0f32, f32::max);
                assert!(
                    dist < 1e-3,
                    "{what}: the GPU then the CPU moved the last logits by {dist}"
                );
            }
            // The cached decode's last logits equal a full recompute, bit for
            // bit, with the prefill in odd-sized chunks (windows, compressor
            // windows and chunk edges all fall differently).
            let mut all = prompt.clone();
            all.extend_from_slice(&out[..n_new - 1]);
            let mut fresh = CausalLm::new_cache(&eng, all.len()).unwrap();
            // Both caches' attention where the other's is (the tier's KV room
            // holds the two small fixture sequences), and no GPU call failed
            // (a failure sends attention back to the CPU).
            #[cfg(feature = "cuda")]
            if std::env::var("BESPOKE_TEST_VRAM").is_ok() {
                assert_eq!(
                    (cache.attention_on_gpu(), fresh.attention_on_gpu()),
                    (true, true),
                    "{what}: attention on the GPU after the decode, and for the recompute"
                );
                assert_eq!(
                    fresh.indexer_on_gpu(),
                    cache.indexer_on_gpu(),
                    "{what}: the recompute's indexers where the decode's are"
                );
            }
            let full = CausalLm::prefill(&eng, &mut fresh, &all, 7, false).unwrap();
            assert_eq!(
                full, last,
                "{what}: cached decode differs from a full recompute"
            );
        }
        // With every matrix resident, a Llama-family model's forwards ran
        // with every layer on the GPU (an MoE model's experts too), and
        // DeepSeek V4's SwiGLU blocks (experts, shared experts) ran whole
        // there.
        #[cfg(feature = "cuda")]
        if std::env::var("BESPOKE_TEST_VRAM").is_ok() {
            let whole = bespoke::gpu::tier::whole_layers(eng.kernels().tier());
            let ran = bespoke::gpu::tier::ffn_blocks(eng.kernels().tier());
            if !name.contains("dsv4") {
                assert!(
                    whole > 0 && (ran > 0 || !name.contains("moe")),
                    "{name} / {}: {whole} layers ran whole on the GPU, {ran} experts there",
                    k.isa()
                );
                eprintln!(
                    "{name} / {}: {whole} layers run whole on the GPU, {ran} experts there",
                    k.isa()
                );
                continue;
            }
            assert_eq!(
                whole, 0,
                "{name}: a forward of layers the GPU cannot run whole"
            );
            assert!(
                ran > 0,
                "{name} / {}: no SwiGLU block ran whole on the GPU",
                k.isa()
            );
            // And products that share their input (q, k, v; DeepSeek V4's
            // projections of the attention input) went queued together.
            let shared = bespoke::gpu::tier::product_batches(eng.kernels().tier());
            assert!(
                shared > 0,
                "{name} / {}: no products queued together",
                k.isa()
            );
            eprintln!(
                "{name} / {}: {ran} SwiGLU blocks whole on the GPU, {shared} batches of products queued together",
                k.isa()
            );
        }
    }
}

/// The `bespoke` binary as a command. Under emulation (a cross build's tests
/// run by qemu-user) the binary is started through BESPOKE_TEST_RUNNER, e.g.
/// `qemu-aarch64 -L /usr/aarch64-linux-gnu`: the emulator does not follow
/// exec into a foreign binary by itself.
pub fn bespoke_command() -> std::process::Command {
    let bin = env!("CARGO_BIN_EXE_bespoke");
    match std::env::var("BESPOKE_TEST_RUNNER") {
        Ok(r) if !r.trim().is_empty() => {
            let mut parts = r.split_whitespace();
            let mut c = std::process::Command::new(parts.next().unwrap());
            c.args(parts).arg(bin);
            c
        }
        _ => std::process::Command::new(bin),
    }
}
