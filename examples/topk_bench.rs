//! Time of the sampler's GPU top-k (`gpu::topk::LogitsTop`) on vocabulary-wide rows: GPU
//! timestamps per dispatch where the adapter has them, else the wall clock of submit + wait
//! (which then includes one submission's overhead). Checks every result against the CPU.
//! `cargo run --release --example topk_bench -- [N=248320] [ROWS=1] [ITERS=20]`
use lathe::gpu::operand::Operand;
use lathe::gpu::topk::LogitsTop;
use lathe::gpu::{AdapterChoice, Gpu};
use std::time::Instant;

fn main() -> lathe::Result<()> {
    let a: Vec<String> = std::env::args().collect();
    let arg = |i: usize, d: u32| a.get(i).map_or(d, |s| s.parse().unwrap());
    let (n, rows, iters) = (arg(1, 248_320), arg(2, 1), arg(3, 20));
    let gpu = Gpu::new(&AdapterChoice::Auto)?;
    eprintln!("{}", gpu.report());
    // Logit-like rows: a smooth bulk with a few large values, deterministic.
    let mut s = 0x9e37_79b9_7f4a_7c15u64;
    let x: Vec<f32> = (0..rows as usize * n as usize)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            let u = (s >> 40) as f32 / (1u64 << 24) as f32;
            if u > 0.9999 {
                10.0 + 10.0 * u
            } else {
                8.0 * u - 4.0
            }
        })
        .collect();
    let xbuf = gpu.upload_f32(&x, "x")?;
    let top = LogitsTop::new(&gpu, rows, n)?;
    let timed = gpu.features.contains(wgpu::Features::TIMESTAMP_QUERY);
    for (k, lse) in [(1, false), (40, false), (64, false), (40, true)] {
        let record = |pass: &mut lathe::gpu::Pass<'_>| {
            top.record(pass, Operand::new(&xbuf, 0), rows, 0, k, lse)
        };
        // Warm the pipelines and check the result.
        let mut pass = gpu.pass();
        record(&mut pass)?;
        pass.submit()?;
        let got = top.read(&gpu, rows, k, lse)?;
        for (r, g) in got.iter().enumerate() {
            let row = &x[r * n as usize..(r + 1) * n as usize];
            let (ids, _) = lathe::cpu::ops::topk(row, k as usize);
            let got_ids: Vec<u32> = g.cands.iter().map(|c| c.0).collect();
            assert_eq!(got_ids, ids, "row {r} k {k}");
        }
        let mut times = Vec::new();
        let mut per_dispatch = Vec::new();
        for _ in 0..iters {
            let mut pass = gpu.pass();
            record(&mut pass)?;
            if timed {
                let prof = pass.submit_profiled()?;
                times.push(prof.iter().map(|p| p.1).sum::<f64>() / 1e3);
                per_dispatch = prof.iter().map(|p| p.1 / 1e3).collect();
            } else {
                let t = Instant::now();
                pass.submit()?;
                gpu.wait()?;
                times.push(t.elapsed().as_secs_f64() * 1e6);
            }
        }
        times.sort_by(|a, b| a.partial_cmp(b).unwrap());
        println!(
            "n {n} rows {rows} k {k:>2} lse {lse:<5}: median {:>9.1} us ({}){}",
            times[times.len() / 2],
            if timed {
                "GPU timestamps"
            } else {
                "wall clock"
            },
            if per_dispatch.is_empty() {
                String::new()
            } else {
                format!(", per dispatch {per_dispatch:.1?} us")
            }
        );
    }
    Ok(())
}
