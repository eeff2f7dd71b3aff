//! Kernel lab for the weight × activation kernels: weight bytes streamed per second by matvec
//! (decode) for each type, against a plain f32 stream kernel measured in the same process, and
//! the prefill matmuls (tiled, and cooperative matrices where the adapter has them) in
//! TFLOP/s.
//!
//! `cargo run --release --bin bench_kernels -- [--types q4_k,q6_k] [--rows N --cols N]
//!  [--mb TOTAL] [--tokens N] [--tune 128x2,256x8x64 (WGxROWS[xLANES])] [--prefill N]
//!  [--int8-x] [--adapter NAME]
//!  [--shapes 4096x12288,12288x4096] [--batch 1,2,4,8,16,24,32] [--no-matvec]`
//!
//! `--batch` compares, per token count, the token-group matvec (`multi`, one weight read per
//! group of 8 tokens; with `--tune`, once per work split), per-token matvec (one grid column
//! per token), the tiled, int8 and matrix-unit matmuls, each with its weight GB/s:
//! where `DENSE_MATVEC_TOKENS` should hand over. With `--int8-x` the int8-activation forms of
//! the two matvecs too (quantization included).
//!
//! Each type gets enough matrices of rows × cols to exceed `--mb` (default 1024 MB on GPUs so
//! the L2 cache cannot hold them; less on CPU adapters), then passes of many dispatches rotate
//! over them. Time is GPU timestamps around the timed passes when the adapter has them, with a
//! long untimed pass queued first so the GPU never waits for the CPU; else wall time.

use clap::Parser;
use lathe::gpu::coopmat::Precision::{Split as SPLIT, SplitX as SPLITX, F16};
use lathe::gpu::matmul::Int8Levels::{One as I8, Two as I8X2};
use lathe::gpu::matvec::{self, MatvecOpts, Tune};
use lathe::gpu::operand::Operand;
use lathe::gpu::{coopmat, matmul};
use lathe::gpu::{
    AdapterChoice, Binding, Gpu, GpuTensor, Pass, PipelineKey, PipelineSpec, StaticName,
};
use lathe::tensor::TensorRef;
use lathe::{quant, DType, Result};
use std::path::Path;
use std::time::Instant;

#[derive(Parser)]
#[command(about = "Benchmark lathe's matvec / matmul kernels")]
struct Args {
    /// Comma-separated types (default: the main ones).
    #[arg(long, default_value = "q4_k,q6_k,q8_0,mxfp4,bf16,f16,f32,q4_0,q5_k")]
    types: String,
    /// Rows per matrix (default 16384, 4096 on CPU adapters).
    #[arg(long)]
    rows: Option<u64>,
    /// Columns per matrix (default 16384, 4096 on CPU adapters).
    #[arg(long)]
    cols: Option<u64>,
    /// Matrix shapes `ROWSxCOLS,...` to run every measurement on in turn (instead of
    /// `--rows` / `--cols`).
    #[arg(long)]
    shapes: Option<String>,
    /// Skip the per-type matvec bandwidth lines (e.g. when only `--batch` is wanted).
    #[arg(long)]
    no_matvec: bool,
    /// Total weight megabytes to rotate over (default 1024, 64 on CPU adapters).
    #[arg(long)]
    mb: Option<u64>,
    /// Tokens per matvec (1..=8).
    #[arg(long, default_value_t = 1)]
    tokens: u32,
    /// Work splits to compare, `WGxROWS[xLANES]` or `auto` (default: the wrapper's choice).
    #[arg(long)]
    tune: Option<String>,
    /// Also time the tiled matmul with this many tokens (0: skip).
    #[arg(long, default_value_t = 0)]
    prefill: u32,
    /// Batched-decode token counts to compare the token-group matvec, per-token matvec, the
    /// tiled matmul and the matrix-unit kernels on, e.g. `1,2,4,8,16,24,32` (empty: skip):
    /// where one overtakes the other.
    #[arg(long, default_value = "")]
    batch: String,
    /// Timed passes per measurement.
    #[arg(long, default_value_t = 5)]
    passes: u32,
    /// Shader define sets to compare (repeatable): `NAME[=VALUE],...`; `-` for none.
    #[arg(long)]
    variant: Vec<String>,
    /// Also time the int8-activation matvec (`MatvecOpts::int8_x`: x quantized in two levels,
    /// then the integer-dot product) for the types that have one: quantize + product per matvec, and the
    /// product alone with x quantized once per pass (x shared by several weights).
    #[arg(long)]
    int8_x: bool,
    /// Time the one-token matvec reading x through the RMSNorm prologue
    /// (`matvec::Prologue::RmsNorm`, as the fused decode), instead of the plain product.
    #[arg(long)]
    norm: bool,
    /// Adapter index or name substring.
    #[arg(long, default_value = "auto")]
    adapter: String,
    /// Bare cooperative-matrix tiles to time instead of the kernels (`all`, or a comma list
    /// of `MODE-BMxBNxBK-SGMxSGN[-sSKEW][-bNBUF][-u]`, see `LabTile`): the ceiling of the
    /// matrix units from WGSL, at `--lab-size` cubed.
    #[arg(long)]
    lab: Option<String>,
    /// M = N = K of the lab's products.
    #[arg(long, default_value_t = 4096)]
    lab_size: u32,
    /// The device's dense f16 peak in TFLOP/s the lab's ratios are against (default: the
    /// H200's ~790, what cuBLAS measures for bf16 products on it).
    #[arg(long, default_value_t = 790.0)]
    peak: f64,
    /// Write the final WGSL of the lab's tiles (`--lab`) and of the cooperative-matrix product
    /// variants of Q4_K and Q8_0 into this directory and exit (no device needed): for
    /// `naga` + `spirv-dis`.
    #[arg(long)]
    dump_wgsl: Option<std::path::PathBuf>,
}

/// Reads the whole buffer as vec4 and writes one sum per workgroup: the bandwidth reference.
const STREAM_WGSL: &str = r#"
struct P { n4: u32, per_thread: u32, pad0: u32, pad1: u32 }
@group(0) @binding(0) var<uniform> p: P;
@group(0) @binding(1) var<storage, read> src: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read_write> dst: array<f32>;
@compute @workgroup_size(256)
fn stream(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
          @builtin(local_invocation_index) lid: u32) {
    let wg = wid.x + wid.y * nwg.x;
    var acc = vec4<f32>(0.0);
    let base = wg * 256u * p.per_thread + lid;
    for (var k = 0u; k < p.per_thread; k++) {
        let i = base + k * 256u;
        if (i < p.n4) { acc += src[i]; }
    }
    let s = acc.x + acc.y + acc.z + acc.w;
    if (s == 12345.678) { dst[wg] = s; }
}
"#;

#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct StreamParams {
    n4: u32,
    per_thread: u32,
    pad: [u32; 2],
}

/// Times `passes` passes of `record`; returns seconds per pass on the GPU (timestamps, else wall)
/// and in wall time (recording, encoding and submitting included: when it is much larger the
/// CPU, not the kernel, sets the pace).
fn time_passes(
    gpu: &Gpu,
    passes: u32,
    record: &mut dyn FnMut(&mut Pass<'_>) -> Result<()>,
) -> Result<(f64, f64)> {
    let ts = gpu.features.contains(
        wgpu::Features::TIMESTAMP_QUERY | wgpu::Features::TIMESTAMP_QUERY_INSIDE_ENCODERS,
    );
    // warm-up (pipelines, caches, clocks: the GPU idles while a new variant compiles), waited for
    for _ in 0..3 {
        let mut pass = gpu.pass();
        record(&mut pass)?;
        pass.submit()?;
    }
    gpu.wait()?;
    let qs = ts.then(|| {
        gpu.device.create_query_set(&wgpu::QuerySetDescriptor {
            label: Some("bench"),
            ty: wgpu::QueryType::Timestamp,
            count: 2,
        })
    });
    // an untimed pass keeps the GPU busy while the timed ones are recorded
    let mut pass = gpu.pass();
    record(&mut pass)?;
    pass.submit()?;
    let stamp = |i: u32| {
        if let Some(q) = &qs {
            let mut enc = gpu.device.create_command_encoder(&Default::default());
            enc.write_timestamp(q, i);
            gpu.queue.submit([enc.finish()]);
        }
    };
    stamp(0);
    let t0 = Instant::now();
    for _ in 0..passes {
        let mut pass = gpu.pass();
        record(&mut pass)?;
        pass.submit()?;
    }
    stamp(1);
    gpu.wait()?;
    let wall = t0.elapsed().as_secs_f64() / passes as f64;
    let Some(q) = qs else { return Ok((wall, wall)) };
    let resolve = gpu.device.create_buffer(&wgpu::BufferDescriptor {
        label: Some("ts"),
        size: 16,
        usage: wgpu::BufferUsages::QUERY_RESOLVE | wgpu::BufferUsages::COPY_SRC,
        mapped_at_creation: false,
    });
    let read = gpu.buffer(16, "ts_read")?;
    let mut enc = gpu.device.create_command_encoder(&Default::default());
    enc.resolve_query_set(&q, 0..2, &resolve, 0);
    enc.copy_buffer_to_buffer(&resolve, 0, &read, 0, 16);
    gpu.queue.submit([enc.finish()]);
    let t: Vec<u64> = bytemuck::pod_collect_to_vec(&gpu.read_bytes(&read, 0, 16)?);
    let ns = t[1].wrapping_sub(t[0]) as f64 * gpu.queue.get_timestamp_period() as f64;
    if ns <= 0.0 || ns > 1e12 {
        return Ok((wall, wall));
    }
    Ok((ns * 1e-9 / passes as f64, wall))
}

/// GB/s of a plain vec4 read over `bytes` bytes (split in buffers of the binding limit).
fn stream_bandwidth(gpu: &Gpu, bytes: u64, passes: u32) -> Result<f64> {
    let chunk = (gpu.max_binding() & !15).min(bytes);
    let n = bytes.div_ceil(chunk);
    let bufs: Vec<_> = (0..n)
        .map(|_| gpu.buffer(chunk, "stream"))
        .collect::<Result<_>>()?;
    let dst = gpu.buffer(1 << 20, "stream_dst")?;
    /// The probe's one variant: no fields.
    #[derive(PartialEq, Eq, Hash)]
    struct Stream;
    impl PipelineKey for Stream {
        fn source(&self) -> &'static str {
            STREAM_WGSL
        }
        fn entry(&self) -> &'static str {
            "stream"
        }
        fn label(&self) -> String {
            "bench_stream".into()
        }
        fn defines(&self, spec: PipelineSpec) -> PipelineSpec {
            spec
        }
    }
    let pipe = gpu.pipeline_for(Stream)?;
    let n4 = (chunk / 16) as u32;
    let per_thread = 16u32;
    let groups = n4.div_ceil(256 * per_thread);
    let reps = 8;
    let mut rec = |pass: &mut Pass<'_>| {
        for _ in 0..reps {
            for b in &bufs {
                let prm = StreamParams {
                    n4,
                    per_thread,
                    pad: [0; 2],
                };
                pass.dispatch(
                    &pipe,
                    "stream",
                    &prm,
                    &[b.into(), Binding::from(&dst)],
                    lathe::gpu::grid(groups),
                );
            }
        }
        Ok(())
    };
    let (s, _) = time_passes(gpu, passes, &mut rec)?;
    Ok((reps as u64 * n * chunk) as f64 / s / 1e9)
}

/// A [rows, cols] weight of `dt`: one quantized pattern of random normals tiled over the rows
/// (contents do not matter for bandwidth, and quantizing 10^8 values on the CPU takes minutes).
fn make_weight(gpu: &Gpu, dt: DType, rows: u64, cols: u64, seed: u64) -> Result<GpuTensor> {
    let pat_rows = 64u64.min(rows);
    let mut s = seed | 1;
    let x: Vec<f32> = (0..pat_rows * cols)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.1
        })
        .collect();
    let pat = quant::quantize(dt, &x)?;
    let row_bytes = pat.len() as u64 / pat_rows;
    let mut data = Vec::with_capacity((rows * row_bytes) as usize);
    while (data.len() as u64) < rows * row_bytes {
        let need = (rows * row_bytes) as usize - data.len();
        data.extend_from_slice(&pat[..need.min(pat.len())]);
    }
    let shape = [rows, cols];
    gpu.upload_tensor(&TensorRef {
        name: "bench",
        dtype: dt,
        shape: &shape,
        data: &data,
        path: Path::new("bench"),
    })
}

fn parse_tunes(s: &Option<String>) -> Vec<Option<Tune>> {
    match s {
        None => vec![None],
        Some(s) => s
            .split(',')
            .filter_map(|t| {
                if t.trim() == "auto" {
                    return Some(None);
                }
                let mut f = t.split('x').map(|v| v.trim().parse::<u32>());
                let wg = f.next()?.ok()?;
                let rows = f.next()?.ok()?;
                let lanes = match f.next() {
                    Some(l) => Some(l.ok()?),
                    None => None,
                };
                Some(Some(Tune { wg, rows, lanes }))
            })
            .collect(),
    }
}

/// `NAME[=VALUE],...` as leaked static define pairs (a handful per run).
fn parse_variant(s: &str) -> &'static [(&'static str, &'static str)] {
    let v: Vec<(&'static str, &'static str)> = s
        .split(',')
        .filter(|d| !d.is_empty() && *d != "-")
        .map(|d| {
            let (n, v) = d.split_once('=').unwrap_or((d, "true"));
            let n: &'static str = Box::leak(n.trim().to_string().into_boxed_str());
            let v: &'static str = Box::leak(v.trim().to_string().into_boxed_str());
            (n, v)
        })
        .collect();
    Box::leak(v.into_boxed_slice())
}

fn main() -> Result<()> {
    let args = Args::parse();
    let lab: Vec<LabTile> = match args.lab.as_deref() {
        None => Vec::new(),
        Some(l) => {
            let l = if l == "all" { LAB_ALL } else { l };
            l.split(',')
                .map(LabTile::parse)
                .collect::<std::result::Result<_, _>>()
                .map_err(lathe::Error::Invalid)?
        }
    };
    if let Some(dir) = &args.dump_wgsl {
        return dump_wgsl(dir, &lab);
    }
    let gpu = Gpu::new(&args.adapter.parse().unwrap_or(AdapterChoice::Auto))?;
    println!("{}", gpu.report());
    if !lab.is_empty() {
        return bench_lab(&gpu, &lab, args.lab_size, args.peak, args.passes);
    }
    let cpu = gpu.info.device_type == wgpu::DeviceType::Cpu;
    let shapes: Vec<(u64, u64)> = match &args.shapes {
        Some(s) => s
            .split(',')
            .filter_map(|v| {
                let (r, c) = v.split_once('x')?;
                Some((r.trim().parse().ok()?, c.trim().parse().ok()?))
            })
            .collect(),
        None => vec![(
            args.rows.unwrap_or(if cpu { 4096 } else { 16384 }),
            args.cols.unwrap_or(if cpu { 4096 } else { 16384 }),
        )],
    };
    let total = args.mb.unwrap_or(if cpu { 64 } else { 1024 }) << 20;
    let passes = if cpu { args.passes.min(2) } else { args.passes };
    let stream = stream_bandwidth(&gpu, total.max(64 << 20), passes)?;
    println!(
        "f32 stream (vec4 reads, {} MB): {stream:.1} GB/s",
        total.max(64 << 20) >> 20
    );
    let tunes = parse_tunes(&args.tune);
    let variants: Vec<_> = if args.variant.is_empty() {
        vec![parse_variant("-")]
    } else {
        args.variant.iter().map(|v| parse_variant(v)).collect()
    };
    let run = Run {
        total,
        passes,
        stream,
    };
    for &(rows, cols) in &shapes {
        bench_shape(&gpu, &args, (rows, cols), &run, &tunes, &variants)?;
    }
    Ok(())
}

/// How every measurement of a shape runs: `total` bytes of weights (copies of the matrix, so
/// that they do not sit in a cache), `passes` timed passes, and the f32 stream bandwidth
/// (GB/s) results are a share of.
struct Run {
    total: u64,
    passes: u32,
    stream: f64,
}

/// Every measurement the arguments ask for on `rows x cols` matrices (`args.tokens` rows of x).
fn bench_shape(
    gpu: &Gpu,
    args: &Args,
    (rows, cols): (u64, u64),
    run: &Run,
    tunes: &[Option<Tune>],
    variants: &[&'static [(&'static str, &'static str)]],
) -> Result<()> {
    for name in args.types.split(',') {
        let Some(dt) = DType::from_name(name.trim()) else {
            eprintln!("unknown type {name}");
            continue;
        };
        let one = dt.bytes_for(rows * cols).unwrap_or(0);
        if one == 0 || !matvec::supported(dt) {
            eprintln!("{dt}: {rows}x{cols} not supported");
            continue;
        }
        let n_mat = run.total.div_ceil(one).max(1);
        let t0 = Instant::now();
        let ws: Vec<GpuTensor> = (0..n_mat)
            .map(|i| make_weight(gpu, dt, rows, cols, 7 + i))
            .collect::<Result<_>>()?;
        gpu.wait()?;
        let m = Matrices {
            dt,
            rows,
            cols,
            one,
            ws,
            setup: t0.elapsed(),
        };
        if !args.no_matvec {
            bench_matvec(gpu, args, &m, run, tunes, variants)?;
        }
        if args.prefill > 0 {
            bench_prefill(gpu, args.prefill, &m, run, variants)?;
        }
        for nb in args
            .batch
            .split(',')
            .filter_map(|v| v.trim().parse::<u32>().ok())
        {
            bench_batch(gpu, args, nb, &m, run, tunes)?;
        }
    }
    Ok(())
}

/// The copies of one weight matrix every measurement of a type cycles through.
struct Matrices {
    dt: DType,
    rows: u64,
    cols: u64,
    /// Bytes of one copy.
    one: u64,
    ws: Vec<GpuTensor>,
    /// How long making and uploading them took.
    setup: std::time::Duration,
}

/// A product `bench_kernels` times: which kernel, with what precision.
#[derive(Clone, Copy)]
enum Product {
    /// `matvec_opts`: one token group per workgroup row set.
    Matvec,
    /// `matvec_multi`: several token rows per weight read.
    Multi,
    Tiled,
    Int8(matmul::Int8Levels),
    Coop(coopmat::Precision),
}

impl Product {
    /// `y[n, rows] = x[n, cols] · wᵀ` with this kernel.
    fn record(
        self,
        pass: &mut Pass<'_>,
        w: &GpuTensor,
        (x, y): (&wgpu::Buffer, &wgpu::Buffer),
        n: u32,
        o: &MatvecOpts,
    ) -> Result<()> {
        let (x, y) = (Operand::new(x, 0), Operand::new(y, 0));
        match self {
            Product::Matvec => matvec::matvec_opts(pass, w, x, y, n, o),
            Product::Multi => matvec::matvec_multi(pass, w, x, y, n, o),
            Product::Tiled => matmul::matmul_tiled(pass, w, x, y, n, o),
            Product::Int8(levels) => matmul::matmul_int8(pass, levels, w, x, y, n, o),
            Product::Coop(p) => coopmat::matmul_coop(pass, p, w, x, y, n, o),
        }
    }
}

/// Decode products of `args.tokens` rows: every tune x variant (x int8-x with
/// `--int8-x`), with the RMSNorm prologue under `--norm`.
fn bench_matvec(
    gpu: &Gpu,
    args: &Args,
    m: &Matrices,
    run: &Run,
    tunes: &[Option<Tune>],
    variants: &[&'static [(&'static str, &'static str)]],
) -> Result<()> {
    let (dt, rows, cols, one) = (m.dt, m.rows, m.cols, m.one);
    let (nt, n_mat) = (args.tokens, m.ws.len());
    let x = gpu.upload_f32(&vec![0.01; (cols * nt as u64) as usize], "x")?;
    let y = gpu.buffer(rows * 4 * nt as u64, "y")?;
    let nw = gpu.upload_f32(&vec![1.0; cols as usize], "nw")?;
    let norm = matvec::Prologue::RmsNorm {
        w: &nw,
        eps: 1e-6,
        keep: None,
    };
    let modes: &[bool] = if args.int8_x && matvec::int8_x_supported(dt) {
        &[false, true]
    } else {
        &[false]
    };
    // Enough products per timed pass to hide the submission's cost, every copy as often
    // (on a CPU adapter each copy once, which is already slow).
    let per_pass = match is_cpu(gpu) {
        true => n_mat,
        false => (64 / n_mat).max(2) * n_mat,
    };
    for ((tune, defines), &int8_x) in tunes
        .iter()
        .flat_map(|t| variants.iter().map(move |v| (t, *v)))
        .flat_map(|tv| modes.iter().map(move |m| (tv, m)))
    {
        let opts = MatvecOpts {
            tune: *tune,
            defines,
            int8_x,
            ..Default::default()
        };
        let mut rec = |pass: &mut Pass<'_>| {
            for w in m.ws.iter().cycle().take(per_pass) {
                if args.norm && !int8_x {
                    let o = MatvecOpts {
                        defines: &[],
                        ..opts
                    };
                    let (xo, yo) = (Operand::new(&x, 0), Operand::new(&y, 0));
                    matvec::matvec_pro(pass, w, xo, yo, nt, &o, &norm)?;
                } else {
                    Product::Matvec.record(pass, w, (&x, &y), nt, &opts)?;
                }
            }
            Ok(())
        };
        let (s, wall) = time_passes(gpu, run.passes, &mut rec)?;
        let (s, wall) = (s / per_pass as f64, wall / per_pass as f64);
        let gbs = one as f64 / s / 1e9;
        println!(
            "{:<6} {rows}x{cols} x{n_mat} ({} MB) nt{nt} {}{} {}: {:8.1} us/matvec {:8.1} GB/s  {:5.1}% of stream  (wall {:.1} us, setup {:.1?})",
            dt.name(),
            (one * n_mat as u64) >> 20,
            tune.map(|t| format!("wg{}x{}{}", t.wg, t.rows, t.lanes.map(|l| format!("x{l}")).unwrap_or_default())).unwrap_or_else(|| "auto".into()),
            if int8_x { " int8-x" } else if args.norm { " norm" } else { "" },
            define_list(defines),
            s * 1e6,
            gbs,
            100.0 * gbs / run.stream,
            wall * 1e6,
            m.setup
        );
        if int8_x {
            // the product alone: x quantized once per pass, as when q/k/v or gate/up share it
            let mut qx = matvec::QuantX::new(gpu, 2 * nt, cols as u32)?;
            let mut rec = |pass: &mut Pass<'_>| {
                matvec::quantize_x2(pass, Operand::new(&x, 0), nt, cols as u32, &mut qx)?;
                for w in m.ws.iter().cycle().take(per_pass) {
                    matvec::matvec_q8x(pass, w, &qx, Operand::new(&y, 0), &opts)?;
                }
                Ok(())
            };
            let (s, _) = time_passes(gpu, run.passes, &mut rec)?;
            let s = s / per_pass as f64;
            let gbs = one as f64 / s / 1e9;
            println!(
                "{:<6} {rows}x{cols} nt{nt} int8-x product only (x quantized once per {per_pass}): {:8.1} us/matvec {:8.1} GB/s  {:5.1}% of stream",
                dt.name(),
                s * 1e6,
                gbs,
                100.0 * gbs / run.stream
            );
        }
    }
    Ok(())
}

/// Prefill products of `np` rows: tiled, int8 where the type has it, and the
/// cooperative-matrix kernels (every variant) where the adapter has them.
fn bench_prefill(
    gpu: &Gpu,
    np: u32,
    m: &Matrices,
    run: &Run,
    variants: &[&'static [(&'static str, &'static str)]],
) -> Result<()> {
    let (dt, rows, cols) = (m.dt, m.rows, m.cols);
    let xp = gpu.upload_f32(&vec![0.01; (cols * np as u64) as usize], "xp")?;
    let yp = gpu.buffer(rows * 4 * np as u64, "yp")?;
    let per_pass = if is_cpu(gpu) { 1 } else { 8 };
    let plain = parse_variant("-");
    let mut kinds = vec![("tiled", Product::Tiled, plain)];
    if matmul::int8_supported(dt) {
        kinds.push(("int8", Product::Int8(I8), plain));
        kinds.push(("int8x2", Product::Int8(I8X2), plain));
    }
    if coopmat::usable(gpu, dt).is_some() {
        kinds.extend(variants.iter().map(|v| ("coop", Product::Coop(F16), *v)));
        kinds.extend(variants.iter().map(|v| ("split", Product::Coop(SPLIT), *v)));
        kinds.push(("splitx", Product::Coop(SPLITX), plain));
    }
    for (kind, product, defines) in kinds {
        let o = MatvecOpts {
            defines,
            ..Default::default()
        };
        let mut rec = |pass: &mut Pass<'_>| {
            for w in m.ws.iter().cycle().take(per_pass) {
                product.record(pass, w, (&xp, &yp), np, &o)?;
            }
            Ok(())
        };
        let s = time_passes(gpu, run.passes, &mut rec)?.0 / per_pass as f64;
        let gflops = 2.0 * (rows * cols) as f64 * np as f64 / s / 1e9;
        println!(
            "{:<6} {rows}x{cols} prefill {np} tokens {kind:>6} {}: {:8.3} ms  {:8.1} GFLOP/s  {:6.0} tok/s",
            dt.name(),
            define_list(defines),
            s * 1e3,
            gflops,
            np as f64 / s
        );
    }
    Ok(())
}

/// Every product kernel on a batch of `nb` rows (a server round's decode rows), on one line.
fn bench_batch(
    gpu: &Gpu,
    args: &Args,
    nb: u32,
    m: &Matrices,
    run: &Run,
    tunes: &[Option<Tune>],
) -> Result<()> {
    let (dt, rows, cols) = (m.dt, m.rows, m.cols);
    let xb = gpu.upload_f32(&vec![0.01; (cols * nb as u64) as usize], "xb")?;
    let yb = gpu.buffer(rows * 4 * nb as u64, "yb")?;
    let per_pass = if is_cpu(gpu) { 1 } else { 16 };
    let mut line = format!("{:<6} {rows}x{cols} batch {nb:>3}:", dt.name());
    let plain = MatvecOpts::default();
    let mut kinds: Vec<(String, Product, MatvecOpts)> = tunes
        .iter()
        .map(|tune| {
            let label = tune.map_or("multi".to_string(), |t| {
                format!("multi-{}x{}", t.wg, t.rows)
            });
            let o = MatvecOpts {
                tune: *tune,
                ..Default::default()
            };
            (label, Product::Multi, o)
        })
        .collect();
    kinds.push(("matvec".into(), Product::Matvec, plain));
    if args.int8_x && matvec::int8_x_supported(dt) {
        let o = MatvecOpts {
            int8_x: true,
            ..Default::default()
        };
        kinds.push(("multi-i8".into(), Product::Multi, o));
        kinds.push(("matvec-i8".into(), Product::Matvec, o));
    }
    kinds.push(("tiled".into(), Product::Tiled, plain));
    if matmul::int8_supported(dt) {
        kinds.push(("int8".into(), Product::Int8(I8), plain));
        kinds.push(("int8x2".into(), Product::Int8(I8X2), plain));
    }
    if coopmat::usable(gpu, dt).is_some() {
        kinds.push(("coop".into(), Product::Coop(F16), plain));
        kinds.push(("split".into(), Product::Coop(SPLIT), plain));
    }
    for (label, product, o) in &kinds {
        let mut rec = |pass: &mut Pass<'_>| {
            for w in m.ws.iter().cycle().take(per_pass) {
                product.record(pass, w, (&xb, &yb), nb, o)?;
            }
            Ok(())
        };
        let s = time_passes(gpu, run.passes, &mut rec)?.0 / per_pass as f64;
        let gbs = m.one as f64 / s / 1e9;
        line += &format!("  {label} {:8.1} us {gbs:6.0} GB/s", s * 1e6);
    }
    println!("{line}");
    Ok(())
}

fn is_cpu(gpu: &Gpu) -> bool {
    gpu.info.device_type == wgpu::DeviceType::Cpu
}

/// `NAME=VALUE,...` of a variant's defines.
fn define_list(defines: &[(&str, &str)]) -> String {
    let dl: Vec<String> = defines.iter().map(|(n, v)| format!("{n}={v}")).collect();
    dl.join(",")
}

/// One bare tile of the kernel lab (`--lab`): f16 x f16 -> f32 cooperative products of
/// `M x K` by `N x K` (both K-contiguous, as lathe's weights and staged x) into `Y[M][N]`,
/// BM x BN per workgroup of SGM x SGN subgroups, BK weights per step, rows of BK + `skew`
/// halves in workgroup memory, `nbuf` buffers.
/// - `smem`: the tiles are filled once; each step only loads fragments out of workgroup
///   memory (buffer `step % nbuf`, so no load is loop-invariant) and multiplies, with the one
///   barrier per step a real double-buffered tile has: the ceiling of the matrix units as WGSL
///   reaches them.
/// - `stream`: A and B stream from global memory, 16-byte loads into registers, stored into
///   workgroup memory at the top of the next step (store first, as NVIDIA's
///   vk_cooperative_matrix_perf `shmem.comp` does), so the loads are in flight during the
///   products; what staging costs on top of `smem`.
///
/// `-p3`: three products per step into the accumulators (hi x hi, lo x hi, hi x lo) from four
/// staged tiles, the cost of operands split into two f16 parts each (`coop-split`); the
/// streamed tile derives the lo tiles from the loaded registers (x 2^-11), as a weight's
/// remainder comes from its one decode.
///
/// Fragments are named variables (never arrays: WGSL has no unroll, and an array of
/// cooperative matrices indexed by a loop variable can land in function memory).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct LabTile {
    stream: bool,
    bm: u32,
    bn: u32,
    bk: u32,
    sgm: u32,
    sgn: u32,
    skew: u32,
    nbuf: u32,
    /// Three products per step from split operands (`-p3`).
    three: bool,
    /// Runtime bounds checks off (indices proven in range by construction).
    unchecked: bool,
}

/// A lab tile's pipeline key: the tile and its generated WGSL ([`LabTile::wgsl`], leaked once
/// per tile timed).
#[derive(PartialEq, Eq, Hash)]
struct Lab {
    tile: LabTile,
    wgsl: StaticName,
}

impl PipelineKey for Lab {
    fn source(&self) -> &'static str {
        self.wgsl.0
    }
    fn entry(&self) -> &'static str {
        "lab"
    }
    fn label(&self) -> String {
        format!("lab_{}", self.tile.name())
    }
    fn defines(&self, spec: PipelineSpec) -> PipelineSpec {
        spec
    }
    // every index is in range by construction: tile offsets are constants plus the subgroup
    // id (< SGM * SGN) and the thread id (< WG), the grid is size / BM x size / BN and the
    // steps size / BK, all exact (size is a multiple of 256)
    fn unchecked(&self) -> bool {
        self.tile.unchecked
    }
}

/// The lab's default set: lathe's tile shapes (8 subgroups of 64 rows x 32 tokens, steps of
/// one chunk (32) as XSTAGE; BK 64 as the L2 tile) and the reference benchmark's (8 subgroups
/// 2 x 4, 128x128 and 256x128, BK 16 for f32 accumulators, 16-byte skew).
const LAB_ALL: &str = "smem-128x128x32-2x4,smem-128x128x16-2x4,smem-256x128x16-2x4,\
smem-128x256x16-2x4,smem-128x128x32-2x4-u,smem-256x128x16-2x4-u,smem-128x128x64-2x4-b1,\
smem-128x128x16-2x4-p3,stream-128x128x32-2x4,stream-128x128x16-2x4,stream-256x128x16-2x4,\
stream-128x256x16-2x4,stream-128x128x16-2x4-b1,stream-128x128x32-2x4-u,\
stream-256x128x16-2x4-u,stream-128x128x16-2x4-p3,stream-128x128x16-2x4-b1-p3";

impl LabTile {
    /// `MODE-BMxBNxBK-SGMxSGN[-sSKEW][-bNBUF][-u]`, e.g. `smem-128x128x16-2x4`.
    fn parse(s: &str) -> std::result::Result<LabTile, String> {
        let bad = || format!("--lab {s}: expected MODE-BMxBNxBK-SGMxSGN[-sSKEW][-bNBUF][-p3][-u]");
        let mut it = s.trim().split('-');
        let stream = match it.next() {
            Some("smem") => false,
            Some("stream") => true,
            _ => return Err(bad()),
        };
        let nums = |t: Option<&str>| -> Option<Vec<u32>> {
            t?.split('x').map(|v| v.parse().ok()).collect()
        };
        let (Some(d), Some(g)) = (nums(it.next()), nums(it.next())) else {
            return Err(bad());
        };
        let (&[bm, bn, bk], &[sgm, sgn]) = (&d[..], &g[..]) else {
            return Err(bad());
        };
        let mut t = LabTile {
            stream,
            bm,
            bn,
            bk,
            sgm,
            sgn,
            skew: 8,
            nbuf: 2,
            three: false,
            unchecked: false,
        };
        for o in it {
            if o == "u" {
                t.unchecked = true;
            } else if o == "p3" {
                t.three = true;
            } else if let Some(v) = o.strip_prefix('s').and_then(|v| v.parse().ok()) {
                t.skew = v;
            } else if let Some(v) = o.strip_prefix('b').and_then(|v| v.parse().ok()) {
                t.nbuf = v;
            } else {
                return Err(bad());
            }
        }
        let wg = 32 * sgm * sgn;
        let ok = sgm > 0
            && sgn > 0
            && bm % (16 * sgm) == 0
            && bn % (16 * sgn) == 0
            && bk % 16 == 0
            && bk > 0
            && t.skew.is_multiple_of(4)
            && (1..=2).contains(&t.nbuf)
            && wg <= 1024
            && (!stream || ((bm * bk / 8) % wg == 0 && (bn * bk / 8) % wg == 0));
        if !ok {
            return Err(format!(
                "--lab {s}: tiles must split into 16x16 fragments per subgroup, BK a multiple \
                 of 16, the skew of 4 halves, 1 or 2 buffers, and (stream) each tile's 16-byte \
                 pieces a multiple of the {wg} threads"
            ));
        }
        Ok(t)
    }

    fn name(&self) -> String {
        format!(
            "{}-{}x{}x{}-{}x{}-s{}-b{}{}{}",
            if self.stream { "stream" } else { "smem" },
            self.bm,
            self.bn,
            self.bk,
            self.sgm,
            self.sgn,
            self.skew,
            self.nbuf,
            if self.three { "-p3" } else { "" },
            if self.unchecked { "-u" } else { "" }
        )
    }

    /// Workgroup memory in bytes.
    fn wg_bytes(&self) -> u32 {
        self.nbuf * (self.bm + self.bn) * (self.bk + self.skew) * 2 * (1 + self.three as u32)
    }

    /// The kernel's WGSL (entry `lab`): generated, so the fragments are named variables.
    fn wgsl(&self) -> String {
        let (fm, fn_) = (self.bm / 16 / self.sgm, self.bn / 16 / self.sgn);
        let wg = 32 * self.sgm * self.sgn;
        let sa = (self.bk + self.skew) / 4;
        let mut s = String::new();
        let mut w = |l: String| {
            s.push_str(&l);
            s.push('\n');
        };
        w("enable f16;\nenable wgpu_cooperative_matrix;".into());
        w("struct P { m: u32, n: u32, k: u32, steps: u32 }".into());
        w("@group(0) @binding(0) var<uniform> p: P;".into());
        w("@group(0) @binding(1) var<storage, read> GA: array<mat2x4<f16>>;".into());
        w("@group(0) @binding(2) var<storage, read> GB: array<mat2x4<f16>>;".into());
        w("@group(0) @binding(3) var<storage, read_write> Y: array<f32>;".into());
        w(format!(
            "const BM = {}u;\nconst BN = {}u;\nconst SA = {sa}u;\nconst NBUF = {}u;\nconst WG = {wg}u;",
            self.bm, self.bn, self.nbuf
        ));
        w("var<workgroup> As: array<vec4<f16>, NBUF * BM * SA>;".into());
        w("var<workgroup> Bs: array<vec4<f16>, NBUF * BN * SA>;".into());
        if self.three {
            w("var<workgroup> As2: array<vec4<f16>, NBUF * BM * SA>;".into());
            w("var<workgroup> Bs2: array<vec4<f16>, NBUF * BN * SA>;".into());
            w("const LO = f16(0.00048828125);".into());
        }
        w("@compute @workgroup_size(WG)".into());
        w("fn lab(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32, @builtin(subgroup_id) sg: u32) {".into());
        w("    let m0 = wid.x * BM;\n    let n0 = wid.y * BN;".into());
        w(format!(
            "    let sm = (sg % {}u) * {}u;\n    let sn = (sg / {}u) * {}u;",
            self.sgm,
            16 * fm,
            self.sgm,
            16 * fn_
        ));
        for i in 0..fm {
            for j in 0..fn_ {
                w(format!("    var c{i}_{j}: coop_mat16x16<f32, C>;"));
            }
        }
        // 16-byte pieces per tile row and per thread
        let pr = self.bk / 8;
        let (na, nb) = (self.bm * pr / wg.max(1), self.bn * pr / wg.max(1));
        let kv = "(p.k / 8u)";
        let load = |w: &mut dyn FnMut(String), step: &str| {
            for (regs, g, r0, n) in [("ra", "GA", "m0", na), ("rb", "GB", "n0", nb)] {
                for t in 0..n {
                    w(format!(
                        "        {{ let q = lid + {}u; {regs}{t} = {g}[({r0} + q / {pr}u) * {kv} + ({step}) * {pr}u + q % {pr}u]; }}",
                        t * wg
                    ));
                }
            }
        };
        let three = self.three;
        let store = |w: &mut dyn FnMut(String)| {
            for (regs, sh, rows, n) in [("ra", "As", "BM", na), ("rb", "Bs", "BN", nb)] {
                for t in 0..n {
                    let lo = if three {
                        format!(" {sh}2[o] = {regs}{t}[0] * LO; {sh}2[o + 1u] = {regs}{t}[1] * LO;")
                    } else {
                        String::new()
                    };
                    w(format!(
                        "        {{ let q = lid + {}u; let o = buf * {rows} * SA + (q / {pr}u) * SA + 2u * (q % {pr}u); {sh}[o] = {regs}{t}[0]; {sh}[o + 1u] = {regs}{t}[1];{lo} }}",
                        t * wg
                    ));
                }
            }
        };
        if self.stream {
            for t in 0..na {
                w(format!("    var ra{t}: mat2x4<f16>;"));
            }
            for t in 0..nb {
                w(format!("    var rb{t}: mat2x4<f16>;"));
            }
            load(&mut w, "0u");
        } else {
            // fill once: small values (exact in f16), never zero; `g` (zero) reads the
            // operands so the bindings stay in the pipeline's derived layout
            w("    let g = GA[0][0].x * f16(0.0) + GB[0][0].x * f16(0.0);".into());
            let tiles: &[(&str, &str)] = if three {
                &[("As", "BM"), ("Bs", "BN"), ("As2", "BM"), ("Bs2", "BN")]
            } else {
                &[("As", "BM"), ("Bs", "BN")]
            };
            for (sh, rows) in tiles {
                w(format!(
                    "    for (var i = lid; i < NBUF * {rows} * SA; i += WG) {{"
                ));
                w(format!("        let v = f16(f32(i % 13u) * 0.0625 - 0.375) + g;\n        {sh}[i] = vec4<f16>(v, -v, v * 0.5, 0.25);"));
                w("    }".into());
            }
            w("    workgroupBarrier();".into());
        }
        w("    for (var step = 0u; step < p.steps; step++) {".into());
        w("        let buf = step % NBUF;".into());
        if self.stream {
            if self.nbuf == 1 {
                w("        workgroupBarrier();".into());
            }
            store(&mut w);
            w("        workgroupBarrier();".into());
            w("        if (step + 1u < p.steps) {".into());
            load(&mut w, "step + 1u");
            w("        }".into());
        }
        w("        let ab = buf * BM * SA;\n        let bb = buf * BN * SA;".into());
        for kq in 0..self.bk / 16 {
            let parts: &[(&str, &str)] = if three {
                &[("", ""), ("2", "l")]
            } else {
                &[("", "")]
            };
            for (sh, v) in parts {
                for i in 0..fm {
                    w(format!(
                        "        let a{v}{kq}_{i} = coopLoadT<coop_mat16x16<f16, A>>(&As{sh}[ab + (sm + {}u) * SA + {}u], SA);",
                        16 * i,
                        4 * kq
                    ));
                }
            }
            for j in 0..fn_ {
                for (sh, v) in parts {
                    w(format!(
                        "        let b{v}{kq}_{j} = coopLoad<coop_mat16x16<f16, B>>(&Bs{sh}[bb + (sn + {}u) * SA + {}u], SA);",
                        16 * j,
                        4 * kq
                    ));
                }
                for i in 0..fm {
                    w(format!(
                        "        c{i}_{j} = coopMultiplyAdd(a{kq}_{i}, b{kq}_{j}, c{i}_{j});"
                    ));
                    if three {
                        w(format!(
                            "        c{i}_{j} = coopMultiplyAdd(al{kq}_{i}, b{kq}_{j}, c{i}_{j});\n        c{i}_{j} = coopMultiplyAdd(a{kq}_{i}, bl{kq}_{j}, c{i}_{j});"
                        ));
                    }
                }
            }
        }
        if !self.stream {
            w("        workgroupBarrier();".into());
        }
        w("    }".into());
        // the store's index and stride as `let`s: naga 30's SPIR-V writer panics ("Expression
        // is not cached") on a cooperative store whose pointer index or stride is an
        // expression over a uniform written in the call itself
        w("    let ys = p.n;".into());
        for i in 0..fm {
            for j in 0..fn_ {
                w(format!(
                    "    let y{i}_{j} = (m0 + sm + {}u) * ys + n0 + sn + {}u;\n    coopStoreT(c{i}_{j}, &Y[y{i}_{j}], ys);",
                    16 * i,
                    16 * j
                ));
            }
        }
        w("}".into());
        s
    }
}

/// `--dump-wgsl`: the lab tiles' and the product variants' final WGSL, one file each.
fn dump_wgsl(dir: &Path, lab: &[LabTile]) -> Result<()> {
    let write = |path: std::path::PathBuf, text: &str| {
        std::fs::write(&path, text).map_err(|source| lathe::Error::Io { path, source })
    };
    std::fs::create_dir_all(dir).map_err(|source| lathe::Error::Io {
        path: dir.to_path_buf(),
        source,
    })?;
    for t in lab {
        write(dir.join(format!("lab-{}.wgsl", t.name())), &t.wgsl())?;
    }
    for dt in [DType::Q4_K, DType::Q8_0] {
        for spec in coopmat::variant_specs(dt, 4096)? {
            write(dir.join(format!("{}.wgsl", spec.label)), &spec.wgsl()?)?;
        }
    }
    println!("wrote {}", dir.display());
    Ok(())
}

#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct LabParams {
    m: u32,
    n: u32,
    k: u32,
    steps: u32,
}

/// Lab operand values: small multiples of 1/8, exact in f16, so the f32 products are exact
/// enough to check against the CPU.
fn lab_value(r: u64, k: u64, mul: u64, m: u64) -> f32 {
    ((r * mul + k * 3) % m) as f32 / 8.0 - 1.0
}

/// `--lab`: each tile's 4096³ product (`size`³) timed, in TFLOP/s and as a share of `peak`;
/// the streamed tiles' results checked at a few entries against the CPU.
fn bench_lab(gpu: &Gpu, tiles: &[LabTile], size: u32, peak: f64, passes: u32) -> Result<()> {
    if coopmat::Precision::of(gpu).is_none() {
        println!("lab: this adapter has no cooperative-matrix path; nothing to time");
        return Ok(());
    }
    if !size.is_multiple_of(256) {
        return Err(lathe::Error::Invalid(format!(
            "--lab-size {size}: must be a multiple of 256 (the largest tile)"
        )));
    }
    let n = size as u64;
    let operand = |mul: u64, m: u64| -> Vec<u8> {
        let v: Vec<half::f16> = (0..n * n)
            .map(|i| half::f16::from_f32(lab_value(i / n, i % n, mul, m)))
            .collect();
        bytemuck::cast_slice(&v).to_vec()
    };
    let ga = gpu.upload(&operand(7, 17), "lab_a")?;
    let gb = gpu.upload(&operand(5, 15), "lab_b")?;
    let y = gpu.buffer(n * n * 4, "lab_y")?;
    let flops = 2.0 * (n * n * n) as f64;
    let per_pass = 8;
    println!("lab: {size}x{size}x{size} f16 x f16 -> f32, peak {peak} TFLOP/s");
    for t in tiles {
        let limit = gpu.limits.max_compute_workgroup_storage_size;
        if t.wg_bytes() > limit {
            println!(
                "lab {:<28} skipped: {} B of workgroup memory (limit {limit})",
                t.name(),
                t.wg_bytes()
            );
            continue;
        }
        let pipe = gpu.pipeline_for(Lab {
            tile: *t,
            wgsl: StaticName(Box::leak(t.wgsl().into_boxed_str())),
        })?;
        let prm = LabParams {
            m: size,
            n: size,
            k: size,
            steps: size / t.bk,
        };
        let mut rec = |pass: &mut Pass<'_>| {
            for _ in 0..per_pass {
                pass.dispatch(
                    &pipe,
                    "lab",
                    &prm,
                    &[Binding::from(&ga), Binding::from(&gb), Binding::from(&y)],
                    [size / t.bm, size / t.bn, 1],
                );
            }
            Ok(())
        };
        let s = time_passes(gpu, passes, &mut rec)?.0 / per_pass as f64;
        // -p3: three products' FLOPs (what the split path's step costs in matrix-unit work)
        let tflops = flops * (1.0 + 2.0 * t.three as u32 as f64) / s / 1e12;
        let check = if t.stream {
            // the lo tiles are the hi ones x 2^-11 (exact): two of the three products add that
            lab_check(
                gpu,
                &y,
                size,
                if t.three { 1.0 + 2.0 / 2048.0 } else { 1.0 },
            )?
        } else {
            String::new()
        };
        println!(
            "lab {:<28} {:8.3} ms {:7.1} TFLOP/s {:5.1}% of peak  ({} B workgroup memory){check}",
            t.name(),
            s * 1e3,
            tflops,
            100.0 * tflops / peak,
            t.wg_bytes()
        );
    }
    Ok(())
}

/// A few entries of the streamed product against the CPU: `, check ok` or the worst miss.
fn lab_check(gpu: &Gpu, y: &wgpu::Buffer, size: u32, factor: f64) -> Result<String> {
    let n = size as u64;
    let mut worst = 0.0f64;
    for m in [0, 1, 77, n / 2 + 3, n - 1] {
        let row: Vec<f32> = bytemuck::pod_collect_to_vec(&gpu.read_bytes(y, m * n * 4, n * 4)?);
        for c in [0, 5, 16, 130, n / 3, n - 2, n - 1] {
            let terms =
                (0..n).map(|k| lab_value(m, k, 7, 17) as f64 * lab_value(c, k, 5, 15) as f64);
            let want: f64 = factor * terms.clone().sum::<f64>();
            // against the sum of magnitudes: the scale of f32 accumulation error
            let scale: f64 = terms.map(f64::abs).sum::<f64>().max(1.0);
            worst = worst.max((row[c as usize] as f64 - want).abs() / scale);
        }
    }
    Ok(if worst < 1e-5 {
        ", check ok".into()
    } else {
        format!(", CHECK FAILED (relative error {worst:.2e})")
    })
}
