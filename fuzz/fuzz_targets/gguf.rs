//! Any bytes as a GGUF file: open, describe, read the hyper-parameters and the vocabulary.
//! Seeds: `cp ../tests/fixtures/gguf/*.gguf ../tests/fixtures/models/*/model-q4_0.gguf corpus/gguf/`.
#![no_main]

use lathe::models::ModelFile;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let path = std::env::temp_dir().join(format!("lathe-fuzz-{}.gguf", std::process::id()));
    if std::fs::write(&path, data).is_err() {
        return;
    }
    if let Ok(f) = ModelFile::open(&path) {
        let _ = lathe::inspect::report(&f);
        let _ = lathe::models::qwen35::Hparams::from_file(&f);
        let _ = lathe::models::deepseek4::Hparams::from_file(&f);
        if let ModelFile::Gguf(g) = &f {
            let _ = lathe::tokenizer::Tokenizer::from_gguf(g);
        }
    }
});
