//! The CPU sampler and the stop rules. Statistical checks use fixed seeds, so they are
//! deterministic; their bounds are wide enough (>6 sigma) that any correct sampler passes.

use lathe::sample::{
    apply_penalties, argmax, min_p, top_k, top_p, FinishReason, Sampler, SamplerConfig,
    StopCondition,
};

/// Logits over 50 tokens with a clear order and some ties.
fn logits() -> Vec<f32> {
    (0..50)
        .map(|i| ((i * 37) % 50) as f32 * 0.1 - 2.0)
        .collect()
}

fn config(temperature: f32, top_k: usize, top_p: f32, min_p: f32) -> SamplerConfig {
    SamplerConfig {
        temperature,
        top_k,
        top_p,
        min_p,
        ..SamplerConfig::default()
    }
}

fn softmax(l: &[f32]) -> Vec<f64> {
    let max = l.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
    let e: Vec<f64> = l.iter().map(|&x| ((x - max) as f64).exp()).collect();
    let s: f64 = e.iter().sum();
    e.into_iter().map(|x| x / s).collect()
}

/// Counts of each token over `n` draws.
fn histogram(cfg: SamplerConfig, l: &[f32], n: usize) -> Vec<usize> {
    let mut s = Sampler::new(cfg);
    let mut counts = vec![0; l.len()];
    for _ in 0..n {
        let mut x = l.to_vec();
        counts[s.sample(&mut x, &[]) as usize] += 1;
    }
    counts
}

#[test]
fn greedy_is_argmax() {
    let l = logits();
    let want = l
        .iter()
        .enumerate()
        .max_by(|a, b| a.1.total_cmp(b.1).then(b.0.cmp(&a.0)))
        .unwrap()
        .0 as u32;
    let mut s = Sampler::new(SamplerConfig::greedy());
    for _ in 0..10 {
        assert_eq!(s.sample(&mut l.clone(), &[]), want);
    }
    assert_eq!(argmax(&l), Some(want));
    // Ties go to the lower id; NaN never wins.
    assert_eq!(argmax(&[1.0, f32::NAN, 3.0, 3.0]), Some(2));
    assert_eq!(argmax(&[]), None);
}

#[test]
fn top_k_one_is_greedy() {
    let l = logits();
    let greedy = argmax(&l).unwrap();
    let mut s = Sampler::new(config(1.5, 1, 1.0, 0.0));
    for _ in 0..200 {
        assert_eq!(s.sample(&mut l.clone(), &[]), greedy);
    }
}

#[test]
fn same_seed_same_tokens() {
    let l = logits();
    let run = |seed: u64| {
        let mut s = Sampler::new(SamplerConfig {
            seed,
            ..config(1.0, 0, 1.0, 0.0)
        });
        (0..300)
            .map(|_| s.sample(&mut l.clone(), &[]))
            .collect::<Vec<u32>>()
    };
    assert_eq!(run(7), run(7));
    assert_ne!(run(7), run(8));
}

#[test]
fn temperature_one_follows_softmax() {
    let l = logits();
    let p = softmax(&l);
    let n = 40_000;
    let counts = histogram(config(1.0, 0, 1.0, 0.0), &l, n);
    for (i, (&c, &pi)) in counts.iter().zip(&p).enumerate() {
        let mean = pi * n as f64;
        let sigma = (n as f64 * pi * (1.0 - pi)).sqrt();
        assert!(
            (c as f64 - mean).abs() <= 6.0 * sigma + 1.0,
            "token {i}: {c} draws, expected {mean:.1} ± {sigma:.1}"
        );
    }
}

#[test]
fn top_p_keeps_the_smallest_nucleus() {
    let l: Vec<f32> = vec![2.0, 1.0, 0.5, 0.0, -1.0, -3.0];
    let p = softmax(&l);
    // Nucleus for 0.8: the shortest prefix whose mass reaches 0.8.
    let mut cum = 0.0;
    let keep = p.iter().take_while(|&&x| {
        let before = cum;
        cum += x;
        before < 0.8
    });
    let keep = keep.count();
    let mut cands = top_k(&l, 0);
    top_p(&mut cands, 0.8);
    assert_eq!(cands.len(), keep);
    assert_eq!(
        cands.iter().map(|c| c.0).collect::<Vec<_>>(),
        (0..keep as u32).collect::<Vec<_>>()
    );

    // Sampling never leaves the nucleus and splits inside it by renormalised probability.
    let n = 20_000;
    let counts = histogram(config(1.0, 0, 0.8, 0.0), &l, n);
    let mass: f64 = p[..keep].iter().sum();
    for i in 0..l.len() {
        if i >= keep {
            assert_eq!(counts[i], 0, "token {i} is outside top-p");
        } else {
            let q = p[i] / mass;
            let sigma = (n as f64 * q * (1.0 - q)).sqrt();
            assert!(
                (counts[i] as f64 - q * n as f64).abs() <= 6.0 * sigma + 1.0,
                "token {i}"
            );
        }
    }
}

#[test]
fn top_p_over_a_large_vocabulary() {
    // 200k tokens, a peaked head: the shortcut that avoids a full sort must agree with a
    // full sort.
    let l: Vec<f32> = (0..200_000u32)
        .map(|i| -((i % 9973) as f32) * 0.01 + if i % 5000 == 0 { 12.0 } else { 0.0 })
        .collect();
    let mut full = top_k(&l, 0);
    top_p(&mut full, 0.9);
    let s = Sampler::new(config(1.0, 0, 0.9, 0.0));
    let fast = s.candidates(&mut l.clone(), &[]);
    assert_eq!(fast.len(), full.len());
    assert!(fast.iter().zip(&full).all(|(a, b)| a.0 == b.0));
}

#[test]
fn min_p_drops_the_tail() {
    let l: Vec<f32> = vec![3.0, 2.9, 1.0, 0.0, -5.0];
    // Keep p >= 0.1 * p_max, i.e. logit >= 3 + ln 0.1 = 0.697.
    let mut cands = top_k(&l, 0);
    min_p(&mut cands, 0.1);
    assert_eq!(cands.iter().map(|c| c.0).collect::<Vec<_>>(), vec![0, 1, 2]);
    let counts = histogram(config(1.0, 0, 1.0, 0.1), &l, 5_000);
    assert_eq!(counts[3] + counts[4], 0);
    assert!(
        counts[2] > 0,
        "token 2 is inside min-p and should be drawn sometimes"
    );
}

#[test]
fn chain_order_top_k_then_top_p_then_temperature() {
    // top-k 3 leaves [0, 1, 2]; top-p then works on their renormalised mass; temperature only
    // divides what is left.
    let l: Vec<f32> = vec![1.0, 0.9, 0.8, 5.0e-1, 0.0];
    let s = Sampler::new(config(0.5, 3, 0.5, 0.0));
    let c = s.candidates(&mut l.clone(), &[]);
    assert_eq!(c.iter().map(|c| c.0).collect::<Vec<_>>(), vec![0, 1]);
    assert!((c[0].1 - 2.0).abs() < 1e-6 && (c[1].1 - 1.8).abs() < 1e-6);
}

#[test]
fn penalties_follow_llama_cpp() {
    let cfg = SamplerConfig {
        repeat_penalty: 2.0,
        presence_penalty: 0.5,
        frequency_penalty: 0.25,
        penalty_window: 5,
        ..SamplerConfig::default()
    };
    let mut l = vec![4.0, -4.0, 1.0, 2.0];
    // The window is [0, 1, 0, 2, 99]: 0 twice, 1 and 2 once, 3 only before it, 99 beyond the
    // vocabulary (ignored).
    apply_penalties(&mut l, &[3, 0, 1, 0, 2, 99], &cfg);
    assert_eq!(l[0], 4.0 / 2.0 - 2.0 * 0.25 - 0.5);
    assert_eq!(l[1], -4.0 * 2.0 - 0.25 - 0.5);
    assert_eq!(l[2], 1.0 / 2.0 - 0.25 - 0.5);
    assert_eq!(l[3], 2.0, "outside the window");
    // No window, no change.
    let mut l2 = vec![4.0, -4.0];
    apply_penalties(
        &mut l2,
        &[0, 1],
        &SamplerConfig {
            penalty_window: 0,
            ..cfg.clone()
        },
    );
    assert_eq!(l2, vec![4.0, -4.0]);
    // A strong repeat penalty moves greedy off the repeated token.
    let mut s = Sampler::new(SamplerConfig {
        temperature: 0.0,
        repeat_penalty: 3.0,
        penalty_window: 8,
        ..SamplerConfig::default()
    });
    assert_eq!(s.sample(&mut [3.0, 2.0], &[0]), 1);
}

#[test]
fn degenerate_logits_do_not_panic() {
    let mut s = Sampler::new(SamplerConfig::default());
    assert_eq!(s.sample(&mut [f32::NEG_INFINITY; 4], &[]), 0);
    assert_eq!(s.sample(&mut [f32::NAN, 1.0, f32::NAN], &[]), 1);
    assert_eq!(s.sample(&mut [], &[]), 0);
    let mut inf = vec![0.0, f32::INFINITY, 1.0];
    assert_eq!(s.sample(&mut inf, &[]), 1);
}

#[test]
fn stop_string_across_token_boundaries() {
    let mut stop = StopCondition::new(None, vec!["</answer>".into(), "STOP".into()], [7]);
    let mut shown = String::new();
    let pieces = ["The answer", " is 4.<", "/ans", "wer>", " never shown"];
    let mut finish = None;
    for (i, p) in pieces.iter().enumerate() {
        let step = stop.push(100 + i as u32, p);
        shown.push_str(&step.text);
        if i == 1 {
            // "<" may start "</answer>": held back.
            assert_eq!(step.text, " is 4.");
            assert_eq!(stop.held(), "<");
        }
        if i == 2 {
            assert_eq!(step.text, "");
            assert_eq!(stop.held(), "</ans");
        }
        if step.finish.is_some() {
            finish = step.finish;
            break;
        }
    }
    assert_eq!(finish, Some(FinishReason::StopString(0)));
    assert_eq!(shown, "The answer is 4.");
    // After the end, nothing more.
    assert_eq!(stop.push(1, "x").text, "");
}

#[test]
fn false_alarm_is_released() {
    let mut stop = StopCondition::new(None, vec!["STOP".into()], []);
    assert_eq!(stop.push(1, "go ST").text, "go ");
    assert_eq!(stop.push(2, "ART").text, "START");
    assert_eq!(stop.push(3, "ST").text, "");
    assert_eq!(stop.finish(), "ST");
}

#[test]
fn stop_inside_one_token_and_multibyte() {
    let mut stop = StopCondition::new(None, vec!["été".into()], []);
    let s1 = stop.push(1, "un é");
    assert_eq!((s1.text.as_str(), stop.held()), ("un ", "é"));
    let s2 = stop.push(2, "tait été là");
    assert_eq!(s2.text, "était ");
    assert_eq!(s2.finish, Some(FinishReason::StopString(0)));
}

#[test]
fn eog_and_length() {
    let mut stop = StopCondition::new(Some(3), vec!["zz".into()], [42]);
    assert_eq!(stop.push(1, "a z").text, "a ");
    let end = stop.push(42, "<|im_end|>");
    assert_eq!(
        end.text, "z",
        "held text is released at EOG; the EOG text is not"
    );
    assert_eq!(end.finish, Some(FinishReason::Eog(42)));
    assert_eq!(end.finish.unwrap().as_api_str(), "stop");

    let mut stop = StopCondition::new(Some(2), vec!["zz".into()], []);
    assert!(stop.push(1, "a").finish.is_none());
    let end = stop.push(2, "bz");
    assert_eq!(end.text, "bz");
    assert_eq!(end.finish, Some(FinishReason::Length));
    assert_eq!(stop.n_tokens(), 2);
    assert_eq!(
        StopCondition::new(Some(0), vec![], []).finished(),
        Some(&FinishReason::Length)
    );
}

/// A mask leaves only its tokens to every sampler: greedy, top-k, top-p and the draw pick
/// among them even when the best logits are masked out, and ids past the mask are out.
#[test]
fn masked_logits_sample_only_allowed_tokens() {
    let l: Vec<f32> = (0..70).map(|i| (i % 13) as f32 * 0.5).collect();
    // Allowed: 3, 33 and 64 (bits of words 0, 1 and 2); 66..70 lies past the words.
    let allowed = [1u32 << 3, 1 << 1, 1];
    for cfg in [
        config(0.0, 0, 1.0, 0.0),
        config(1.0, 40, 0.95, 0.05),
        config(1.5, 0, 1.0, 0.0),
    ] {
        let mut s = Sampler::new(cfg);
        for _ in 0..50 {
            let mut m = l.clone();
            lathe::sample::mask_logits(&mut m, &allowed);
            let id = s.sample(&mut m, &[]);
            assert!([3, 33, 64].contains(&id), "{id}");
        }
    }
    let mut m = l.clone();
    lathe::sample::mask_logits(&mut m, &[u32::MAX, u32::MAX, u32::MAX]);
    assert_eq!(m, l, "an all-set mask changes nothing");
}
