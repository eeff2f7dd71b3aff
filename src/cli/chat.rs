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
    SamplingArgs, SpecArgs, TokenLimit,
};

#[derive(Args, Debug)]
pub struct ChatArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// System message that opens the conversation (kept across /reset).
    #[arg(long, value_name = "TEXT")]
    pub system: Option<String>,
    /// Most tokens per reply (a reply also ends at the model's end-of-turn token); -1:
    /// until the context (--ctx) is full.
    #[arg(
        short = 'n',
        long,
        value_name = "N",
        default_value_t = TokenLimit(Some(4096)),
        visible_alias = "n-predict",
        allow_negative_numbers = true
    )]
    pub max_tokens: TokenLimit,
    /// End a reply before this text (repeatable).
    #[arg(long, value_name = "STR", num_args = 1..)]
    pub stop: Vec<String>,
    /// Print the speeds of each reply on stderr.
    #[arg(long)]
    pub stats: bool,
    #[command(flatten)]
    pub template: super::text::ChatTemplateArgs,
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
    let template = args.template.choice()?;
    let hint = "it cannot chat; try `lathe run --prompt-tokens 1,2,3`";
    if !has_vocabulary(&args.model.model)? {
        return Err(no_vocabulary(&args.model.model, hint));
    }
    // The conversation's sequence and its checkpoint.
    let mut engine = load_engine_seqs(&args.model, 2, &args.spec)?;
    let Some(tok) = engine.tokenizer.as_ref() else {
        return Err(no_vocabulary(&args.model.model, hint));
    };
    let chat = ChatPrompt::chosen(tok, template.as_ref())?;
    if chat.fallback {
        eprintln!("note: the model carries no chat template; using ChatML");
    }
    let interrupt = interrupt_flag()?;
    let mut opts = GenerateOptions {
        max_tokens: None,
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
    let mut input = if interactive {
        Input::Editor(Box::new(LineEditor::new()?))
    } else {
        Input::Lines(stdin.lock())
    };
    loop {
        // Ctrl-C while waiting for input quits; while generating it stops the reply.
        set_busy(false);
        let input = input.read()?;
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
        opts.max_tokens = Some(args.max_tokens.tokens(args.model.ctx, prompt.len()));
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
    args.model.load.moe.save(&engine)
}

/// Where messages come from: a terminal, through a line editor, or a pipe or file.
enum Input<R> {
    Editor(Box<LineEditor>),
    Lines(R),
}

impl<R: BufRead> Input<R> {
    /// One message, `None` at the end of input.
    fn read(&mut self) -> Result<Option<String>> {
        match self {
            Input::Editor(e) => e.read_message(),
            Input::Lines(r) => read_message(r),
        }
    }
}

/// Line editing in a terminal (arrows, Home/End, Ctrl-R search; rustyline, readline's keys)
/// with the history of earlier sessions in `$XDG_STATE_HOME/lathe/chat_history` (else
/// `~/.local/state/lathe/chat_history`: the XDG base directory spec's place for history).
struct LineEditor {
    editor: rustyline::DefaultEditor,
    history: Option<std::path::PathBuf>,
}

impl LineEditor {
    fn new() -> Result<LineEditor> {
        let mut editor = rustyline::DefaultEditor::new()
            .map_err(|e| Error::Invalid(format!("line editor: {e}")))?;
        let var = |k| {
            std::env::var_os(k)
                .filter(|v| !v.is_empty())
                .map(std::path::PathBuf::from)
        };
        let history = var("XDG_STATE_HOME")
            .filter(|p| p.is_absolute())
            .or_else(|| var("HOME").map(|h| h.join(".local/state")))
            .map(|d| d.join("lathe").join("chat_history"));
        if let Some(h) = &history {
            // No history yet (a first session) is not an error.
            let _ = editor.load_history(h);
        }
        Ok(LineEditor { editor, history })
    }

    /// A line, or several joined when each but the last ends with `\`; Ctrl-D or Ctrl-C
    /// at the prompt end the input.
    fn read_message(&mut self) -> Result<Option<String>> {
        use rustyline::error::ReadlineError;
        let mut msg = String::new();
        let mut prompt = "> ";
        loop {
            let line = match self.editor.readline(prompt) {
                Ok(l) => l,
                Err(ReadlineError::Eof | ReadlineError::Interrupted) => {
                    return Ok((!msg.is_empty()).then_some(msg));
                }
                Err(e) => return Err(Error::Invalid(format!("reading the terminal: {e}"))),
            };
            if !line.trim().is_empty() {
                let _ = self.editor.add_history_entry(line.as_str());
                self.save_history();
            }
            match line.strip_suffix('\\') {
                Some(head) => {
                    msg.push_str(head);
                    msg.push('\n');
                    prompt = ". ";
                }
                None => {
                    msg.push_str(&line);
                    return Ok(Some(msg));
                }
            }
        }
    }

    /// Saved after every line, so a session ended by Ctrl-C during a reply keeps it.
    fn save_history(&mut self) {
        if let Some(h) = &self.history {
            if let Some(dir) = h.parent() {
                let _ = std::fs::create_dir_all(dir);
            }
            if let Err(e) = self.editor.save_history(h) {
                eprintln!("note: chat history not saved to {}: {e}", h.display());
                self.history = None;
            }
        }
    }
}

/// Reads one message from a pipe or file: a line, or several joined when each but the last
/// ends with `\`. `None` at end of input.
fn read_message(input: &mut impl BufRead) -> Result<Option<String>> {
    let mut msg = String::new();
    loop {
        let mut raw = Vec::new();
        let n = input
            .read_until(b'\n', &mut raw)
            .map_err(|e| Error::Invalid(format!("reading stdin: {e}")))?;
        if n == 0 {
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
            }
            None => {
                msg.push_str(line);
                return Ok(Some(msg));
            }
        }
    }
}
