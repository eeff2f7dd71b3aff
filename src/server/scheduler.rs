//! The engine thread: it alone owns the [`Engine`] and `n` slots, each a sequence with the
//! tokens it holds. Requests wait in a bounded queue and take a free slot between steps.
//!
//! One step runs every active slot once: a decoding slot feeds its last sampled token, a
//! prefilling slot feeds the next piece of its prompt. Prompt tokens per step are capped
//! (`prefill_chunk`), so a long prompt delays the others' next token by at most one chunk's
//! work; the cap is shared fairly among the prefilling slots ([`share_prompt_budget`],
//! chunked-prefill interleaving as vLLM's and llama.cpp's servers do), so a short prompt
//! that arrives during a long one's prefill is fed in its first step rather than after it.
//! The step's work, a list of (slot, tokens), goes to the GPU as one batched forward
//! ([`Engine::forward_batch_with`]) in [`run_batch`].
//!
//! A slot keeps its tokens after a request ends: a later request whose prompt starts with all
//! of them feeds only the rest (the cache of a multi-turn chat). Recurrent layers cannot be
//! rolled back to a shorter prefix, so each slot also keeps a [`Checkpoint`], a second
//! sequence holding the state where its last prompt's conversation ended (`Job::checkpoint`,
//! before the generation prompt): a follow-up chat request whose rendering rewrites the last
//! assistant turn (templates drop its reasoning) restores it and feeds the rest. A slot whose
//! tokens and checkpoint are both no prefix is reset. A slot thus holds two sequence states
//! ([`SEQS_PER_SLOT`]); a slot that could not get its second one runs without checkpoint.
//!
//! With speculative decoding (`--spec`) each request drafts on its own sequence
//! ([`crate::spec`]): a step settles every decoding slot's last verify pass (the rollbacks in
//! shared passes), drafts per slot, and checks all slots' drafts in shared verify passes;
//! a slot then samples on through its pass's rows for as long as each sampled token is the
//! draft the next row was fed, so one step can stream several tokens of a request.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, TrySendError};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use rayon::prelude::*;
use tokio::sync::mpsc::UnboundedSender;

use llguidance::Matcher;

use super::constrain::{self, Constrainer};
use super::metrics::{MemoryKind, Metrics};
use crate::engine::{Engine, Logits, Seq, TopLogits, Want};
use crate::generate::{Checkpoint, HeldSeq};
use crate::sample::{FinishReason, Sampler, SamplerConfig, StopCondition};
use crate::spec::{PassCosts, SpecMode, SpecOptions, SpecStats, Speculator};
use crate::tokenizer::{StreamDecoder, Tokenizer};
use crate::{Error, Result};

/// Sequence states a slot holds (its sequence and its checkpoint): what
/// `LoadOptions::max_seqs` must allow per slot.
pub const SEQS_PER_SLOT: usize = 2;

/// One request for the engine thread.
pub struct Job {
    pub id: String,
    pub prompt: Vec<u32>,
    /// Prompt tokens after which the slot saves its checkpoint: where a chat's conversation
    /// ends and the generation prompt begins ([`crate::generate::conversation_len`]), the
    /// prompt's length for a completion.
    pub checkpoint: usize,
    /// Tokens to sample at most (already capped by the context length).
    pub max_tokens: usize,
    pub sampler: SamplerConfig,
    pub stop: Vec<String>,
    /// None = no log-probabilities; Some(k) = the chosen token's and the k most likely.
    pub logprobs: Option<usize>,
    pub logit_bias: Vec<(u32, f32)>,
    /// End-of-generation tokens do not end it: it runs to `max_tokens`.
    pub ignore_eos: bool,
    /// Structured output: the request's grammar, which says before each token which may
    /// come next ([`super::constrain`]).
    pub constraint: Option<Matcher>,
    pub deadline: Instant,
    pub events: UnboundedSender<Event>,
    /// The request's other choices (`n > 1`): the same prompt, their own sampling and
    /// events. They start together, each in its own free slot, and take this job's state
    /// after all but the last prompt token by a sequence copy ([`Worker::fork`]) instead of
    /// computing the prompt again; then every choice feeds that last token in one batched
    /// step and they decode side by side.
    pub siblings: Vec<Job>,
}

/// A request for the hidden states of some inputs (`/v1/embeddings`): the engine thread runs
/// each through the model in a free slot ([`Engine::hidden_states`]), between two steps.
pub struct EmbedJob {
    pub inputs: Vec<Vec<u32>>,
    pub deadline: Instant,
    /// Per input its final-norm hidden states `[n, n_embd]` row-major, or why not.
    pub reply: tokio::sync::oneshot::Sender<std::result::Result<Vec<Vec<f32>>, String>>,
}

/// What the queue holds (a job boxed: it is far larger than an embedding request).
enum Task {
    Generate(Box<Job>),
    Embed(EmbedJob),
}

/// The log-probability of one sampled token (natural log, of the model's distribution
/// before sampling settings), and the `top` most likely tokens with theirs.
#[derive(Clone, Debug)]
pub struct TokenLogprob {
    pub id: u32,
    pub logprob: f32,
    pub top: Vec<(u32, f32)>,
}

/// Why a generation ended, in the API's terms.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Finish {
    /// An end-of-generation token or a stop string.
    Stop,
    /// `max_tokens` or the context length.
    Length,
}

impl Finish {
    /// The API's `finish_reason` word.
    pub fn as_str(self) -> &'static str {
        match self {
            Finish::Stop => "stop",
            Finish::Length => "length",
        }
    }
}

/// What the engine thread tells a request's handler, in order: `Started`, any number of
/// `Delta`s, then `Done` or `Error`.
#[derive(Debug)]
pub enum Event {
    Started {
        n_cached: usize,
    },
    /// Text that is now safe to show (it may be empty) and the token sampled this step.
    Delta {
        text: String,
        logprob: Option<TokenLogprob>,
    },
    Done {
        finish: Finish,
        n_prompt: usize,
        n_cached: usize,
        n_generated: usize,
        /// What speculative decoding did for the request; `None` without it.
        spec: Option<SpecStats>,
    },
    Error {
        message: String,
        /// `timeout` or `internal`.
        code: &'static str,
    },
}

/// Settings of the engine thread.
#[derive(Clone, Debug)]
pub struct SchedulerConfig {
    pub n_slots: usize,
    pub queue: usize,
    pub prefill_chunk: usize,
    /// Most tokens a slot may hold (prompt + generated).
    pub ctx: usize,
    /// Speculative decoding (`--spec`, `--draft`): each decoding slot drafts tokens and
    /// the target checks every slot's in shared verify passes.
    pub spec: SpecOptions,
    /// `--draft-model`: loaded after the model, with these options (one sequence per slot).
    pub draft_model: Option<(std::path::PathBuf, crate::engine::LoadOptions)>,
    /// What `--spec auto` decides from; `None`: measured on the device after the load
    /// ([`crate::spec::measure_pass_costs`]).
    pub spec_costs: Option<PassCosts>,
}

/// Filled by the engine thread once the model is loaded.
pub struct Loaded {
    pub tokenizer: Arc<Tokenizer>,
    pub vocab: usize,
}

/// State the HTTP side reads.
#[derive(Default)]
pub struct Shared {
    pub loaded: OnceLock<Loaded>,
    /// Set when loading failed or the engine thread ended: the server cannot generate.
    pub failed: Mutex<Option<String>>,
    pub active: AtomicUsize,
    pub queued: AtomicUsize,
    /// What speculative decoding did over the finished requests; `None` before any
    /// speculated.
    pub spec: Mutex<Option<SpecStats>>,
    /// Compiles structured-output constraints; made at the first request that has one
    /// (the token trie of the whole vocabulary), or why it could not be.
    pub constrainer: OnceLock<std::result::Result<Constrainer, String>>,
    /// `/metrics`.
    pub metrics: Metrics,
    /// `/slots`: each slot as of the end of the last step.
    pub slots: Mutex<Vec<SlotInfo>>,
}

/// What `/slots` shows of a slot.
#[derive(Clone, Debug, Default)]
pub struct SlotInfo {
    /// The request it runs (its response id), if any.
    pub task: Option<String>,
    /// Tokens its sequence holds (prompt cache included).
    pub n_tokens: usize,
    /// Of the running request: prompt tokens, those taken from the cache, tokens generated.
    pub n_prompt: usize,
    pub n_cached: usize,
    pub n_generated: usize,
    pub prefilling: bool,
    pub speculating: bool,
    pub constrained: bool,
}

impl Shared {
    pub fn failure(&self) -> Option<String> {
        self.failed.lock().ok().and_then(|f| f.clone())
    }
}

/// Why a job was not queued.
#[derive(Debug)]
pub enum SubmitError {
    Full,
    Closed,
}

/// The HTTP side's handle on the engine thread.
#[derive(Clone)]
pub struct Scheduler {
    tx: SyncSender<Task>,
    pub shared: Arc<Shared>,
}

impl Scheduler {
    pub fn submit(&self, job: Job) -> std::result::Result<(), SubmitError> {
        self.queue(Task::Generate(Box::new(job)))
    }

    pub fn embed(&self, job: EmbedJob) -> std::result::Result<(), SubmitError> {
        self.queue(Task::Embed(job))
    }

    fn queue(&self, task: Task) -> std::result::Result<(), SubmitError> {
        self.shared.queued.fetch_add(1, Ordering::Relaxed);
        let r = self.tx.try_send(task);
        if r.is_err() {
            self.shared.queued.fetch_sub(1, Ordering::Relaxed);
        }
        match r {
            Ok(()) => Ok(()),
            Err(TrySendError::Full(_)) => Err(SubmitError::Full),
            Err(TrySendError::Disconnected(_)) => Err(SubmitError::Closed),
        }
    }
}

/// Starts the engine thread; `load` runs on it and makes the engine and its tokenizer. The
/// thread ends when every [`Scheduler`] is dropped and the last active request is done.
pub fn start(
    cfg: SchedulerConfig,
    load: impl FnOnce() -> Result<(Engine, Tokenizer)> + Send + 'static,
    on_loaded: impl FnOnce(std::result::Result<(), String>) + Send + 'static,
) -> (Scheduler, std::thread::JoinHandle<()>) {
    let (tx, rx) = std::sync::mpsc::sync_channel(cfg.queue.max(1));
    let shared = Arc::new(Shared::default());
    let sh = shared.clone();
    let handle = std::thread::Builder::new()
        .name("lathe-engine".into())
        .spawn(move || {
            let fail = |sh: &Shared, msg: String| {
                if let Ok(mut f) = sh.failed.lock() {
                    *f = Some(msg);
                }
            };
            let setup = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                load().and_then(|(mut engine, tok)| {
                    let mut spec = cfg.spec.clone();
                    if let Some((path, opts)) = &cfg.draft_model {
                        let d = Engine::load(path, opts).map_err(|e| {
                            Error::Invalid(format!("--draft-model {}: {e}", path.display()))
                        })?;
                        eprintln!("lathe serve: draft model {} loaded", path.display());
                        spec.draft_model = Some(crate::spec::DraftModel::new(d));
                    }
                    // A wrong --spec fails here, not at each request.
                    let speculates = Speculator::new(&mut engine, &spec)?.is_some();
                    let auto = match (spec.mode, speculates) {
                        (SpecMode::Auto, true) => Some(AutoSpec::new(&mut engine, &spec, &cfg)),
                        _ => None,
                    };
                    let mut slots = (0..cfg.n_slots.max(1))
                        .map(|_| Slot::new(&engine))
                        .collect::<Result<Vec<_>>>()?;
                    // Every slot's sequence first: checkpoints only take what is left.
                    for s in &mut slots {
                        match Checkpoint::new(&engine) {
                            Ok(c) => s.held.set_checkpoint(Some(c)),
                            Err(e) => eprintln!(
                                "lathe serve: a slot runs without prompt-cache checkpoint: {e}"
                            ),
                        }
                    }
                    Ok((engine, Arc::new(tok), slots, spec, auto))
                })
            }))
            .unwrap_or_else(|_| Err(Error::Invalid("loading crashed (internal error)".into())));
            let (engine, tokenizer, slots, spec, auto) = match setup {
                Ok(x) => x,
                Err(e) => {
                    fail(&sh, e.to_string());
                    on_loaded(Err(e.to_string()));
                    return;
                }
            };
            let m = &sh.metrics;
            m.slots.set(slots.len() as i64);
            let gpu_memory = |kind| m.gpu_memory.get_or_create(&MemoryKind { kind }).clone();
            gpu_memory("model").set(engine.model_bytes as i64);
            if let Some(mem) = &engine.gpu.memory {
                gpu_memory("heap").set(mem.heap as i64);
                if let Some(b) = mem.budget {
                    gpu_memory("budget").set(b as i64);
                }
            }
            let _ = sh.loaded.set(Loaded {
                tokenizer: tokenizer.clone(),
                vocab: engine.vocab_size(),
            });
            on_loaded(Ok(()));
            let mut cfg = cfg;
            cfg.spec = spec;
            // Every slot's state shares one KV pool per layer, bounded by the adapter's
            // binding limit: a reply stops there ("length") instead of failing the forward.
            if let Some(m) = engine.max_context().filter(|&m| m < cfg.ctx) {
                eprintln!(
                    "lathe serve: warning: {} slots (with their checkpoints) fit {m} positions \
                     each on this adapter, less than --ctx {}: replies stop there; use fewer \
                     --parallel slots for longer contexts",
                    cfg.n_slots, cfg.ctx
                );
                cfg.ctx = m;
            }
            let mut w = Worker {
                cfg,
                engine,
                tokenizer,
                slots,
                rx,
                shared: sh.clone(),
                clock: 0,
                waiting: None,
                auto,
            };
            w.publish_slots();
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| w.run()));
            let why = match r {
                Ok(()) => "the engine thread has stopped".to_string(),
                Err(_) => "the engine thread crashed (internal error)".to_string(),
            };
            fail(&sh, why);
        })
        .expect("spawning the engine thread");
    (Scheduler { tx, shared }, handle)
}

/// A sequence and the tokens it holds.
struct Slot {
    /// The slot's sequence, the tokens it holds and its checkpoint.
    held: HeldSeq,
    /// For picking the least recently used free slot.
    last_used: u64,
    active: Option<Active>,
}

impl Slot {
    /// Ends the slot's request with an internal error: `log` goes to the server's log after
    /// the request id, `message` to the client. `stale`: the failed step may have written part
    /// of the slot's cache, so its tokens are not reused.
    fn fail(&mut self, shared: &Shared, stale: bool, log: &str, message: String) {
        if stale {
            self.held.mark_stale();
        }
        if let Some(a) = self.active.take() {
            shared.active.fetch_sub(1, Ordering::Relaxed);
            eprintln!("lathe serve: {}: {log}", a.job.id);
            let _ = a.job.events.send(Event::Error {
                message,
                code: "internal",
            });
        }
    }
    fn new(engine: &Engine) -> Result<Slot> {
        Ok(Slot {
            held: HeldSeq::new(engine)?,
            last_used: 0,
            active: None,
        })
    }
}

/// A request running in a slot.
struct Active {
    job: Job,
    /// Tokens to feed next: the rest of the prompt, then each sampled token.
    feed: Vec<u32>,
    prefilling: bool,
    n_cached: usize,
    n_generated: usize,
    sampler: Sampler,
    stop: StopCondition,
    decoder: StreamDecoder,
    started: Instant,
    first_token: Option<Duration>,
    /// When the last token was sampled, for the per-token latency.
    last_token: Option<Instant>,
    /// The request's speculation; `None`: plain decode.
    spec: Option<Speculator>,
    /// The tokens the request's constraint allows for the token sampled next, computed
    /// during the step ([`Worker::run_step_masked`]); a bitset over the vocabulary.
    mask: Option<Vec<u32>>,
    /// A choice of `n > 1` waiting for the slot of its first choice to reach `fork`: it
    /// feeds nothing until then ([`Worker::fork`]).
    follows: Option<usize>,
    /// The first choice of `n > 1` with choices following it: the prompt position its
    /// state is copied at (the prompt's last token then goes through every choice).
    fork: Option<usize>,
}

impl Active {
    /// Tokens the slot's sequence holds past `held` (a verify pass's, while in flight).
    fn in_flight(&self) -> &[u32] {
        self.spec.as_ref().map_or(&[], |s| s.in_flight())
    }
}

/// What a slot feeds this step.
#[derive(Clone)]
struct Work {
    slot: usize,
    tokens: Vec<u32>,
    /// What of the last token's logits the slot samples from ([`Want::None`] while its
    /// prompt goes on).
    want: Want,
    /// Through the slot's speculator: its prompt pieces (`after`: the prompt's next
    /// token) or its sampled token (drafts and a verify pass).
    spec: Option<SpecWork>,
}

#[derive(Clone, Copy)]
enum SpecWork {
    Prompt { after: Option<u32> },
    Decode,
}

struct Worker {
    cfg: SchedulerConfig,
    engine: Engine,
    tokenizer: Arc<Tokenizer>,
    slots: Vec<Slot>,
    rx: Receiver<Task>,
    shared: Arc<Shared>,
    clock: u64,
    /// A job of several choices taken from the queue before enough slots were free: it
    /// starts, before any later job, once they are.
    waiting: Option<Job>,
    /// `--spec auto`'s measurements and last choice; `None` for the other modes and
    /// models that do not speculate.
    auto: Option<AutoSpec>,
}

/// `--spec auto`: the device's pass costs and what was last chosen with them.
struct AutoSpec {
    /// `None`: measuring failed, and `auto` does not speculate.
    costs: Option<PassCosts>,
    /// The last choice logged: speculating requests (the new one included) and the draft.
    logged: Option<(usize, usize)>,
    /// Requests `auto` declined to speculate since the last one that did.
    declined: usize,
}

/// While `--spec auto` declines, one request in this many speculates anyway at one draft,
/// so that the acceptance it decides with stays measured (real text changes it).
const PROBE_EVERY: usize = 32;

impl AutoSpec {
    /// The configured costs, else measured on `engine` (logged either way).
    fn new(engine: &mut Engine, spec: &SpecOptions, cfg: &SchedulerConfig) -> AutoSpec {
        let costs = match &cfg.spec_costs {
            Some(c) => Ok(c.clone()),
            None => crate::spec::measure_pass_costs(engine, spec, 3),
        };
        let costs = match costs {
            Ok(c) => {
                let ms: Vec<String> = c.pass.iter().map(|t| format!("{:.2}", t * 1e3)).collect();
                eprintln!(
                    "lathe serve: --spec auto: verify passes of 1..={} rows cost {} ms, a draft \
                     {:.2} ms",
                    c.pass.len(),
                    ms.join(" / "),
                    c.draft * 1e3
                );
                Some(c)
            }
            Err(e) => {
                eprintln!(
                    "lathe serve: --spec auto: measuring the verify passes failed ({e}): \
                     decoding without speculation"
                );
                None
            }
        };
        AutoSpec {
            costs,
            logged: None,
            declined: 0,
        }
    }

    /// The draft length for a request joining `speculating` speculating ones, at the
    /// acceptance measured so far (0: decode it plainly); the choice is logged when it
    /// changes.
    fn draft(&mut self, speculating: usize, measured: Option<SpecStats>, max: usize) -> usize {
        let Some(c) = &self.costs else {
            return 0;
        };
        let n = speculating + 1;
        let a = crate::spec::acceptance_estimate(measured);
        let mut k = crate::spec::choose_draft(c, n, a, max);
        if k == 0 {
            self.declined += 1;
            if self.declined.is_multiple_of(PROBE_EVERY) {
                k = 1;
            }
        } else {
            self.declined = 0;
        }
        if self.logged != Some((n, k)) {
            self.logged = Some((n, k));
            match k {
                0 => eprintln!(
                    "lathe serve: --spec auto: {n} requests at acceptance {a:.2}: plain decode \
                     pays more than speculation"
                ),
                k => eprintln!(
                    "lathe serve: --spec auto: {n} requests at acceptance {a:.2}: speculating \
                     with {k} drafts"
                ),
            }
        }
        k
    }
}

impl Worker {
    fn run(&mut self) {
        loop {
            if !self.admit() {
                return;
            }
            self.drop_finished_or_expired();
            let work = self.plan();
            if work.is_empty() {
                continue;
            }
            let results = self.run_step_masked(&work);
            self.absorb(work, results);
            self.publish_slots();
        }
    }

    /// Writes what `/slots` shows.
    fn publish_slots(&self) {
        let info = self
            .slots
            .iter()
            .map(|s| {
                let mut i = SlotInfo {
                    n_tokens: s.held.tokens().len(),
                    ..SlotInfo::default()
                };
                if let Some(a) = &s.active {
                    i.task = Some(a.job.id.clone());
                    i.n_prompt = a.job.prompt.len();
                    i.n_cached = a.n_cached;
                    i.n_generated = a.n_generated;
                    i.prefilling = a.prefilling;
                    i.speculating = a.spec.is_some();
                    i.constrained = a.job.constraint.is_some();
                }
                i
            })
            .collect();
        if let Ok(mut s) = self.shared.slots.lock() {
            *s = info;
        }
    }

    fn n_active(&self) -> usize {
        self.slots.iter().filter(|s| s.active.is_some()).count()
    }

    /// Moves queued jobs into free slots. Blocks while nothing is active. Returns false when
    /// the server is gone and nothing is left to do.
    fn admit(&mut self) -> bool {
        while self.slots.iter().any(|s| s.active.is_none()) {
            let free = self.slots.iter().filter(|s| s.active.is_none()).count();
            if let Some(job) = self.waiting.take() {
                if job.siblings.len() < free {
                    self.start_job(job);
                    continue;
                }
                self.waiting = Some(job);
                return true;
            }
            let job = if self.n_active() == 0 {
                match self.rx.recv() {
                    Ok(j) => j,
                    Err(_) => return false,
                }
            } else {
                match self.rx.try_recv() {
                    Ok(j) => j,
                    Err(_) => return true,
                }
            };
            self.shared.queued.fetch_sub(1, Ordering::Relaxed);
            let job = match job {
                Task::Generate(j) => *j,
                Task::Embed(e) => {
                    self.embed(e);
                    continue;
                }
            };
            if job.events.is_closed() {
                continue;
            }
            if Instant::now() >= job.deadline {
                for j in std::iter::once(&job).chain(&job.siblings) {
                    let _ = j.events.send(Event::Error {
                        message: "the request timed out waiting in the queue".into(),
                        code: "timeout",
                    });
                }
                continue;
            }
            if job.siblings.len() >= self.slots.len() {
                for j in std::iter::once(&job).chain(&job.siblings) {
                    let _ = j.events.send(Event::Error {
                        message: format!(
                            "{} choices need more slots than the server has",
                            job.siblings.len() + 1
                        ),
                        code: "internal",
                    });
                }
                continue;
            }
            if job.siblings.len() >= free {
                self.waiting = Some(job);
                return true;
            }
            self.start_job(job);
        }
        true
    }

    /// Runs an embedding job in the least recently used free slot (there is one: `admit`
    /// runs while one is), one input after another from an empty sequence; the slot then
    /// holds the last input, as after a prompt.
    fn embed(&mut self, e: EmbedJob) {
        if e.reply.is_closed() {
            return;
        }
        if Instant::now() >= e.deadline {
            let _ = e
                .reply
                .send(Err("the request timed out waiting in the queue".into()));
            return;
        }
        let free = self.slots.iter_mut().filter(|s| s.active.is_none());
        let Some(slot) = free.min_by_key(|s| s.last_used) else {
            let _ = e.reply.send(Err("no free slot (internal error)".into()));
            return;
        };
        self.clock += 1;
        slot.last_used = self.clock;
        let engine = &mut self.engine;
        let mut out = Vec::with_capacity(e.inputs.len());
        let mut run = || -> Result<()> {
            for t in &e.inputs {
                slot.held.reset(engine)?;
                out.push(engine.hidden_states(slot.held.seq_mut(), t)?);
                slot.held.fed(t);
            }
            Ok(())
        };
        let r = run();
        let n: usize = e.inputs.iter().map(Vec::len).sum();
        self.shared.metrics.prompt_tokens.inc_by(n as u64);
        let _ = e.reply.send(match r {
            Ok(()) => Ok(out),
            Err(err) => {
                slot.held.mark_stale();
                eprintln!("lathe serve: embeddings failed: {err}");
                Err(err.to_string())
            }
        });
    }

    /// Starts a job and its sibling choices (enough slots are free for all of them): the
    /// siblings follow the first choice's prompt ([`Worker::fork`]) unless their own slot
    /// already holds as much of it.
    fn start_job(&mut self, mut job: Job) {
        let siblings = std::mem::take(&mut job.siblings);
        let fork = job.prompt.len() - 1;
        let Some(lead) = self.start_one(job, None) else {
            for s in siblings {
                let _ = s.events.send(Event::Error {
                    message: "the request's first choice failed to start".into(),
                    code: "internal",
                });
            }
            return;
        };
        for s in siblings {
            self.start_one(s, Some(lead));
        }
        let following = self
            .slots
            .iter()
            .any(|s| s.active.as_ref().is_some_and(|a| a.follows == Some(lead)));
        if let Some(a) = self.slots[lead].active.as_mut().filter(|_| following) {
            a.fork = Some(fork);
            self.fork(lead);
        }
    }

    /// Hands the prompt state of the first choice in slot `lead`, once it holds its fork
    /// position, to the choices following it: each copies the sequence and feeds the rest
    /// of the prompt (its last token) itself. A failed copy leaves that choice to compute
    /// the prompt alone.
    fn fork(&mut self, lead: usize) {
        let Some(a) = self.slots[lead].active.as_ref() else {
            return;
        };
        if a.fork != Some(self.slots[lead].held.tokens().len()) {
            return;
        }
        let (at, id) = (a.fork.unwrap_or(0), a.job.id.clone());
        for j in 0..self.slots.len() {
            let follows = self.slots[j]
                .active
                .as_ref()
                .is_some_and(|f| f.follows == Some(lead) && f.job.id == id);
            if !follows {
                continue;
            }
            let (src, dst) = match j < lead {
                true => {
                    let (lo, hi) = self.slots.split_at_mut(lead);
                    (&hi[0], &mut lo[j])
                }
                false => {
                    let (lo, hi) = self.slots.split_at_mut(j);
                    (&lo[lead], &mut hi[0])
                }
            };
            let copied = dst.held.copy_from(&self.engine, &src.held);
            let f = dst.active.as_mut().expect("following slot");
            f.follows = None;
            match copied {
                Ok(()) => {
                    f.n_cached = at;
                    f.feed = f.job.prompt[at..].to_vec();
                }
                Err(e) => {
                    eprintln!(
                        "lathe serve: {}: copying the prompt state failed: {e}",
                        f.job.id
                    );
                    if let Err(e) = dst.held.reset(&self.engine) {
                        eprintln!(
                            "lathe serve: {}: resetting the sequence failed: {e}",
                            f.job.id
                        );
                        dst.held.mark_stale();
                    }
                    f.n_cached = 0;
                    f.feed = f.job.prompt.clone();
                }
            }
        }
        if let Some(a) = self.slots[lead].active.as_mut() {
            a.fork = None;
        }
    }

    /// Starts one job in a free slot (the one holding the longest reusable prefix, else
    /// the least recently used); `follow`: the slot of the first choice of its request,
    /// whose prompt state it is to copy. Returns the slot, or None when the job failed.
    fn start_one(&mut self, job: Job, follow: Option<usize>) -> Option<usize> {
        // The free slot holding the longest reusable prefix; else the least recently used.
        let free = self
            .slots
            .iter()
            .enumerate()
            .filter(|(_, s)| s.active.is_none());
        let best = free
            .max_by_key(|(_, s)| (s.held.reusable(&job.prompt), std::cmp::Reverse(s.last_used)))
            .map(|(i, _)| i);
        let i = best?;
        let speculating = self
            .slots
            .iter()
            .filter(|s| s.active.as_ref().is_some_and(|a| a.spec.is_some()))
            .count();
        self.clock += 1;
        let slot = &mut self.slots[i];
        slot.last_used = self.clock;
        let n_cached = match slot.held.resume(&self.engine, &job.prompt) {
            Ok(n) => n,
            Err(e) => {
                let _ = job.events.send(Event::Error {
                    message: format!("preparing the sequence failed: {e}"),
                    code: "internal",
                });
                return None;
            }
        };
        let cached = &job.prompt[..n_cached];
        // A choice follows the first unless its slot holds as much of the prompt already.
        let follow = follow.filter(|_| n_cached + 1 < job.prompt.len());
        // A constrained request does not speculate: a draft's tokens would each need the
        // grammar's mask before the verify pass could accept them. Nor do the choices of
        // `n > 1`: a copied sequence has no draft state, and they decode batched anyway.
        let several = follow.is_some() || !job.siblings.is_empty();
        let spec = match job.constraint.is_some() || several {
            true => Ok(None),
            false => {
                let measured = self.shared.spec.lock().ok().and_then(|s| *s);
                let draft = self
                    .auto
                    .as_mut()
                    .map(|a| a.draft(speculating, measured, self.cfg.spec.draft));
                new_speculator(&mut self.engine, &self.cfg.spec, draft, cached)
            }
        };
        let spec = match spec {
            Ok(s) => s,
            Err(e) => {
                slot.held.mark_stale();
                let _ = job.events.send(Event::Error {
                    message: format!("preparing speculative decoding failed: {e}"),
                    code: "internal",
                });
                return None;
            }
        };
        let eog = if job.ignore_eos {
            Vec::new()
        } else {
            self.tokenizer.eog_ids()
        };
        let _ = job.events.send(Event::Started { n_cached });
        slot.active = Some(Active {
            feed: job.prompt[n_cached..].to_vec(),
            prefilling: true,
            n_cached,
            n_generated: 0,
            sampler: Sampler::new(job.sampler.clone()),
            stop: StopCondition::new(Some(job.max_tokens), job.stop.clone(), eog),
            decoder: StreamDecoder::new(),
            started: Instant::now(),
            first_token: None,
            last_token: None,
            spec,
            mask: None,
            follows: follow,
            fork: None,
            job,
        });
        self.shared.active.fetch_add(1, Ordering::Relaxed);
        Some(i)
    }

    /// Frees the slots of requests whose client has gone, and ends those past their deadline.
    fn drop_finished_or_expired(&mut self) {
        // A choice whose first choice ended before its fork computes the prompt alone.
        for j in 0..self.slots.len() {
            let Some(lead) = self.slots[j].active.as_ref().and_then(|a| a.follows) else {
                continue;
            };
            let id = self.slots[j].active.as_ref().map(|a| a.job.id.clone());
            let leading = self.slots[lead]
                .active
                .as_ref()
                .is_some_and(|a| a.fork.is_some() && Some(&a.job.id) == id.as_ref());
            if !leading {
                if let Some(a) = self.slots[j].active.as_mut() {
                    a.follows = None;
                }
            }
        }
        let now = Instant::now();
        for slot in &mut self.slots {
            let Some(a) = &slot.active else { continue };
            let gone = a.job.events.is_closed();
            if !gone && now < a.job.deadline {
                continue;
            }
            // Free the slot before telling the client, as `emit` does.
            end_spec(&mut self.engine, &self.shared, slot);
            let a = slot.active.take().expect("active slot");
            self.shared.active.fetch_sub(1, Ordering::Relaxed);
            if gone {
                self.shared.metrics.count("cancelled");
                eprintln!("lathe serve: {} cancelled (client gone)", a.job.id);
            } else {
                eprintln!("lathe serve: {} timed out", a.job.id);
                let _ = a.job.events.send(Event::Error {
                    message: "the request timed out".into(),
                    code: "timeout",
                });
            }
        }
    }

    /// This step's work: every decoding slot's token, then prompt pieces up to the chunk.
    fn plan(&self) -> Vec<Work> {
        let mut work = Vec::new();
        for (i, s) in self.slots.iter().enumerate() {
            if let Some(a) = &s.active {
                if !a.prefilling {
                    work.push(Work {
                        slot: i,
                        tokens: a.feed.clone(),
                        want: want_of(a),
                        spec: a.spec.as_ref().map(|_| SpecWork::Decode),
                    });
                }
            }
        }
        // Oldest request first: the remainder of an uneven share goes to it.
        let mut pre: Vec<(usize, Instant)> = self
            .slots
            .iter()
            .enumerate()
            .filter_map(|(i, s)| {
                s.active
                    .as_ref()
                    .filter(|a| a.prefilling && a.follows.is_none())
                    .map(|a| (i, a.started))
            })
            .collect();
        pre.sort_by_key(|p| p.1);
        // What each could feed: the rest of its prompt, up to its checkpoint (saved between
        // two steps) where that comes first, and up to the fork of choices following it.
        let wants: Vec<usize> = pre
            .iter()
            .map(|&(i, _)| {
                let a = self.slots[i].active.as_ref().expect("prefilling slot");
                let (held, ck) = (self.slots[i].held.tokens().len(), a.job.checkpoint);
                let mut n = a.feed.len();
                if held < ck && ck < held + n {
                    n = ck - held;
                }
                if let Some(f) = a.fork.filter(|&f| held < f && f < held + n) {
                    n = f - held;
                }
                n
            })
            .collect();
        let shares = share_prompt_budget(self.cfg.prefill_chunk.max(1), &wants);
        for (&(i, _), n) in pre.iter().zip(shares) {
            if n == 0 {
                continue;
            }
            let a = self.slots[i].active.as_ref().expect("prefilling slot");
            let feed = &a.feed;
            work.push(Work {
                slot: i,
                tokens: feed[..n].to_vec(),
                want: if n == feed.len() {
                    want_of(a)
                } else {
                    Want::None
                },
                spec: a.spec.as_ref().map(|_| SpecWork::Prompt {
                    after: feed.get(n).copied(),
                }),
            });
        }
        work
    }

    /// [`Worker::run_step`], with the token masks of the constrained slots that sample this
    /// step computed on the CPU meanwhile, on a second thread (rayon across slots): the mask
    /// then costs the step nothing while it is shorter than the GPU's work. A slot whose mask
    /// fails ends with an error (its sequence, fed this step, is marked stale).
    fn run_step_masked(&mut self, work: &[Work]) -> Vec<Result<Logits>> {
        let mut taken: Vec<(usize, Matcher)> = Vec::new();
        for w in work.iter().filter(|w| w.want != Want::None) {
            if let Some(m) = self.slots[w.slot]
                .active
                .as_mut()
                .and_then(|a| a.job.constraint.take())
            {
                taken.push((w.slot, m));
            }
        }
        if taken.is_empty() {
            return self.run_step(work);
        }
        let (results, masks) = std::thread::scope(|s| {
            let h = s.spawn(|| {
                taken
                    .par_iter_mut()
                    .map(|(_, m)| constrain::mask(m))
                    .collect::<Vec<_>>()
            });
            let r = self.run_step(work);
            (r, h.join())
        });
        let masks = masks.unwrap_or_else(|_| {
            let e = Err("computing the token mask crashed (internal error)".to_string());
            vec![e; taken.len()]
        });
        for ((i, m), mask) in taken.into_iter().zip(masks) {
            let slot = &mut self.slots[i];
            let Some(a) = slot.active.as_mut() else {
                continue;
            };
            a.job.constraint = Some(m);
            match mask {
                Ok(mask) => a.mask = Some(mask),
                Err(e) => slot.fail(
                    &self.shared,
                    true,
                    &format!("the grammar failed: {e}"),
                    format!("the output constraint failed: {e}"),
                ),
            }
        }
        results
    }

    /// Runs one step's work: the plain items in one batched forward ([`run_batch`]); the
    /// prompt pieces of speculating slots one at a time through their speculators (the MTP
    /// block reads each piece's rows); the sampled tokens of speculating slots drafted on,
    /// then checked together in shared verify passes ([`verify_many`]). Per item what its
    /// `want` asks of its next logits.
    fn run_step(&mut self, work: &[Work]) -> Vec<Result<Logits>> {
        let plain: Vec<Work> = work.iter().filter(|w| w.spec.is_none()).cloned().collect();
        let plain_out = match plain.is_empty() {
            true => Vec::new(),
            false => run_batch(&mut self.engine, &mut self.slots, &plain),
        };
        let mut plain_out = plain_out.into_iter();
        let settle_err = self.settle_decoding(work).err();
        let mut out: Vec<Option<Result<Logits>>> = Vec::with_capacity(work.len());
        let mut prepared = Vec::new();
        for (i, w) in work.iter().enumerate() {
            let Slot { held, active, .. } = &mut self.slots[w.slot];
            let Some(a) = active.as_mut() else {
                out.push(Some(Err(Error::Invalid("the slot has no request".into()))));
                continue;
            };
            // The tokens the sequence will hold once what is in flight settles.
            let holds = held.tokens().len() + a.in_flight().len();
            let room = self.cfg.ctx.saturating_sub(holds + 1);
            let left = a.job.max_tokens.saturating_sub(a.n_generated + 1);
            let r = match (w.spec, a.spec.as_mut()) {
                (Some(SpecWork::Decode), Some(_)) if settle_err.is_some() => {
                    Err(Error::Gpu(format!(
                        "rolling back drafts failed: {}",
                        settle_err.as_deref().unwrap_or("")
                    )))
                }
                (None, _) => plain_out.next().unwrap_or_else(|| {
                    Err(Error::Gpu("the batch returned too few results".into()))
                }),
                (Some(SpecWork::Prompt { after }), Some(s)) => {
                    held.spec_feed_prompt(&mut self.engine, s, &w.tokens, after, w.want)
                }
                (Some(SpecWork::Decode), Some(s)) => {
                    match held.spec_prepare(&mut self.engine, s, w.tokens[0], room.min(left)) {
                        Ok(()) => {
                            prepared.push(i);
                            out.push(None);
                            continue;
                        }
                        Err(e) => Err(e),
                    }
                }
                (Some(_), None) => Err(Error::Invalid("the slot does not speculate".into())),
            };
            if r.is_err() && w.spec.is_some() {
                held.mark_stale();
            }
            out.push(Some(r));
        }
        if !prepared.is_empty() {
            let in_step: Vec<usize> = prepared.iter().map(|&i| work[i].slot).collect();
            let mut want = vec![Want::None; self.slots.len()];
            for &i in &prepared {
                want[work[i].slot] = work[i].want;
            }
            let mut items: Vec<(&mut Speculator, &mut Seq, Want)> = Vec::new();
            let mut order = Vec::new();
            for (j, s) in self.slots.iter_mut().enumerate() {
                if !in_step.contains(&j) {
                    continue;
                }
                let Slot { held, active, .. } = s;
                if let Some(sp) = active.as_mut().and_then(|a| a.spec.as_mut()) {
                    items.push((sp, held.seq_mut(), want[j]));
                    order.push(j);
                }
            }
            let r = crate::spec::verify_many(&mut self.engine, &mut items);
            drop(items);
            let mut by_slot: Vec<Option<Result<Logits>>> =
                (0..self.slots.len()).map(|_| None).collect();
            match r {
                Ok(ls) if ls.len() == order.len() => {
                    for (j, l) in order.into_iter().zip(ls) {
                        by_slot[j] = Some(Ok(l));
                    }
                }
                r => {
                    let msg = match r {
                        Err(e) => e.to_string(),
                        Ok(_) => "the verify pass returned too few results".into(),
                    };
                    for &j in &in_step {
                        self.slots[j].held.mark_stale();
                        by_slot[j] = Some(Err(Error::Gpu(msg.clone())));
                    }
                }
            }
            for &i in &prepared {
                out[i] = by_slot[work[i].slot].take();
            }
        }
        out.into_iter()
            .map(|r| r.unwrap_or_else(|| Err(Error::Gpu("the verify pass skipped a slot".into()))))
            .collect()
    }

    /// Settles the verify passes in flight of this step's speculating decode slots, their
    /// rollbacks in shared passes ([`crate::spec::settle_many`]). On failure the slots are
    /// stale.
    fn settle_decoding(&mut self, work: &[Work]) -> std::result::Result<(), String> {
        let slots: Vec<usize> = work
            .iter()
            .filter(|w| matches!(w.spec, Some(SpecWork::Decode)))
            .map(|w| w.slot)
            .collect();
        let mut items: Vec<(&mut Speculator, &mut Seq)> = Vec::new();
        let mut order = Vec::new();
        for (j, s) in self.slots.iter_mut().enumerate() {
            let Slot { held, active, .. } = s;
            if let (true, Some(sp)) = (
                slots.contains(&j),
                active.as_mut().and_then(|a| a.spec.as_mut()),
            ) {
                items.push((sp, held.seq_mut()));
                order.push(j);
            }
        }
        if items.is_empty() {
            return Ok(());
        }
        let r = crate::spec::settle_many(&mut self.engine, &mut items);
        drop(items);
        match r {
            Ok(fed) => {
                for (j, t) in order.into_iter().zip(fed) {
                    self.slots[j].held.fed(&t);
                }
                Ok(())
            }
            Err(e) => {
                for j in order {
                    self.slots[j].held.mark_stale();
                }
                Err(e.to_string())
            }
        }
    }

    /// The next row of slot `i`'s verify pass in flight when `id`, just sampled, is the
    /// draft it was fed; a request whose row cannot be sampled ends with an error.
    fn advance(&mut self, i: usize, id: u32) -> Option<Logits> {
        let a = self.slots[i].active.as_mut()?;
        let (logits, _) = a.spec.as_mut()?.advance(id)?;
        match crate::generate::check_finite(&self.engine, &logits, a.n_generated) {
            Ok(()) => Some(logits),
            Err(e) => {
                self.slots[i].fail(&self.shared, true, &e.to_string(), e.to_string());
                None
            }
        }
    }

    /// Takes the step's logits: advances prompts, samples, streams, finishes.
    fn absorb(&mut self, work: Vec<Work>, results: Vec<Result<Logits>>) {
        // (slot, logits) of the slots that sample this step.
        let mut to_sample: Vec<(usize, Logits)> = Vec::new();
        for (w, r) in work.into_iter().zip(results) {
            let slot = &mut self.slots[w.slot];
            let Some(a) = slot.active.as_mut() else {
                continue;
            };
            match r {
                Ok(logits) => {
                    if w.spec.is_none() {
                        slot.held.fed(&w.tokens);
                    }
                    a.feed.drain(..w.tokens.len());
                    if a.prefilling && slot.held.tokens().len() == a.job.checkpoint {
                        // A failed copy leaves no checkpoint; the request goes on.
                        if let Err(e) = slot.held.save_checkpoint(&self.engine) {
                            eprintln!("lathe serve: {}: checkpoint failed: {e}", a.job.id);
                        }
                    }
                    if !a.feed.is_empty() {
                        if a.fork.is_some() {
                            self.fork(w.slot);
                        }
                        continue;
                    }
                    if let Err(e) =
                        crate::generate::check_finite(&self.engine, &logits, a.n_generated)
                    {
                        slot.fail(&self.shared, false, &e.to_string(), e.to_string());
                        continue;
                    }
                    a.prefilling = false;
                    to_sample.push((w.slot, logits));
                }
                Err(e) => slot.fail(
                    &self.shared,
                    true,
                    &format!("forward failed: {e}"),
                    format!("the forward pass failed: {e}"),
                ),
            }
        }
        // Sampling full logits costs O(vocab) per slot: in parallel over slots. A speculating
        // slot whose sampled token is the draft its verify pass's next row was fed samples
        // again from that row, in the next round.
        let mut round = to_sample;
        while !round.is_empty() {
            let mut logits_of: Vec<Option<Logits>> = (0..self.slots.len()).map(|_| None).collect();
            for (i, l) in round {
                logits_of[i] = Some(l);
            }
            // rayon's collect keeps the slots' order.
            let picks: Vec<(usize, u32, Option<TokenLogprob>)> = self
                .slots
                .par_iter_mut()
                .zip(logits_of.par_iter_mut())
                .enumerate()
                .filter_map(|(i, (s, l))| {
                    let mut logits = l.take()?;
                    let a = s.active.as_mut()?;
                    // The penalties' history: what the sequence holds, in flight included.
                    let history = match a.in_flight() {
                        [] => std::borrow::Cow::Borrowed(s.held.tokens()),
                        f => std::borrow::Cow::Owned([s.held.tokens(), f].concat()),
                    };
                    let (id, lp) = sample_one(a, &history, &mut logits);
                    Some((i, id, lp))
                })
                .collect();
            round = Vec::new();
            for (i, id, logprob) in picks {
                self.emit(i, id, logprob);
                if let Some(l) = self.advance(i, id) {
                    round.push((i, l));
                }
            }
        }
    }

    /// Streams one sampled token and ends the request when it was the last.
    fn emit(&mut self, i: usize, id: u32, logprob: Option<TokenLogprob>) {
        let ctx = self.cfg.ctx;
        let slot = &mut self.slots[i];
        let Some(a) = slot.active.as_mut() else {
            return;
        };
        a.n_generated += 1;
        let now = Instant::now();
        let m = &self.shared.metrics;
        match a.last_token {
            None => {
                let ttft = now - a.started;
                a.first_token = Some(ttft);
                m.time_to_first_token.observe(ttft.as_secs_f64());
            }
            Some(t) => m.time_per_token.observe((now - t).as_secs_f64()),
        }
        a.last_token = Some(now);
        let piece = a.decoder.push(&self.tokenizer, id);
        let step = a.stop.push(id, &piece);
        let mut text = step.text;
        let mut finish = step.finish.map(|f| match f {
            FinishReason::Length => Finish::Length,
            _ => Finish::Stop,
        });
        // The next forward would pass the context length.
        if finish.is_none() && slot.held.tokens().len() + a.in_flight().len() >= ctx {
            text.push_str(&a.stop.finish());
            finish = Some(Finish::Length);
        }
        // The constraint takes the token; a grammar that is complete ends the reply.
        let refused = match (finish, a.job.constraint.as_mut()) {
            (None, Some(m)) => match m.consume_token(id) {
                Ok(()) => {
                    if m.is_stopped() {
                        text.push_str(&a.stop.finish());
                        finish = Some(Finish::Stop);
                    }
                    None
                }
                Err(e) => Some(e.to_string()),
            },
            _ => None,
        };
        if let Some(e) = refused {
            slot.fail(
                &self.shared,
                false,
                &format!("the grammar refused token {id}: {e}"),
                format!("the output constraint refused a token: {e}"),
            );
            return;
        }
        if finish == Some(Finish::Stop) && a.job.constraint.is_some() {
            text.push_str(&a.decoder.flush());
        }
        if finish == Some(Finish::Length) {
            text.push_str(&a.decoder.flush());
        }
        let sent = a.job.events.send(Event::Delta { text, logprob }).is_ok();
        match finish {
            Some(finish) => {
                // Free the slot before saying so: a client that reads `Done` and asks
                // /health sees it free.
                let spec = end_spec(&mut self.engine, &self.shared, slot);
                let a = slot.active.take().expect("active slot");
                self.shared.active.fetch_sub(1, Ordering::Relaxed);
                log_done(&a, finish);
                m.count(finish.as_str());
                m.prompt_tokens.inc_by(a.job.prompt.len() as u64);
                m.prompt_cached_tokens.inc_by(a.n_cached as u64);
                if a.n_cached > 0 {
                    m.prompt_cache_hits.inc();
                }
                m.generated_tokens.inc_by(a.n_generated as u64);
                let _ = a.job.events.send(Event::Done {
                    finish,
                    n_prompt: a.job.prompt.len(),
                    n_cached: a.n_cached,
                    n_generated: a.n_generated,
                    spec,
                });
            }
            None if !sent => {
                self.shared.metrics.count("cancelled");
                eprintln!("lathe serve: {} cancelled (client gone)", a.job.id);
                end_spec(&mut self.engine, &self.shared, slot);
                slot.active = None;
                self.shared.active.fetch_sub(1, Ordering::Relaxed);
            }
            None => a.feed = vec![id],
        }
    }
}

/// Settles the speculation of the request in `slot` (the sequence then holds exactly the
/// tokens its slot says; on failure it is marked stale) and adds its counts to the server's.
/// Prompt tokens of one step for each prefilling slot, from the step's `budget`: `wants[i]`
/// is what slot `i` (oldest request first) could feed. Max-min fair (water-filling): each
/// slot gets up to an equal share, and what a slot needing less leaves is shared again
/// among the others; the remainder of an uneven division goes to the oldest. A short prompt
/// arriving during a long one's prefill is thus fed whole in its first step while the long
/// one keeps the rest, and a stream of short prompts cannot starve a long one: it gets at
/// least `budget / n` of every step with `n` prompts in prefill.
fn share_prompt_budget(budget: usize, wants: &[usize]) -> Vec<usize> {
    let mut got = vec![0; wants.len()];
    let mut left = budget;
    loop {
        let open: Vec<usize> = (0..wants.len()).filter(|&i| got[i] < wants[i]).collect();
        if open.is_empty() || left == 0 {
            return got;
        }
        let share = left / open.len();
        if share == 0 {
            // Fewer tokens left than open slots: one each, oldest first.
            for &i in open.iter().take(left) {
                got[i] += 1;
            }
            return got;
        }
        for &i in &open {
            let n = share.min(wants[i] - got[i]);
            got[i] += n;
            left -= n;
        }
    }
}

fn end_spec(engine: &mut Engine, shared: &Shared, slot: &mut Slot) -> Option<SpecStats> {
    let Slot { held, active, .. } = slot;
    let s = active.as_mut()?.spec.as_mut()?;
    if let Err(e) = held.settle(engine, s) {
        eprintln!("lathe serve: settling speculation failed: {e}");
        held.mark_stale();
    }
    let st = s.stats;
    shared.metrics.spec_drafted.inc_by(st.drafted as u64);
    shared.metrics.spec_accepted.inc_by(st.accepted as u64);
    if let Ok(mut all) = shared.spec.lock() {
        let t = all.get_or_insert_with(SpecStats::default);
        t.drafted += st.drafted;
        t.accepted += st.accepted;
        t.verify_passes += st.verify_passes;
        t.tokens += st.tokens;
    }
    Some(st)
}

/// The speculation of a request whose slot holds `cached` already (`None`: speculation is
/// off, the model cannot run it, or `--spec auto` chose plain decode).
///
/// `auto_draft`: `--spec auto`'s draft length ([`AutoSpec::draft`], 0: plain decode): it
/// speculates whenever the device's measured pass costs and the measured acceptance say
/// that speculation yields more tokens per second than plain batched decode
/// ([`crate::spec::choose_draft`]). An explicit `--spec mtp` or `draft` always speculates
/// with `--draft` tokens.
fn new_speculator(
    engine: &mut Engine,
    opts: &SpecOptions,
    auto_draft: Option<usize>,
    cached: &[u32],
) -> Result<Option<Speculator>> {
    let chosen;
    let opts = match auto_draft {
        Some(0) => return Ok(None),
        Some(k) => {
            chosen = SpecOptions {
                draft: k,
                ..opts.clone()
            };
            &chosen
        }
        None => opts,
    };
    let mut s = Speculator::new(engine, opts)?;
    if let Some(s) = &mut s {
        s.held(cached)?;
    }
    Ok(s)
}

fn log_done(a: &Active, finish: Finish) {
    let total = a.started.elapsed();
    let ttft = a.first_token.unwrap_or(total);
    let decode = total.saturating_sub(ttft).as_secs_f64();
    let mut rate = if a.n_generated > 1 && decode > 0.0 {
        format!(" ({:.1} tok/s)", (a.n_generated - 1) as f64 / decode)
    } else {
        String::new()
    };
    if let Some(s) = &a.spec {
        rate.push_str(&format!(
            ", drafts accepted {:.1}% ({} of {})",
            100.0 * s.stats.acceptance(),
            s.stats.accepted,
            s.stats.drafted
        ));
    }
    eprintln!(
        "lathe serve: {} prompt {} ({} cached), generated {}{rate}, first token {:.0} ms, finish {}",
        a.job.id,
        a.job.prompt.len(),
        a.n_cached,
        a.n_generated,
        ttft.as_secs_f64() * 1e3,
        finish.as_str()
    );
}

/// What a slot's forward returns for sampling: the sampler's plan
/// ([`crate::sample::SamplerConfig::gpu_want`]: the best logits, found on the GPU, for greedy
/// and top-k), but full logits when `logit_bias` or a constraint's mask changes them first.
fn want_of(a: &Active) -> Want {
    if a.job.logit_bias.is_empty() && a.job.constraint.is_none() {
        a.sampler.config.gpu_want(a.job.logprobs)
    } else {
        Want::Last
    }
}

/// Samples the next token of `a` from what its forward returned ([`want_of`]); `history` is
/// everything the slot holds (prompt and generated tokens), for the penalties.
fn sample_one(a: &mut Active, history: &[u32], logits: &mut Logits) -> (u32, Option<TokenLogprob>) {
    let logits = match logits {
        Logits::Full(l) => l,
        Logits::Top(t) => {
            let id = a.sampler.sample_top(t);
            let lp = a.job.logprobs.map(|k| logprob_of_top(t, id, k));
            return (id, lp);
        }
    };
    for &(id, b) in &a.job.logit_bias {
        if let Some(l) = logits.get_mut(id as usize) {
            *l += b;
        }
    }
    let raw = a.job.logprobs.map(|_| logits.to_vec());
    // Masked before every sampler step (penalties, top-k, ...): only what the grammar allows.
    if let Some(mask) = a.mask.take() {
        crate::sample::mask_logits(logits, &mask);
    }
    let id = a.sampler.sample(logits, history);
    let lp = raw.map(|raw| logprob_of(&raw, id, a.job.logprobs.unwrap_or(0)));
    (id, lp)
}

/// log-softmax of `logits` at `id`, and the `k` largest entries with theirs.
pub fn logprob_of(logits: &[f32], id: u32, k: usize) -> TokenLogprob {
    let lse = crate::sample::log_sum_exp(logits);
    let lp = |x: f32| (x as f64 - lse) as f32;
    let top = crate::sample::top_k(logits, k.max(1))
        .into_iter()
        .take(k)
        .map(|(t, l)| (t, lp(l)))
        .collect();
    TokenLogprob {
        id,
        logprob: logits
            .get(id as usize)
            .map_or(f32::NEG_INFINITY, |&l| lp(l)),
        top,
    }
}

/// [`logprob_of`] from the best logits and the log-sum-exp the GPU found: `top` holds at
/// least `k` candidates and the sampled `id` (greedy and top-k only pick among them).
pub fn logprob_of_top(top: &TopLogits, id: u32, k: usize) -> TokenLogprob {
    let lse = top.lse.map_or(f64::NAN, |l| l as f64);
    let lp = |x: f32| (x as f64 - lse) as f32;
    TokenLogprob {
        id,
        logprob: top
            .cands
            .iter()
            .find(|c| c.0 == id)
            .map_or(f32::NEG_INFINITY, |c| lp(c.1)),
        top: top.cands.iter().take(k).map(|&(t, l)| (t, lp(l))).collect(),
    }
}

/// Runs one step's work in one batched forward: `work[i].tokens` through
/// `slots[work[i].slot]` (each slot at most once), returning per item what its `want` asked
/// of its last token's logits. A failed pass leaves every sequence in it in an unknown
/// state: they are all marked stale.
fn run_batch(engine: &mut Engine, slots: &mut [Slot], work: &[Work]) -> Vec<Result<Logits>> {
    let result = {
        let mut seqs: Vec<Option<&mut Seq>> =
            slots.iter_mut().map(|s| Some(s.held.seq_mut())).collect();
        let mut items: Vec<(&mut Seq, &[u32], Want)> = work
            .iter()
            .map(|w| {
                let seq = seqs[w.slot].take().expect("a slot appears once in a step");
                (seq, w.tokens.as_slice(), w.want)
            })
            .collect();
        engine.forward_batch_with(&mut items)
    };
    match result {
        Ok(out) if out.len() == work.len() => out.into_iter().map(Ok).collect(),
        Ok(out) => {
            for w in work {
                slots[w.slot].held.mark_stale();
            }
            let msg = format!(
                "the batch returned {} results for {} sequences",
                out.len(),
                work.len()
            );
            work.iter().map(|_| Err(Error::Gpu(msg.clone()))).collect()
        }
        Err(e) => {
            for w in work {
                slots[w.slot].held.mark_stale();
            }
            let msg = e.to_string();
            work.iter().map(|_| Err(Error::Gpu(msg.clone()))).collect()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn logprobs_are_a_log_softmax() {
        let l = [1.0f32, 3.0, 2.0, f32::NAN];
        let t = logprob_of(&l, 2, 2);
        let z: f64 = [1.0f64, 3.0, 2.0].iter().map(|x| x.exp()).sum();
        assert!((t.logprob as f64 - (2.0 - z.ln())).abs() < 1e-6);
        assert_eq!(t.top.iter().map(|x| x.0).collect::<Vec<_>>(), vec![1, 2]);
        assert!((t.top[0].1 as f64 - (3.0 - z.ln())).abs() < 1e-6);
        assert!(logprob_of(&l, 1, 0).top.is_empty());
    }

    /// A 2-token prompt arriving during a 7,900-token prefill (issue 38's case) is fed whole
    /// in its first step, while the long one keeps all but those two tokens of every step's
    /// budget; the shares never exceed the budget or a slot's want, the whole budget is
    /// used while prompts remain, and the same inputs give the same plan.
    #[test]
    fn short_prompts_share_the_prompt_budget() {
        let budget = 256;
        let (mut long, mut short) = (7900usize, 0usize);
        let mut short_done = None;
        for step in 0..20 {
            if step == 3 {
                short = 2;
            }
            let wants: Vec<usize> = [long, short].into_iter().filter(|&n| n > 0).collect();
            let got = share_prompt_budget(budget, &wants);
            assert_eq!(got, share_prompt_budget(budget, &wants));
            assert!(got.iter().zip(&wants).all(|(g, w)| g <= w));
            let total: usize = got.iter().sum();
            assert_eq!(total, budget.min(wants.iter().sum()));
            assert!(
                got[0] >= budget / wants.len(),
                "the long prompt starved: {got:?}"
            );
            long -= got[0];
            if wants.len() == 2 {
                short -= got[1];
                if short == 0 {
                    short_done = Some(step);
                }
            }
        }
        assert_eq!(
            short_done,
            Some(3),
            "the short prompt waited behind the long one"
        );
        assert_eq!(long, 7900 - 20 * budget + 2);
        // Uneven shares: water-filling, the remainder to the oldest.
        assert_eq!(share_prompt_budget(10, &[100, 1, 100]), vec![5, 1, 4]);
        assert_eq!(share_prompt_budget(2, &[5, 5, 5]), vec![1, 1, 0]);
        assert_eq!(share_prompt_budget(9, &[2, 3]), vec![2, 3]);
        assert_eq!(share_prompt_budget(0, &[4]), vec![0]);
    }

    /// The GPU path's log-probabilities (top candidates + log-sum-exp) equal the full path's.
    #[test]
    fn logprobs_from_top_match_full() {
        let l: Vec<f32> = (0..300)
            .map(|i| ((i * 7919) % 300) as f32 * 0.03 - 4.0)
            .collect();
        let (k, id) = (5, 123u32);
        let top = TopLogits {
            cands: crate::sample::top_k(&l, 8),
            lse: Some(crate::sample::log_sum_exp(&l) as f32),
        };
        let want = logprob_of(&l, top.cands[2].0, k);
        let got = logprob_of_top(&top, top.cands[2].0, k);
        assert_eq!(got.id, want.id);
        assert!(
            (got.logprob - want.logprob).abs() < 1e-5,
            "{got:?} {want:?}"
        );
        assert_eq!(got.top.len(), k);
        for (g, w) in got.top.iter().zip(&want.top) {
            assert_eq!(g.0, w.0);
            assert!((g.1 - w.1).abs() < 1e-5, "{got:?} {want:?}");
        }
        // An id outside the candidates has no known logit.
        assert_eq!(logprob_of_top(&top, id, k).logprob, f32::NEG_INFINITY);
    }
}
