//! Run the CPU reference forward of a Qwen3.5-family model over a fixture's tokens and
//! print the error against its reference logits (a debugging aid).
use lathe::models::qwen35::cpu::CpuModel;
use lathe::models::ModelFile;

fn main() -> lathe::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let f = ModelFile::open(&args[1])?;
    let m = CpuModel::load(&f)?;
    let toks = lathe::npy::read_i64(&args[2])?;
    let refl = lathe::npy::read_f32(&args[3])?;
    let v = m.hp.n_vocab;
    let mut seq = m.new_seq();
    let (mut se, mut n, mut agree) = (0f64, 0usize, 0usize);
    for (t, &tok) in toks.data.iter().enumerate() {
        let l = m.step(&mut seq, tok as u32);
        let r = &refl.data[t * v..(t + 1) * v];
        for i in 0..v {
            se += ((l[i] - r[i]) as f64).powi(2);
        }
        n += v;
        let am = |x: &[f32]| {
            x.iter()
                .enumerate()
                .fold(0, |b, (i, y)| if *y > x[b] { i } else { b })
        };
        agree += (am(&l) == am(r)) as usize;
    }
    println!(
        "rms {:.3e} top1 {}/{}",
        (se / n as f64).sqrt(),
        agree,
        toks.data.len()
    );
    Ok(())
}
