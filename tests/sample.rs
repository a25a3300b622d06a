use bespoke::sample::{argmax, Sampler, SamplingParams};

fn params(temperature: f32, top_k: usize, top_p: f32, seed: u64) -> SamplingParams {
    SamplingParams {
        temperature,
        top_k,
        top_p,
        repetition_penalty: 1.0,
        seed,
    }
}

fn draws(p: SamplingParams, logits: &[f32], n: usize) -> Vec<u32> {
    let mut s = Sampler::new(p).unwrap();
    (0..n)
        .map(|_| s.sample(&mut logits.to_vec(), &[]))
        .collect()
}

#[test]
fn argmax_ties_and_nan() {
    assert_eq!(argmax(&[1.0, 3.0, 3.0, 2.0]), 1);
    assert_eq!(argmax(&[f32::NAN, 0.5, f32::NAN, 0.7]), 3);
    assert_eq!(argmax(&[f32::NAN, f32::NAN]), 0);
    assert_eq!(argmax(&[]), 0);
    assert_eq!(argmax(&[f32::NEG_INFINITY, f32::NEG_INFINITY]), 0);
    assert_eq!(argmax(&[-1.0, f32::INFINITY, f32::NAN]), 1);
}

#[test]
fn greedy_ignores_seed() {
    let logits = [0.1, 2.0, 1.9, -3.0];
    for seed in 0..20 {
        let p = SamplingParams {
            seed,
            ..SamplingParams::greedy()
        };
        assert!(p.is_greedy());
        assert!(draws(p, &logits, 10).iter().all(|&t| t == 1));
    }
}

#[test]
fn repetition_penalty_direction() {
    let p = SamplingParams {
        repetition_penalty: 2.0,
        ..SamplingParams::greedy()
    };
    let mut s = Sampler::new(p).unwrap();
    // Positive: 2.0 / 2 = 1.0 < 1.5, so token 1 loses to token 2.
    let mut l = vec![0.0, 2.0, 1.5];
    assert_eq!(s.sample(&mut l, &[1, 1, 99]), 2);
    assert_eq!(l, vec![0.0, 1.0, 1.5]); // once per distinct id; 99 out of vocab
                                        // Negative: -1.0 * 2 = -2.0 < -1.5, so token 0 loses to token 2.
    let mut l = vec![-1.0, -3.0, -1.5];
    assert_eq!(s.sample(&mut l, &[0]), 2);
    assert_eq!(l[0], -2.0);
    // Without history nothing changes.
    assert_eq!(s.sample(&mut [-1.0, -3.0, -1.5], &[]), 0);
}

#[test]
fn seeds_are_deterministic() {
    let logits: Vec<f32> = (0..100).map(|i| ((i * 37) % 11) as f32 * 0.3).collect();
    let p = |seed| params(1.0, 0, 1.0, seed);
    let a = draws(p(42), &logits, 200);
    assert_eq!(a, draws(p(42), &logits, 200));
    assert_ne!(a, draws(p(43), &logits, 200));
}

#[test]
fn top_k() {
    let logits = [0.5, 3.0, 1.0, 2.5, 2.9, -1.0];
    let p1 = params(1.0, 1, 1.0, 7);
    assert!(p1.is_greedy());
    assert!(draws(p1, &logits, 100).iter().all(|&t| t == 1));
    let got = draws(params(1.5, 3, 1.0, 7), &logits, 2000);
    assert!(got.iter().all(|t| [1, 3, 4].contains(t)));
    for t in [1, 3, 4] {
        assert!(got.contains(&t), "token {t} never drawn");
    }
    // Boundary ties survive: the 2nd largest value appears twice.
    let got = draws(params(1.0, 2, 1.0, 3), &[1.0, 2.0, 2.0, 5.0], 2000);
    assert!(got.iter().all(|t| [1, 2, 3].contains(t)));
    assert!(got.contains(&1) && got.contains(&2));
}

#[test]
fn top_p() {
    let logits: Vec<f32> = [0.6f32, 0.3, 0.1].iter().map(|p| p.ln()).collect();
    assert!(draws(params(1.0, 0, 0.5, 1), &logits, 2000)
        .iter()
        .all(|&t| t == 0));
    let got = draws(params(1.0, 0, 0.85, 1), &logits, 2000);
    assert!(got.iter().all(|&t| t <= 1));
    assert!(got.contains(&0) && got.contains(&1));
    let got = draws(params(1.0, 0, 0.95, 1), &logits, 2000);
    assert!(got.contains(&2));
}

#[test]
fn empirical_frequencies_match_softmax() {
    let logits = [1.0f32, 2.0, 0.5, -1.0];
    let m = logits.iter().map(|&l| (l as f64).exp()).collect::<Vec<_>>();
    let z: f64 = m.iter().sum();
    let n = 20_000;
    let mut counts = [0usize; 4];
    for t in draws(params(1.0, 0, 1.0, 2024), &logits, n) {
        counts[t as usize] += 1;
    }
    for i in 0..4 {
        let f = counts[i] as f64 / n as f64;
        assert!(
            (f - m[i] / z).abs() < 0.02,
            "token {i}: {f} vs {}",
            m[i] / z
        );
    }
}

#[test]
fn degenerate_inputs_do_not_panic() {
    let mut s = Sampler::new(SamplingParams {
        top_p: 0.9,
        repetition_penalty: 1.3,
        ..Default::default()
    })
    .unwrap();
    assert_eq!(s.sample(&mut [], &[0, 5]), 0);
    assert_eq!(s.sample(&mut [f32::NAN; 4], &[1]), 0);
    assert_eq!(s.sample(&mut [f32::NEG_INFINITY; 4], &[]), 0);
    assert_eq!(s.sample(&mut [f32::NAN, 1.0, f32::NAN], &[]), 1);
    assert_eq!(s.sample(&mut [0.0, f32::INFINITY, 1.0], &[]), 1);
    let mut cold = Sampler::new(params(1e-30, 0, 1.0, 0)).unwrap();
    assert_eq!(cold.sample(&mut [1e30, 3e30, 2e30], &[]), 1);
}

#[test]
fn validation() {
    assert_eq!(SamplingParams::default(), params(1.0, 50, 1.0, 0));
    assert!(SamplingParams::default().validate().is_ok());
    assert!(SamplingParams::greedy().validate().is_ok());
    let bad = |p: SamplingParams| Sampler::new(p).err().unwrap();
    let d = SamplingParams::default;
    assert_eq!(
        bad(SamplingParams {
            temperature: -1.0,
            ..d()
        }),
        "--temperature must be finite and >= 0, got -1"
    );
    assert!(bad(SamplingParams {
        temperature: f32::NAN,
        ..d()
    })
    .starts_with("--temperature"));
    assert_eq!(
        bad(SamplingParams { top_p: 1.5, ..d() }),
        "--top-p must be in (0, 1], got 1.5"
    );
    assert!(bad(SamplingParams { top_p: 0.0, ..d() }).starts_with("--top-p"));
    assert_eq!(
        bad(SamplingParams {
            repetition_penalty: 0.0,
            ..d()
        }),
        "--repetition-penalty must be > 0, got 0"
    );
}
