//! Any text as a chat template, rendered with lathe's limits over a fixed conversation.
#![no_main]

use lathe::tokenizer::{ChatTemplate, TemplateLimits};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let src = String::from_utf8_lossy(data);
    let limits = TemplateLimits {
        fuel: 1_000_000,
        max_output: 1 << 20,
    };
    if let Ok(t) = ChatTemplate::with_limits(&src, limits) {
        let messages = serde_json::json!([
            {"role": "system", "content": "s"},
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "yo", "tool_calls": [
                {"type": "function", "function": {"name": "f", "arguments": {"a": 1}}}]}
        ]);
        let _ = t.render(&messages, true, &serde_json::Map::new());
    }
});
