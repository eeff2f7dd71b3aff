//! Check that sequences run together in one batched pass give the logits they get alone.
//! `cargo run --example batch_check -- MODEL TOKENS.npy`
use lathe::engine::{Engine, LoadOptions, Want};

fn main() -> lathe::Result<()> {
    let a: Vec<String> = std::env::args().collect();
    let toks: Vec<u32> = lathe::npy::read_i64(&a[2])?
        .data
        .iter()
        .map(|&t| t as u32)
        .collect();
    let mut e = Engine::load(std::path::Path::new(&a[1]), &LoadOptions::default())?;
    let v = e.vocab_size();
    // Alone: each sequence prefilled with a different prefix, then decoded.
    let cuts = [5usize, 9, 13];
    let mut alone = Vec::new();
    for &c in &cuts {
        let mut s = e.new_seq()?;
        e.forward(&mut s, &toks[..c], false)?;
        alone.push(e.forward(&mut s, &toks[c..c + 1], false)?);
    }
    // Together: three prefills in one batch, then three decode rows in one batch.
    let mut seqs: Vec<_> = cuts.iter().map(|_| e.new_seq().unwrap()).collect();
    {
        let mut items: Vec<_> = seqs
            .iter_mut()
            .zip(&cuts)
            .map(|(s, &c)| (s, &toks[..c], Want::None))
            .collect();
        e.forward_batch(&mut items)?;
    }
    let mut items: Vec<_> = seqs
        .iter_mut()
        .zip(&cuts)
        .map(|(s, &c)| (s, &toks[c..c + 1], Want::Last))
        .collect();
    let together = e.forward_batch(&mut items)?;
    for i in 0..cuts.len() {
        let d = (0..v)
            .map(|j| (alone[i][j] - together[i][j]).abs())
            .fold(0f32, f32::max);
        println!("seq {i}: max abs diff alone vs batched {d:.2e}");
    }
    Ok(())
}
