//! Any bytes as the JSON body of a chat or completion request: parsed as the server parses
//! it, and a chat request rendered through ChatML.
#![no_main]

use lathe::tokenizer::{ChatTemplate, CHATML};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(body) = serde_json::from_slice::<serde_json::Value>(data) else {
        return;
    };
    if let Ok(r) = lathe::server::api::chat_request(&body, 1000, 1) {
        if let Ok(t) = ChatTemplate::new(CHATML) {
            let _ = t.render(&r.messages, true, &r.template_vars);
        }
    }
    let _ = lathe::server::api::completion_request(&body, 1000, 1);
});
