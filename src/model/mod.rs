//! A Hugging Face-style model directory: config.json (+ generation_config.json),
//! memory-mapped safetensors (single file or sharded with an index), the
//! tokenizer. [`ModelDir::open`] validates all of it — every tensor the
//! family needs, by name, dtype and shape — before any compute starts.

pub mod layout;
pub mod store;

use crate::plan::config::{Family, ModelConfig};
use crate::plan::json::{ConfigError, Fields};
use crate::safetensors::{Dtype, FileError};
use crate::tokenizer::{Tokenizer, TokenizerError};
use layout::{Expected, Kind, Naming};
use serde_json::Value;
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
pub use store::WeightStore;

/// Everything that can be wrong with a model directory.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("{} is not a directory (pass the model directory that holds config.json and the .safetensors files)", .0.display())]
    NotADirectory(PathBuf),
    #[error("cannot read {}: {source}", path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{0}")]
    Config(#[from] ConfigError),
    #[error("{0}")]
    Safetensors(#[from] FileError),
    #[error("{}: {message}", path.display())]
    Index { path: PathBuf, message: String },
    #[error("{}: shard {} is missing ({tensors} tensors are listed in it)", index.display(), shard.display())]
    MissingShard {
        index: PathBuf,
        shard: PathBuf,
        tensors: usize,
    },
    #[error("no weights in {}: expected model.safetensors, model.safetensors.index.json with its shards, or *.safetensors files", dir.display())]
    NoWeights { dir: PathBuf },
    #[error("tensor {name:?} is in both {} and {}", first.display(), second.display())]
    DuplicateTensor {
        name: String,
        first: PathBuf,
        second: PathBuf,
    },
    #[error("{what}")]
    Naming { what: String },
    #[error("tensor {name:?} is missing: expected {expected}{}", more_note(*more))]
    MissingTensor {
        name: String,
        expected: String,
        more: usize,
    },
    #[error("tensor {name:?}: expected {expected}, found {found}{}", more_note(*more))]
    TensorMismatch {
        name: String,
        expected: String,
        found: String,
        more: usize,
    },
    #[error("{0}")]
    Tokenizer(#[from] TokenizerError),
}

fn more_note(more: usize) -> String {
    match more {
        0 => String::new(),
        n => format!(" (and {n} more tensor problems)"),
    }
}

/// Sampling defaults from generation_config.json.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct GenerationConfig {
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
    pub pad_token_id: Option<u32>,
    pub do_sample: Option<bool>,
    pub temperature: Option<f64>,
    pub top_k: Option<usize>,
    pub top_p: Option<f64>,
    pub repetition_penalty: Option<f64>,
    pub max_new_tokens: Option<usize>,
}

impl GenerationConfig {
    pub fn from_json_str(
        source: &str,
        text: &str,
        vocab: usize,
    ) -> Result<GenerationConfig, ConfigError> {
        let root = parse_json(source, text)?;
        let f = Fields::new(source, &root)?;
        let single = |field: &str| -> Result<Option<u32>, ConfigError> {
            Ok(f.token_ids(field, vocab)?.first().copied())
        };
        Ok(GenerationConfig {
            bos_token_id: single("bos_token_id")?,
            eos_token_ids: f.token_ids("eos_token_id", vocab)?,
            pad_token_id: single("pad_token_id")?,
            do_sample: match f.get("do_sample") {
                None => None,
                Some(_) => Some(f.boolean("do_sample", false)?),
            },
            temperature: f.opt_float("temperature", 0.0, 1e6)?,
            top_k: f.opt_usize("top_k", 0, 1 << 31)?,
            top_p: f.opt_float("top_p", 0.0, 1.0)?,
            repetition_penalty: f.opt_float("repetition_penalty", 1e-6, 1e6)?,
            max_new_tokens: f.opt_usize("max_new_tokens", 0, 1 << 31)?,
        })
    }
}

/// JSON text → value, with a clearer word for Python's NaN/Infinity literals.
fn parse_json(source: &str, text: &str) -> Result<Value, ConfigError> {
    serde_json::from_str(text).map_err(|e| {
        let hint = if ["NaN", "Infinity"].iter().any(|t| text.contains(t)) {
            " (NaN and Infinity are not JSON, and no config value may be non-finite)"
        } else {
            ""
        };
        ConfigError {
            file: source.into(),
            field: String::new(),
            message: format!("not valid JSON: {e}{hint}"),
        }
    })
}

/// Read and parse `dir/config.json`.
pub fn read_config(dir: &Path) -> Result<ModelConfig, ModelError> {
    let path = dir.join("config.json");
    let text = std::fs::read_to_string(&path).map_err(|source| ModelError::Io {
        path: path.clone(),
        source,
    })?;
    let source = path.display().to_string();
    let root = parse_json(&source, &text)?;
    Ok(ModelConfig::from_json(&source, &root)?)
}

/// A checked tensor: what it is and where its bytes live.
#[derive(Debug, Clone)]
pub struct TensorEntry {
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    pub bytes: usize,
    /// None for tensors the model does not use (e.g. DeepSeek V4's MTP block).
    pub kind: Option<Kind>,
    pub shard: usize,
}

/// An opened, validated model directory. Weights stay in the mappings.
pub struct ModelDir {
    pub dir: PathBuf,
    pub config: ModelConfig,
    pub generation: Option<GenerationConfig>,
    pub weights: WeightStore,
    pub naming: Naming,
    /// The tensors the model uses, in load order.
    pub expected: Vec<Expected>,
    pub tokenizer: Option<Tokenizer>,
}

impl std::fmt::Debug for ModelDir {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ModelDir")
            .field("dir", &self.dir)
            .field("family", &self.config.family)
            .field("tensors", &self.weights.len())
            .finish()
    }
}

fn shape_str(shape: &[usize]) -> String {
    let dims: Vec<String> = shape.iter().map(|d| d.to_string()).collect();
    format!("[{}]", dims.join(", "))
}

fn expected_str(x: &Expected) -> String {
    let names: Vec<&str> = x.kind.dtypes().iter().map(|d| d.name()).collect();
    format!("{} {}", names.join("/"), shape_str(&x.shape))
}

/// Which naming the checkpoint uses, from the tensors present.
fn detect_naming(cfg: &ModelConfig, store: &WeightStore) -> Result<Naming, ModelError> {
    if cfg.family != Family::DeepseekV4 {
        return Ok(Naming::Hf);
    }
    match (store.contains("embed.weight"), store.contains("model.embed_tokens.weight")) {
        (true, false) => Ok(Naming::Dsv4Release),
        (false, true) => Ok(Naming::Hf),
        (true, true) => Err(ModelError::Naming {
            what: "both embed.weight (release naming) and model.embed_tokens.weight (transformers naming) are present; a checkpoint must use one naming".into(),
        }),
        (false, false) => Err(ModelError::Naming {
            what: "tensor \"embed.weight\" (release naming) or \"model.embed_tokens.weight\" (transformers naming) is missing: cannot find the embeddings".into(),
        }),
    }
}

impl ModelDir {
    /// Open and validate `dir`. The tokenizer is optional (a model can run
    /// from token ids); when tokenizer.json exists it must load.
    pub fn open(dir: &Path) -> Result<ModelDir, ModelError> {
        if !dir.is_dir() {
            return Err(ModelError::NotADirectory(dir.to_path_buf()));
        }
        let config = read_config(dir)?;
        let gen_path = dir.join("generation_config.json");
        let generation = if gen_path.exists() {
            let text = std::fs::read_to_string(&gen_path).map_err(|source| ModelError::Io {
                path: gen_path.clone(),
                source,
            })?;
            Some(GenerationConfig::from_json_str(
                &gen_path.display().to_string(),
                &text,
                config.vocab_size,
            )?)
        } else {
            None
        };
        let weights = WeightStore::open(dir)?;
        let naming = detect_naming(&config, &weights)?;
        let fused = weights
            .names()
            .any(|n| n.ends_with(".mlp.experts.gate_up_proj"));
        let expected =
            layout::expected(&config, naming, fused).map_err(|what| ModelError::Naming { what })?;
        check_tensors(&weights, &expected)?;
        check_index_tables(&config, &weights, &expected)?;
        let tokenizer = if dir.join("tokenizer.json").exists() {
            let t = Tokenizer::load(dir)?;
            if t.vocab_size() > config.vocab_size {
                return Err(ModelError::Tokenizer(TokenizerError {
                    path: t.path.clone(),
                    message: format!(
                        "has {} tokens but the model's vocab_size is {} (ids past the embedding table)",
                        t.vocab_size(),
                        config.vocab_size
                    ),
                }));
            }
            Some(t)
        } else {
            None
        };
        Ok(ModelDir {
            dir: dir.to_path_buf(),
            config,
            generation,
            weights,
            naming,
            expected,
            tokenizer,
        })
    }

    /// Every tensor in the files, with its role (None: not used by bespoke).
    pub fn entries(&self) -> Vec<TensorEntry> {
        let kinds: BTreeMap<&str, &Kind> = self
            .expected
            .iter()
            .map(|x| (x.name.as_str(), &x.kind))
            .collect();
        let shard_index: BTreeMap<&Path, usize> = self
            .weights
            .shards
            .iter()
            .enumerate()
            .map(|(i, s)| (s.path.as_path(), i))
            .collect();
        self.weights
            .names()
            .filter_map(|name| {
                let t = self.weights.get(name)?;
                let shard = self
                    .weights
                    .shard_of(name)
                    .map(|s| shard_index[s.path.as_path()])
                    .unwrap_or(0);
                Some(TensorEntry {
                    name: name.to_string(),
                    dtype: t.dtype(),
                    shape: t.shape().to_vec(),
                    bytes: t.bytes.len(),
                    kind: kinds.get(name).map(|k| (*k).clone()),
                    shard,
                })
            })
            .collect()
    }

    /// Parameters the model uses (FP4 counts two per byte).
    pub fn parameters(&self) -> u64 {
        self.expected
            .iter()
            .map(|x| {
                let n: u64 = x.shape.iter().map(|&d| d as u64).product();
                match x.kind {
                    Kind::Fp4 { .. } => 2 * n,
                    Kind::Scale { .. } => 0,
                    _ => n,
                }
            })
            .sum()
    }

    /// Bytes of used tensors grouped by format label, largest first.
    pub fn bytes_by_format(&self) -> Vec<(&'static str, u64)> {
        let mut m: BTreeMap<&'static str, u64> = BTreeMap::new();
        for x in &self.expected {
            if let Some(t) = self.weights.get(&x.name) {
                *m.entry(x.kind.format_label(t.dtype())).or_default() += t.bytes.len() as u64;
            }
        }
        let mut v: Vec<_> = m.into_iter().collect();
        v.sort_by_key(|e| std::cmp::Reverse(e.1));
        v
    }

    /// Tensors in the files that the model does not use.
    pub fn unused(&self) -> Vec<&str> {
        let used: BTreeSet<&str> = self.expected.iter().map(|x| x.name.as_str()).collect();
        self.weights.names().filter(|n| !used.contains(n)).collect()
    }
}

/// Index tables (DeepSeek V4's token → expert maps) must name real experts;
/// a bad entry would otherwise index past the expert list at run time.
fn check_index_tables(
    cfg: &ModelConfig,
    store: &WeightStore,
    expected: &[Expected],
) -> Result<(), ModelError> {
    let experts = cfg.moe.as_ref().map_or(0, |m| m.num_experts) as i64;
    for x in expected.iter().filter(|x| x.kind == Kind::Index) {
        let t = store.get(&x.name).expect("checked present");
        let values = t.i64s().map_err(|e| ModelError::Naming {
            what: e.to_string(),
        })?;
        if let Some((i, v)) = values
            .iter()
            .enumerate()
            .find(|(_, &v)| v < 0 || v >= experts)
        {
            let k = x.shape.last().copied().unwrap_or(1).max(1);
            return Err(ModelError::TensorMismatch {
                name: x.name.clone(),
                expected: format!("expert ids in 0..{experts}"),
                found: format!("{v} at [{}, {}]", i / k, i % k),
                more: 0,
            });
        }
    }
    Ok(())
}

/// Every expected tensor present with an allowed dtype and the exact shape.
/// Reports the first problem by name (with a count of the rest).
fn check_tensors(store: &WeightStore, expected: &[Expected]) -> Result<(), ModelError> {
    let mut first: Option<ModelError> = None;
    let mut more = 0;
    for x in expected {
        let problem = match store.get(&x.name) {
            None => Some(ModelError::MissingTensor {
                name: x.name.clone(),
                expected: expected_str(x),
                more: 0,
            }),
            Some(t) if !x.kind.dtypes().contains(&t.dtype()) || t.shape() != x.shape.as_slice() => {
                Some(ModelError::TensorMismatch {
                    name: x.name.clone(),
                    expected: expected_str(x),
                    found: format!("{} {}", t.dtype(), shape_str(t.shape())),
                    more: 0,
                })
            }
            Some(_) => None,
        };
        if let Some(p) = problem {
            if first.is_none() {
                first = Some(p);
            } else {
                more += 1;
            }
        }
    }
    match first {
        None => Ok(()),
        Some(ModelError::MissingTensor { name, expected, .. }) => Err(ModelError::MissingTensor {
            name,
            expected,
            more,
        }),
        Some(ModelError::TensorMismatch {
            name,
            expected,
            found,
            ..
        }) => Err(ModelError::TensorMismatch {
            name,
            expected,
            found,
            more,
        }),
        Some(other) => Err(other),
    }
}
