//! The VRAM tier's inputs, on the CPU: every matrix an engine multiplies by is
//! in exactly one placement item (the embedding, a row lookup, in none), the
//! routed experts are items of their own, the engines count expert usage as
//! they route, and the placement fills a budget hottest-first from those
//! counts.

mod common;
use bespoke::generate::{AnyModel, CausalLm};
use bespoke::placement::{place, Item};
use bespoke::Kernels;

fn check(name: &str) {
    let (m, r) = common::fixture(name);
    let eng = AnyModel::load(&m, Kernels::best()).unwrap();
    let items = eng.placement_items();
    let mut seen = std::collections::HashSet::new();
    let (mut experts, mut dense) = (0usize, 0usize);
    for (item, mats) in &items {
        assert!(!mats.is_empty(), "{name}: empty item {item:?}");
        let bytes: u64 = mats.iter().map(|x| x.bytes()).sum();
        assert_eq!(bytes, item.bytes(), "{name}: {item:?}");
        for x in mats {
            assert!(
                seen.insert(x.name.clone()),
                "{name}: {} placed twice",
                x.name
            );
            assert!(
                !x.name.contains("embed"),
                "{name}: the embedding is a lookup, not a product"
            );
        }
        match item {
            Item::Expert { .. } => experts += 1,
            Item::Dense { .. } => dense += 1,
        }
    }
    let counts = eng.usage().snapshot();
    let n_experts: usize = counts.iter().map(Vec::len).sum();
    assert_eq!(experts, n_experts, "{name}: one item per routed expert");
    assert!(dense > 0);
    assert_eq!(
        counts.iter().flatten().sum::<u64>(),
        0,
        "{name}: nothing counted before a run"
    );

    // Run the first prompt: each MoE layer routes every token to top_k experts.
    let prompt = common::ids(&r["prompts"][0]["ids"]);
    let mut cache = CausalLm::new_cache(&eng, prompt.len()).unwrap();
    CausalLm::prefill(&eng, &mut cache, &prompt, 64, false).unwrap();
    let counts = eng.usage().snapshot();
    let per_layer: Vec<u64> = counts
        .iter()
        .filter(|l| !l.is_empty())
        .map(|l| l.iter().sum())
        .collect();
    assert!(!per_layer.is_empty());
    let top_k = per_layer[0] / prompt.len() as u64;
    assert!(
        top_k >= 1 && per_layer.iter().all(|&s| s == top_k * prompt.len() as u64),
        "{name}: {per_layer:?}"
    );

    // A budget of the dense items plus two experts: the two most used
    // experts of the first MoE layers, by rank.
    let only: Vec<Item> = items.iter().map(|(i, _)| i.clone()).collect();
    let dense_bytes: u64 = only
        .iter()
        .filter(|i| matches!(i, Item::Dense { .. }))
        .map(Item::bytes)
        .sum();
    let biggest = only
        .iter()
        .filter(|i| matches!(i, Item::Expert { .. }))
        .map(Item::bytes)
        .max()
        .unwrap();
    let p = place(&only, &counts, dense_bytes + 2 * biggest, 0);
    assert_eq!(p.dense.0, p.dense.1, "{name}: every dense item fits");
    assert!(p.experts.0 >= 2, "{name}: {p:?}");
    for (i, on) in only.iter().zip(&p.on_gpu) {
        if let (Item::Expert { layer, expert, .. }, true) = (i, on) {
            let l = &counts[*layer];
            let hotter = l
                .iter()
                .enumerate()
                .filter(|&(e, &c)| c > l[*expert] && e != *expert)
                .count();
            // Placed experts are among their layer's hottest (rank < experts placed).
            assert!(
                hotter < p.experts.0,
                "{name}: layer {layer} expert {expert} placed over hotter ones"
            );
        }
    }
}

#[test]
fn qwen3_moe_items_usage_and_placement() {
    check("tiny-qwen3-moe");
}

#[test]
fn dsv4_items_usage_and_placement() {
    check("tiny-dsv4");
}
