//! Loading a Qwen3.5-family model onto the GPU: the weights (products over one input
//! grouped into [`ProjSet`]s), the RoPE table, the state pools, the scratch and the expert
//! offload when the budget asks for one.

use super::*;

impl ProjSet {
    /// `proj[t, :] = [W_g x_t for each group g]` for the `n` rows of `x` ([n, cols] packed).
    pub(super) fn run(
        &self,
        pass: &mut Pass<'_>,
        x: &wgpu::Buffer,
        y: &wgpu::Buffer,
        n: u32,
    ) -> Result<()> {
        self.run_opts(pass, x, y, n, false)
    }

    /// [`ProjSet::run`] reading `x` through `pro` (see [`matvec::matvec_fused`]), and with
    /// `conv` the GDN conv step fused into the group that starts at column 0 (its first
    /// `conv.channels` rows: the qkv member); only for the token counts
    /// [`matvec::prologue_fits`] takes, without int8 x. Groups with neither run as in
    /// [`ProjSet::run`].
    pub(super) fn run_fused(
        &self,
        pass: &mut Pass<'_>,
        x: &wgpu::Buffer,
        y: &wgpu::Buffer,
        n: u32,
        pro: Option<&Prologue<'_>>,
        conv: Option<&matvec::ConvStep<'_>>,
    ) -> Result<()> {
        let opts = MatvecOpts::default();
        let x = Operand::new(x, 0);
        for (w, col) in &self.groups {
            let y = Operand::strided(y, *col, self.width);
            match (pro, conv.filter(|_| *col == 0)) {
                (None, None) => matmul::matmul_opts(pass, w, x, y, n, &opts)?,
                (pro, c) => {
                    let epi = c.map_or(matvec::Epilogue::Store, matvec::Epilogue::Conv);
                    matvec::matvec_fused(pass, w, x, y, n, &opts, matvec::Fused { pro, epi })?
                }
            }
        }
        Ok(())
    }

    /// The set's weight when it is one group of two equal members (gate, then up) that takes
    /// the SwiGLU store ([`matvec::Epilogue::SwiGlu`]).
    pub(super) fn glu_weight(&self) -> Option<&GpuTensor> {
        match (&self.groups[..], &self.off[..]) {
            ([(w, 0)], [0, u]) if 2 * *u as u64 == w.n_rows() => {
                matvec::glu_fits(w.n_rows(), w.parts.len()).then_some(w)
            }
            _ => None,
        }
    }

    /// Whether the group at column 0 holds the first member and `channels` rows, in one part.
    pub(super) fn first_group_holds(&self, channels: u32) -> bool {
        self.off.first() == Some(&0)
            && self
                .groups
                .iter()
                .any(|(w, col)| *col == 0 && w.parts.len() == 1 && w.n_rows() >= channels as u64)
    }

    /// [`ProjSet::run`]; `exact`: f32 products (a set holding the MoE router, whose top-k
    /// f16 rounding would flip; see [`MatvecOpts::exact`]).
    pub(super) fn run_opts(
        &self,
        pass: &mut Pass<'_>,
        x: &wgpu::Buffer,
        y: &wgpu::Buffer,
        n: u32,
        exact: bool,
    ) -> Result<()> {
        let opts = MatvecOpts {
            exact,
            ..Default::default()
        };
        for (w, col) in &self.groups {
            let y = Operand::strided(y, *col, self.width);
            matmul::matmul_opts(pass, w, Operand::new(x, 0), y, n, &opts)?;
        }
        Ok(())
    }

    /// Group the members of a set by (stored type, width), first appearance first, and
    /// upload each group with `upload` (given the group's weights and a label).
    pub(super) fn build(
        ws: &[Weight<'_>],
        mut upload: impl FnMut(&[&Weight<'_>], &str) -> Result<GpuTensor>,
    ) -> Result<ProjSet> {
        let key = |w: &Weight<'_>| (w.dtype(), w.shape().last().copied().unwrap_or(1));
        let mut keys: Vec<(DType, u64)> = Vec::new();
        let mut members: Vec<Vec<usize>> = Vec::new();
        for (i, w) in ws.iter().enumerate() {
            match keys.iter().position(|k| *k == key(w)) {
                Some(g) => members[g].push(i),
                None => {
                    keys.push(key(w));
                    members.push(vec![i]);
                }
            }
        }
        let rows = |w: &Weight<'_>| {
            let s = w.shape();
            s.iter().product::<u64>() / s.last().copied().unwrap_or(1).max(1)
        };
        let mut off = vec![0u32; ws.len()];
        let mut groups = Vec::with_capacity(members.len());
        let mut col = 0u64;
        for m in &members {
            let refs: Vec<&Weight<'_>> = m.iter().map(|&i| &ws[i]).collect();
            let t = upload(&refs, &group_label(&refs))?;
            groups.push((t, col as u32));
            for &i in m {
                off[i] = col as u32;
                col += rows(&ws[i]);
            }
        }
        if col > u32::MAX as u64 / 4 {
            return Err(Error::Invalid(format!(
                "{}: {col} output columns",
                group_label(&ws.iter().collect::<Vec<_>>())
            )));
        }
        Ok(ProjSet {
            groups,
            off,
            width: col as u32,
        })
    }
}

/// A group's label: its first member's name, then the others' without the prefix they share
/// with it up to a dot (`blk.0.attn_qkv.weight+attn_gate.weight`).
pub(super) fn group_label(ws: &[&Weight<'_>]) -> String {
    let first = ws.first().map_or("", |w| w.name());
    let mut label = first.to_string();
    for w in ws.iter().skip(1) {
        let name = w.name();
        let common = first
            .bytes()
            .zip(name.bytes())
            .take_while(|(a, b)| a == b)
            .count();
        let cut = name[..common].rfind('.').map_or(0, |i| i + 1);
        label.push('+');
        label.push_str(&name[cut..]);
    }
    label
}

/// `f` over the stored-type bytes of all `ws` at once (`Weight::with_tensor`, nested: only
/// row selections and computed vectors are copies).
pub(super) fn with_tensors<R>(
    ws: &[&Weight<'_>],
    f: &mut dyn FnMut(&[TensorRef<'_>]) -> Result<R>,
) -> Result<R> {
    fn go<R>(
        ws: &[&Weight<'_>],
        acc: &[TensorRef<'_>],
        f: &mut dyn FnMut(&[TensorRef<'_>]) -> Result<R>,
    ) -> Result<R> {
        match ws.split_first() {
            None => f(acc),
            Some((w, rest)) => w.with_tensor(|t| {
                let mut next: Vec<TensorRef<'_>> = acc.to_vec();
                next.push(*t);
                go(rest, &next, f)
            }),
        }
    }
    go(ws, &[], f)
}

impl GpuSink<'_> {
    pub(super) fn progress(&mut self, bytes: u64) {
        self.done += bytes;
        if let Some(p) = &self.opts.progress {
            p(self.done.min(self.total), self.total);
        }
    }
}

impl Sink for GpuSink<'_> {
    type T = GpuTensor;
    type Set = ProjSet;

    fn one(&mut self, w: Weight<'_>) -> Result<GpuTensor> {
        let elsewhere = self
            .experts_elsewhere
            .is_some_and(|n| n.is_expert(w.name()));
        if elsewhere || !(self.held)(w.name()) {
            return Ok(w.stand_in());
        }
        let t = w.with_tensor(|t| self.gpu.upload_tensor(t))?;
        self.progress(t.bytes());
        Ok(t)
    }

    fn set(&mut self, ws: Vec<Weight<'_>>) -> Result<SetOut<GpuTensor, ProjSet>> {
        // A set's members are one layer's: another device's layer is not uploaded here.
        if ws.first().is_some_and(|w| !(self.held)(w.name())) {
            return Ok((ws.iter().map(Weight::stand_in).collect(), None));
        }
        let gpu = self.gpu;
        let mut bytes = 0;
        let set = ProjSet::build(&ws, |group, label| {
            let t = with_tensors(group, &mut |ts| gpu.upload_concat(ts, label))?;
            bytes += t.bytes();
            Ok(t)
        })?;
        self.progress(bytes);
        Ok((ws.iter().map(Weight::stand_in).collect(), Some(set)))
    }
}

impl GpuModel {
    pub fn load(gpu: Arc<Gpu>, file: &ModelFile, opts: &LoadOptions) -> Result<GpuModel> {
        let hp = Hparams::from_file(file)?;
        let part = opts
            .part
            .clone()
            .unwrap_or_else(|| PartSpec::whole(hp.n_layer));
        // Placement first: experts without the stacks go to the arena after the rest.
        let needs = |rows| state::needs_part(&hp, RunShape::new(opts, rows), &part);
        let limits = BufferLimits::of(&gpu.limits);
        let batch = fit_rows(DEFAULT_BATCH, limits, &file.path(), |r| needs(r).buffers)?;
        let plan = Plan::new(
            &gpu,
            file,
            crate::models::registry::family(file)?.experts,
            opts,
            &needs,
            batch,
        )?;
        // Rows of one pass: longer where a prompt's cold experts stream (`Plan::rows`).
        let rows = plan.as_ref().map_or(batch, |p| p.rows);
        let ld = crate::models::Loader::<weights::W>::new(file);
        let embedding = ld.name(weights::W::TokEmbd);
        let tied = ld.get(weights::W::Output).is_none();
        let held = |name: &str| part.holds(PartSpec::role(name, hp.n_layer, &embedding, tied));
        let sink = GpuSink {
            gpu: &gpu,
            experts_elsewhere: plan.as_ref().map(|p| p.info.names),
            held: &held,
            opts,
            done: 0,
            total: file.tensors().map(|t| t.data.len() as u64).sum(),
        };
        let mut w = weights::load_sets(file, &hp, sink)?;
        if plan.is_some() && hp.moe.is_some() && w.mtp.take().is_some() {
            // Its experts would be stand-ins for an arena that has no slots for them.
            eprintln!("note: the MTP block is not loaded: the routed experts are offloaded");
        }
        let inv = crate::cpu::ops::rope_inv_freq(hp.rope_theta, hp.n_rot.max(2));
        let rope = RopeTable::new(&gpu, &inv, "qwen35.rope")?;
        let kv_type = match opts.kv_type {
            KvType::Auto | KvType::F16 => attention::KvType::F16,
            KvType::F32 => attention::KvType::F32,
        };
        let scratch = Scratch::new(&gpu, &hp, rows, opts.max_seqs.max(1))?;
        let pools = Pools::new(
            &gpu,
            &hp,
            &part,
            kv_type,
            opts.max_seqs.max(1),
            state::kv_cap(opts.ctx),
        )?;
        let offload = match plan {
            Some(p) => Some(Offload::new(&gpu, file, p, opts, rows)?),
            None => None,
        };
        let handoff = (!part.last).then(|| Readback::new(&gpu, (rows * hp.n_embd * 4) as u64));
        let mut m = GpuModel {
            suppress: crate::models::runtime::head::suppress_mask(&gpu, file, hp.n_vocab)?,
            gpu,
            hp,
            w,
            rope,
            kv_type,
            pools,
            scratch,
            trace: Tracer::default(),
            hidden_out: false,
            profile: None,
            offload,
            spec: SpecState::default(),
            fused_loads: opts.fused_loads,
            part,
            link: Link::default(),
            handoff,
        };
        // Speculation runs on one device: a split model's parts leave the MTP block out.
        if m.part.first && m.part.last {
            m.attach_mtp()?;
        }
        Ok(m)
    }
}
