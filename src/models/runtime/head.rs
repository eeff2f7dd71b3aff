//! The output head of a round and what comes back from it: the top rows' logits and
//! top-k on the GPU, then the wanted runs of full logits packed into the logits buffer
//! (more passes, each read back, only when they outgrow it).

use super::rounds::{RoundOut, TopReq};
use crate::gpu::elementwise as ew;
use crate::gpu::operand::Operand;
use crate::gpu::{matmul, topk, Gpu, GpuTensor, Pass};
use crate::model_file::ModelFile;
use crate::models::{head_rows, head_runs, read_rows, row_runs};
use crate::Result;

/// What a suppressed token's logit becomes: far below any real logit, and still finite
/// through a 0.01 temperature and a ×100 repetition penalty, where `f32::MIN` would turn
/// into -inf (which `sample::logits_are_finite` reads as a broken row, and which WGSL leaves
/// undefined). transformers masks with finite minima too (`torch.finfo(dtype).min`).
pub const SUPPRESSED: f32 = -1e30;

/// `[n_vocab]` f32 added to every row of logits after soft-capping: 0, or [`SUPPRESSED`] at
/// each id of `file`'s `suppress_tokens` (`ModelFile::suppress_tokens`), so that greedy
/// decoding, the GPU's top-k, sampling, speculative verification and `lathe logits` all see
/// the mask, as in llama.cpp, which biases them in the graph. `None` when the file names none.
pub fn suppress_mask(gpu: &Gpu, file: &ModelFile, n_vocab: usize) -> Result<Option<wgpu::Buffer>> {
    let ids = file.suppress_tokens(n_vocab)?;
    if ids.is_empty() {
        return Ok(None);
    }
    let mut mask = vec![0.0f32; n_vocab];
    for id in ids {
        mask[id as usize] = SUPPRESSED;
    }
    gpu.upload_f32(&mask, "suppress_tokens").map(Some)
}

/// The head's weight and the buffers it reads and writes.
pub struct Head<'a> {
    /// [n_vocab, n_embd]
    pub w: &'a GpuTensor,
    pub n_vocab: usize,
    /// [rows, n_embd]: the normed rows of the round.
    pub h: &'a wgpu::Buffer,
    pub n_embd: usize,
    /// [logit_rows, n_vocab]
    pub logits: &'a wgpu::Buffer,
    pub logit_rows: usize,
    pub top: &'a topk::LogitsTop,
    /// `Forward::hidden_out`: the wanted rows of `h` come back instead of their logits.
    pub hidden: bool,
    /// Gemma's final logit soft-capping (`cap·tanh(z/cap)`), before top-k and readback.
    pub softcap: Option<f32>,
    /// [n_vocab]: [`suppress_mask`], added after the soft-cap.
    pub suppress: Option<&'a wgpu::Buffer>,
}

impl Head<'_> {
    /// Soft-cap `rows` rows of logits from row `row` where the model caps them, then mask
    /// its suppressed tokens.
    fn finish(&self, pass: &mut Pass<'_>, row: usize, rows: usize) -> Result<()> {
        let (rows, v) = (rows as u32, self.n_vocab as u32);
        let y = Operand::new(self.logits, row as u32 * v);
        if let Some(c) = self.softcap {
            ew::softcap_inplace(pass, rows, v, y, c)?;
        }
        match self.suppress {
            Some(mask) => ew::add_inplace(pass, rows, v, y, Operand::strided(mask, 0, 0)),
            None => Ok(()),
        }
    }
}

/// Submit `pass` with the head over the normed rows in `h`: the top rows first, in this
/// pass (their logits into the logits buffer, one product per run of consecutive rows,
/// `head_rows`: a batch's decode rows, a verify pass; each row with a lone decode's bits),
/// then their top-k; the wanted runs after them reuse the buffer. `prof`: the per-dispatch
/// times of every submission are appended there.
pub fn head_logits(
    mut pass: Pass<'_>,
    head: &Head<'_>,
    wants: &[(usize, usize)],
    top: &TopReq,
    mut prof: Option<&mut Vec<(String, f64)>>,
) -> Result<RoundOut> {
    let gpu = pass.gpu();
    let (e, v) = (head.n_embd, head.n_vocab);
    if head.hidden {
        pass.submit_or_profile(prof)?;
        return Ok((read_rows(gpu, head.h, wants, e)?, Vec::new()));
    }
    let mut r0 = 0;
    for chunk in top.rows.chunks(head.logit_rows) {
        for (j, r, m) in row_runs(chunk) {
            head_rows(&mut pass, head.w, head.h, (r, e), head.logits, (j, v), m)?;
        }
        head.finish(&mut pass, 0, chunk.len())?;
        let rows = chunk.len() as u32;
        head.top.record(
            &mut pass,
            Operand::new(head.logits, 0),
            rows,
            r0,
            top.k,
            top.lse,
        )?;
        r0 += rows;
    }
    let total: usize = wants.iter().map(|w| w.1).sum();
    let mut logits = Vec::with_capacity(total * v);
    let mut pending = Some(pass);
    let mut used = 0usize;
    let runs = head_runs(wants, head.logit_rows);
    for (i, &(r, take)) in runs.iter().enumerate() {
        if used + take > head.logit_rows {
            let p = pending.take().unwrap_or_else(|| gpu.pass());
            p.submit_or_profile(prof.as_deref_mut())?;
            logits.extend(gpu.read_f32(head.logits, 0, used * v)?);
            used = 0;
        }
        let p = pending.get_or_insert_with(|| gpu.pass());
        matmul::matmul(
            p,
            head.w,
            Operand::new(head.h, (r * e) as u32),
            Operand::new(head.logits, (used * v) as u32),
            take as u32,
        )?;
        head.finish(p, used, take)?;
        used += take;
        if i + 1 == runs.len() {
            let p = pending.take().expect("a pass holds the head");
            p.submit_or_profile(prof.as_deref_mut())?;
            logits.extend(gpu.read_f32(head.logits, 0, used * v)?);
        }
    }
    if let Some(p) = pending {
        p.submit_or_profile(prof)?;
    }
    let tops = head.top.read(gpu, r0, top.k, top.lse)?;
    Ok((logits, tops))
}
