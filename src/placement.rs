//! Where a model's matrices live when there is a GPU: the VRAM tier.
//!
//! Routed-expert usage is counted per layer as the engines run, and persisted
//! next to the model (`<model>/.bespoke/expert-usage.json`, or under
//! `~/.cache/bespoke/usage/` when the model directory is read-only), so the
//! next run knows which experts are hot. [`place`] then fills a VRAM budget:
//! first the dense matrices (attention, dense MLPs, shared experts, routers,
//! the head) in model order while they fit, then the routed experts, hottest
//! first within each layer, one rank across all layers at a time (every
//! layer's hottest, then every layer's second hottest, ...), while they fit.
//! Everything else stays on the CPU.

use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// Expert selections per layer and expert, as the engines count them.
#[derive(Debug, Default)]
pub struct UsageCounter {
    counts: Mutex<Vec<Vec<u64>>>,
}

impl UsageCounter {
    /// `experts[l]`: routed experts of layer l (0 for dense layers).
    pub fn new(experts: &[usize]) -> UsageCounter {
        UsageCounter {
            counts: Mutex::new(experts.iter().map(|&e| vec![0; e]).collect()),
        }
    }

    /// Layer `layer` routed `tokens` tokens to expert `expert`.
    pub fn record(&self, layer: usize, expert: usize, tokens: usize) {
        if let Ok(mut c) = self.counts.lock() {
            if let Some(v) = c.get_mut(layer).and_then(|l| l.get_mut(expert)) {
                *v += tokens as u64;
            }
        }
    }

    pub fn snapshot(&self) -> Vec<Vec<u64>> {
        self.counts.lock().map(|c| c.clone()).unwrap_or_default()
    }

    /// Start from counts saved by earlier runs (same shape only).
    pub fn add(&self, earlier: &Usage) {
        if let Ok(mut c) = self.counts.lock() {
            if shape_of(&c) == shape_of(&earlier.counts) {
                for (l, e) in c.iter_mut().zip(&earlier.counts) {
                    for (a, b) in l.iter_mut().zip(e) {
                        *a += b;
                    }
                }
            }
        }
    }
}

fn shape_of(c: &[Vec<u64>]) -> Vec<usize> {
    c.iter().map(Vec::len).collect()
}

/// The persisted counts.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Usage {
    /// What the counts are: selections of each routed expert, per layer.
    pub what: String,
    pub counts: Vec<Vec<u64>>,
}

pub const USAGE_FILE: &str = ".bespoke/expert-usage.json";

/// Where a model's usage lives when it can be written next to the model.
fn next_to(model_dir: &Path) -> PathBuf {
    model_dir.join(USAGE_FILE)
}

/// Where it lives otherwise: under the user cache, named after the model's path.
fn in_cache(model_dir: &Path) -> PathBuf {
    let cache = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .unwrap_or_else(std::env::temp_dir);
    let canon = model_dir
        .canonicalize()
        .unwrap_or_else(|_| model_dir.to_path_buf());
    let name: String = canon
        .to_string_lossy()
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .collect();
    cache.join("bespoke/usage").join(format!("{name}.json"))
}

/// Counts saved for this model, if any. A file that does not parse or does
/// not match the model's shape is an error naming the file.
pub fn load_usage(model_dir: &Path, experts: &[usize]) -> Result<Option<Usage>, String> {
    // Next to the model first, then the cache (where a read-only model's went).
    let mut found = None;
    for path in [next_to(model_dir), in_cache(model_dir)] {
        match std::fs::read_to_string(&path) {
            Ok(t) => {
                found = Some((path, t));
                break;
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(format!("{}: {e}", path.display())),
        }
    }
    let Some((path, text)) = found else {
        return Ok(None);
    };
    let u: Usage = serde_json::from_str(&text).map_err(|e| {
        format!(
            "{}: not an expert-usage file ({e}); delete it to start counting again",
            path.display()
        )
    })?;
    if shape_of(&u.counts) != experts {
        return Err(format!(
            "{}: counts for {} layers × {:?} experts, but the model has {} layers × {:?}; \
             delete it to start counting again",
            path.display(),
            u.counts.len(),
            u.counts.iter().map(Vec::len).max().unwrap_or(0),
            experts.len(),
            experts.iter().max().unwrap_or(&0)
        ));
    }
    Ok(Some(u))
}

/// Write the counts next to the model, or under the user cache when the
/// model directory cannot be written (atomically: a temporary file, then
/// rename). Returns where they went.
pub fn save_usage(model_dir: &Path, counts: Vec<Vec<u64>>) -> Result<PathBuf, String> {
    let u = Usage {
        what: "routed-expert selections per layer (one token routed to one expert = 1), \
               summed over bespoke runs; the VRAM tier places the most used first"
            .into(),
        counts,
    };
    let text = serde_json::to_string(&u).map_err(|e| e.to_string())?;
    let write = |path: &Path| -> Result<(), String> {
        let d = path.parent().unwrap_or(Path::new("."));
        std::fs::create_dir_all(d).map_err(|e| format!("{}: {e}", d.display()))?;
        let tmp = path.with_extension(format!("json.tmp{}", std::process::id()));
        std::fs::write(&tmp, &text).map_err(|e| format!("{}: {e}", tmp.display()))?;
        std::fs::rename(&tmp, path).map_err(|e| format!("{}: {e}", path.display()))
    };
    let path = next_to(model_dir);
    match write(&path) {
        Ok(()) => Ok(path),
        Err(_) => {
            let path = in_cache(model_dir);
            write(&path).map(|()| path)
        }
    }
}

/// One thing that can be placed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Item {
    /// Attention, dense MLP, shared expert, router, head: read every token.
    Dense { name: String, bytes: u64 },
    /// A routed expert (all its matrices).
    Expert {
        layer: usize,
        expert: usize,
        bytes: u64,
    },
}

impl Item {
    pub fn bytes(&self) -> u64 {
        match self {
            Item::Dense { bytes, .. } | Item::Expert { bytes, .. } => *bytes,
        }
    }
}

/// What [`place`] decided.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Placement {
    /// Parallel to the items: on the GPU or not.
    pub on_gpu: Vec<bool>,
    pub dense: (usize, usize),
    pub experts: (usize, usize),
    /// Bytes of items placed.
    pub bytes: u64,
    /// Bytes set aside for the KV cache (attention on the GPU): the
    /// reservation asked for, or 0 where it did not fit after the dense items.
    pub kv: u64,
}

/// Fill `budget` bytes: dense items in order, then `kv_reserve` bytes for the
/// KV cache that attention on the GPU keeps (where they fit), then experts
/// by rank within their layer (ties: lower expert index), round by round
/// across layers.
pub fn place(items: &[Item], counts: &[Vec<u64>], budget: u64, kv_reserve: u64) -> Placement {
    let mut p = Placement {
        on_gpu: vec![false; items.len()],
        ..Placement::default()
    };
    let mut left = budget;
    let take = |i: usize, p: &mut Placement, left: &mut u64| {
        let b = items[i].bytes();
        if b <= *left {
            *left -= b;
            p.on_gpu[i] = true;
            p.bytes += b;
            true
        } else {
            false
        }
    };
    for (i, it) in items.iter().enumerate() {
        if let Item::Dense { .. } = it {
            p.dense.1 += 1;
            if take(i, &mut p, &mut left) {
                p.dense.0 += 1;
            }
        }
    }
    if kv_reserve > 0 && kv_reserve <= left {
        left -= kv_reserve;
        p.kv = kv_reserve;
    }
    // Per layer: its expert items, hottest first.
    let mut by_layer: std::collections::BTreeMap<usize, Vec<(u64, usize, usize)>> =
        Default::default();
    for (i, it) in items.iter().enumerate() {
        if let Item::Expert { layer, expert, .. } = it {
            let c = counts
                .get(*layer)
                .and_then(|l| l.get(*expert))
                .copied()
                .unwrap_or(0);
            by_layer.entry(*layer).or_default().push((c, *expert, i));
            p.experts.1 += 1;
        }
    }
    for v in by_layer.values_mut() {
        v.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
    }
    let rounds = by_layer.values().map(Vec::len).max().unwrap_or(0);
    for r in 0..rounds {
        for v in by_layer.values() {
            if let Some(&(_, _, i)) = v.get(r) {
                if take(i, &mut p, &mut left) {
                    p.experts.0 += 1;
                }
            }
        }
    }
    p
}

#[cfg(test)]
mod tests {
    use super::*;

    fn expert(layer: usize, expert: usize) -> Item {
        Item::Expert {
            layer,
            expert,
            bytes: 10,
        }
    }

    #[test]
    fn dense_first_then_hottest_per_layer() {
        let items = vec![
            Item::Dense {
                name: "attn".into(),
                bytes: 30,
            },
            expert(0, 0),
            expert(0, 1),
            expert(0, 2),
            expert(1, 0),
            expert(1, 1),
            Item::Dense {
                name: "head".into(),
                bytes: 50,
            },
        ];
        let counts = vec![vec![1, 9, 5], vec![7, 2]];
        // 30 + 50 dense, then 40 for experts: L0 e1, L1 e0, L0 e2, L1 e1.
        let p = place(&items, &counts, 120, 0);
        assert_eq!(p.on_gpu, [true, false, true, true, true, true, true]);
        assert_eq!((p.dense, p.experts, p.bytes), ((2, 2), (4, 5), 120));
        // 100: two experts, each layer's hottest.
        let p = place(&items, &counts, 100, 0);
        assert_eq!(p.on_gpu, [true, false, true, false, true, false, true]);
        // A dense item that does not fit is skipped, the rest still placed.
        let p = place(&items, &counts, 45, 0);
        assert_eq!(p.on_gpu, [true, false, true, false, false, false, false]);
        assert_eq!(p.dense, (1, 2));
        assert_eq!(place(&items, &counts, 0, 0).bytes, 0);
        // The KV reservation comes after the dense items and before the
        // experts: 120 - 80 dense - 20 KV leaves two experts.
        let p = place(&items, &counts, 120, 20);
        assert_eq!(p.on_gpu, [true, false, true, false, true, false, true]);
        assert_eq!((p.kv, p.bytes), (20, 100));
        // A reservation that does not fit after the dense items is not made.
        let p = place(&items, &counts, 100, 30);
        assert_eq!((p.kv, p.experts.0), (0, 2));
    }

    #[test]
    fn counts_round_trip_and_wrong_shapes_are_named() {
        let dir = std::env::temp_dir().join(format!("bespoke-usage-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        assert_eq!(load_usage(&dir, &[2, 0]).unwrap(), None);
        let c = UsageCounter::new(&[2, 0]);
        c.record(0, 1, 3);
        c.record(1, 0, 5); // a dense layer: ignored
        let path = save_usage(&dir, c.snapshot()).unwrap();
        assert!(path.ends_with(USAGE_FILE));
        let u = load_usage(&dir, &[2, 0]).unwrap().unwrap();
        assert_eq!(u.counts, vec![vec![0, 3], vec![]]);
        let c2 = UsageCounter::new(&[2, 0]);
        c2.add(&u);
        c2.record(0, 1, 1);
        assert_eq!(c2.snapshot(), vec![vec![0, 4], vec![]]);
        let e = load_usage(&dir, &[4, 4]).unwrap_err();
        assert!(
            e.contains("expert-usage.json") && e.contains("delete it"),
            "{e}"
        );
        std::fs::write(&path, "{").unwrap();
        assert!(load_usage(&dir, &[2, 0])
            .unwrap_err()
            .contains("not an expert-usage file"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
