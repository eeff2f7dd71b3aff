//! The GPU side of MoE models bigger than VRAM (`shaders/moe.wgsl`): the expert arena, the
//! per-layer remap tables, the kernels that map router ids to slots and put the CPU's cold
//! rows in place, and the one readback per MoE layer. They know slots and tables, not the
//! planner: the recipe that ties them into a forward (`moe::Offload`) and the placement they
//! are filled from are in `moe/`. CPU references: `moe::remap_ids`, a plain scatter, and the
//! arena's bytes against the mmap.

use super::elementwise as ew;
use super::matmul::{self, MoeRoute};
use super::matvec::{self, MatvecOpts};
use super::operand::Operand;
use super::{check_len, grid, Binding, Gpu, GpuTensor, Pass, PipelineSpec, TensorPart};
pub use crate::cpu::moe::Glu;
use crate::tensor::MatShape;
use crate::{Error, Result};

const SRC: &str = include_str!("../../shaders/moe.wgsl");
const WG: u32 = 256;

/// Uniforms of `moe.wgsl` (same fields, same order).
#[repr(C)]
#[derive(Clone, Copy, Default, bytemuck::Pod, bytemuck::Zeroable)]
struct Params {
    n: u32,          // remap: ids; scatter_rows: rows; copy_bytes: destination words
    n_expert: u32,   // remap: table entries
    width: u32,      // scatter_rows: words per row
    n_out: u32,      // scatter_rows: rows of the output
    in_off: u32,     // words
    out_off: u32,    // words
    out_stride: u32, // words
    tab_off: u32,    // words
    byte_off: u32,   // bytes
    n_bytes: u32,    // bytes
    _pad: [u32; 2],
}
const _: () = assert!(std::mem::size_of::<Params>() == 48);

fn pipe(gpu: &Gpu, entry: &'static str) -> Result<std::sync::Arc<wgpu::ComputePipeline>> {
    #[derive(PartialEq, Eq, Hash)]
    struct Moe {
        entry: super::StaticName,
    }
    impl super::PipelineKey for Moe {
        fn source(&self) -> &'static str {
            SRC
        }
        fn entry(&self) -> &'static str {
            self.entry.0
        }
        fn label(&self) -> String {
            format!("moe_{}", self.entry.0)
        }
        fn defines(&self, spec: PipelineSpec) -> PipelineSpec {
            spec
        }
    }
    gpu.pipeline_for(Moe {
        entry: super::StaticName(entry),
    })
}

/// One arena group on the GPU: gate, up, down as `[n_slots, rows, cols]` tensors in the
/// stored type, split into parts of whole slots (binding limit), so `matvec_indexed` /
/// `matmul_indexed` read them with slot ids.
pub struct ArenaTensors {
    pub gate: GpuTensor,
    pub up: GpuTensor,
    pub down: GpuTensor,
    pub n_slots: u32,
}

/// Names of an arena group's three tensors, in [`ArenaTensors::get`] order.
const MATS: [&str; 3] = ["gate", "up", "down"];

impl ArenaTensors {
    /// Gate (0), up (1) or down (2).
    pub fn get(&self, mat: usize) -> &GpuTensor {
        [&self.gate, &self.up, &self.down][mat]
    }
}

/// The model-wide expert arena: one [`ArenaTensors`] per placement group (`None` for a
/// group without slots).
pub struct ExpertArena {
    pub groups: Vec<Option<ArenaTensors>>,
}

/// A zeroed `[n_slots, rows, cols]` tensor in parts of at most the binding limit.
fn arena_tensor(gpu: &Gpu, name: String, s: MatShape, n_slots: u32) -> Result<GpuTensor> {
    let eb = s.bytes();
    let max = gpu.max_binding() & !3;
    if eb > max {
        return Err(Error::Gpu(format!(
            "{name}: one expert matrix of {eb} bytes exceeds the binding limit {max}"
        )));
    }
    let per_part = (max / eb).max(1);
    let mut parts = Vec::new();
    let mut s0 = 0u64;
    while s0 < n_slots as u64 {
        let n = per_part.min(n_slots as u64 - s0);
        // ≥ 16 bytes: the matvec kernels view weights as 16-byte vectors.
        let buffer = gpu.buffer((n * eb).max(16), &name)?;
        parts.push(TensorPart {
            buffer,
            row_start: s0 * s.rows,
            n_rows: n * s.rows,
        });
        s0 += n;
    }
    Ok(GpuTensor {
        name,
        dtype: s.dtype,
        shape: vec![n_slots as u64, s.rows, s.cols],
        parts,
    })
}

impl ExpertArena {
    /// Allocate every group's slots, zeroed: per group its slot count and the gate, up and
    /// down shape of one slot (`moe::new_arena` passes a placement's groups).
    pub fn new(gpu: &Gpu, groups_in: &[(u32, [MatShape; 3])]) -> Result<ExpertArena> {
        let mut groups = Vec::with_capacity(groups_in.len());
        for (g, &(n_slots, shapes)) in groups_in.iter().enumerate() {
            if n_slots == 0 {
                groups.push(None);
                continue;
            }
            let t = |i: usize| {
                arena_tensor(
                    gpu,
                    format!("moe.arena.g{g}.{}", MATS[i]),
                    shapes[i],
                    n_slots,
                )
            };
            groups.push(Some(ArenaTensors {
                gate: t(0)?,
                up: t(1)?,
                down: t(2)?,
                n_slots,
            }));
        }
        Ok(ExpertArena { groups })
    }

    /// Group `g`'s tensors (`None` when it has no slots).
    pub fn group(&self, g: usize) -> Option<&ArenaTensors> {
        self.groups.get(g).and_then(Option::as_ref)
    }

    /// Copy one expert's gate, up and down matrices (`mats`: shape and bytes in the stored
    /// type) into slot `slot` of group `g`; `what` names the expert in errors. Ordered before
    /// the next submission and after everything submitted so far. Slots whose size is a
    /// multiple of 4 bytes take one `queue.write_buffer` per matrix; others go through a
    /// staging buffer and the `copy_bytes` kernel (one submission), which keeps the
    /// neighbouring slots' bytes.
    pub fn write_expert(
        &self,
        gpu: &Gpu,
        g: usize,
        slot: u32,
        mats: &[(MatShape, &[u8]); 3],
        what: &str,
    ) -> Result<()> {
        let at = self
            .group(g)
            .ok_or_else(|| Error::Invalid(format!("moe arena: group {g} has no slots")))?;
        if slot >= at.n_slots {
            return Err(Error::Invalid(format!(
                "moe arena: slot {slot} of {} ({what})",
                at.n_slots,
            )));
        }
        let mut pass: Option<Pass<'_>> = None;
        for (i, &(shape, bytes)) in mats.iter().enumerate() {
            let t = at.get(i);
            if shape.dtype != t.dtype
                || [shape.rows, shape.cols] != [t.shape[1], t.shape[2]]
                || bytes.len() as u64 != shape.bytes()
            {
                return Err(Error::Invalid(format!(
                    "moe arena: {what} {} is {}x{} {} ({} bytes), group {g} holds {:?} {}",
                    MATS[i],
                    shape.rows,
                    shape.cols,
                    shape.dtype,
                    bytes.len(),
                    &t.shape[1..],
                    t.dtype
                )));
            }
            let eb = shape.bytes();
            let row0 = slot as u64 * shape.rows;
            let part = t
                .parts
                .iter()
                .find(|p| (p.row_start..p.row_start + p.n_rows).contains(&row0))
                .expect("arena parts cover every slot");
            let off = (row0 - part.row_start) / shape.rows * eb;
            if eb.is_multiple_of(4) {
                gpu.write(&part.buffer, off, bytes);
            } else {
                let staging = gpu.upload(bytes, "moe.arena.staging")?;
                let first = off / 4;
                let end = (off + eb).div_ceil(4);
                let prm = Params {
                    n: (end - first) as u32,
                    byte_off: off as u32,
                    n_bytes: eb as u32,
                    ..Default::default()
                };
                if off + eb > u32::MAX as u64 {
                    return Err(Error::Gpu(format!(
                        "{}: part beyond 4 GiB with unaligned slots",
                        t.name
                    )));
                }
                let p = pass.get_or_insert_with(|| gpu.pass());
                p.dispatch(
                    &pipe(gpu, "copy_bytes")?,
                    "moe_copy_bytes",
                    &prm,
                    &[(&staging).into(), Binding::from(&part.buffer)],
                    grid(prm.n.div_ceil(WG)),
                );
            }
        }
        if let Some(p) = pass {
            p.submit()?;
        }
        Ok(())
    }
}

/// Every MoE layer's remap table (`u32 [n_expert]`: slot, or `u32::MAX` for an expert
/// without one, `moe::COLD`) in one buffer.
pub struct RemapTables {
    pub buffer: wgpu::Buffer,
    /// (model layer, first word, n_expert).
    layers: Vec<(usize, u32, u32)>,
}

impl RemapTables {
    /// Upload `tables`: (model layer, its table) per MoE layer.
    pub fn new(gpu: &Gpu, tables: &[(usize, &[u32])]) -> Result<RemapTables> {
        let mut words = Vec::new();
        let mut layers = Vec::new();
        for &(layer, remap) in tables {
            layers.push((layer, words.len() as u32, remap.len() as u32));
            words.extend_from_slice(remap);
        }
        let buffer = gpu.upload(bytemuck::cast_slice(&words), "moe.remap")?;
        Ok(RemapTables { buffer, layers })
    }

    /// (first word, n_expert) of model layer `layer`'s table.
    pub fn table(&self, layer: usize) -> Option<(u32, u32)> {
        self.layers
            .iter()
            .find(|l| l.0 == layer)
            .map(|&(_, o, n)| (o, n))
    }

    /// Replace `layer`'s table (e.g. with `ResidencyCache::remap(layer)` after uploads);
    /// ordered before the next submission.
    pub fn write(&self, gpu: &Gpu, layer: usize, remap: &[u32]) -> Result<()> {
        let (off, n) = self.table(layer).ok_or_else(|| {
            Error::Invalid(format!("moe remap: layer {layer} is not a MoE layer"))
        })?;
        if remap.len() != n as usize {
            return Err(Error::Invalid(format!(
                "moe remap: layer {layer} has {n} experts, table of {}",
                remap.len()
            )));
        }
        gpu.write(&self.buffer, off as u64 * 4, bytemuck::cast_slice(remap));
        Ok(())
    }
}

/// `slots.buf[slots.off + i] = table_L[ids.buf[ids.off + i]]` for `i < n` (`u32::MAX` for ids
/// outside the table): router ids → arena slot ids of layer `layer`. `ids` and `slots` are
/// u32 (in different buffers); their strides are not used.
pub fn remap(
    pass: &mut Pass<'_>,
    tables: &RemapTables,
    layer: usize,
    ids: Operand<'_>,
    slots: Operand<'_>,
    n: u32,
) -> Result<()> {
    let (tab_off, n_expert) = tables
        .table(layer)
        .ok_or_else(|| Error::Invalid(format!("moe remap: layer {layer} is not a MoE layer")))?;
    let (ids_off, slots_off) = (ids.off, slots.off);
    check_len("moe", "remap ids", ids.buf, ids_off as u64 + n as u64)?;
    check_len("moe", "remap slots", slots.buf, slots_off as u64 + n as u64)?;
    if n == 0 {
        return Ok(());
    }
    let prm = Params {
        n,
        n_expert,
        in_off: ids_off,
        out_off: slots_off,
        tab_off,
        ..Default::default()
    };
    pass.dispatch(
        &pipe(pass.gpu(), "remap")?,
        "moe_remap",
        &prm,
        &[
            (&tables.buffer).into(),
            Binding::from(slots.buf),
            ids.buf.into(),
        ],
        grid(n.div_ceil(WG)),
    );
    Ok(())
}

/// Row r < n_rows of `rows` (f32 `[n_rows, width]`, packed) goes to row `index` word r (u32)
/// of `out` (rows of `width` at its stride); index values ≥ `n_out` are skipped. Puts the
/// CPU's cold expert rows into the per-pair buffer: `index` = `token·n_used + slot` of each
/// cold pair, `n_out` = `n_tokens·n_used`.
pub fn scatter_rows(
    pass: &mut Pass<'_>,
    rows: Operand<'_>,
    index: Operand<'_>,
    n_rows: u32,
    width: u32,
    out: Operand<'_>,
    n_out: u32,
) -> Result<()> {
    if n_rows == 0 || width == 0 {
        return Ok(());
    }
    let (rows_off, index_off, out_off) = (rows.off, index.off, out.off);
    let out_stride = out.stride_for(width);
    if rows.stride_for(width) != width {
        return Err(Error::Invalid(format!(
            "moe scatter: rows of {width} at stride {} (packed rows only)",
            rows.stride_for(width)
        )));
    }
    if out_stride < width {
        return Err(Error::Invalid(format!(
            "moe scatter: stride {out_stride} below the row width {width}"
        )));
    }
    let total = n_rows as u64 * width as u64;
    if total > u32::MAX as u64 {
        return Err(Error::Invalid(format!(
            "moe scatter: {n_rows} rows of {width}"
        )));
    }
    check_len("moe", "scatter rows", rows.buf, rows_off as u64 + total)?;
    check_len(
        "moe",
        "scatter index",
        index.buf,
        index_off as u64 + n_rows as u64,
    )?;
    check_len(
        "moe",
        "scatter output",
        out.buf,
        out_off as u64 + (n_out.max(1) as u64 - 1) * out_stride as u64 + width as u64,
    )?;
    let prm = Params {
        n: n_rows,
        width,
        n_out,
        in_off: rows_off,
        out_off,
        out_stride,
        tab_off: index_off,
        ..Default::default()
    };
    pass.dispatch(
        &pipe(pass.gpu(), "scatter_rows")?,
        "moe_scatter_rows",
        &prm,
        &[rows.buf.into(), Binding::from(out.buf), index.buf.into()],
        grid((total as u32).div_ceil(WG)),
    );
    Ok(())
}

/// The one readback of a MoE layer with cold experts: `n_ids` u32 at word `ids_off` of `ids`
/// and `n_x` f32 at element `x_off` of `x`, through one staging buffer, one submission and
/// one wait (everything submitted before is finished when it returns).
pub fn read_back(
    gpu: &Gpu,
    ids: (&wgpu::Buffer, u32, u32),
    x: (&wgpu::Buffer, u32, u32),
) -> Result<(Vec<u32>, Vec<f32>)> {
    let (ib, io, ni) = ids;
    let (xb, xo, nx) = x;
    check_len("moe", "readback ids", ib, io as u64 + ni as u64)?;
    check_len("moe", "readback rows", xb, xo as u64 + nx as u64)?;
    let (ilen, xlen) = (ni as u64 * 4, nx as u64 * 4);
    let staging = gpu.device.create_buffer(&wgpu::BufferDescriptor {
        label: Some("moe.readback"),
        size: (ilen + xlen).max(4),
        usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
        mapped_at_creation: false,
    });
    let mut enc = gpu.device.create_command_encoder(&Default::default());
    if ilen > 0 {
        enc.copy_buffer_to_buffer(ib, io as u64 * 4, &staging, 0, ilen);
    }
    if xlen > 0 {
        enc.copy_buffer_to_buffer(xb, xo as u64 * 4, &staging, ilen, xlen);
    }
    gpu.queue.submit([enc.finish()]);
    map_read(gpu, &staging, ilen, xlen)
}

/// Waits for the queue, maps `staging` (MAP_READ) and splits its first `ilen + xlen` bytes into
/// u32 ids and f32 rows; unmapped again before returning, so the buffer can be reused.
pub fn map_read(
    gpu: &Gpu,
    staging: &wgpu::Buffer,
    ilen: u64,
    xlen: u64,
) -> Result<(Vec<u32>, Vec<f32>)> {
    let slice = staging.slice(..(ilen + xlen).max(4));
    let (tx, rx) = std::sync::mpsc::channel();
    slice.map_async(wgpu::MapMode::Read, move |r| {
        let _ = tx.send(r);
    });
    gpu.wait()?;
    rx.recv()
        .map_err(|_| Error::Gpu("moe readback: map callback never ran".into()))?
        .map_err(|e| Error::Gpu(format!("moe readback: {e}")))?;
    let (ids_v, x_v) = {
        let data = slice
            .get_mapped_range()
            .map_err(|e| Error::Gpu(format!("moe readback: {e:?}")))?;
        (
            bytemuck::pod_collect_to_vec(&data[..ilen as usize]),
            bytemuck::pod_collect_to_vec(&data[ilen as usize..(ilen + xlen) as usize]),
        )
    };
    staging.unmap();
    Ok((ids_v, x_v))
}

/// Scratch of one routed FFN: `gate`, `up` `[rows·n_used, n_ff]`, `act` (gated output, same
/// size), `out` `[rows·n_used, n_embd]` (the per-pair buffer `moe_out`).
pub struct FfnBufs<'b> {
    pub gate: &'b wgpu::Buffer,
    pub up: &'b wgpu::Buffer,
    pub act: &'b wgpu::Buffer,
    pub out: &'b wgpu::Buffer,
}

/// A layer's routed experts as three stacks `[n, rows, cols]`: the model's expert tensors,
/// or an arena group's slots ([`ArenaTensors`]).
pub struct ExpertStacks<'a> {
    pub gate: &'a GpuTensor,
    pub up: &'a GpuTensor,
    pub down: &'a GpuTensor,
}

/// Which experts the rows of a routed FFN pick: `ids` u32 `[n, k]` (router ids, or arena
/// slots), and `route`, the scratch that groups the pairs by expert for the tiled matmul.
pub struct Picks<'a> {
    pub ids: &'a wgpu::Buffer,
    pub route: &'a MoeRoute,
    pub n: u32,
    pub k: u32,
}

/// Rows of a pass up to which the routed experts run the per-pair indexed matvec (each pair a
/// one-token product, so batched rows keep a lone decode's bits); more are grouped by expert
/// for the tiled matmul, which reads each picked expert once but fills its 64-pair tiles with
/// a few pairs at decode batch sizes. H100 2026-12-07, `bench --parallel`, aggregate tok/s against
/// 8 rows: Qwen3-30B-A3B Q4_K_M 632 vs 360 at 16 streams, 785 vs 541 at 32; DeepSeek-V4-Flash
/// 8 layers 912 vs 367, 1106 vs 469.
pub const EXPERT_MATVEC_ROWS: u32 = 32;

/// Whether a pass of `n_rows` rows runs its routed experts through the indexed matvec
/// ([`EXPERT_MATVEC_ROWS`]); placement (the offload's int8 cold rows) follows the same rule.
pub fn experts_by_matvec(n_rows: u32) -> bool {
    n_rows <= EXPERT_MATVEC_ROWS
}

/// The routed SwiGLU experts of `p.n` rows of `x` (`[n, n_embd]`), `p.k` per row: row
/// `t·k + s` of `b.out` gets expert `ids[t·k + s]`'s unweighted output (ids at or above the
/// stacks' count write nothing, so an arena's cold pairs are skipped). Up to
/// [`EXPERT_MATVEC_ROWS`] rows run the indexed matvec; more are grouped by expert into
/// `p.route` for the tiled matmul. `limit` is DeepSeek's SwiGLU clamp. The one block both
/// families' MoE layers and the offload's hot experts use.
pub fn routed_ffn(
    pass: &mut Pass<'_>,
    w: &ExpertStacks<'_>,
    x: &wgpu::Buffer,
    p: &Picks<'_>,
    b: &FfnBufs<'_>,
    limit: Option<f32>,
) -> Result<()> {
    routed_ffn_glu(pass, w, x, p, b, Glu::Swiglu(limit))
}

/// [`routed_ffn`] for experts of any gated activation `glu` (Gemma's GeGLU).
pub fn routed_ffn_glu(
    pass: &mut Pass<'_>,
    w: &ExpertStacks<'_>,
    x: &wgpu::Buffer,
    p: &Picks<'_>,
    b: &FfnBufs<'_>,
    glu: Glu,
) -> Result<()> {
    let (ids, route, n, k) = (p.ids, p.route, p.n, p.k);
    let ff = w.gate.shape[1] as u32;
    let opts = MatvecOpts::default();
    let small = experts_by_matvec(n);
    if small {
        for (m, y) in [(w.gate, b.gate), (w.up, b.up)] {
            matvec::matvec_indexed(
                pass,
                m,
                Operand::new(x, 0),
                &matvec::Pairs {
                    ids: Operand::new(ids, 0),
                    n_tokens: n,
                    n_used: k,
                    x_per_pair: false,
                },
                Operand::new(y, 0),
                &opts,
            )?;
        }
    } else {
        matmul::route(pass, route, ids, 0, n, k)?;
        for (m, y) in [(w.gate, b.gate), (w.up, b.up)] {
            matmul::matmul_indexed(
                pass,
                m,
                Operand::new(x, 0),
                &matmul::RoutePairs {
                    route,
                    n_tokens: n,
                    n_used: k,
                    x_per_pair: false,
                },
                Operand::new(y, 0),
                &opts,
            )?;
        }
    }
    let (act, g, u) = (
        Operand::new(b.act, 0),
        Operand::new(b.gate, 0),
        Operand::new(b.up, 0),
    );
    match glu {
        Glu::Swiglu(limit) => ew::swiglu(pass, n * k, ff, act, g, u, limit)?,
        Glu::SwigluActClamp(limit) => ew::swiglu_act_clamp(pass, n * k, ff, act, g, u, limit)?,
        Glu::GegluTanh => ew::geglu(pass, n * k, ff, act, g, u)?,
    }
    if small {
        matvec::matvec_indexed(
            pass,
            w.down,
            Operand::new(b.act, 0),
            &matvec::Pairs {
                ids: Operand::new(ids, 0),
                n_tokens: n,
                n_used: k,
                x_per_pair: true,
            },
            Operand::new(b.out, 0),
            &opts,
        )
    } else {
        matmul::matmul_indexed(
            pass,
            w.down,
            Operand::new(b.act, 0),
            &matmul::RoutePairs {
                route,
                n_tokens: n,
                n_used: k,
                x_per_pair: true,
            },
            Operand::new(b.out, 0),
            &opts,
        )
    }
}
