//! Per-kernel GPU time of one decode step (GPU timestamps), summed by kernel family.
//! `cargo run --release --example profile_step -- MODEL [CONTEXT]`
use lathe::engine::{Engine, LoadOptions};
use std::collections::BTreeMap;

fn main() -> lathe::Result<()> {
    let a: Vec<String> = std::env::args().collect();
    let ctx: usize = a.get(2).map_or(64, |s| s.parse().unwrap());
    let mut e = Engine::load(std::path::Path::new(&a[1]), &LoadOptions::default())?;
    eprintln!("{}", e.gpu.report());
    let mut s = e.new_seq()?;
    let prompt: Vec<u32> = (0..ctx as u32).map(|i| i % 100 + 1).collect();
    e.forward(&mut s, &prompt, false)?;
    e.profile_step(&mut s, 7)?; // warm pipelines
    let prof = e.profile_step(&mut s, 8)?;
    let total: f64 = prof.iter().map(|p| p.1).sum();
    let mut by: BTreeMap<String, (usize, f64)> = BTreeMap::new();
    for (l, ns) in &prof {
        let key = l.split(['.', ' ']).next().unwrap_or(l).to_string();
        let key = if key.starts_with("blk") || key.contains("weight") {
            "matvec (weights)".to_string()
        } else {
            key
        };
        let en = by.entry(key).or_default();
        en.0 += 1;
        en.1 += ns;
    }
    println!(
        "{} dispatches, {:.1} us GPU time in one decode step at context {ctx}",
        prof.len(),
        total / 1e3
    );
    let mut v: Vec<_> = by.into_iter().collect();
    v.sort_by(|a, b| b.1 .1.partial_cmp(&a.1 .1).unwrap());
    for (k, (n, ns)) in v {
        println!(
            "{k:<28} {n:>5} dispatches {:>10.1} us {:>5.1}%",
            ns / 1e3,
            100.0 * ns / total
        );
    }
    Ok(())
}
