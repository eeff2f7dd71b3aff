//! `lathe chat`: an interactive conversation on stdin/stdout.
//!
//! The conversation lives in one sequence. Each turn renders the whole conversation with the
//! chat template and hands it to [`Session::generate_at`], which feeds only the tokens past
//! what the sequence already holds when the earlier rendering is a token-level prefix of the
//! new one. When it is not (templates rewrite the last assistant turn: Qwen3.5 and
//! DeepSeek-V4 drop its reasoning; a reply cut by a stop string or the token limit), the
//! session's checkpoint, saved where the previous turn's conversation ended (before the
//! generation prompt), is restored and only the rest is fed. `--stats` shows per reply how
//! many prompt tokens were reused ("N cached").

use std::io::{BufRead, IsTerminal, Write};
use std::sync::atomic::Ordering;

use clap::Args;
use lathe::generate::{ChatPrompt, GenerateOptions, Session};
use lathe::{Error, Result};
use serde_json::{json, Value};

use super::run::{
    has_vocabulary, interrupt_flag, load_engine_seqs, no_vocabulary, set_busy, ModelArgs,
    SamplingArgs, SpecArgs,
};

#[derive(Args, Debug)]
pub struct ChatArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// System message that opens the conversation (kept across /reset).
    #[arg(long, value_name = "TEXT")]
    pub system: Option<String>,
    /// Most tokens per reply (a reply also ends at the model's end-of-turn token).
    #[arg(
        short = 'n',
        long,
        value_name = "N",
        default_value_t = 4096,
        visible_alias = "n-predict"
    )]
    pub max_tokens: usize,
    /// End a reply before this text (repeatable).
    #[arg(long, value_name = "STR", num_args = 1..)]
    pub stop: Vec<String>,
    /// Print the speeds of each reply on stderr.
    #[arg(long)]
    pub stats: bool,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    #[command(flatten)]
    pub spec: SpecArgs,
}

const HELP: &str = "Type a message and press Enter (end a line with \\ to go on to the next). \
Commands: /reset forgets the conversation, /exit or Ctrl-D quits. Ctrl-C stops a reply, \
or the reading of a long message (which is then dropped); it quits when nothing runs.";

pub fn run(args: ChatArgs) -> Result<()> {
    let sampler = args.sampling.config()?;
    let hint = "it cannot chat; try `lathe run --prompt-tokens 1,2,3`";
    if !has_vocabulary(&args.model.model)? {
        return Err(no_vocabulary(&args.model.model, hint));
    }
    // The conversation's sequence and its checkpoint.
    let mut engine = load_engine_seqs(&args.model, 2)?;
    let Some(tok) = engine.tokenizer.as_ref() else {
        return Err(no_vocabulary(&args.model.model, hint));
    };
    let chat = ChatPrompt::for_tokenizer(tok)?;
    if chat.fallback {
        eprintln!("note: the model carries no chat template; using ChatML");
    }
    let interrupt = interrupt_flag()?;
    let opts = GenerateOptions {
        max_tokens: Some(args.max_tokens),
        sampler,
        stop: args.stop.clone(),
        ignore_eog: false,
        cancel: Some(interrupt.clone()),
        spec: args.spec.options(&args.model)?,
    };
    let interactive = std::io::stdin().is_terminal();
    if interactive {
        eprintln!("{HELP}");
    }
    let opening: Vec<Value> = args
        .system
        .iter()
        .map(|s| json!({"role": "system", "content": s}))
        .collect();
    let mut messages = opening.clone();
    let mut session = Session::with_checkpoint(&engine)?;
    let stdin = std::io::stdin();
    let mut lines = stdin.lock();
    loop {
        // Ctrl-C while waiting for input quits; while generating it stops the reply.
        set_busy(false);
        let input = read_message(&mut lines, interactive)?;
        set_busy(true);
        interrupt.store(false, Ordering::SeqCst);
        let Some(input) = input else {
            break;
        };
        match input.trim() {
            "" => continue,
            "/exit" | "/quit" => break,
            "/reset" => {
                messages = opening.clone();
                session.reset(&engine)?;
                eprintln!("(conversation cleared)");
                continue;
            }
            "/help" | "/?" => {
                eprintln!("{HELP}");
                continue;
            }
            cmd if cmd.starts_with('/') && !cmd.contains(char::is_whitespace) => {
                eprintln!("unknown command {cmd}; /help lists them");
                continue;
            }
            _ => {}
        }
        messages.push(json!({"role": "user", "content": input}));
        let Some(tok) = engine.tokenizer.as_ref() else {
            unreachable!("checked above")
        };
        let (prompt, conversation) = chat.encode(tok, &Value::Array(messages.clone()))?;
        let stdout = std::io::stdout();
        let mut w = stdout.lock();
        let mut last_newline = true;
        let out = session.generate_at(&mut engine, &prompt, conversation, &opts, |p| {
            if !p.text.is_empty() {
                last_newline = p.text.ends_with('\n');
                let _ = w.write_all(p.text.as_bytes());
                let _ = w.flush();
            }
        })?;
        if !last_newline || out.text.is_empty() {
            let _ = writeln!(w);
        }
        if out.finish.is_none() {
            let _ = writeln!(w, "[interrupted]");
        }
        let _ = w.flush();
        drop(w);
        if args.stats {
            super::run::print_stats(&out);
        }
        if out.finish.is_none() && out.tokens.is_empty() {
            // Stopped while reading the prompt: the message goes unanswered and is dropped
            // (the session keeps what it fed; the next turn reuses what still agrees).
            messages.pop();
            continue;
        }
        messages.push(json!({"role": "assistant", "content": out.text}));
    }
    args.model.moe.save(&engine)
}

/// Reads one message: a line, or several joined when each but the last ends with `\`.
/// `None` at end of input.
fn read_message(input: &mut impl BufRead, interactive: bool) -> Result<Option<String>> {
    let mut msg = String::new();
    let mut prompt = "> ";
    loop {
        if interactive {
            print!("{prompt}");
            let _ = std::io::stdout().flush();
        }
        let mut raw = Vec::new();
        let n = input
            .read_until(b'\n', &mut raw)
            .map_err(|e| Error::Invalid(format!("reading stdin: {e}")))?;
        if n == 0 {
            if interactive {
                println!();
            }
            return Ok((!msg.is_empty()).then_some(msg));
        }
        // One bad line (a stray byte from a paste or a file in another encoding) should not
        // end the conversation: say so and read the next.
        let Ok(line) = String::from_utf8(raw) else {
            eprintln!("that line is not valid UTF-8: ignored");
            continue;
        };
        let line = line.strip_suffix('\n').unwrap_or(&line);
        let line = line.strip_suffix('\r').unwrap_or(line);
        match line.strip_suffix('\\') {
            Some(head) => {
                msg.push_str(head);
                msg.push('\n');
                prompt = ". ";
            }
            None => {
                msg.push_str(line);
                return Ok(Some(msg));
            }
        }
    }
}
