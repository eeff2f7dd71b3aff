//! The forward: batched rounds over the layers (GDN, attention, dense or routed FFN) and
//! the logits each item wants.

use super::state::kv_shape;
use super::*;
use crate::gpu::router::RouterRows;

impl GpuModel {
    pub(super) fn check_tokens(&self, tokens: &[u32]) -> Result<()> {
        let v = self.hp.n_vocab;
        match tokens.iter().find(|&&t| t as usize >= v) {
            Some(&bad) => Err(Error::Invalid(format!(
                "token id {bad} is outside the vocabulary of {v}"
            ))),
            None => Ok(()),
        }
    }

    /// Feed `tokens`; returns logits for every token (`all`) or only the last one.
    pub fn forward(&mut self, seq: &mut GpuSeq, tokens: &[u32], all: bool) -> Result<Vec<f32>> {
        let want = if all { Want::All } else { Want::Last };
        let mut out = self.forward_batch(&mut [(seq, tokens, want)])?;
        Ok(out.pop().map(Logits::into_full).unwrap_or_default())
    }

    /// Feed several sequences at once, in the runtime's rounds of at most `DEFAULT_BATCH`
    /// rows shared by all items ([`rounds::run_batch`]). Returns, per item, the logits it
    /// wants (`[n, vocab]` row-major), or for [`Want::Top`] the best logits of its last
    /// token, found in the round's pass.
    pub fn forward_batch(
        &mut self,
        items: &mut [(&mut GpuSeq, &[u32], Want)],
    ) -> Result<Vec<Logits>> {
        self.spec.trunk = None;
        let (v, rows, last) = (self.hp.n_vocab, self.scratch.rows, self.part.last);
        rounds::run_batch(items, v, rows, last, |r| {
            self.run_round(&r.parts, &r.toks, &r.wants, &r.top)
        })
    }

    /// One pass over the rows of `parts`; returns the logits of the `wants` row runs and the
    /// top logits of the `top` rows (in order).
    pub(super) fn run_round(
        &mut self,
        parts: &[Part],
        toks: &[u32],
        wants: &[(usize, usize)],
        top: &TopReq,
    ) -> Result<(Vec<f32>, Vec<TopLogits>)> {
        let gpu = self.gpu.clone();
        let n = toks.len() as u32;
        let need = parts.iter().map(|p| p.pos0 + p.n).max().unwrap_or(0);
        self.trace
            .prepare(&gpu, (self.scratch.rows * self.hp.n_embd * 4) as u64)?;
        let mut pass = gpu.pass();
        if self.profile.is_some() || self.trace.on() {
            pass.hold();
        }
        self.reserve(&mut pass, need)?;
        let cap = self.pools.cap as u32;
        // Per-row positions and KV destination rows; per decode row its visible key range.
        let mut pos = Vec::with_capacity(toks.len());
        let mut kv_rows = Vec::with_capacity(toks.len());
        let mut ranges = Vec::new();
        for p in parts {
            for j in 0..p.n {
                let q = (p.pos0 + j) as u32;
                pos.push(q);
                kv_rows.push(p.slot * cap + q);
                if p.n == 1 {
                    ranges.extend_from_slice(&[p.slot * cap, q + 1]);
                }
            }
        }
        let sc = &mut self.scratch;
        gpu.write(&sc.ids, 0, bytemuck::cast_slice(toks));
        gpu.write(&sc.pos, 0, bytemuck::cast_slice(&pos));
        gpu.write(&sc.kv_rows, 0, bytemuck::cast_slice(&kv_rows));
        if !ranges.is_empty() {
            gpu.write(&sc.ranges, 0, bytemuck::cast_slice(&ranges));
        }
        let spans: Vec<SeqSpan> = parts
            .iter()
            .map(|p| SeqSpan {
                row: p.row as u32,
                n_tokens: p.n as u32,
                slot: p.slot,
            })
            .collect();
        sc.batch.update(&gpu, &spans)?;
        let sc = &self.scratch;
        let hp = &self.hp;
        if self.part.first {
            embed::embed(
                &mut pass,
                &self.w.tok_embd,
                &sc.ids,
                0,
                n,
                Operand::new(&sc.x, 0),
            )?;
        } else {
            self.link.receive_into(&gpu, &sc.x, toks.len(), hp.n_embd)?;
        }
        // The trunk's layers this device holds (an MTP block's layer follows the trunk,
        // `spec.rs`).
        let held = self.part.layers.clone();
        // A layer's head recorded early: an offloaded MoE layer records the next layer's
        // while the CPU runs its cold experts (`Offload::cold_ffn`).
        let mut ahead = None;
        // Whether the last residual product also wrote x · (this layer's attention norm
        // weight) into `h` (`Epilogue::Normed`).
        let mut weighted = false;
        for l in held.clone() {
            let lw = &self.w.layers[l];
            let pre = match ahead.take() {
                Some(pre) => pre,
                None => self.layer_head(&mut pass, parts, l, n, weighted)?,
            };
            weighted = false;
            match &lw.ffn {
                Ffn::Moe(m) if self.offload.as_ref().is_some_and(|o| o.has_layer(l)) => {
                    // Not past the layers held, nor past a traced layer (its output is read
                    // before the next layer runs).
                    let next = (l + 1 < held.end && !self.trace.at(l)).then_some(l + 1);
                    ahead =
                        self.moe_offload_block(&mut pass, l, m, n, pre, next.map(|l| (l, parts)))?;
                }
                f => {
                    // not past the layers held, nor past a traced layer
                    let next = (l + 1 < held.end && !self.trace.at(l))
                        .then(|| &self.w.layers[l + 1].attn_norm);
                    weighted = self.ffn_block(&mut pass, l, f, n, pre, next)?;
                }
            }
            // Trace point: the residual stream after the layer, [n, n_embd].
            self.trace
                .point(&mut pass, "layer_out", l, &sc.x, toks.len() * hp.n_embd);
            pass.flush_every(crate::gpu::FLUSH_OPS)?;
        }
        let profiling = self.profile.is_some();
        let mut prof = Vec::new();
        let result = match &self.handoff {
            Some(rb) => self
                .link
                .hand_off(
                    pass,
                    &sc.x,
                    rb,
                    toks.len(),
                    hp.n_embd,
                    profiling.then_some(&mut prof),
                )
                .map(|()| (Vec::new(), Vec::new())),
            None => self.finish_round(pass, n, wants, top, profiling.then_some(&mut prof)),
        };
        if profiling {
            self.profile = Some(prof);
        }
        let out = result?;
        self.trace.collect(&gpu)?;
        Ok(out)
    }

    /// The head over the wanted rows of a round (final norm, then the runtime's head and
    /// readback, [`head_logits`]); submits `pass`.
    pub(super) fn finish_round(
        &self,
        mut pass: Pass<'_>,
        n: u32,
        wants: &[(usize, usize)],
        top: &TopReq,
        prof: Option<&mut Vec<(String, f64)>>,
    ) -> Result<RoundOut> {
        let sc = &self.scratch;
        let hp = &self.hp;
        if wants.is_empty() && top.rows.is_empty() {
            pass.submit_or_profile(prof)?;
            return Ok((Vec::new(), Vec::new()));
        }
        norm::rms_norm(
            &mut pass,
            n,
            hp.n_embd as u32,
            Operand::new(&sc.x, 0),
            Some(Operand::new(&sc.h, 0)),
            Some(&self.w.output_norm),
            hp.eps,
        )?;
        let head = Head {
            w: self.w.output.as_ref().unwrap_or(&self.w.tok_embd),
            n_vocab: hp.n_vocab,
            h: &sc.h,
            n_embd: hp.n_embd,
            logits: &sc.logits,
            logit_rows: sc.logit_rows,
            top: &sc.top,
            hidden: self.hidden_out,
            softcap: None,
            suppress: self.suppress.as_ref(),
        };
        head_logits(pass, &head, wants, top, prof)
    }

    /// Whether products of `n` tokens take fused activation loads (`LoadOptions::fused_loads`).
    fn fused(&self, n: u32) -> bool {
        self.fused_loads && matvec::prologue_fits(n)
    }

    /// RMSNorm of the residual stream with weight `w`, as the input of the next product set:
    /// fused into the products' activation load (returned) where they run as matvec, else
    /// written to `h` (`None`: the set reads `h`). `keep`: the fused products write `h` too.
    /// `weighted`: the residual product before wrote x · w into `h` ([`Self::residual`]), which
    /// the products then read ([`Self::pre_x`]).
    pub(super) fn normed<'w>(
        &'w self,
        pass: &mut Pass<'_>,
        n: u32,
        w: &'w GpuTensor,
        keep: bool,
        weighted: bool,
    ) -> Result<Option<Prologue<'w>>> {
        let sc = &self.scratch;
        if weighted && !keep {
            return Ok(Some(Prologue::RmsNormRaw {
                raw: &sc.x,
                eps: self.hp.eps,
            }));
        }
        if self.fused(n) && w.dtype == DType::F32 && w.parts.len() == 1 {
            return Ok(Some(Prologue::RmsNorm {
                w: &w.parts[0].buffer,
                eps: self.hp.eps,
                keep: keep.then_some(&sc.h),
            }));
        }
        norm::rms_norm(
            pass,
            n,
            self.hp.n_embd as u32,
            Operand::new(&sc.x, 0),
            Some(Operand::new(&sc.h, 0)),
            Some(w),
            self.hp.eps,
        )?;
        Ok(None)
    }

    /// The buffer a product reading the layer's input through `pre` reads: the residual
    /// stream, or `h` (the normed rows, or x · w for [`Prologue::RmsNormRaw`]).
    pub(super) fn pre_x(&self, pre: Option<&Prologue<'_>>) -> &wgpu::Buffer {
        let sc = &self.scratch;
        match pre {
            None | Some(Prologue::RmsNormRaw { .. }) => &sc.h,
            Some(_) => &sc.x,
        }
    }

    /// `set` over the layer's input: `h`, or the residual stream through `pre`.
    pub(super) fn run_set(
        &self,
        pass: &mut Pass<'_>,
        set: &ProjSet,
        n: u32,
        pre: Option<Prologue<'_>>,
    ) -> Result<()> {
        let sc = &self.scratch;
        let x = self.pre_x(pre.as_ref());
        match pre {
            Some(p) => set.run_fused(pass, x, &sc.proj, n, Some(&p), None),
            None => set.run(pass, x, &sc.proj, n),
        }
    }

    /// `x += W a` (a residual product of `n` rows of `a`, read through `pro`), and with `next`
    /// (the next RMSNorm's weight) x · next written into `h` too where the fused decode takes
    /// it (`Epilogue::Normed`): returns whether it did, for that norm ([`Self::normed`]).
    pub(super) fn residual(
        &self,
        pass: &mut Pass<'_>,
        w: &GpuTensor,
        a: &wgpu::Buffer,
        n: u32,
        pro: Option<&Prologue<'_>>,
        next: Option<&GpuTensor>,
    ) -> Result<bool> {
        let sc = &self.scratch;
        let opts = MatvecOpts {
            accumulate: true,
            ..Default::default()
        };
        let e = self.hp.n_embd as u64;
        let fits = |nw: &&GpuTensor| {
            self.fused(n)
                && nw.dtype == DType::F32
                && nw.parts.len() == 1
                && nw.shape == [e]
                && w.parts.len() == 1
        };
        if let Some(nw) = next.filter(fits) {
            let epi = matvec::Epilogue::Normed {
                w: &nw.parts[0].buffer,
                out: &sc.h,
            };
            matvec::matvec_fused(
                pass,
                w,
                Operand::new(a, 0),
                Operand::new(&sc.x, 0),
                n,
                &opts,
                matvec::Fused { pro, epi },
            )?;
            return Ok(true);
        }
        match pro {
            Some(p) => matvec::matvec_pro(
                pass,
                w,
                Operand::new(a, 0),
                Operand::new(&sc.x, 0),
                n,
                &opts,
                p,
            )?,
            None => self.linear(pass, w, a, &sc.x, n, true)?,
        }
        Ok(false)
    }

    /// The layer's product set (the GPU sink makes one for every set).
    pub(super) fn set<'s>(&self, s: &'s Option<ProjSet>) -> &'s ProjSet {
        s.as_ref().expect("the GPU loader makes every product set")
    }

    /// Member `i` of `set` in `proj`: one row of its outputs per token.
    /// MoE layer `l`'s router logits with the shared expert's gate, up and gate input (one
    /// product per stored type into columns of `proj`, in f32: see `MatvecOpts::exact`), then
    /// the softmax top-k into `moe_ids` / `moe_w`. Returns the layer's product set.
    pub(super) fn moe_router(
        &self,
        pass: &mut Pass<'_>,
        l: usize,
        n: u32,
        pre: Option<Prologue<'_>>,
    ) -> Result<&ProjSet> {
        let sc = &self.scratch;
        let mp = self.hp.moe.as_ref().expect("MoE layer in a MoE model");
        let set = self.set(&self.w.layers[l].ffn_set);
        match pre {
            Some(p) => set.run_fused(pass, self.pre_x(Some(&p)), &sc.proj, n, Some(&p), None)?,
            None => set.run_opts(pass, &sc.h, &sc.proj, n, true)?,
        }
        let rows = RouterRows {
            n_tok: n,
            n_exp: mp.n_expert as u32,
            k: mp.n_used as u32,
            logits: self.col(set, 0),
            ids: Operand::new(&sc.moe_ids, 0),
            weights: Operand::new(&sc.moe_w, 0),
        };
        topk::router_softmax_topk(pass, &rows, mp.norm_topk)?;
        Ok(set)
    }

    pub(super) fn col(&self, set: &ProjSet, i: usize) -> Operand<'_> {
        Operand::strided(&self.scratch.proj, set.off[i], set.width)
    }

    /// `src` (one row of `len` per token) as packed rows: itself for one token, else
    /// copied into `dst`. Returns the buffer and the element offset of the rows.
    pub(super) fn packed_rows<'s>(
        &'s self,
        pass: &mut Pass<'_>,
        src: Operand<'s>,
        len: u32,
        n: u32,
        dst: &'s wgpu::Buffer,
    ) -> Result<(&'s wgpu::Buffer, u32)> {
        if n == 1 {
            return Ok((src.buf, src.off));
        }
        ew::copy(pass, n, len, Operand::new(dst, 0), src)?;
        Ok((dst, 0))
    }

    pub(super) fn linear(
        &self,
        pass: &mut Pass<'_>,
        w: &GpuTensor,
        x: &wgpu::Buffer,
        y: &wgpu::Buffer,
        n: u32,
        accumulate: bool,
    ) -> Result<()> {
        // A member of a product set has no buffers of its own: it runs through `ProjSet::run`.
        debug_assert!(!w.parts.is_empty(), "{}: no GPU buffers", w.name);
        let opts = MatvecOpts {
            accumulate,
            ..Default::default()
        };
        matmul::matmul_opts(pass, w, Operand::new(x, 0), Operand::new(y, 0), n, &opts)
    }

    /// Layer `l`'s mixer weights, which [`Self::layer_head`] dispatched on.
    fn mixer(&self, l: usize) -> &Mixer<GpuTensor> {
        &self.w.layers[l].mixer
    }

    /// GDN layer `l` (see [`Self::layer_head`]).
    pub(super) fn gdn_block(
        &self,
        pass: &mut Pass<'_>,
        parts: &[Part],
        l: usize,
        n: u32,
        pre: Option<Prologue<'_>>,
        next: Option<&GpuTensor>,
    ) -> Result<bool> {
        let Mixer::Gdn(g) = self.mixer(l) else {
            unreachable!("layer {l} is a GDN layer")
        };
        let hp = &self.hp;
        let sc = &self.scratch;
        let cd = hp.conv_dim() as u32;
        let hv = hp.n_v_heads as u32;
        let vd = hp.v_dim() as u32;
        // qkv, z, beta, alpha: one product per stored type, into columns of `proj`.
        let set = self.set(&self.w.layers[l].mixer_set);
        let (off_qkv, off_b, off_a, width) = (set.off[0], set.off[2], set.off[3], set.width);
        let conv_state = self.pools.conv[l]
            .as_ref()
            .expect("GDN layer has conv state");
        let ssm_state = self.pools.ssm[l]
            .as_ref()
            .expect("GDN layer has recurrent state");
        // Decode: the conv step in the qkv product's store; its output stays in `proj`.
        let conv_fits = g.conv.dtype == DType::F32
            && hp.conv_kernel >= 2
            && set.first_group_holds(cd)
            && matvec::conv_step_fits(&self.gpu, &sc.batch, n, 1);
        let step = matvec::ConvStep {
            channels: cd,
            k: hp.conv_kernel as u32,
            w: &g.conv.parts[0].buffer,
            state: conv_state,
            state_off: 0,
            batch: &sc.batch,
        };
        let fused_conv = match pre {
            Some(p @ (Prologue::RmsNorm { keep: None, .. } | Prologue::RmsNormRaw { .. }))
                if conv_fits =>
            {
                set.run_fused(
                    pass,
                    self.pre_x(Some(&p)),
                    &sc.proj,
                    n,
                    Some(&p),
                    Some(&step),
                )?;
                true
            }
            // Without int8 x the plain products are f32 matvecs: the conv step joins their
            // store as it joins the fused ones'.
            None if conv_fits && matvec::prologue_fits(n) && !self.gpu.int8_decode() => {
                set.run_fused(pass, &sc.h, &sc.proj, n, None, Some(&step))?;
                true
            }
            _ => {
                self.run_set(pass, set, n, pre)?;
                conv::conv1d_silu(
                    pass,
                    cd,
                    hp.conv_kernel as u32,
                    &sc.batch,
                    &ConvIo {
                        x: &sc.proj,
                        x_off: off_qkv,
                        x_stride: width,
                        w: &g.conv.parts[0].buffer,
                        state: conv_state,
                        state_off: 0,
                        y: &sc.qkv,
                        y_off: 0,
                        y_stride: cd,
                    },
                )?;
                false
            }
        };
        let (qkv_buf, qkv_off, qkv_stride) = if fused_conv {
            (&sc.proj, off_qkv, width)
        } else {
            (&sc.qkv, 0, cd)
        };
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
            qkv: qkv_buf,
            qkv_off,
            qkv_stride,
            a: &sc.proj,
            a_off: off_a,
            a_stride: width,
            b: &sc.proj,
            b_off: off_b,
            b_stride: width,
            a_neg: &g.a.parts[0].buffer,
            dt_bias: &g.dt_bias.parts[0].buffer,
            state: ssm_state,
            state_off: 0,
            o: &sc.o,
            o_off: 0,
            o_stride: vd,
        };
        if parts.iter().all(|p| p.n == 1) || self.spec.exact {
            if gdn::normed_fits(&self.gpu, &sc.batch) && g.norm.dtype == DType::F32 {
                // The step and the gated norm in one dispatch, z read from `proj`.
                let gn = gdn::GatedNorm {
                    z: &sc.proj,
                    z_off: set.off[1],
                    z_stride: width,
                    w: &g.norm.parts[0].buffer,
                    eps: hp.eps,
                };
                gdn::recurrent_normed(pass, &shape, &sc.batch, &io, &gn)?;
                return self.residual(pass, &g.out, &sc.o, n, None, next);
            }
            gdn::recurrent(pass, &shape, &sc.batch, &io)?;
        } else {
            gdn::chunked(pass, &shape, &sc.batch, &io, &sc.gdn_scratch)?;
        }
        // The norm takes z as packed [n·Hv, dv] rows: one token's are (in `proj`), several
        // tokens' are not (a row of `proj` per token), so those are packed first.
        let (z, z_off) = self.packed_rows(pass, self.col(set, 1), vd, n, &sc.z)?;
        let rms = norm::Rms {
            n_rows: n * hv,
            dim: hp.d_v as u32,
            eps: hp.eps,
        };
        let (o, z) = (Operand::new(&sc.o, 0), Operand::new(z, z_off));
        norm::gated_rms_norm(pass, rms, o, z, None, Some(&g.norm))?;
        self.residual(pass, &g.out, &sc.o, n, None, next)
    }

    /// Full-attention layer `l` (see [`Self::layer_head`]).
    pub(super) fn attn_block(
        &self,
        pass: &mut Pass<'_>,
        parts: &[Part],
        l: usize,
        n: u32,
        pre: Option<Prologue<'_>>,
        next: Option<&GpuTensor>,
    ) -> Result<bool> {
        let Mixer::Attn(a) = self.mixer(l) else {
            unreachable!("layer {l} is a full-attention layer")
        };
        let hp = &self.hp;
        let sc = &self.scratch;
        let (nh, nkv, hd) = (hp.n_head as u32, hp.n_head_kv as u32, hp.head_dim as u32);
        // q (with its gates), k, v: one product per stored type, into columns of `proj`;
        // q and k are normed per head in place, so several tokens' are packed first.
        let set = self.set(&self.w.layers[l].mixer_set);
        self.run_set(pass, set, n, pre)?;
        let (qg, qg_off) = self.packed_rows(pass, self.col(set, 0), 2 * nh * hd, n, &sc.qg)?;
        let (kc, vc) = self.pools.kv[l]
            .as_ref()
            .expect("attention layer has a KV cache");
        let shape = kv_shape(hp, self.kv_type);
        let f32_norms = a.q_norm.dtype == DType::F32 && a.k_norm.dtype == DType::F32;
        if n == 1 && f32_norms && hd <= 256 {
            // One token: q/k norms, RoPE and the cache writes in one dispatch.
            rope::qk_norm_rope(
                pass,
                &rope::QkvDecode {
                    buf: &sc.proj,
                    n_head: nh,
                    n_head_kv: nkv,
                    head_dim: hd,
                    q_off: qg_off,
                    q_stride: 2 * hd,
                    k_off: set.off[1],
                    v_off: set.off[2],
                    q_norm: &a.q_norm.parts[0].buffer,
                    k_norm: &a.k_norm.parts[0].buffer,
                    eps: hp.eps,
                    positions: &sc.pos,
                    pos_off: 0,
                    rows: &sc.kv_rows,
                    row_off: 0,
                    k_cache: kc,
                    v_cache: vc,
                    f16: shape.dtype == attention::KvType::F16,
                },
                &self.rope,
            )?;
        } else {
            self.qk_prep(pass, set, a, n, (qg, qg_off), (kc, vc))?;
        }
        self.attend(pass, parts, l, n, Operand::new(qg, qg_off), next)
    }

    /// Per-head q/k RMSNorm, RoPE, and k and v into the KV cache (several tokens, or norms
    /// not stored as f32).
    fn qk_prep(
        &self,
        pass: &mut Pass<'_>,
        set: &ProjSet,
        a: &weights::Attn<GpuTensor>,
        n: u32,
        (qg, qg_off): (&wgpu::Buffer, u32),
        (kc, vc): (&wgpu::Buffer, &wgpu::Buffer),
    ) -> Result<()> {
        let hp = &self.hp;
        let sc = &self.scratch;
        let (nh, nkv, hd) = (hp.n_head as u32, hp.n_head_kv as u32, hp.head_dim as u32);
        let (kb, k_off) = self.packed_rows(pass, self.col(set, 1), nkv * hd, n, &sc.k)?;
        // Per-head q/k RMSNorm; q heads sit every 2·head_dim (interleaved with their gates).
        norm::rms_norm(
            pass,
            n * nh,
            hd,
            Operand::strided(qg, qg_off, 2 * hd),
            None,
            Some(&a.q_norm),
            hp.eps,
        )?;
        norm::rms_norm(
            pass,
            n * nkv,
            hd,
            Operand::new(kb, k_off),
            None,
            Some(&a.k_norm),
            hp.eps,
        )?;
        let positions = Positions::Buffer {
            buf: &sc.pos,
            off: 0,
        };
        let qv = RopeView {
            buf: qg,
            off: qg_off,
            n_tokens: n,
            n_heads: nh,
            head_dim: hd,
            token_stride: nh * 2 * hd,
            head_stride: 2 * hd,
        };
        rope::rope(pass, &qv, RopeStyle::Neox, 0, &self.rope, positions, false)?;
        rope::rope(
            pass,
            &RopeView::packed(kb, k_off, n, nkv, hd),
            RopeStyle::Neox,
            0,
            &self.rope,
            positions,
            false,
        )?;
        let shape = kv_shape(hp, self.kv_type);
        let dst = attention::DstRows::List {
            rows: &sc.kv_rows,
            off: 0,
        };
        attention::write_kv(pass, shape, kb, k_off, nkv * hd, n, kc, dst)?;
        // v straight from `proj` (write_kv takes a row stride).
        attention::write_kv(pass, shape, &sc.proj, set.off[2], set.width, n, vc, dst)
    }

    /// Layer `l`'s attention over its cache for every part, the output gate and the o
    /// product (added to the residual stream); `qg`: the rows of q | gate per head.
    fn attend(
        &self,
        pass: &mut Pass<'_>,
        parts: &[Part],
        l: usize,
        n: u32,
        qg: Operand<'_>,
        next: Option<&GpuTensor>,
    ) -> Result<bool> {
        let Mixer::Attn(a) = self.mixer(l) else {
            unreachable!("layer {l} is a full-attention layer")
        };
        let (kc, vc) = self.pools.kv[l]
            .as_ref()
            .expect("attention layer has a KV cache");
        let (qg, qg_off) = (qg.buf, qg.off);
        let hp = &self.hp;
        let sc = &self.scratch;
        let (nh, hd) = (hp.n_head as u32, hp.head_dim as u32);
        let shape = kv_shape(hp, self.kv_type);
        let cap = self.pools.cap as u32;
        let q_stride = nh * 2 * hd;
        let o_stride = nh * hd;
        let call = |pass: &mut Pass<'_>,
                    row: u32,
                    n_q: u32,
                    keys: Keys<'_>,
                    max_keys: u32,
                    per_query: bool|
         -> Result<()> {
            // Split-K only when a few query rows face many keys (decode); the scratch is
            // sized for `SPLIT_ROWS` query rows.
            let mut n_split = attention::pick_n_split(n_q, nh, shape, max_keys, per_query);
            while n_split > 1
                && attention::scratch_elems(n_q, nh, hd, n_split) * 4 > sc.attn_split.size()
            {
                n_split /= 2;
            }
            attention::attention(
                pass,
                &Attention {
                    n_q,
                    n_head: nh,
                    kv: shape,
                    scale: 1.0 / (hd as f32).sqrt(),
                    q: QView {
                        buf: qg,
                        off: qg_off + row * q_stride,
                        tok_stride: q_stride,
                        head_stride: 2 * hd,
                    },
                    out: OutView {
                        buf: &sc.att,
                        off: row * o_stride,
                        tok_stride: o_stride,
                    },
                    a: KvSource { k: kc, v: Some(vc) },
                    b: None,
                    keys,
                    sinks: None,
                    split: (n_split > 1).then_some((&sc.attn_split, n_split)),
                },
            )
        };
        // Verify rows (`spec.exact`, single tokens too): each row as the one-token decode
        // call at its position.
        for p in parts.iter().filter(|_| self.spec.exact) {
            for j in 0..p.n as u32 {
                let q = p.pos0 as u32 + j;
                let keys = Keys::Causal {
                    row0: p.slot * cap,
                    pos0: q,
                    n_kv: q + 1,
                    window: 0,
                };
                call(pass, p.row as u32 + j, 1, keys, q + 1, false)?;
            }
        }
        // Prefill parts: causal over their own slot's rows (flash tiles shared by queries).
        for p in parts.iter().filter(|p| p.n > 1 && !self.spec.exact) {
            let (pos0, np) = (p.pos0 as u32, p.n as u32);
            let keys = Keys::Causal {
                row0: p.slot * cap,
                pos0,
                n_kv: pos0 + np,
                window: 0,
            };
            call(pass, p.row as u32, np, keys, pos0 + np, false)?;
        }
        // Decode rows (contiguous at the end of the pass): one call for all of them.
        let singles: Vec<&Part> = parts
            .iter()
            .filter(|p| p.n == 1 && !self.spec.exact)
            .collect();
        if let [p] = singles[..] {
            let keys = Keys::Causal {
                row0: p.slot * cap,
                pos0: p.pos0 as u32,
                n_kv: p.pos0 as u32 + 1,
                window: 0,
            };
            call(pass, p.row as u32, 1, keys, p.pos0 as u32 + 1, false)?;
        } else if let Some(first) = singles.first() {
            let max_keys = singles.iter().map(|p| p.pos0 as u32 + 1).max().unwrap_or(1);
            let keys = Keys::Ranges {
                desc: &sc.ranges,
                off: 0,
                max_keys,
            };
            call(
                pass,
                first.row as u32,
                singles.len() as u32,
                keys,
                max_keys,
                true,
            )?;
        }
        // Output gate: attn ⊙ sigmoid(gate), the gate being the second half of each head's q
        // row; one token's in the o product's activation load.
        if n == 1 {
            let gate = Prologue::SigmoidGate {
                gate: qg,
                off: qg_off + hd,
                head_dim: hd,
                head_stride: 2 * hd,
            };
            return self.residual(pass, &a.o, &sc.att, 1, Some(&gate), next);
        }
        ew::sigmoid_mul(
            pass,
            n * nh,
            hd,
            Operand::new(&sc.att_g, 0),
            Operand::strided(qg, qg_off + hd, 2 * hd),
            Operand::new(&sc.att, 0),
        )?;
        self.residual(pass, &a.o, &sc.att_g, n, None, next)
    }

    /// The shared expert of a MoE layer into `out` `[n, n_embd]`: SwiGLU of its gate and up
    /// columns of `set`'s projections (gate `g` `[ff, n_embd]`), its down product `d`, and its
    /// sigmoid gate (column 3).
    fn shared_expert(
        &self,
        pass: &mut Pass<'_>,
        set: &ProjSet,
        g: &GpuTensor,
        d: &GpuTensor,
        out: &wgpu::Buffer,
        n: u32,
    ) -> Result<()> {
        let sc = &self.scratch;
        let e = self.hp.n_embd as u32;
        ew::swiglu(
            pass,
            n,
            g.shape[0] as u32,
            Operand::new(&sc.o, 0),
            self.col(set, 1),
            self.col(set, 2),
            None,
        )?;
        self.linear(pass, d, &sc.o, out, n, false)?;
        ew::sigmoid_mul_row_inplace(pass, n, e, Operand::new(out, 0), self.col(set, 3))
    }

    /// Layer `l` up to its FFN: the mixer's norm, GDN or attention (added to the residual
    /// stream), and the FFN's norm (as [`normed`](Self::normed) returns it).
    pub(super) fn layer_head<'w>(
        &'w self,
        pass: &mut Pass<'_>,
        parts: &[Part],
        l: usize,
        n: u32,
        weighted: bool,
    ) -> Result<Option<Prologue<'w>>> {
        let lw = &self.w.layers[l];
        let pre = self.normed(pass, n, &lw.attn_norm, false, weighted)?;
        // MoE layers read `h` beyond their product set (the experts' input): the normed
        // rows, not x · w.
        let keep = !matches!(lw.ffn, Ffn::Dense { .. });
        let next = (!keep).then_some(&lw.post_norm);
        let weighted = match &lw.mixer {
            Mixer::Gdn(_) => self.gdn_block(pass, parts, l, n, pre, next)?,
            Mixer::Attn(_) => self.attn_block(pass, parts, l, n, pre, next)?,
        };
        self.normed(pass, n, &lw.post_norm, keep, weighted)
    }

    /// A MoE layer whose experts live in the offload's arena (recipe in `moe/mod.rs`): the
    /// same router, per-pair outputs, slot-order combine and shared expert as the stacked
    /// path below, with cold pairs computed on the CPU between passes. With `next` (a
    /// layer and the round's parts), that layer's head is recorded after the combine,
    /// while the CPU computes (`Offload::cold_ffn`); its FFN norm is returned.
    pub(super) fn moe_offload_block<'w>(
        &'w self,
        pass: &mut Pass<'_>,
        l: usize,
        m: &weights::Moe<GpuTensor>,
        n: u32,
        pre: Option<Prologue<'_>>,
        next: Option<(usize, &[Part])>,
    ) -> Result<Option<Option<Prologue<'w>>>> {
        let off = self.offload.as_ref().expect("offload layer");
        let hp = &self.hp;
        let sc = &self.scratch;
        let e = hp.n_embd as u32;
        let set = self.moe_router(pass, l, n, pre)?;
        let k = hp.moe.as_ref().expect("MoE layer in a MoE model").n_used as u32;
        let cold = off.route(pass, l, &sc.moe_ids, &sc.h, n)?;
        let bufs = FfnBufs {
            gate: &sc.f_gate,
            up: &sc.f_up,
            act: &sc.o,
            out: &sc.moe_out,
        };
        off.hot_ffn(pass, l, &sc.h, n, &bufs, None)?;
        // The shared expert while the CPU runs the cold pairs; added after the routed sum
        // as in the stacked path.
        if let Some((g, _, d, _)) = &m.shared {
            self.shared_expert(pass, set, g, d, &sc.sh_out, n)?;
        }
        let mut ahead = None;
        let mut tail = |p: &mut Pass<'_>| -> Result<()> {
            ew::moe_combine(
                p,
                n,
                e,
                k,
                Operand::new(&sc.x, 0),
                Operand::new(&sc.moe_w, 0),
                Operand::new(&sc.moe_out, 0),
            )?;
            if m.shared.is_some() {
                ew::add_inplace(p, n, e, Operand::new(&sc.x, 0), Operand::new(&sc.sh_out, 0))?;
            }
            if let Some((nl, parts)) = next {
                ahead = Some(self.layer_head(p, parts, nl, n, false)?);
            }
            Ok(())
        };
        off.cold_ffn(pass, cold, &bufs, None, Some(&mut tail))?;
        Ok(ahead)
    }

    pub(super) fn ffn_block(
        &self,
        pass: &mut Pass<'_>,
        l: usize,
        f: &Ffn<GpuTensor>,
        n: u32,
        pre: Option<Prologue<'_>>,
        next: Option<&GpuTensor>,
    ) -> Result<bool> {
        let hp = &self.hp;
        let sc = &self.scratch;
        let e = hp.n_embd as u32;
        match f {
            Ffn::Dense { gate, down, .. } => {
                let ff = gate.shape[0] as u32;
                // gate and up: one product when they share a stored type, into `proj`.
                let set = self.set(&self.w.layers[l].ffn_set);
                // Decode with f32 x: SwiGLU as that product's store, into `o`.
                let glu = set
                    .glu_weight()
                    .filter(|_| matvec::prologue_fits(n) && !self.gpu.int8_decode());
                if let Some(gu) = glu {
                    let x = self.pre_x(pre.as_ref());
                    let opts = MatvecOpts::default();
                    let epi = matvec::Epilogue::SwiGlu;
                    matvec::matvec_fused(
                        pass,
                        gu,
                        Operand::new(x, 0),
                        Operand::new(&sc.o, 0),
                        n,
                        &opts,
                        matvec::Fused {
                            pro: pre.as_ref(),
                            epi,
                        },
                    )?;
                    return self.residual(pass, down, &sc.o, n, None, next);
                }
                self.run_set(pass, set, n, pre)?;
                // SwiGLU in the down product's activation load where it runs as matvec.
                let (g0, u0) = (set.off[0], set.off[1]);
                if self.fused(n) && u0 > g0 {
                    let opts = MatvecOpts {
                        accumulate: true,
                        ..Default::default()
                    };
                    let glu = Prologue::SwiGlu { up: u0 - g0 };
                    let x = Operand::strided(&sc.proj, g0, set.width);
                    matvec::matvec_pro(pass, down, x, Operand::new(&sc.x, 0), n, &opts, &glu)?;
                    return Ok(false);
                }
                ew::swiglu(
                    pass,
                    n,
                    ff,
                    Operand::new(&sc.o, 0),
                    self.col(set, 0),
                    self.col(set, 1),
                    None,
                )?;
                self.residual(pass, down, &sc.o, n, None, next)
            }
            Ffn::Moe(m) if self.offload.as_ref().is_some_and(|o| o.has_layer(l)) => self
                .moe_offload_block(pass, l, m, n, pre, None)
                .map(|_| false),
            Ffn::Moe(m) => {
                let set = self.moe_router(pass, l, n, pre)?;
                let k = hp.moe.as_ref().expect("MoE layer in a MoE model").n_used as u32;
                let r = sc.route.as_ref().expect("route made for MoE models");
                let stacks = ExpertStacks {
                    gate: &m.gate_exps,
                    up: &m.up_exps,
                    down: &m.down_exps,
                };
                let bufs = FfnBufs {
                    gate: &sc.f_gate,
                    up: &sc.f_up,
                    act: &sc.o,
                    out: &sc.moe_out,
                };
                let picks = Picks {
                    ids: &sc.moe_ids,
                    route: r,
                    n,
                    k,
                };
                routed_ffn(pass, &stacks, &sc.h, &picks, &bufs, None)?;
                // Combine in slot order (fixed order: placement never changes the sum).
                ew::moe_combine(
                    pass,
                    n,
                    e,
                    k,
                    Operand::new(&sc.x, 0),
                    Operand::new(&sc.moe_w, 0),
                    Operand::new(&sc.moe_out, 0),
                )?;
                let (g0, u0) = (set.off[1], set.off[2]);
                if let (Some((_, _, d, _)), true) = (&m.shared, self.fused(n) && u0 > g0) {
                    // The shared expert's SwiGLU, down product, sigmoid gate and residual add
                    // in one dispatch.
                    let opts = MatvecOpts::default();
                    let glu = Prologue::SwiGluGated {
                        up: u0 - g0,
                        gate: &sc.proj,
                        off: set.off[3],
                        stride: set.width,
                    };
                    let x = Operand::strided(&sc.proj, g0, set.width);
                    matvec::matvec_pro(pass, d, x, Operand::new(&sc.x, 0), n, &opts, &glu)?;
                    return Ok(false);
                }
                if let Some((g, _, d, _)) = &m.shared {
                    self.shared_expert(pass, set, g, d, &sc.moe_out, n)?;
                    ew::add_inplace(
                        pass,
                        n,
                        e,
                        Operand::new(&sc.x, 0),
                        Operand::new(&sc.moe_out, 0),
                    )?;
                }
                Ok(false)
            }
        }
    }
}
