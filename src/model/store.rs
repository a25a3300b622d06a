//! All of a model's safetensors shards, memory-mapped, behind one name → tensor map.

use super::ModelError;
use crate::safetensors::{SafetensorsFile, TensorView};
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::{Component, Path, PathBuf};

pub const SINGLE_FILE: &str = "model.safetensors";
pub const INDEX_FILE: &str = "model.safetensors.index.json";

/// The weights of one model directory.
#[derive(Debug)]
pub struct WeightStore {
    pub shards: Vec<SafetensorsFile>,
    /// The sharded checkpoint's index, when there is one.
    pub index_file: Option<PathBuf>,
    /// Tensor name → index into `shards`.
    by_name: BTreeMap<String, usize>,
}

fn index_err(path: &Path, message: impl Into<String>) -> ModelError {
    ModelError::Index {
        path: path.to_path_buf(),
        message: message.into(),
    }
}

/// A shard name from the index must name a file inside the model directory:
/// no `..`, no absolute path. (Checked on the text, not the resolved path, so
/// that a Hugging Face cache snapshot — whose files are symlinks into a blob
/// store — still loads.)
fn shard_path(dir: &Path, index: &Path, tensor: &str, file: &str) -> Result<PathBuf, ModelError> {
    let p = Path::new(file);
    if file.is_empty() || !p.components().all(|c| matches!(c, Component::Normal(_))) {
        return Err(index_err(
            index,
            format!(
                "weight_map[{tensor:?}] = {file:?} is not a file name inside the model directory"
            ),
        ));
    }
    Ok(dir.join(p))
}

impl WeightStore {
    /// `dir/model.safetensors.index.json` with its shards, else
    /// `dir/model.safetensors`, else every `*.safetensors` in `dir`.
    pub fn open(dir: &Path) -> Result<WeightStore, ModelError> {
        let index = dir.join(INDEX_FILE);
        if index.exists() {
            return Self::open_index(dir, &index);
        }
        let single = dir.join(SINGLE_FILE);
        let files = if single.exists() {
            vec![single]
        } else {
            let mut found: Vec<PathBuf> = std::fs::read_dir(dir)
                .map_err(|source| ModelError::Io {
                    path: dir.to_path_buf(),
                    source,
                })?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
                .collect();
            found.sort();
            if found.is_empty() {
                return Err(ModelError::NoWeights {
                    dir: dir.to_path_buf(),
                });
            }
            found
        };
        let mut store = WeightStore {
            shards: Vec::new(),
            index_file: None,
            by_name: BTreeMap::new(),
        };
        for f in files {
            store.add_shard(&f)?;
        }
        Ok(store)
    }

    fn add_shard(&mut self, path: &Path) -> Result<usize, ModelError> {
        let shard = SafetensorsFile::open(path)?;
        let n = self.shards.len();
        for name in shard.header.tensors.keys() {
            if let Some(&other) = self.by_name.get(name) {
                return Err(ModelError::DuplicateTensor {
                    name: name.clone(),
                    first: self.shards[other].path.clone(),
                    second: path.to_path_buf(),
                });
            }
            self.by_name.insert(name.clone(), n);
        }
        self.shards.push(shard);
        Ok(n)
    }

    fn open_index(dir: &Path, index: &Path) -> Result<WeightStore, ModelError> {
        let text = std::fs::read_to_string(index).map_err(|source| ModelError::Io {
            path: index.into(),
            source,
        })?;
        let root: Value = serde_json::from_str(&text)
            .map_err(|e| index_err(index, format!("not valid JSON: {e}")))?;
        let map = root
            .get("weight_map")
            .and_then(|m| m.as_object())
            .ok_or_else(|| {
                index_err(
                    index,
                    "has no \"weight_map\" object (tensor name → shard file)",
                )
            })?;
        if map.is_empty() {
            return Err(index_err(index, "weight_map is empty"));
        }
        // Shard file → tensors the index puts there, in first-seen order.
        let mut shards: Vec<(String, Vec<&str>)> = Vec::new();
        for (tensor, file) in map {
            let file = file.as_str().ok_or_else(|| {
                index_err(
                    index,
                    format!("weight_map[{tensor:?}] must be a file name string"),
                )
            })?;
            shard_path(dir, index, tensor, file)?;
            match shards.iter_mut().find(|(f, _)| f == file) {
                Some((_, names)) => names.push(tensor),
                None => shards.push((file.to_string(), vec![tensor])),
            }
        }
        shards.sort_by(|a, b| a.0.cmp(&b.0));
        let mut store = WeightStore {
            shards: Vec::new(),
            index_file: Some(index.to_path_buf()),
            by_name: BTreeMap::new(),
        };
        for (file, names) in &shards {
            let path = dir.join(file);
            if !path.exists() {
                return Err(ModelError::MissingShard {
                    index: index.to_path_buf(),
                    shard: path,
                    tensors: names.len(),
                });
            }
            let n = store.add_shard(&path)?;
            for name in names {
                if !store.shards[n].header.tensors.contains_key(*name) {
                    return Err(index_err(
                        index,
                        format!(
                            "says tensor {name:?} is in {file}, but that file does not hold it"
                        ),
                    ));
                }
            }
        }
        Ok(store)
    }

    pub fn get(&self, name: &str) -> Option<TensorView<'_>> {
        let &n = self.by_name.get(name)?;
        self.shards[n].tensor(name)
    }

    pub fn contains(&self, name: &str) -> bool {
        self.by_name.contains_key(name)
    }

    /// Every tensor name, sorted.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.by_name.keys().map(String::as_str)
    }

    pub fn len(&self) -> usize {
        self.by_name.len()
    }

    pub fn is_empty(&self) -> bool {
        self.by_name.is_empty()
    }

    /// Which shard holds `name`.
    pub fn shard_of(&self, name: &str) -> Option<&SafetensorsFile> {
        self.by_name.get(name).map(|&n| &self.shards[n])
    }

    /// Total bytes of tensor data.
    pub fn data_bytes(&self) -> u64 {
        self.shards.iter().map(|s| s.header.data_len as u64).sum()
    }

    /// Read one byte of every 4 KiB page of every shard, so that the
    /// operating system has the whole files in its page cache (in parallel,
    /// 64 MiB a task). Returns the bytes the mappings cover.
    pub fn page_in(&self) -> u64 {
        use rayon::prelude::*;
        const PAGE: usize = 4096;
        let mut total = 0u64;
        for s in &self.shards {
            let m = s.mapped();
            total += m.len() as u64;
            let sum: u64 = m
                .par_chunks(64 << 20)
                .map(|c| c.iter().step_by(PAGE).map(|&b| u64::from(b)).sum::<u64>())
                .sum();
            std::hint::black_box(sum);
        }
        total
    }

    /// Whether `bytes` lies inside one of the shard mappings (the views are
    /// in place, not copies).
    pub fn is_mapped(&self, bytes: &[u8]) -> bool {
        let (p, n) = (bytes.as_ptr() as usize, bytes.len());
        self.shards.iter().any(|s| {
            let m = s.mapped();
            let (b, len) = (m.as_ptr() as usize, m.len());
            p >= b && p + n <= b + len
        })
    }
}
