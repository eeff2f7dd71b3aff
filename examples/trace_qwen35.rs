//! Diff the GPU forward against the CPU reference layer by layer on a token sequence.
//! `cargo run --example trace_qwen35 -- MODEL TOKENS.npy [N]`
use lathe::models::qwen35::{cpu::CpuModel, gpu::GpuModel};
use lathe::models::runtime::trace::Trace;
use lathe::models::ModelFile;
use std::sync::Arc;

fn main() -> lathe::Result<()> {
    let a: Vec<String> = std::env::args().collect();
    let f = ModelFile::open(&a[1])?;
    let toks: Vec<u32> = lathe::npy::read_i64(&a[2])?
        .data
        .iter()
        .map(|&t| t as u32)
        .collect();
    let n: usize = a.get(3).map_or(4, |s| s.parse().unwrap());
    let toks = &toks[..n.min(toks.len())];
    let cpu = CpuModel::load(&f)?;
    let e = cpu.hp.n_embd;
    let mut want = vec![vec![0f32; toks.len() * e]; cpu.hp.n_layer];
    let mut seq = cpu.new_seq();
    for (t, &tok) in toks.iter().enumerate() {
        cpu.step_traced(&mut seq, tok, &mut |l, x| {
            want[l][t * e..(t + 1) * e].copy_from_slice(x)
        });
    }
    let gpu = Arc::new(lathe::gpu::Gpu::new(&Default::default())?);
    let opts = lathe::engine::LoadOptions {
        kv_type: lathe::engine::KvType::F32,
        ..Default::default()
    };
    let mut m = GpuModel::load(gpu, &f, &opts)?;
    for (l, want_l) in want.iter().enumerate() {
        m.trace.want = Some(Trace {
            name: "layer_out",
            layer: l,
        });
        m.trace.traced.clear();
        let mut s = m.new_seq()?;
        m.forward(&mut s, toks, false)?;
        let got = &m.trace.traced;
        let per_tok: Vec<String> = (0..toks.len())
            .map(|t| {
                let d = (0..e)
                    .map(|i| (got[t * e + i] - want_l[t * e + i]).abs())
                    .fold(0f32, f32::max);
                format!("{d:.1e}")
            })
            .collect();
        println!(
            "layer {l} ({}): max abs diff per token {}",
            if cpu.hp.recurrent[l] { "gdn" } else { "attn" },
            per_tok.join(" ")
        );
    }
    Ok(())
}
