//! A Hugging Face checkpoint directory from fuzzed bytes: the input's first line is
//! config.json, the rest model.safetensors. Open, describe, read the hyper-parameters and
//! load the weights on the CPU.
#![no_main]

use lathe::models::ModelFile;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let split = data.iter().position(|&b| b == b'\n').unwrap_or(data.len());
    let (config, weights) = data.split_at(split);
    let dir = std::env::temp_dir().join(format!("lathe-fuzz-hf-{}", std::process::id()));
    let _ = std::fs::create_dir_all(&dir);
    if std::fs::write(dir.join("config.json"), config).is_err()
        || std::fs::write(
            dir.join("model.safetensors"),
            weights.get(1..).unwrap_or(&[]),
        )
        .is_err()
    {
        return;
    }
    if let Ok(f) = ModelFile::open(&dir) {
        let _ = lathe::inspect::report(&f);
        if lathe::models::qwen35::Hparams::from_file(&f).is_ok() {
            let _ = lathe::models::qwen35::cpu::CpuModel::load(&f);
        }
        let _ = lathe::models::deepseek4::Hparams::from_file(&f);
    }
});
