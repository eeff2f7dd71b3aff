//! The output head of a round and what comes back from it: the top rows' logits and
//! top-k on the GPU, then the wanted runs of full logits packed into the logits buffer
//! (more passes, each read back, only when they outgrow it).

use super::rounds::{RoundOut, TopReq};
use crate::gpu::elementwise as ew;
use crate::gpu::operand::Operand;
use crate::gpu::{matmul, topk, GpuTensor, Pass};
use crate::models::{head_rows, head_runs, read_rows, row_runs};
use crate::Result;

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
}

impl Head<'_> {
    /// Soft-cap `rows` rows of logits from row `row` where the model caps them.
    fn cap(&self, pass: &mut Pass<'_>, row: usize, rows: usize) -> Result<()> {
        match self.softcap {
            Some(c) => {
                let y = Operand::new(self.logits, (row * self.n_vocab) as u32);
                ew::softcap_inplace(pass, rows as u32, self.n_vocab as u32, y, c)
            }
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
        head.cap(&mut pass, 0, chunk.len())?;
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
        head.cap(p, used, take)?;
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
