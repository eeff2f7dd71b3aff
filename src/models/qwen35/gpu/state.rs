//! What a Qwen3.5-family model keeps between and within passes: the per-sequence state pools
//! (KV rows, conv and GDN state) and their sequences, the activation scratch, and what both
//! cost ([`needs`], the planner's budget input).

use super::*;

pub(super) fn kv_shape(hp: &Hparams, t: attention::KvType) -> KvShape {
    KvShape {
        dtype: t,
        n_head_kv: hp.n_head_kv as u32,
        head_dim: hp.head_dim as u32,
    }
}

impl Pools {
    /// The pools of `part`'s layers (other layers get none).
    pub(super) fn new(
        gpu: &Gpu,
        hp: &Hparams,
        part: &PartSpec,
        kv_type: attention::KvType,
        slots: usize,
        cap: usize,
    ) -> Result<Pools> {
        let shape = kv_shape(hp, kv_type);
        let (mut kv, mut conv, mut ssm) = (Vec::new(), Vec::new(), Vec::new());
        let rows = (slots * cap) as u64;
        for l in 0..hp.n_layer {
            if !part.layers.contains(&l) {
                kv.push(None);
                conv.push(None);
                ssm.push(None);
            } else if hp.recurrent[l] {
                kv.push(None);
                conv.push(Some(gpu.buffer(
                    (slots * (hp.conv_kernel - 1) * hp.conv_dim() * 4) as u64,
                    "pool.conv",
                )?));
                ssm.push(Some(gpu.buffer(
                    (slots * hp.n_v_heads * hp.d_k * hp.d_v * 4) as u64,
                    "pool.ssm",
                )?));
            } else {
                kv.push(Some((
                    gpu.buffer(shape.bytes(rows), "kv.k")?,
                    gpu.buffer(shape.bytes(rows), "kv.v")?,
                )));
                conv.push(None);
                ssm.push(None);
            }
        }
        Ok(Pools {
            slots,
            cap,
            kv,
            conv,
            ssm,
            // Popped from the end: slot 0 first.
            free: Arc::new(Mutex::new((0..slots as u32).rev().collect())),
        })
    }
}

impl Dims {
    /// `logit_rows`: rows of logits a pass holds (the binding limit may allow fewer than
    /// `rows`).
    pub(super) fn new(hp: &Hparams, rows: usize, logit_rows: usize) -> Dims {
        let r = rows;
        let (k, ffw) = match &hp.moe {
            Some(m) => (m.n_used, m.n_ff_exp.max(m.n_ff_shexp)),
            None => (1, 0),
        };
        let ff = hp.n_ff.max(ffw);
        let att = hp.n_head * hp.head_dim;
        // The widest product set (see `weights::Layer`): GDN qkv|z|beta|alpha, attention
        // q|k|v, dense gate|up, MoE router|shared gate|up|gate input.
        let proj_w = (hp.conv_dim() + hp.v_dim() + 2 * hp.n_v_heads)
            .max(2 * att + 2 * hp.n_head_kv * hp.head_dim)
            .max(2 * hp.n_ff)
            .max(
                hp.moe
                    .as_ref()
                    .map_or(0, |m| m.n_expert + 2 * m.n_ff_shexp + 1),
            );
        // `o` doubles as the SwiGLU output, so it holds the widest of the three uses.
        let o_w = hp.v_dim().max(ff * k).max(att);
        Dims {
            ids: r,
            pos: r,
            kv_rows: r,
            ranges: 2 * r,
            x: r * hp.n_embd,
            h: r * hp.n_embd,
            proj: r * proj_w,
            qkv: r * hp.conv_dim(),
            z: r * hp.v_dim(),
            o: r * o_w,
            qg: r * 2 * att,
            k: r * hp.n_head_kv * hp.head_dim,
            att: r * att,
            att_g: r * att,
            // routed experts only: dense and shared-expert gate/up land in `proj`
            f_gate: r * ffw * k,
            f_up: r * ffw * k,
            moe_out: r * k * hp.n_embd,
            moe_ids: r * k,
            moe_w: r * k,
            sh_out: if hp.moe.is_some() { r * hp.n_embd } else { 1 },
            logits: logit_rows * hp.n_vocab,
        }
    }

    /// Each with the label [`Scratch::new`] allocates it under.
    pub(super) fn named(&self) -> [(&'static str, usize); 21] {
        let d = self;
        [
            ("ids", d.ids),
            ("pos", d.pos),
            ("kv_rows", d.kv_rows),
            ("ranges", d.ranges),
            ("x", d.x),
            ("h", d.h),
            ("proj", d.proj),
            ("qkv", d.qkv),
            ("z", d.z),
            ("o", d.o),
            ("qg", d.qg),
            ("k", d.k),
            ("att", d.att),
            ("att_g", d.att_g),
            ("f_gate", d.f_gate),
            ("f_up", d.f_up),
            ("moe_out", d.moe_out),
            ("moe_ids", d.moe_ids),
            ("moe_w", d.moe_w),
            ("sh_out", d.sh_out),
            ("logits", d.logits),
        ]
    }

    /// Bytes of all of them (each at least one element, as allocated).
    pub(super) fn bytes(&self) -> u64 {
        self.named().iter().map(|&(_, n)| n.max(1) as u64 * 4).sum()
    }
}

/// The GDN layers' shape (for the chunk scratch).
pub(super) fn gdn_shape(hp: &Hparams) -> GdnShape {
    GdnShape {
        n_head_k: hp.n_k_heads,
        n_head_v: hp.n_v_heads,
        d_k: hp.d_k,
        d_v: hp.d_v,
        map: KeyHeadMap::Repeat,
    }
}

/// Chunk slots of the GDN scratch for a pass of `rows` rows: Σ ceil(n_i / CHUNK) ≤
/// ceil(rows / CHUNK) + one partial chunk per sequence sharing the pass.
pub(super) fn gdn_chunks(rows: usize, max_seqs: usize) -> u32 {
    (rows as u32).div_ceil(gdn::CHUNK as u32) + max_seqs as u32
}

/// Split-K partials for a decode step of every sequence at MAX_SPLIT splits, capped at 64 MiB
/// (fewer splits are used beyond it): elements.
pub(super) fn attn_split_elems(hp: &Hparams, max_seqs: usize) -> u64 {
    attention::scratch_elems(
        max_seqs as u32,
        hp.n_head as u32,
        hp.head_dim as u32,
        attention::MAX_SPLIT,
    )
    .min(16 << 20)
}

impl Scratch {
    pub(super) fn new(gpu: &Gpu, hp: &Hparams, rows: usize, max_seqs: usize) -> Result<Scratch> {
        let f = |n: usize, label: &str| gpu.buffer((n.max(1) * 4) as u64, label);
        let r = rows;
        let batch = SeqBatch::new(
            gpu,
            &[SeqSpan {
                row: 0,
                n_tokens: r as u32,
                slot: 0,
            }],
        )?;
        let gdn_scratch = gpu.buffer(
            gdn::scratch_bytes(&gdn_shape(hp), gdn_chunks(r, max_seqs)).max(4),
            "gdn.scratch",
        )?;
        let attn_split = gpu.buffer(attn_split_elems(hp, max_seqs) * 4, "attn.split")?;
        let logit_rows = ((gpu.max_binding() / 4) as usize / hp.n_vocab).clamp(1, r);
        let d = Dims::new(hp, r, logit_rows);
        Ok(Scratch {
            rows: r,
            ids: f(d.ids, "ids")?,
            pos: f(d.pos, "pos")?,
            kv_rows: f(d.kv_rows, "kv_rows")?,
            ranges: f(d.ranges, "ranges")?,
            x: f(d.x, "x")?,
            h: f(d.h, "h")?,
            proj: f(d.proj, "proj")?,
            qkv: f(d.qkv, "qkv")?,
            z: f(d.z, "z")?,
            o: f(d.o, "o")?,
            qg: f(d.qg, "qg")?,
            k: f(d.k, "k")?,
            att: f(d.att, "att")?,
            att_g: f(d.att_g, "att_g")?,
            f_gate: f(d.f_gate, "f_gate")?,
            f_up: f(d.f_up, "f_up")?,
            moe_out: f(d.moe_out, "moe_out")?,
            moe_ids: f(d.moe_ids, "moe_ids")?,
            moe_w: f(d.moe_w, "moe_w")?,
            sh_out: f(d.sh_out, "sh_out")?,
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
            logits: f(d.logits, "logits")?,
            logit_rows,
            top: topk::LogitsTop::new(gpu, r as u32, hp.n_vocab as u32)?,
        })
    }

    /// Bytes [`Scratch::new`] allocates for `rows` rows and `max_seqs` sequences, counting
    /// logits for every row (the binding limit may hold fewer): the activation part of
    /// [`needs`]. The one-sequence GDN batch table (16 bytes) is left out.
    pub(super) fn bytes(hp: &Hparams, rows: usize, max_seqs: usize) -> u64 {
        let route = hp.moe.as_ref().map_or(0, |m| {
            MoeRoute::bytes(m.n_expert as u32, (rows * m.n_used) as u32)
        });
        Dims::new(hp, rows, rows).bytes()
            + gdn::scratch_bytes(&gdn_shape(hp), gdn_chunks(rows, max_seqs)).max(4)
            + attn_split_elems(hp, max_seqs) * 4
            + route
            + topk::LogitsTop::bytes(rows as u32, hp.n_vocab as u32)
    }
}

/// What a Qwen3.5-family model needs beside its weights for `run` (the planner's budget
/// input, `lathe plan` and the loader alike): KV rows of the attention layers, the GDN
/// layers' recurrent and conv state (as [`Pools`] allocates them), and [`Scratch::bytes`].
/// `KvType::Auto` is f16 here, as the loader picks.
pub fn needs(hp: &Hparams, run: RunShape) -> Needs {
    needs_part(hp, run, &PartSpec::whole(hp.n_layer))
}

/// [`needs`] of the layers of one device's `part` (`models::chain`).
pub fn needs_part(hp: &Hparams, run: RunShape, part: &PartSpec) -> Needs {
    let seqs = run.seqs.max(1);
    let kv_elem: u64 = if run.kv == KvType::F32 { 4 } else { 2 };
    let held = &hp.recurrent[part.layers.clone()];
    let n_attn = held.iter().filter(|r| !**r).count() as u64;
    let n_gdn = held.len() as u64 - n_attn;
    let kv_per_token = n_attn * 2 * (hp.n_head_kv * hp.head_dim) as u64 * kv_elem;
    // f32 recurrent state [Hv, dk, dv] and the conv's last K-1 inputs per GDN layer.
    let state = n_gdn
        * 4
        * ((hp.n_v_heads * hp.d_k * hp.d_v) as u64
            + (hp.conv_kernel.saturating_sub(1) * hp.conv_dim()) as u64);
    Needs {
        weights: 0,
        kv_per_token: kv_per_token * seqs,
        state: state * seqs,
        activations: Scratch::bytes(hp, run.batch.max(1) as usize, seqs as usize),
        buffers: pass_buffers(hp, run, part),
        kv_elem,
        note: None,
    }
}

/// KV rows per sequence the pools start with for a context of `ctx` (they grow on demand, to
/// [`KvShape::max_positions`]).
pub(super) fn kv_cap(ctx: usize) -> usize {
    ctx.clamp(16, 4096)
}

/// Every buffer a run of `run` allocates whose size follows it (as [`Scratch::new`],
/// [`Pools::new`], the MTP block and a chain's handoff make them): the scratch at `run.batch`
/// rows with one row of logits, the KV pools at their first capacity and the GDN state for
/// `run.seqs` sequences.
fn pass_buffers(hp: &Hparams, run: RunShape, part: &PartSpec) -> Vec<PassBuffer> {
    let (rows, seqs) = (run.batch.max(1) as usize, run.seqs.max(1) as usize);
    let mut v: Vec<PassBuffer> = Dims::new(hp, rows, 1)
        .named()
        .iter()
        .map(|&(l, n)| PassBuffer::bound(l, n as u64 * 4))
        .collect();
    v.extend([
        PassBuffer::bound(
            "gdn.scratch",
            gdn::scratch_bytes(&gdn_shape(hp), gdn_chunks(rows, seqs)),
        ),
        PassBuffer::bound("attn.split", attn_split_elems(hp, seqs) * 4),
        PassBuffer::bound(
            "logits_top",
            topk::LogitsTop::bytes(rows as u32, hp.n_vocab as u32),
        ),
    ]);
    if let Some(m) = &hp.moe {
        let route = MoeRoute::bytes(m.n_expert as u32, (rows * m.n_used) as u32);
        v.push(PassBuffer::bound("moe_route", route));
    }
    let kv_type = match run.kv {
        KvType::F32 => attention::KvType::F32,
        KvType::Auto | KvType::F16 => attention::KvType::F16,
    };
    let kv = kv_shape(hp, kv_type).bytes((seqs * kv_cap(run.ctx as usize)) as u64);
    for l in part.layers.clone() {
        if hp.recurrent[l] {
            let conv = (seqs * (hp.conv_kernel - 1) * hp.conv_dim() * 4) as u64;
            v.push(PassBuffer::bound("pool.conv", conv));
            let ssm = (seqs * hp.n_v_heads * hp.d_k * hp.d_v * 4) as u64;
            v.push(PassBuffer::bound("pool.ssm", ssm));
        } else {
            v.extend([PassBuffer::bound("kv.k", kv), PassBuffer::bound("kv.v", kv)]);
        }
    }
    let (r, e) = (rows as u64, hp.n_embd as u64);
    if hp.n_mtp > 0 && part.first && part.last {
        v.extend([
            PassBuffer::bound("mtp.cat", r * 2 * e * 4),
            PassBuffer::bound("mtp.hid", r * e * 4),
            PassBuffer::bound("mtp.out", r * e * 4),
            PassBuffer::bound("mtp.saved", seqs as u64 * MAX_VERIFY as u64 * e * 4),
        ]);
    }
    if !part.last {
        v.push(PassBuffer::copied("chain.readback", r * e * 4));
    }
    v
}

impl GpuModel {
    /// A new sequence in a free slot (at most `LoadOptions::max_seqs` live at once).
    pub fn new_seq(&self) -> Result<GpuSeq> {
        let slot = self
            .pools
            .free
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .pop()
            .ok_or_else(|| {
                Error::Invalid(format!(
                    "all {} sequence slots are in use (raise LoadOptions::max_seqs / --parallel)",
                    self.pools.slots
                ))
            })?;
        let mut seq = GpuSeq {
            slot,
            pos: 0,
            free: self.pools.free.clone(),
        };
        self.reset(&mut seq)?;
        Ok(seq)
    }

    /// Forget everything the sequence has seen (zeroes its recurrent state).
    pub fn reset(&self, seq: &mut GpuSeq) -> Result<()> {
        let hp = &self.hp;
        let mut enc = self.gpu.device.create_command_encoder(&Default::default());
        let s = seq.slot as u64;
        let conv_len = ((hp.conv_kernel - 1) * hp.conv_dim() * 4) as u64;
        let ssm_len = (hp.n_v_heads * hp.d_k * hp.d_v * 4) as u64;
        for b in self.pools.conv.iter().flatten() {
            enc.clear_buffer(b, s * conv_len, Some(conv_len));
        }
        for b in self.pools.ssm.iter().flatten() {
            enc.clear_buffer(b, s * ssm_len, Some(ssm_len));
        }
        self.gpu.queue.submit([enc.finish()]);
        seq.pos = 0;
        Ok(())
    }

    /// Make `dst` a copy of `src` (a checkpoint, or its restore): KV rows `[0, pos)` of every
    /// attention layer and the conv + GDN state of every recurrent layer, slot to slot, all
    /// on the GPU in one submission. Both slots live in the same pool buffers and WebGPU
    /// forbids a copy within one buffer, so each region goes through a staging buffer (wgpu
    /// orders the copies with barriers). Every slot has the pool's `cap` rows, so `dst`
    /// never needs to grow.
    pub fn copy_seq(&self, src: &GpuSeq, dst: &mut GpuSeq) -> Result<()> {
        let hp = &self.hp;
        let p = &self.pools;
        debug_assert!(src.pos <= p.cap && src.slot != dst.slot);
        let (s, d) = (src.slot as u64, dst.slot as u64);
        let conv_len = ((hp.conv_kernel - 1) * hp.conv_dim() * 4) as u64;
        let ssm_len = (hp.n_v_heads * hp.d_k * hp.d_v * 4) as u64;
        let ks = kv_shape(hp, self.kv_type);
        // [pos, n_head_kv, head_dim]: a multiple of 4 bytes (head_dim is, see KvShape).
        let kv_len = ks.bytes(src.pos as u64);
        let (kv_src, kv_dst) = (ks.bytes(s * p.cap as u64), ks.bytes(d * p.cap as u64));
        let mut regions: Vec<(&wgpu::Buffer, u64, u64, u64)> = Vec::new();
        for (l, kv) in p.kv.iter().enumerate() {
            if let Some((k, v)) = kv {
                if kv_len > 0 {
                    regions.push((k, kv_src, kv_dst, kv_len));
                    regions.push((v, kv_src, kv_dst, kv_len));
                }
            }
            if let Some(c) = &p.conv[l] {
                regions.push((c, s * conv_len, d * conv_len, conv_len));
            }
            if let Some(b) = &p.ssm[l] {
                regions.push((b, s * ssm_len, d * ssm_len, ssm_len));
            }
        }
        copy_regions(&self.gpu, &regions, "seq.copy_stage")?;
        dst.pos = src.pos;
        Ok(())
    }

    /// Grow every slot's KV rows to at least `need` (doubling; old rows copied on the GPU).
    pub(super) fn reserve(&mut self, pass: &mut Pass<'_>, need: usize) -> Result<()> {
        if need <= self.pools.cap {
            return Ok(());
        }
        let p = &mut self.pools;
        p.cap = kv_shape(&self.hp, self.kv_type).grow_pools(
            pass,
            p.kv.iter_mut().flatten(),
            p.slots,
            p.cap,
            need,
            "kv",
        )?;
        Ok(())
    }

    /// Positions per sequence the KV pools can grow to ([`KvShape::max_positions`]).
    pub fn max_positions(&self) -> usize {
        kv_shape(&self.hp, self.kv_type).max_positions(&self.gpu, self.pools.slots)
    }
}
