//! The Qwen3.5-family forward on the GPU. One pass (one submission) per chunk of tokens:
//! prefill chunks use the tiled matmul, the chunked GDN scan and flash attention; a decode
//! step (one token) uses matvec, the recurrent GDN step and split-K attention. Nothing is
//! read back inside the layer loop; only the requested logits come back.

use super::weights::{self, Ffn, Mixer, Weights};
use super::{HeadMap, Hparams};
use crate::engine::{KvType, LoadOptions};
use crate::gpu::attention::{self, Attention, Keys, KvShape, KvSource, OutView, QView};
use crate::gpu::conv::{self, ConvIo};
use crate::gpu::elementwise::{self as ew, View};
use crate::gpu::gdn::{self, GdnIo, GdnShape, KeyHeadMap, SeqBatch, SeqSpan};
use crate::gpu::matmul::{self, MoeRoute};
use crate::gpu::matvec::{self, MatvecOpts};
use crate::gpu::norm;
use crate::gpu::rope::{self, Positions, RopeStyle, RopeTable, RopeView};
use crate::gpu::{embed, topk, Gpu, GpuTensor, Pass};
use crate::models::ModelFile;
use crate::{Error, Result};
use std::sync::Arc;

/// Tokens per prefill pass: activations are sized for this many rows.
pub const DEFAULT_BATCH: usize = 256;

/// Activation buffers, sized once for `rows` tokens per pass (f32 unless said).
struct Scratch {
    rows: usize,
    /// [rows] u32 token ids.
    ids: wgpu::Buffer,
    /// [rows, n_embd]: the residual stream, and its normed copy.
    x: wgpu::Buffer,
    h: wgpu::Buffer,
    /// [rows, conv_dim]: fused q|k|v before and after the conv.
    qkv_raw: wgpu::Buffer,
    qkv: wgpu::Buffer,
    /// [rows, Hv·dv] each.
    z: wgpu::Buffer,
    o: wgpu::Buffer,
    /// [rows, Hv] each.
    a: wgpu::Buffer,
    b: wgpu::Buffer,
    /// [rows, n_head·2·head_dim]: q and gate interleaved per head.
    qg: wgpu::Buffer,
    /// [rows, n_head_kv·head_dim] each.
    k: wgpu::Buffer,
    v: wgpu::Buffer,
    /// [rows, n_head·head_dim]: attention output, and after the gate.
    att: wgpu::Buffer,
    att_g: wgpu::Buffer,
    /// [rows·max(1, n_used), ffn width]: gate / up / SwiGLU.
    f_gate: wgpu::Buffer,
    f_up: wgpu::Buffer,
    /// [rows·n_used, n_embd]: routed expert outputs; [rows, n_expert] router logits,
    /// [rows, n_used] ids (u32) and weights; [rows, 1] shared-expert gate.
    moe_out: wgpu::Buffer,
    router: wgpu::Buffer,
    moe_ids: wgpu::Buffer,
    moe_w: wgpu::Buffer,
    sh_gate: wgpu::Buffer,
    route: Option<MoeRoute>,
    /// GDN chunk scratch and the one-sequence batch table.
    gdn_scratch: wgpu::Buffer,
    batch: SeqBatch,
    /// Split-K attention partials for decode.
    attn_split: wgpu::Buffer,
    /// [logit_rows, n_vocab]
    logits: wgpu::Buffer,
    logit_rows: usize,
}

/// The per-sequence state: KV caches of the attention layers, conv and recurrent state of
/// the GDN layers. Caches grow by doubling (a copy on the GPU), never with host work per row.
pub struct GpuSeq {
    pos: usize,
    cap: usize,
    /// Per layer: (K, V) caches [cap, n_head_kv, head_dim] (f16 or f32).
    kv: Vec<Option<(wgpu::Buffer, wgpu::Buffer)>>,
    /// Per layer: conv state [K-1, conv_dim] and GDN state [Hv, dk, dv].
    conv: Vec<Option<wgpu::Buffer>>,
    ssm: Vec<Option<wgpu::Buffer>>,
}

impl GpuSeq {
    /// Tokens consumed so far.
    pub fn pos(&self) -> usize {
        self.pos
    }
}

pub struct GpuModel {
    pub gpu: Arc<Gpu>,
    pub hp: Hparams,
    w: Weights<GpuTensor>,
    rope: RopeTable,
    kv_type: attention::KvType,
    ctx: usize,
    scratch: Scratch,
    /// Debugging: stop the next pass after this layer and return the residual stream
    /// `[n_tokens, n_embd]` instead of logits.
    pub trace_layer: Option<usize>,
}

fn kv_shape(hp: &Hparams, t: attention::KvType) -> KvShape {
    KvShape {
        dtype: t,
        n_head_kv: hp.n_head_kv as u32,
        head_dim: hp.head_dim as u32,
    }
}

impl GpuModel {
    pub fn load(gpu: Arc<Gpu>, file: &ModelFile, opts: &LoadOptions) -> Result<GpuModel> {
        let hp = Hparams::from_file(file)?;
        let total: u64 = file.tensors().map(|t| t.data.len() as u64).sum();
        let mut done = 0u64;
        let w = weights::load(file, &hp, |w| {
            let t = w.with_tensor(|t| gpu.upload_tensor(t))?;
            done += t.bytes();
            if let Some(p) = &opts.progress {
                p(done.min(total), total);
            }
            Ok(t)
        })?;
        let inv = crate::cpu::ops::rope_inv_freq(hp.rope_theta, hp.n_rot.max(2));
        let rope = RopeTable::new(&gpu, &inv, "qwen35.rope")?;
        let kv_type = match opts.kv_type {
            KvType::F16 => attention::KvType::F16,
            KvType::F32 => attention::KvType::F32,
        };
        let scratch = Scratch::new(&gpu, &hp, DEFAULT_BATCH)?;
        Ok(GpuModel {
            gpu,
            hp,
            w,
            rope,
            kv_type,
            ctx: opts.ctx.max(16),
            scratch,
            trace_layer: None,
        })
    }

    pub fn new_seq(&self) -> Result<GpuSeq> {
        let hp = &self.hp;
        let gpu = &self.gpu;
        let cap = self.ctx.min(4096);
        let mut seq = GpuSeq {
            pos: 0,
            cap,
            kv: Vec::new(),
            conv: Vec::new(),
            ssm: Vec::new(),
        };
        for l in 0..hp.n_layer {
            if hp.recurrent[l] {
                seq.kv.push(None);
                seq.conv.push(Some(gpu.buffer(
                    ((hp.conv_kernel - 1) * hp.conv_dim() * 4) as u64,
                    "seq.conv",
                )?));
                seq.ssm.push(Some(
                    gpu.buffer((hp.n_v_heads * hp.d_k * hp.d_v * 4) as u64, "seq.ssm")?,
                ));
            } else {
                let s = kv_shape(hp, self.kv_type);
                seq.kv.push(Some((
                    gpu.buffer(s.bytes(cap as u64), "seq.k")?,
                    gpu.buffer(s.bytes(cap as u64), "seq.v")?,
                )));
                seq.conv.push(None);
                seq.ssm.push(None);
            }
        }
        Ok(seq)
    }

    /// Forget everything the sequence has seen (zeroes the recurrent state).
    pub fn reset(&self, seq: &mut GpuSeq) -> Result<()> {
        let mut enc = self.gpu.device.create_command_encoder(&Default::default());
        for b in seq.conv.iter().chain(seq.ssm.iter()).flatten() {
            enc.clear_buffer(b, 0, None);
        }
        self.gpu.queue.submit([enc.finish()]);
        seq.pos = 0;
        Ok(())
    }

    /// Grow the KV caches to hold `need` positions (doubling; old rows copied on the GPU).
    fn reserve(&self, pass: &mut Pass<'_>, seq: &mut GpuSeq, need: usize) -> Result<()> {
        if need <= seq.cap {
            return Ok(());
        }
        let new_cap = need.max(seq.cap * 2).next_multiple_of(256);
        let s = kv_shape(&self.hp, self.kv_type);
        for kv in seq.kv.iter_mut().flatten() {
            let k = self.gpu.buffer(s.bytes(new_cap as u64), "seq.k")?;
            let v = self.gpu.buffer(s.bytes(new_cap as u64), "seq.v")?;
            let used = s.bytes(seq.pos as u64);
            if used > 0 {
                pass.copy(&kv.0, 0, &k, 0, used);
                pass.copy(&kv.1, 0, &v, 0, used);
            }
            *kv = (k, v);
        }
        seq.cap = new_cap;
        Ok(())
    }

    /// Feed `tokens`; returns logits for every token (`all`) or only the last one.
    pub fn forward(&mut self, seq: &mut GpuSeq, tokens: &[u32], all: bool) -> Result<Vec<f32>> {
        let v = self.hp.n_vocab;
        if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= v) {
            return Err(Error::Invalid(format!(
                "token id {bad} is outside the vocabulary of {v}"
            )));
        }
        let mut out = Vec::with_capacity(if all { tokens.len() * v } else { v });
        let chunk = self.scratch.rows;
        let n_chunks = tokens.len().div_ceil(chunk);
        for (ci, c) in tokens.chunks(chunk).enumerate() {
            let last = ci + 1 == n_chunks;
            let want = if all {
                c.len()
            } else if last {
                1
            } else {
                0
            };
            out.extend(self.forward_chunk(seq, c, want)?);
        }
        Ok(out)
    }

    /// One pass over `toks` (≤ scratch rows); logits of the last `want` tokens.
    fn forward_chunk(&mut self, seq: &mut GpuSeq, toks: &[u32], want: usize) -> Result<Vec<f32>> {
        let gpu = self.gpu.clone();
        let hp = &self.hp;
        let n = toks.len() as u32;
        let e = hp.n_embd as u32;
        let sc = &mut self.scratch;
        gpu.write(&sc.ids, 0, bytemuck::cast_slice(toks));
        sc.batch.update(
            &gpu,
            &[SeqSpan {
                row: 0,
                n_tokens: n,
                slot: 0,
            }],
        )?;
        let mut pass = gpu.pass();
        // Split the borrow: `reserve` needs &self while scratch is borrowed mutably.
        let sc = &self.scratch;
        {
            let me: &GpuModel = self;
            me.reserve(&mut pass, seq, seq.pos + toks.len())?;
        }
        embed::embed(
            &mut pass,
            &self.w.tok_embd,
            &sc.ids,
            0,
            n,
            View::new(&sc.x, 0),
        )?;
        for (l, lw) in self.w.layers.iter().enumerate() {
            norm::rms_norm(
                &mut pass,
                n,
                e,
                View::new(&sc.x, 0),
                Some(View::new(&sc.h, 0)),
                Some(&lw.attn_norm),
                hp.eps,
            )?;
            match &lw.mixer {
                Mixer::Gdn(g) => self.gdn_block(&mut pass, seq, l, g, n)?,
                Mixer::Attn(a) => self.attn_block(&mut pass, seq, l, a, n)?,
            }
            norm::rms_norm(
                &mut pass,
                n,
                e,
                View::new(&sc.x, 0),
                Some(View::new(&sc.h, 0)),
                Some(&lw.post_norm),
                hp.eps,
            )?;
            self.ffn_block(&mut pass, &lw.ffn, n)?;
            if self.trace_layer == Some(l) {
                pass.submit()?;
                return gpu.read_f32(&sc.x, 0, toks.len() * hp.n_embd);
            }
        }
        let mut logits = Vec::new();
        if want > 0 {
            let first = n as usize - want;
            // Final norm and head for the wanted rows, in chunks the logits buffer holds.
            norm::rms_norm(
                &mut pass,
                n,
                e,
                View::new(&sc.x, 0),
                Some(View::new(&sc.h, 0)),
                Some(&self.w.output_norm),
                hp.eps,
            )?;
            let head = self.w.output.as_ref().unwrap_or(&self.w.tok_embd);
            let v = hp.n_vocab;
            let mut r = first;
            let mut pending = Some(pass);
            while r < n as usize {
                let rows = (n as usize - r).min(sc.logit_rows);
                let mut p = pending.take().unwrap_or_else(|| gpu.pass());
                matmul::matmul(
                    &mut p,
                    head,
                    &sc.h,
                    (r * hp.n_embd) as u32,
                    &sc.logits,
                    0,
                    rows as u32,
                )?;
                p.submit()?;
                logits.extend(gpu.read_f32(&sc.logits, 0, rows * v)?);
                r += rows;
            }
        } else {
            pass.submit()?;
        }
        seq.pos += toks.len();
        Ok(logits)
    }

    fn linear(
        &self,
        pass: &mut Pass<'_>,
        w: &GpuTensor,
        x: &wgpu::Buffer,
        y: &wgpu::Buffer,
        n: u32,
        accumulate: bool,
    ) -> Result<()> {
        let opts = MatvecOpts {
            accumulate,
            ..Default::default()
        };
        matmul::matmul_opts(pass, w, x, 0, y, 0, n, &opts)
    }

    fn gdn_block(
        &self,
        pass: &mut Pass<'_>,
        seq: &GpuSeq,
        l: usize,
        g: &weights::Gdn<GpuTensor>,
        n: u32,
    ) -> Result<()> {
        let hp = &self.hp;
        let sc = &self.scratch;
        let cd = hp.conv_dim() as u32;
        let hv = hp.n_v_heads as u32;
        let vd = hp.v_dim() as u32;
        self.linear(pass, &g.qkv, &sc.h, &sc.qkv_raw, n, false)?;
        self.linear(pass, &g.z, &sc.h, &sc.z, n, false)?;
        self.linear(pass, &g.beta, &sc.h, &sc.b, n, false)?;
        self.linear(pass, &g.alpha, &sc.h, &sc.a, n, false)?;
        let conv_state = seq.conv[l].as_ref().expect("GDN layer has conv state");
        let ssm_state = seq.ssm[l].as_ref().expect("GDN layer has recurrent state");
        conv::conv1d_silu(
            pass,
            cd,
            hp.conv_kernel as u32,
            &sc.batch,
            &ConvIo {
                x: &sc.qkv_raw,
                x_off: 0,
                x_stride: cd,
                w: &g.conv.parts[0].buffer,
                state: conv_state,
                state_off: 0,
                y: &sc.qkv,
                y_off: 0,
                y_stride: cd,
            },
        )?;
        let shape = GdnShape {
            n_head_k: hp.n_k_heads,
            n_head_v: hp.n_v_heads,
            d_k: hp.d_k,
            d_v: hp.d_v,
            map: match hp.head_map {
                HeadMap::Div => KeyHeadMap::Repeat,
                HeadMap::Mod => KeyHeadMap::Tile,
            },
        };
        let io = GdnIo {
            qkv: &sc.qkv,
            qkv_off: 0,
            qkv_stride: cd,
            a: &sc.a,
            a_off: 0,
            a_stride: hv,
            b: &sc.b,
            b_off: 0,
            b_stride: hv,
            a_neg: &g.a.parts[0].buffer,
            dt_bias: &g.dt_bias.parts[0].buffer,
            state: ssm_state,
            state_off: 0,
            o: &sc.o,
            o_off: 0,
            o_stride: vd,
        };
        if n == 1 {
            gdn::recurrent(pass, &shape, &sc.batch, &io)?;
        } else {
            gdn::chunked(pass, &shape, &sc.batch, &io, &sc.gdn_scratch)?;
        }
        norm::gated_rms_norm(
            pass,
            n * hv,
            hp.d_v as u32,
            View::new(&sc.o, 0),
            View::new(&sc.z, 0),
            None,
            Some(&g.norm),
            hp.eps,
        )?;
        self.linear(pass, &g.out, &sc.o, &sc.x, n, true)
    }

    fn attn_block(
        &self,
        pass: &mut Pass<'_>,
        seq: &GpuSeq,
        l: usize,
        a: &weights::Attn<GpuTensor>,
        n: u32,
    ) -> Result<()> {
        let hp = &self.hp;
        let sc = &self.scratch;
        let (nh, nkv, hd) = (hp.n_head as u32, hp.n_head_kv as u32, hp.head_dim as u32);
        self.linear(pass, &a.q, &sc.h, &sc.qg, n, false)?;
        self.linear(pass, &a.k, &sc.h, &sc.k, n, false)?;
        self.linear(pass, &a.v, &sc.h, &sc.v, n, false)?;
        // Per-head q/k RMSNorm; q heads sit every 2·head_dim (interleaved with their gates).
        norm::rms_norm(
            pass,
            n * nh,
            hd,
            View::strided(&sc.qg, 0, 2 * hd),
            None,
            Some(&a.q_norm),
            hp.eps,
        )?;
        norm::rms_norm(
            pass,
            n * nkv,
            hd,
            View::new(&sc.k, 0),
            None,
            Some(&a.k_norm),
            hp.eps,
        )?;
        let pos0 = seq.pos as u32;
        let qv = RopeView {
            buf: &sc.qg,
            off: 0,
            n_tokens: n,
            n_heads: nh,
            head_dim: hd,
            token_stride: nh * 2 * hd,
            head_stride: 2 * hd,
        };
        rope::rope(
            pass,
            &qv,
            RopeStyle::Neox,
            0,
            &self.rope,
            Positions::From(pos0),
            false,
        )?;
        rope::rope(
            pass,
            &RopeView::packed(&sc.k, 0, n, nkv, hd),
            RopeStyle::Neox,
            0,
            &self.rope,
            Positions::From(pos0),
            false,
        )?;
        let (kc, vc) = seq.kv[l].as_ref().expect("attention layer has a KV cache");
        let shape = kv_shape(hp, self.kv_type);
        attention::write_kv(
            pass,
            shape,
            &sc.k,
            0,
            nkv * hd,
            n,
            kc,
            attention::DstRows::Range { row0: pos0 },
        )?;
        attention::write_kv(
            pass,
            shape,
            &sc.v,
            0,
            nkv * hd,
            n,
            vc,
            attention::DstRows::Range { row0: pos0 },
        )?;
        let n_kv = pos0 + n;
        // Split-K only for decode: the scratch is sized for one query row per head.
        let n_split = if n == 1 {
            attention::pick_n_split(n, nh, shape, n_kv, false)
        } else {
            1
        };
        attention::attention(
            pass,
            &Attention {
                n_q: n,
                n_head: nh,
                kv: shape,
                scale: 1.0 / (hd as f32).sqrt(),
                q: QView {
                    buf: &sc.qg,
                    off: 0,
                    tok_stride: nh * 2 * hd,
                    head_stride: 2 * hd,
                },
                out: OutView {
                    buf: &sc.att,
                    off: 0,
                    tok_stride: nh * hd,
                },
                a: KvSource { k: kc, v: Some(vc) },
                b: None,
                keys: Keys::Causal {
                    row0: 0,
                    pos0,
                    n_kv,
                    window: 0,
                },
                sinks: None,
                split: (n_split > 1).then_some((&sc.attn_split, n_split)),
            },
        )?;
        // Output gate: attn ⊙ sigmoid(gate), the gate being the second half of each head's q row.
        ew::sigmoid_mul(
            pass,
            n * nh,
            hd,
            View::new(&sc.att_g, 0),
            View::strided(&sc.qg, hd, 2 * hd),
            View::new(&sc.att, 0),
        )?;
        self.linear(pass, &a.o, &sc.att_g, &sc.x, n, true)
    }

    fn ffn_block(&self, pass: &mut Pass<'_>, f: &Ffn<GpuTensor>, n: u32) -> Result<()> {
        let hp = &self.hp;
        let sc = &self.scratch;
        let e = hp.n_embd as u32;
        match f {
            Ffn::Dense { gate, up, down } => {
                let ff = gate.shape[0] as u32;
                self.linear(pass, gate, &sc.h, &sc.f_gate, n, false)?;
                self.linear(pass, up, &sc.h, &sc.f_up, n, false)?;
                ew::swiglu(
                    pass,
                    n,
                    ff,
                    View::new(&sc.o, 0),
                    View::new(&sc.f_gate, 0),
                    View::new(&sc.f_up, 0),
                    None,
                )?;
                self.linear(pass, down, &sc.o, &sc.x, n, true)
            }
            Ffn::Moe(m) => {
                let mp = hp.moe.as_ref().expect("MoE layer in a MoE model");
                let (ne, k, ff) = (mp.n_expert as u32, mp.n_used as u32, mp.n_ff_exp as u32);
                self.linear(pass, &m.router, &sc.h, &sc.router, n, false)?;
                topk::router_softmax_topk(
                    pass,
                    n,
                    ne,
                    k,
                    mp.norm_topk,
                    View::new(&sc.router, 0),
                    View::new(&sc.moe_ids, 0),
                    View::new(&sc.moe_w, 0),
                )?;
                let opts = MatvecOpts::default();
                if n <= matvec::MAX_TOKENS {
                    matvec::matvec_indexed(
                        pass,
                        &m.gate_exps,
                        &sc.h,
                        0,
                        false,
                        &sc.moe_ids,
                        0,
                        k,
                        &sc.f_gate,
                        0,
                        n,
                        &opts,
                    )?;
                    matvec::matvec_indexed(
                        pass,
                        &m.up_exps,
                        &sc.h,
                        0,
                        false,
                        &sc.moe_ids,
                        0,
                        k,
                        &sc.f_up,
                        0,
                        n,
                        &opts,
                    )?;
                } else {
                    let r = sc.route.as_ref().expect("route made for MoE models");
                    matmul::route(pass, r, &sc.moe_ids, 0, n, k)?;
                    matmul::matmul_indexed(
                        pass,
                        &m.gate_exps,
                        &sc.h,
                        0,
                        false,
                        r,
                        n,
                        k,
                        &sc.f_gate,
                        0,
                        &opts,
                    )?;
                    matmul::matmul_indexed(
                        pass, &m.up_exps, &sc.h, 0, false, r, n, k, &sc.f_up, 0, &opts,
                    )?;
                }
                ew::swiglu(
                    pass,
                    n * k,
                    ff,
                    View::new(&sc.o, 0),
                    View::new(&sc.f_gate, 0),
                    View::new(&sc.f_up, 0),
                    None,
                )?;
                if n <= matvec::MAX_TOKENS {
                    matvec::matvec_indexed(
                        pass,
                        &m.down_exps,
                        &sc.o,
                        0,
                        true,
                        &sc.moe_ids,
                        0,
                        k,
                        &sc.moe_out,
                        0,
                        n,
                        &opts,
                    )?;
                } else {
                    let r = sc.route.as_ref().expect("route made for MoE models");
                    matmul::matmul_indexed(
                        pass,
                        &m.down_exps,
                        &sc.o,
                        0,
                        true,
                        r,
                        n,
                        k,
                        &sc.moe_out,
                        0,
                        &opts,
                    )?;
                }
                // Combine in slot order (fixed order: placement never changes the sum).
                for s in 0..k {
                    ew::axpy_row(
                        pass,
                        n,
                        e,
                        View::new(&sc.x, 0),
                        View::strided(&sc.moe_w, s, k),
                        View::strided(&sc.moe_out, s * e, k * e),
                    )?;
                }
                if let Some((g, u, d, gi)) = &m.shared {
                    let fs = g.shape[0] as u32;
                    self.linear(pass, g, &sc.h, &sc.f_gate, n, false)?;
                    self.linear(pass, u, &sc.h, &sc.f_up, n, false)?;
                    ew::swiglu(
                        pass,
                        n,
                        fs,
                        View::new(&sc.o, 0),
                        View::new(&sc.f_gate, 0),
                        View::new(&sc.f_up, 0),
                        None,
                    )?;
                    self.linear(pass, d, &sc.o, &sc.moe_out, n, false)?;
                    self.linear(pass, gi, &sc.h, &sc.sh_gate, n, false)?;
                    ew::sigmoid_mul_row_inplace(
                        pass,
                        n,
                        e,
                        View::new(&sc.moe_out, 0),
                        View::new(&sc.sh_gate, 0),
                    )?;
                    ew::add_inplace(pass, n, e, View::new(&sc.x, 0), View::new(&sc.moe_out, 0))?;
                }
                Ok(())
            }
        }
    }
}

impl Scratch {
    fn new(gpu: &Gpu, hp: &Hparams, rows: usize) -> Result<Scratch> {
        let f = |n: usize, label: &str| gpu.buffer((n.max(1) * 4) as u64, label);
        let r = rows;
        let (k, ffw) = match &hp.moe {
            Some(m) => (m.n_used, m.n_ff_exp.max(m.n_ff_shexp)),
            None => (1, 0),
        };
        let ff = hp.n_ff.max(ffw);
        let att = hp.n_head * hp.head_dim;
        let shape = GdnShape {
            n_head_k: hp.n_k_heads,
            n_head_v: hp.n_v_heads,
            d_k: hp.d_k,
            d_v: hp.d_v,
            map: KeyHeadMap::Repeat,
        };
        let batch = SeqBatch::new(
            gpu,
            &[SeqSpan {
                row: 0,
                n_tokens: r as u32,
                slot: 0,
            }],
        )?;
        let gdn_scratch = gpu.buffer(
            gdn::scratch_bytes(&shape, batch.total_chunks).max(4),
            "gdn.scratch",
        )?;
        let max_split = attention::MAX_SPLIT;
        let attn_split = gpu.buffer(
            attention::scratch_elems(1, hp.n_head as u32, hp.head_dim as u32, max_split) * 4,
            "attn.split",
        )?;
        let logit_rows = ((gpu.max_binding() / 4) as usize / hp.n_vocab).clamp(1, r);
        // `o` doubles as the SwiGLU output, so it holds the widest of the three uses.
        let o_w = hp.v_dim().max(ff * k).max(att);
        Ok(Scratch {
            rows: r,
            ids: f(r, "ids")?,
            x: f(r * hp.n_embd, "x")?,
            h: f(r * hp.n_embd, "h")?,
            qkv_raw: f(r * hp.conv_dim(), "qkv_raw")?,
            qkv: f(r * hp.conv_dim(), "qkv")?,
            z: f(r * hp.v_dim(), "z")?,
            o: f(r * o_w, "o")?,
            a: f(r * hp.n_v_heads, "a")?,
            b: f(r * hp.n_v_heads, "b")?,
            qg: f(r * 2 * att, "qg")?,
            k: f(r * hp.n_head_kv * hp.head_dim, "k")?,
            v: f(r * hp.n_head_kv * hp.head_dim, "v")?,
            att: f(r * att, "att")?,
            att_g: f(r * att, "att_g")?,
            f_gate: f(r * ff * k, "f_gate")?,
            f_up: f(r * ff * k, "f_up")?,
            moe_out: f(r * k * hp.n_embd, "moe_out")?,
            router: f(r * hp.moe.as_ref().map_or(1, |m| m.n_expert), "router")?,
            moe_ids: f(r * k, "moe_ids")?,
            moe_w: f(r * k, "moe_w")?,
            sh_gate: f(r, "sh_gate")?,
            route: match &hp.moe {
                Some(m) => Some(MoeRoute::new(
                    gpu,
                    m.n_expert as u32,
                    (r * m.n_used) as u32,
                )?),
                None => None,
            },
            gdn_scratch,
            batch,
            attn_split,
            logits: f(logit_rows * hp.n_vocab, "logits")?,
            logit_rows,
        })
    }
}
