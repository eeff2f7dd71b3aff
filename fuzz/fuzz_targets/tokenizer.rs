//! Any bytes as a tokenizer.json, then its own bytes (lossily) as text to encode, bound
//! (the server's `exceeds`) and decode.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let path =
        std::env::temp_dir().join(format!("lathe-fuzz-{}-tokenizer.json", std::process::id()));
    if std::fs::write(&path, data).is_err() {
        return;
    }
    if let Ok(tok) = lathe::tokenizer::Tokenizer::from_file(&path) {
        let text = String::from_utf8_lossy(data);
        if let Ok(ids) = tok.encode(&text, true) {
            let _ = tok.decode(&ids);
        }
        let _ = tok.exceeds(&text, true, 64);
    }
});
