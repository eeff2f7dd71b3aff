//! Diff the DeepSeek-V4 GPU forward against the CPU reference, intermediate by intermediate
//! and layer by layer, on the first N tokens of a fixture.
//! `cargo run --release --example trace_deepseek4 -- MODEL TOKENS.npy [N] [PREFILL]`
//! The GPU feeds the first PREFILL tokens (default N) as one batch and the rest one by one.
use lathe::models::deepseek4::{cpu::CpuModel, gpu::GpuModel};
use lathe::models::runtime::trace::Trace;
use lathe::models::ModelFile;
use std::collections::HashMap;
use std::sync::Arc;

const NAMES: [&str; 5] = ["attn_in", "attn_out", "ffn_in", "moe_out", "layer_out"];

/// Max |a − b| per token of rows of `width`.
fn per_token(a: &[f32], b: &[f32], width: usize) -> Vec<f32> {
    a.chunks(width)
        .zip(b.chunks(width))
        .map(|(x, y)| {
            x.iter()
                .zip(y)
                .map(|(p, q)| (p - q).abs())
                .fold(0f32, f32::max)
        })
        .collect()
}

fn summary(d: &[f32]) -> String {
    let worst = d
        .iter()
        .enumerate()
        .fold((0, 0f32), |b, (i, v)| if *v > b.1 { (i, *v) } else { b });
    format!("max {:.1e} at token {}", worst.1, worst.0)
}

fn main() -> lathe::Result<()> {
    let a: Vec<String> = std::env::args().collect();
    if a.len() < 3 {
        eprintln!("usage: trace_deepseek4 MODEL TOKENS.npy [N] [PREFILL]");
        std::process::exit(2);
    }
    let f = ModelFile::open(&a[1])?;
    let toks: Vec<u32> = lathe::npy::read_i64(&a[2])?
        .data
        .iter()
        .map(|&t| t as u32)
        .collect();
    let n: usize = a.get(3).map_or(16, |s| s.parse().unwrap());
    let toks = &toks[..n.min(toks.len())];
    let prefill: usize = a.get(4).map_or(toks.len(), |s| s.parse().unwrap());
    let cpu = CpuModel::load(&f)?;
    let hp = cpu.hp.clone();
    // (name, layer) -> [T, width]; "logits" at layer MAX.
    let mut want: HashMap<(String, usize), Vec<f32>> = HashMap::new();
    let mut seq = cpu.new_seq();
    for &tok in toks {
        cpu.step_traced(&mut seq, tok, &mut |name, l, x| {
            want.entry((name.to_string(), l))
                .or_default()
                .extend_from_slice(x)
        })?;
    }
    let gpu = Arc::new(lathe::gpu::Gpu::new(&Default::default())?);
    eprintln!("{}", gpu.report());
    let opts = lathe::engine::LoadOptions {
        kv_type: lathe::engine::KvType::F32,
        ..Default::default()
    };
    let mut m = GpuModel::load(gpu, &f, &opts)?;
    let run = |m: &mut GpuModel| -> lathe::Result<Vec<f32>> {
        let mut s = m.new_seq()?;
        let mut out = m.forward(&mut s, &toks[..prefill.min(toks.len())], true)?;
        for t in &toks[prefill.min(toks.len())..] {
            out.extend(m.forward(&mut s, std::slice::from_ref(t), true)?);
        }
        Ok(out)
    };
    for l in 0..hp.n_layer {
        let mut line = Vec::new();
        for name in NAMES {
            m.trace.want = Some(Trace { name, layer: l });
            m.trace.traced.clear();
            run(&mut m)?;
            let w = &want[&(name.to_string(), l)];
            let width = w.len() / toks.len();
            line.push(format!(
                "{name} {}",
                summary(&per_token(&m.trace.traced, w, width))
            ));
        }
        println!(
            "layer {l} (ratio {}): {}",
            hp.compress_ratio[l],
            line.join(" | ")
        );
    }
    m.trace.want = None;
    let got = run(&mut m)?;
    let w = &want[&("logits".to_string(), usize::MAX)];
    let d = per_token(&got, w, hp.n_vocab);
    println!("logits: {}", summary(&d));
    Ok(())
}
