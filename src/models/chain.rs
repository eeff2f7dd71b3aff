//! A model split over several devices: a chain of parts, each a family's GPU model that
//! holds a contiguous range of layers ([`PartSpec`]) on its own `wgpu::Device` (with its own
//! weights, state, scratch and kernel variants), behind the same [`Forward`] as one model.
//!
//! wgpu has no peer copies, so the residual stream crosses a device boundary through the
//! host: the sending part copies its rows into a persistent `MAP_READ` buffer at the end of
//! its pass ([`Readback`](super::runtime::link::Readback)), the receiving part writes them
//! into its residual buffer before its first layer. One copy per boundary and round: `rows · width · 4` bytes
//! ([`HopReport`]). Each part runs on its own thread and hands rounds on through a bounded
//! channel, so a prompt of several rounds keeps every device busy (part `j` runs round
//! `r + 1` while part `j + 1` runs round `r`).
//!
//! Every part plans its rounds from the same items the same way (the plan depends on token
//! counts and positions only), so the rounds line up; a receiver checks the row count.

use super::runtime::link::{Hidden, HopCounters, Link, Part, LINK_BROKEN};
use super::{Forward, ModelFile, Seq, SeqState};
use crate::forward::{LoadOptions, Logits, Want};
use crate::gpu::{AdapterChoice, Gpu};
use crate::model_file::PartSpec;
use crate::moe::{AdapterMemory, MemSource, Offload};
use crate::{Error, Result};
use std::sync::atomic::Ordering;
use std::sync::mpsc::{Receiver, SyncSender};
use std::sync::Arc;

/// Rounds a part may run ahead of the next one (bounds the host memory in flight).
const AHEAD: usize = 2;

/// Device boundary crossings since load (`lathe bench --json` `"hops"`).
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize)]
pub struct HopReport {
    /// Devices and boundaries of the chain.
    pub devices: usize,
    pub boundaries: usize,
    /// Residual-stream copies that crossed a boundary, and their bytes.
    pub hops: u64,
    pub bytes: u64,
    /// Host time of those copies: reading back on the sender once its pass is done, writing
    /// on the receiver (µs in all).
    pub us: f64,
}

impl HopReport {
    /// The counters since `before` (a report taken earlier).
    pub fn since(&self, before: &HopReport) -> HopReport {
        HopReport {
            hops: self.hops - before.hops,
            bytes: self.bytes - before.bytes,
            us: self.us - before.us,
            ..self.clone()
        }
    }
    /// Both counts added.
    pub fn plus(&self, o: &HopReport) -> HopReport {
        HopReport {
            devices: self.devices.max(o.devices),
            boundaries: self.boundaries.max(o.boundaries),
            hops: self.hops + o.hops,
            bytes: self.bytes + o.bytes,
            us: self.us + o.us,
        }
    }

    pub fn us_per_hop(&self) -> f64 {
        self.us / self.hops.max(1) as f64
    }
}

/// A sequence of a chain: one per part.
pub struct ChainSeq {
    parts: Vec<Seq>,
}

impl SeqState for ChainSeq {
    fn pos(&self) -> usize {
        self.parts[0].pos()
    }
}

/// What [`Chain::run_linked`] runs on each part with its sequences.
type PartJob<'a, R> = dyn Fn(&mut dyn Part, &mut [&mut Seq]) -> Result<R> + Sync + 'a;

/// Several parts run as one model.
pub struct Chain {
    parts: Vec<Box<dyn Part>>,
    counters: Arc<HopCounters>,
    /// `LoadOptions::micro_batches`.
    pub micro_batches: usize,
}

/// Contiguous layer ranges for `ratios` (one per device) over `n_layer` layers: each device
/// gets at least one layer, boundaries at the rounded cumulative shares.
pub fn split_layers(n_layer: usize, ratios: &[f64]) -> Result<Vec<std::ops::Range<usize>>> {
    let n = ratios.len();
    if n == 0 || n > n_layer {
        return Err(Error::Invalid(format!(
            "{n} devices for {n_layer} layers: each device needs at least one layer"
        )));
    }
    if let Some(r) = ratios.iter().find(|r| !(r.is_finite() && **r > 0.0)) {
        return Err(Error::Invalid(format!(
            "--split: ratio {r}: every share must be positive"
        )));
    }
    let total: f64 = ratios.iter().sum();
    let mut ranges = Vec::with_capacity(n);
    let mut start = 0;
    let mut acc = 0.0;
    for (i, r) in ratios.iter().enumerate() {
        acc += r;
        // Leave at least one layer for each device after this one.
        let end = if i + 1 == n {
            n_layer
        } else {
            ((acc / total * n_layer as f64).round() as usize)
                .clamp(start + 1, n_layer - (n - 1 - i))
        };
        ranges.push(start..end);
        start = end;
    }
    Ok(ranges)
}

/// Parse `--split`: positive ratios separated by commas (`1,3`, `0.25,0.75`).
pub fn parse_split(s: &str) -> Result<Vec<f64>> {
    s.split(',')
        .map(|p| match p.trim().parse::<f64>() {
            Ok(r) if r.is_finite() && r > 0.0 => Ok(r),
            _ => Err(Error::Invalid(format!(
                "--split {s}: `{p}` is not a positive ratio"
            ))),
        })
        .collect()
}

/// Parse `--devices`: `all` (every GPU adapter), or indices and name substrings separated
/// by commas.
pub fn parse_devices(s: &str) -> Result<Vec<AdapterChoice>> {
    if s.eq_ignore_ascii_case("all") {
        // Every GPU; a CPU adapter (lavapipe) only where there is nothing else.
        let all = crate::gpu::list_adapters();
        let gpus: Vec<usize> = (0..all.len())
            .filter(|&i| all[i].device_type != wgpu::DeviceType::Cpu)
            .collect();
        let picked = if gpus.is_empty() {
            (0..all.len()).collect()
        } else {
            gpus
        };
        if picked.is_empty() {
            return Err(Error::Gpu("--devices all: no GPU adapter found".into()));
        }
        return Ok(picked.into_iter().map(AdapterChoice::Index).collect());
    }
    s.split(',')
        .map(|p| {
            let p = p.trim();
            if p.is_empty() {
                return Err(Error::Invalid(format!("--devices {s}: an empty entry")));
            }
            Ok(p.parse().unwrap_or(AdapterChoice::Auto))
        })
        .collect()
}

/// The memory each device plans with: `opts.gpu_mem` (one size for all, or one per
/// device), else detected.
pub fn device_memory(gpus: &[Arc<Gpu>], opts: &LoadOptions) -> Result<Vec<AdapterMemory>> {
    let n = opts.gpu_mem.len();
    if n > 1 && n != gpus.len() {
        return Err(Error::Invalid(format!(
            "--gpu-mem: {n} sizes for {} devices (one, or one per device)",
            gpus.len()
        )));
    }
    Ok(gpus
        .iter()
        .enumerate()
        .map(|(i, g)| AdapterMemory::detect(&g.info, g.memory.as_ref(), opts.gpu_mem_of(i)))
        .collect())
}

/// Bytes of `file`'s weights by where a split puts them: per layer, the embedding's, and
/// the rest's (output norm and head, extra blocks).
pub struct LayerBytes {
    pub layers: Vec<u64>,
    pub embedding: u64,
    pub head: u64,
    /// The head is the embedding (no output tensor): the last device holds it too.
    pub tied: bool,
}

impl LayerBytes {
    pub fn of(file: &ModelFile, n_layer: usize) -> LayerBytes {
        use crate::model_file::WeightRole;
        const EMBEDDINGS: &[&str] = &[
            "token_embd.weight",
            "model.embed_tokens.weight",
            "embed.weight",
        ];
        const HEADS: &[&str] = &["output.weight", "lm_head.weight", "head.weight"];
        let tied = !HEADS.iter().any(|h| file.tensor(h).is_some());
        let embd = EMBEDDINGS
            .iter()
            .find(|e| file.tensor(e).is_some())
            .copied()
            .unwrap_or_default();
        let mut b = LayerBytes {
            layers: vec![0; n_layer],
            embedding: 0,
            head: 0,
            tied,
        };
        for t in file.tensors() {
            let n = t.data.len() as u64;
            match PartSpec::role(t.name, n_layer, embd, tied) {
                WeightRole::Layer(l) => b.layers[l] += n,
                WeightRole::Embedding { .. } => b.embedding += n,
                WeightRole::Head => b.head += n,
            }
        }
        b
    }

    /// Bytes device `i` of `n` holds with `layers`.
    fn part(&self, layers: std::ops::Range<usize>, i: usize, n: usize) -> u64 {
        let mut b: u64 = self.layers[layers].iter().sum();
        if i == 0 {
            b += self.embedding;
        }
        if i + 1 == n {
            b += self.head
                + if self.tied && n > 1 {
                    self.embedding
                } else {
                    0
                };
        }
        b
    }
}

/// The default split: contiguous ranges (at least one layer each) that give every device
/// the same share of its memory, as near as whole layers allow (the largest `bytes / memory`
/// of any device is the smallest possible), counting the embedding on the first device and
/// the head on the last; equal memory where a device's is unknown. Cold experts then go to
/// the CPU only when the devices together cannot hold the model.
pub fn balanced_split(bytes: &LayerBytes, mems: &[AdapterMemory]) -> Vec<std::ops::Range<usize>> {
    let (n, l) = (mems.len(), bytes.layers.len());
    let mem: Vec<f64> = default_ratios(mems);
    // best[i][j]: the smallest largest load of devices 0..=i holding layers 0..j; from[i][j]
    // where device i's range starts.
    let mut best = vec![vec![f64::INFINITY; l + 1]; n];
    let mut from = vec![vec![0usize; l + 1]; n];
    for (j, b) in best[0].iter_mut().enumerate().skip(1) {
        *b = bytes.part(0..j, 0, n) as f64 / mem[0];
    }
    for i in 1..n {
        for j in i + 1..=l {
            for k in i..j {
                let load = best[i - 1][k].max(bytes.part(k..j, i, n) as f64 / mem[i]);
                if load < best[i][j] {
                    best[i][j] = load;
                    from[i][j] = k;
                }
            }
        }
    }
    let mut ranges = vec![0..0; n];
    let mut end = l;
    for i in (0..n).rev() {
        let start = if i == 0 { 0 } else { from[i][end] };
        ranges[i] = start..end;
        end = start;
    }
    ranges
}

/// Shares by memory where every device's is known, equal otherwise.
pub fn default_ratios(mems: &[AdapterMemory]) -> Vec<f64> {
    if mems.iter().any(|m| m.source == MemSource::Assumed) {
        vec![1.0; mems.len()]
    } else {
        mems.iter().map(|m| m.bytes as f64).collect()
    }
}

/// Blocks of the model in `file` (its family's trunk).
pub fn n_layer(file: &ModelFile) -> Result<usize> {
    (super::registry::family(file)?.n_layer)(file)
}

/// The layer ranges of `opts` over the devices `gpus` for the model in `file`.
pub fn plan_split(
    file: &ModelFile,
    gpus: &[Arc<Gpu>],
    opts: &LoadOptions,
) -> Result<(Vec<std::ops::Range<usize>>, Vec<AdapterMemory>)> {
    let mems = device_memory(gpus, opts)?;
    let n_layer = n_layer(file)?;
    let ranges = match &opts.split {
        Some(r) if r.len() != gpus.len() => {
            return Err(Error::Invalid(format!(
                "--split: {} ratios for {} devices",
                r.len(),
                gpus.len()
            )))
        }
        Some(r) => split_layers(n_layer, r)?,
        None => {
            // Checks the device count against the layers.
            split_layers(n_layer, &vec![1.0; gpus.len()])?;
            balanced_split(&LayerBytes::of(file, n_layer), &mems)
        }
    };
    Ok((ranges, mems))
}

impl Chain {
    /// Load the model in `file` over the devices of `opts.devices`, one part per device;
    /// `exact` as `Gpu::with_matmul`'s `auto` (each device picks its own path).
    pub fn load(
        file: &ModelFile,
        opts: &LoadOptions,
        exact: crate::gpu::AutoProducts,
    ) -> Result<(Vec<Arc<Gpu>>, Chain)> {
        if opts.collect_expert_stats || opts.save_expert_stats.is_some() {
            // Each part counts the layers it holds; one file of all of them is not written.
            return Err(Error::Unsupported(
                "expert statistics with several devices (--save-expert-stats): collect them \
                 on one device"
                    .into(),
            ));
        }
        let gpus = opts
            .devices
            .iter()
            .map(|d| {
                Gpu::with_matmul(d, opts.matmul, exact)
                    .map(|g| Arc::new(g.with_int8_decode(opts.activations.int8())))
            })
            .collect::<Result<Vec<_>>>()?;
        let (ranges, mems) = plan_split(file, &gpus, opts)?;
        let n = ranges.len();
        let mut parts = Vec::with_capacity(n);
        for (i, (gpu, layers)) in gpus.iter().zip(ranges).enumerate() {
            eprintln!(
                "device {i}: layers {}..{} on {} (memory {}; matmul {})",
                layers.start,
                layers.end,
                gpu.info.name,
                mems[i].describe(),
                gpu.matmul_path().name()
            );
            let o = LoadOptions {
                gpu_mem: vec![mems[i].bytes],
                part: Some(PartSpec {
                    layers,
                    first: i == 0,
                    last: i + 1 == n,
                }),
                ..opts.clone()
            };
            parts.push(super::load_part(gpu.clone(), file, &o)?);
        }
        Ok((
            gpus,
            Chain {
                parts,
                counters: Arc::default(),
                micro_batches: opts.micro_batches.max(1),
            },
        ))
    }

    /// Device boundary crossings since load.
    pub fn hops(&self) -> HopReport {
        let c = &self.counters;
        HopReport {
            devices: self.parts.len(),
            boundaries: self.parts.len() - 1,
            hops: c.hops.load(Ordering::Relaxed),
            bytes: c.bytes.load(Ordering::Relaxed),
            us: c.ns.load(Ordering::Relaxed) as f64 / 1e3,
        }
    }

    /// Run `job` on every part, each on its own thread with its sequences (`seqs[j]` for
    /// part `j`), linked to its neighbours by bounded channels. Returns each part's result;
    /// an error is the first part's own, not a neighbour's broken link.
    fn run_linked<R: Send>(
        &mut self,
        seqs: Vec<Vec<&mut Seq>>,
        job: &PartJob<'_, R>,
    ) -> Result<Vec<R>> {
        let n = self.parts.len();
        let mut inputs: Vec<Option<Receiver<Hidden>>> = vec![None];
        let mut outputs: Vec<Option<SyncSender<Hidden>>> = Vec::new();
        for _ in 1..n {
            let (tx, rx) = std::sync::mpsc::sync_channel(AHEAD);
            outputs.push(Some(tx));
            inputs.push(Some(rx));
        }
        outputs.push(None);
        let counters = self.counters.clone();
        let results: Vec<Result<R>> = std::thread::scope(|s| {
            let handles: Vec<_> = self
                .parts
                .iter_mut()
                .zip(seqs)
                .zip(inputs.into_iter().zip(outputs))
                .map(|((part, mut seqs), (input, output))| {
                    let counters = counters.clone();
                    s.spawn(move || {
                        part.link(Link {
                            input: input.map(std::sync::Mutex::new),
                            output,
                            counters,
                        });
                        // A panic too must drop the ends below, or a neighbour waits on
                        // this part for ever.
                        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                            job(&mut **part, &mut seqs)
                        }))
                        .unwrap_or_else(|_| Err(Error::Gpu("a device's part panicked".into())));
                        // Dropping the ends unblocks a neighbour waiting on this part.
                        part.link(Link::default());
                        r
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| {
                    h.join()
                        .unwrap_or_else(|_| Err(Error::Gpu("a device's part panicked".into())))
                })
                .collect()
        });
        let own = |r: &Result<R>| matches!(r, Err(Error::Gpu(m)) if m == LINK_BROKEN);
        if let Some(i) = results.iter().position(|r| r.is_err() && !own(r)) {
            return Err(results
                .into_iter()
                .nth(i)
                .and_then(|r| r.err())
                .expect("an error"));
        }
        results.into_iter().collect()
    }

    /// Per part, the parts' sequences of `seqs` (chain sequences).
    fn per_part<'s>(&self, seqs: Vec<&'s mut ChainSeq>) -> Vec<Vec<&'s mut Seq>> {
        let mut out: Vec<Vec<&mut Seq>> = (0..self.parts.len()).map(|_| Vec::new()).collect();
        for cs in seqs {
            for (j, s) in cs.parts.iter_mut().enumerate() {
                out[j].push(s);
            }
        }
        out
    }
}

impl Forward for Chain {
    fn vocab_size(&self) -> usize {
        self.parts.last().expect("a chain has parts").vocab_size()
    }
    fn new_seq(&self) -> Result<Seq> {
        let parts = self
            .parts
            .iter()
            .map(|p| p.new_seq())
            .collect::<Result<_>>()?;
        Ok(Seq::new(ChainSeq { parts }))
    }
    fn reset(&self, seq: &mut Seq) -> Result<()> {
        let cs = seq.get_mut::<ChainSeq>()?;
        for (p, s) in self.parts.iter().zip(cs.parts.iter_mut()) {
            p.reset(s)?;
        }
        Ok(())
    }
    fn copy_seq(&self, src: &Seq, dst: &mut Seq) -> Result<()> {
        let (s, d) = (src.get::<ChainSeq>()?, dst.get_mut::<ChainSeq>()?);
        for ((p, a), b) in self.parts.iter().zip(&s.parts).zip(d.parts.iter_mut()) {
            p.copy_seq(a, b)?;
        }
        Ok(())
    }
    fn forward_batch(&mut self, items: &mut [(&mut Seq, &[u32], Want)]) -> Result<Vec<Logits>> {
        let toks: Vec<&[u32]> = items.iter().map(|i| i.1).collect();
        let wants: Vec<Want> = items.iter().map(|i| i.2).collect();
        // Micro-batches: contiguous groups of items, each one call of every part.
        let group = items.len().div_ceil(self.micro_batches.max(1)).max(1);
        let mut seqs = Vec::with_capacity(items.len());
        for (s, _, _) in items.iter_mut() {
            seqs.push(s.get_mut::<ChainSeq>()?);
        }
        let per_part = self.per_part(seqs);
        let job = |part: &mut dyn Part, seqs: &mut [&mut Seq]| -> Result<Vec<Logits>> {
            let mut out = Vec::with_capacity(seqs.len());
            for (g, chunk) in seqs.chunks_mut(group).enumerate() {
                let i0 = g * group;
                let mut its: Vec<(&mut Seq, &[u32], Want)> = chunk
                    .iter_mut()
                    .enumerate()
                    .map(|(k, s)| (&mut **s, toks[i0 + k], wants[i0 + k]))
                    .collect();
                out.extend(part.forward_batch(&mut its)?);
            }
            Ok(out)
        };
        Ok(self
            .run_linked(per_part, &job)?
            .pop()
            .expect("a chain has parts"))
    }
    fn forward(&mut self, seq: &mut Seq, tokens: &[u32], all: bool) -> Result<Vec<f32>> {
        let want = if all { Want::All } else { Want::Last };
        let mut out = self.forward_batch(&mut [(seq, tokens, want)])?;
        Ok(out.pop().map(Logits::into_full).unwrap_or_default())
    }
    fn profile(&mut self, items: &mut [(&mut Seq, &[u32])]) -> Result<Vec<(String, f64)>> {
        let toks: Vec<&[u32]> = items.iter().map(|i| i.1).collect();
        let mut seqs = Vec::with_capacity(items.len());
        for (s, _) in items.iter_mut() {
            seqs.push(s.get_mut::<ChainSeq>()?);
        }
        let per_part = self.per_part(seqs);
        let job = |part: &mut dyn Part, seqs: &mut [&mut Seq]| {
            let mut its: Vec<(&mut Seq, &[u32])> = seqs
                .iter_mut()
                .zip(&toks)
                .map(|(s, t)| (&mut **s, *t))
                .collect();
            part.profile(&mut its)
        };
        let profs = self.run_linked(per_part, &job)?;
        Ok(profs
            .into_iter()
            .enumerate()
            .flat_map(|(j, p)| {
                p.into_iter()
                    .map(move |(l, ns)| (format!("dev{j}.{l}"), ns))
            })
            .collect())
    }
    /// The first part's offload (each part places the experts of its own layers).
    fn offload(&self) -> Option<&Offload> {
        self.parts.iter().find_map(|p| p.offload())
    }
    fn routed_experts(&self) -> usize {
        self.parts[0].routed_experts()
    }
    fn max_context(&self) -> Option<usize> {
        self.parts.iter().filter_map(|p| p.max_context()).min()
    }
    fn pass_rows(&self) -> usize {
        self.parts.iter().map(|p| p.pass_rows()).min().unwrap_or(1)
    }
    fn hops(&self) -> Option<HopReport> {
        Some(Chain::hops(self))
    }
    fn offloads(&self) -> Vec<&Offload> {
        self.parts.iter().filter_map(|p| p.offload()).collect()
    }
}
