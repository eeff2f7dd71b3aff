//! Dispatches and time of DeepSeek-V4's batched passes: one decode step of N sequences in
//! one pass, and verify passes of k + 1 rows of one sequence (what grows with the rows).
//! `cargo run --release --example dsv4_dispatches -- MODEL [CONTEXT]`
//! Per pass: dispatches (all, and all / n_layer: the embedding and head included), the GPU
//! time summed over dispatches (timestamps) and the wall time of an unprofiled pass (mean
//! of 5).
use lathe::engine::{LoadOptions, Want};
use lathe::gpu::{AdapterChoice, Gpu};
use lathe::models::deepseek4::gpu::GpuModel;
use lathe::models::{Forward, ModelFile};
use std::sync::Arc;
use std::time::Instant;

const REPS: usize = 5;

/// (dispatches, GPU µs) of one profiled run of `f`, and the mean wall µs of `REPS` runs.
fn measure(
    m: &mut GpuModel,
    mut f: impl FnMut(&mut GpuModel) -> lathe::Result<()>,
) -> lathe::Result<(usize, f64, f64)> {
    f(m)?;
    m.profile = Some(Vec::new());
    let r = f(m);
    let prof = m.profile.take().unwrap_or_default();
    r?;
    let t = Instant::now();
    for _ in 0..REPS {
        f(m)?;
    }
    let wall = t.elapsed().as_secs_f64() * 1e6 / REPS as f64;
    let gpu_us = prof.iter().map(|p| p.1).sum::<f64>() / 1e3;
    Ok((prof.len(), gpu_us, wall))
}

fn main() -> lathe::Result<()> {
    let a: Vec<String> = std::env::args().collect();
    let ctx: usize = a
        .get(2)
        .map_or(40, |s| s.parse().expect("CONTEXT: a number"));
    let f = ModelFile::open(&a[1])?;
    let gpu = Arc::new(Gpu::new(&AdapterChoice::Auto)?);
    eprintln!("{}", gpu.report());
    let opts = LoadOptions {
        max_seqs: 17,
        ctx: ctx + 64,
        ..Default::default()
    };
    let mut m = GpuModel::load(gpu, &f, &opts)?;
    let n_layer = m.hp.n_layer as f64;
    let v = m.hp.n_vocab as u32;
    let prompt: Vec<u32> = (0..ctx as u32).map(|i| (i * 7 + 3) % v).collect();
    println!(
        "| pass | rows | dispatches | per layer | GPU µs (profiled) | wall µs | wall µs/row |"
    );
    println!("| --- | ---: | ---: | ---: | ---: | ---: | ---: |");
    for n in [1usize, 4, 16] {
        let mut seqs = Vec::new();
        for _ in 0..n {
            let mut s = m.new_seq()?;
            m.forward_want(&mut s, &prompt, Want::None)?;
            seqs.push(s);
        }
        // Each run is the next decode step of all n sequences.
        let tok = [5u32];
        let (d, g, w) = measure(&mut m, |m| {
            let mut items: Vec<_> = seqs
                .iter_mut()
                .map(|s| (s, &tok[..], Want::Top { k: 1, lse: false }))
                .collect();
            m.forward_batch(&mut items).map(drop)
        })?;
        println!(
            "| decode, {n} sequences | {n} | {d} | {:.1} | {g:.0} | {w:.0} | {:.0} |",
            d as f64 / n_layer,
            w / n as f64
        );
    }
    let mut seq = Forward::new_seq(&m)?;
    Forward::forward_batch(&mut m, &mut [(&mut seq, &prompt[..], Want::None)])?;
    for rows in [1usize, 2, 4, 8] {
        let toks: Vec<u32> = (0..rows as u32).map(|i| (i * 13 + 1) % v).collect();
        // Each run verifies the same rows and rolls them back.
        let (d, g, w) = measure(&mut m, |m| {
            let s = m.speculate().expect("DeepSeek-V4 verifies");
            s.verify(&mut seq, &toks, Want::Top { k: 1, lse: false })?;
            s.rollback(&mut seq, &[])
        })?;
        println!(
            "| verify | {rows} | {d} | {:.1} | {g:.0} | {w:.0} | {:.0} |",
            d as f64 / n_layer,
            w / rows as f64
        );
    }
    Ok(())
}
