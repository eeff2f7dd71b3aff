//! The MoE planner: size parsing and budget arithmetic, placement (even spread, statistics,
//! fractions), the residency cache on a synthetic layer-sweep trace, the CPU cold path
//! against a dequantize + f64 reference on the qwen35moe-tiny fixture, block-scaled release
//! experts (FP8 and packed MXFP4 in a synthetic checkpoint written here) against their scales'
//! own dequantization, the GPU pieces on whatever adapter the machine has (lavapipe in CI),
//! the load progress with an arena, and `lathe plan` (and its agreement with the loaders).

use lathe::cpu::moe::{combine_slots, expert_rows};
use lathe::gpu::elementwise as ew;
use lathe::gpu::matvec::{self, MatvecOpts};
use lathe::gpu::moe::{read_back, remap, scatter_rows};
use lathe::gpu::operand::Operand;
use lathe::gpu::{AdapterChoice, Gpu};
use lathe::models::registry::expert_names;
use lathe::models::ModelFile;
use lathe::moe::budget::{default_margin, ASSUMED_MEMORY};
use lathe::moe::{
    cold_pairs, parse_size, remap_ids, AdapterMemory, Budget, BudgetInputs, CacheConfig, ColdPair,
    ExpertMats, ExpertStats, ExpertWeights, Fill, MatShape, MemSource, MoeInfo, MoeLayerInfo,
    Placement, ResidencyCache, COLD,
};
use lathe::moe::{fill_arena, new_arena, remap_tables, write_expert};
use lathe::DType;
use std::path::{Path, PathBuf};

const GIB: u64 = 1 << 30;
const MIB: u64 = 1 << 20;

fn fixture(file: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/models/qwen35moe-tiny")
        .join(file)
}

/// xorshift64*: deterministic test data without a dependency.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    /// Uniform in [-1, 1).
    fn f(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
    /// `k` distinct values below `n`.
    fn distinct(&mut self, n: usize, k: usize) -> Vec<u32> {
        let mut v: Vec<u32> = Vec::new();
        while v.len() < k {
            let e = self.below(n) as u32;
            if !v.contains(&e) {
                v.push(e);
            }
        }
        v
    }
}

// ---------------------------------------------------------------------------------------
// Sizes and budget

#[test]
fn parse_sizes() {
    assert_eq!(parse_size("24GiB").unwrap(), 24 * GIB);
    assert_eq!(parse_size("512MiB").unwrap(), 512 * MIB);
    assert_eq!(parse_size("1.5GB").unwrap(), 1_500_000_000);
    assert_eq!(parse_size("1.5 GiB").unwrap(), 3 * GIB / 2);
    assert_eq!(parse_size("24G").unwrap(), 24 * GIB);
    assert_eq!(parse_size("24gb").unwrap(), 24_000_000_000);
    assert_eq!(parse_size("64k").unwrap(), 65536);
    assert_eq!(parse_size("4096").unwrap(), 4096);
    assert_eq!(parse_size("4096B").unwrap(), 4096);
    assert_eq!(parse_size("2TiB").unwrap(), 2 << 40);
    for bad in ["", "GiB", "12XB", "-1GB", "1.2.3G", "1e3"] {
        let e = parse_size(bad).unwrap_err().to_string();
        assert!(e.contains(bad) || bad.is_empty(), "{bad}: {e}");
    }
}

#[test]
fn budget_arithmetic() {
    let inp = BudgetInputs {
        memory: 24 * GIB,
        weights: 3 * GIB,
        kv_bytes_per_token: 40 * 1024,
        ctx: 32768,
        state_bytes: 100 * MIB,
        activation_bytes: 500 * MIB,
        margin: None,
    };
    let b = Budget::new(&inp);
    assert_eq!(b.kv, 40 * 1024 * 32768);
    assert_eq!(b.margin, 24 * GIB / 20, "5% of 24 GiB");
    assert_eq!(
        b.experts,
        24 * GIB - (3 * GIB + 1280 * MIB + 100 * MIB + 500 * MIB + b.margin)
    );
    assert!(b.fits());
    assert_eq!(b.beside_experts() + b.experts, b.memory);

    let small = Budget::new(&BudgetInputs {
        memory: 2 * GIB,
        weights: 3 * GIB,
        margin: Some(0),
        ..inp.clone()
    });
    assert_eq!(small.experts, 0);
    assert!(!small.fits());
    assert_eq!(
        small.shortfall,
        3 * GIB + 1280 * MIB + 100 * MIB + 500 * MIB - 2 * GIB
    );

    // Margins: 5%, at least min(256 MiB, 1/8).
    assert_eq!(default_margin(140 * GIB), 7 * GIB);
    assert_eq!(default_margin(2 * GIB), 256 * MIB);
    assert_eq!(default_margin(64 * MIB), 8 * MIB);
}

#[test]
fn adapter_memory_sources() {
    let base = lathe::gpu::list_adapters()
        .into_iter()
        .next()
        .expect("a wgpu adapter (lavapipe in CI)");
    let with = |name: &str, ty: wgpu::DeviceType| {
        let mut i = base.clone();
        i.name = name.into();
        i.device_type = ty;
        i
    };
    let cpu = with("llvmpipe (LLVM 15.0.6, 256 bits)", wgpu::DeviceType::Cpu);
    let r = AdapterMemory::detect_with(&cpu, None, None, Some(24 * GIB));
    assert_eq!(
        (r.bytes, r.source.clone()),
        (12 * GIB, MemSource::SystemRam)
    );
    let r = AdapterMemory::detect_with(&cpu, None, Some(GIB), Some(24 * GIB));
    assert_eq!((r.bytes, r.source.clone()), (GIB, MemSource::Flag));
    let a100 = with("NVIDIA A100-SXM4-80GB", wgpu::DeviceType::DiscreteGpu);
    assert_eq!(
        AdapterMemory::detect_with(&a100, None, None, None).bytes,
        80 * GIB
    );
    let h200 = with("NVIDIA H200", wgpu::DeviceType::DiscreteGpu);
    let r = AdapterMemory::detect_with(&h200, None, None, Some(GIB));
    assert_eq!((r.bytes, r.source.clone()), (140 * GIB, MemSource::Name));
    let other = with("Some GPU 9000", wgpu::DeviceType::DiscreteGpu);
    let r = AdapterMemory::detect_with(&other, None, None, Some(GIB));
    assert_eq!(
        (r.bytes, r.source.clone()),
        (ASSUMED_MEMORY, MemSource::Assumed)
    );
    assert!(r.describe().contains("--gpu-mem"), "{}", r.describe());

    // A driver's report wins over the name table and the assumption: its budget when it
    // gives one, else the heap; an integrated adapter keeps at most half the RAM.
    let rep = |heap, budget| lathe::gpu::DeviceMemory {
        heap,
        budget,
        usage: budget.map(|_| 0),
        source: "test",
    };
    let d = rep(24 * GIB, Some(20 * GIB));
    let r = AdapterMemory::detect_with(&other, Some(&d), None, Some(GIB));
    assert_eq!(r.bytes, 20 * GIB);
    assert!(matches!(r.source, MemSource::Driver(_)), "{:?}", r.source);
    assert!(r.describe().contains("driver"), "{}", r.describe());
    let d = rep(16 * GIB, None);
    let r = AdapterMemory::detect_with(&h200, Some(&d), None, None);
    assert_eq!(r.bytes, 16 * GIB);
    let r = AdapterMemory::detect_with(&h200, Some(&d), Some(GIB), None);
    assert_eq!((r.bytes, r.source.clone()), (GIB, MemSource::Flag));
    let r = AdapterMemory::detect_with(&cpu, Some(&d), None, Some(24 * GIB));
    assert_eq!(
        (r.bytes, r.source.clone()),
        (12 * GIB, MemSource::SystemRam)
    );
    // A CPU adapter's heap is made up by its driver: half the RAM counts.
    let r = AdapterMemory::detect_with(&cpu, Some(&d), None, Some(64 * GIB));
    assert_eq!(
        (r.bytes, r.source.clone()),
        (32 * GIB, MemSource::SystemRam)
    );
    let r = AdapterMemory::detect_with(&cpu, Some(&d), None, None);
    assert_eq!(r.bytes, 16 * GIB);
    let igpu = with("AMD Radeon Graphics", wgpu::DeviceType::IntegratedGpu);
    let r = AdapterMemory::detect_with(&igpu, Some(&d), None, Some(64 * GIB));
    assert_eq!(r.bytes, 16 * GIB);
    assert!(matches!(r.source, MemSource::Driver(_)), "{:?}", r.source);
    let r = AdapterMemory::detect_with(&igpu, Some(&d), None, Some(24 * GIB));
    assert_eq!(
        (r.bytes, r.source.clone()),
        (12 * GIB, MemSource::SystemRam)
    );
}

/// The backend's own report of the adapter's memory (lavapipe's Vulkan heap in CI): a
/// device-local heap of some size, a budget within it when VK_EXT_memory_budget is there,
/// and the planner's memory taken from it (or half the RAM, for a CPU adapter).
#[test]
fn adapter_memory_from_the_driver() {
    let infos = lathe::gpu::list_adapters();
    let Some((i, info)) = infos
        .iter()
        .enumerate()
        .find(|(_, a)| a.backend == wgpu::Backend::Vulkan)
    else {
        panic!("no Vulkan adapter (lavapipe in CI): {infos:?}");
    };
    let d = lathe::gpu::adapter_memory(i).expect("Vulkan reports its memory heaps");
    assert!(d.heap >= 64 * MIB, "{d:?}");
    if let Some(b) = d.budget {
        assert!(b > 0 && d.usable() <= d.heap, "{d:?}");
    }
    let gpu = lathe::gpu::Gpu::new(&lathe::gpu::AdapterChoice::Index(i)).expect("device");
    assert_eq!(gpu.memory.as_ref().map(|m| m.heap), Some(d.heap));
    let m = AdapterMemory::detect(info, Some(&d), None);
    if info.device_type == wgpu::DeviceType::Cpu {
        assert_eq!(m.source, MemSource::SystemRam, "{m:?}");
    } else {
        assert!(m.bytes > 0 && m.bytes <= d.heap, "{m:?}");
    }
}

// ---------------------------------------------------------------------------------------
// Placement

fn layer(l: usize, n_expert: usize, down: DType) -> MoeLayerInfo {
    let m = |dtype, rows, cols| MatShape { dtype, rows, cols };
    MoeLayerInfo {
        layer: l,
        n_expert,
        gate: m(DType::Q4_K, 512, 2048),
        up: m(DType::Q4_K, 512, 2048),
        down: m(down, 2048, 512),
    }
}

/// A 35B-A3B-like model: 40 MoE layers × 256 experts, top-8, Q4_K_M-style down types.
fn synthetic_info() -> MoeInfo {
    MoeInfo {
        path: "synthetic.gguf".into(),
        arch: "qwen35moe".into(),
        n_layer: 40,
        n_used: 8,
        layers: (0..40)
            .map(|l| layer(l, 256, if l % 2 == 0 { DType::Q6_K } else { DType::Q4_K }))
            .collect(),
        names: lathe::models::registry::FAMILIES[0].experts,
        other_bytes: GIB,
        other_decode_bytes: GIB / 2,
    }
}

#[test]
fn placement_spreads_budget_evenly() {
    let info = synthetic_info();
    let (q6, q4) = (info.layers[0].expert_bytes(), info.layers[1].expert_bytes());
    assert!(q6 > q4);
    let budget = 5 * GIB + 12345;
    let p = Placement::new(&info, Fill::Budget(budget), None).unwrap();
    assert_eq!(
        p.groups.len(),
        2,
        "Q6_K and Q4_K down tensors: two arena groups"
    );
    assert!(p.arena_bytes() <= budget);
    // Nothing more fits, and every layer got about the same bytes (± one slot).
    assert!(
        budget - p.arena_bytes() < q4,
        "left {}",
        budget - p.arena_bytes()
    );
    let bytes: Vec<u64> = p
        .layers
        .iter()
        .zip(&info.layers)
        .map(|(lp, m)| lp.n_slots() as u64 * m.expert_bytes())
        .collect();
    let (lo, hi) = (*bytes.iter().min().unwrap(), *bytes.iter().max().unwrap());
    assert!(hi - lo <= q6, "per-layer bytes {lo}..{hi}");
    // The tail is not starved.
    assert!(p.layers.last().unwrap().n_slots() >= p.layers[0].n_slots() - 1);
    // Remap tables: slots unique per group, contiguous from 0.
    for (g, grp) in p.groups.iter().enumerate() {
        let mut slots: Vec<u32> = p
            .layers
            .iter()
            .filter(|l| l.group == g)
            .flat_map(|l| l.hot().map(|(_, s)| s))
            .collect();
        slots.sort();
        assert_eq!(slots, (0..grp.n_slots).collect::<Vec<_>>());
    }
    // Without statistics the hot experts are the lowest ids.
    let l0 = &p.layers[0];
    assert!(l0.remap[..l0.n_slots()].iter().all(|&s| s != COLD));
    assert!(l0.remap[l0.n_slots()..].iter().all(|&s| s == COLD));

    // A budget beyond all experts makes everything hot; zero makes everything cold.
    let all = Placement::new(&info, Fill::Budget(u64::MAX / 2), None).unwrap();
    assert!(all.layers.iter().all(|l| l.n_slots() == 256));
    let none = Placement::new(&info, Fill::Budget(0), None).unwrap();
    assert!(none.layers.iter().all(|l| l.n_slots() == 0));
    assert_eq!(none.arena_bytes(), 0);
}

#[test]
fn placement_fraction_and_traffic() {
    let info = synthetic_info();
    let p = Placement::new(&info, Fill::Fraction(0.25), None).unwrap();
    assert!(p.layers.iter().all(|l| l.n_slots() == 64));
    assert!(Placement::new(&info, Fill::Fraction(1.5), None).is_err());
    assert!(Placement::new(&info, Fill::Fraction(f64::NAN), None).is_err());
    // Uniform routing: a quarter of the 8 picks hit slots in every layer.
    let t = p.traffic(&info, None);
    for (tr, m) in t.iter().zip(&info.layers) {
        assert!((tr.hot_picks - 2.0).abs() < 1e-9 && (tr.cold_picks - 6.0).abs() < 1e-9);
        assert!((tr.host_bytes - 6.0 * m.expert_bytes() as f64).abs() < 1e-3);
    }
}

/// Statistics with expert e of layer l picked in proportion to a skewed, per-layer shuffled
/// weight, `tokens` tokens.
fn skewed_stats(info: &MoeInfo, tokens: u64, rng: &mut Rng) -> ExpertStats {
    let mut st = ExpertStats::new(info);
    for (li, l) in st.layers.iter_mut().enumerate() {
        let n = l.counts.len();
        let mut perm: Vec<usize> = (0..n).collect();
        for i in (1..n).rev() {
            perm.swap(i, rng.below(i + 1));
        }
        // Zipf-like weights, a different skew per layer; counts sum to n_used · tokens.
        let s = 0.6 + 0.02 * li as f64;
        let w: Vec<f64> = (0..n).map(|r| 1.0 / ((r + 1) as f64).powf(s)).collect();
        let tot: f64 = w.iter().sum();
        for (r, &e) in perm.iter().enumerate() {
            l.counts[e] = (w[r] / tot * (info.n_used as u64 * tokens) as f64).round() as u64;
        }
        l.tokens = tokens;
    }
    st
}

#[test]
fn placement_honours_statistics() {
    let info = synthetic_info();
    let mut rng = Rng(7);
    let st = skewed_stats(&info, 10_000, &mut rng);
    let budget = 3 * GIB;
    let p = Placement::new(&info, Fill::Budget(budget), Some(&st)).unwrap();
    assert!(p.arena_bytes() <= budget);
    // Any hot expert is picked at least as often as any cold one of the same slot cost
    // (the greedy ranking over all layers), up to the leftover even spread.
    for q in [0usize, 1] {
        let mut hot_min = f64::MAX;
        let mut cold_max = 0f64;
        for (lp, ls) in p
            .layers
            .iter()
            .zip(&st.layers)
            .filter(|(lp, _)| lp.layer % 2 == q)
        {
            for e in 0..lp.n_expert {
                let pe = ls.picks_per_token(e);
                if lp.remap[e] != COLD {
                    hot_min = hot_min.min(pe);
                } else {
                    cold_max = cold_max.max(pe);
                }
            }
        }
        assert!(
            hot_min >= cold_max,
            "parity {q}: hot {hot_min} < cold {cold_max}"
        );
    }
    // Statistics beat uniform placement on expected host traffic under those statistics.
    let uni = Placement::new(&info, Fill::Budget(budget), None).unwrap();
    let host = |p: &Placement| {
        p.traffic(&info, Some(&st))
            .iter()
            .map(|t| t.host_bytes)
            .sum::<f64>()
    };
    let (hs, hu) = (host(&p), host(&uni));
    eprintln!(
        "host bytes per token: stats placement {:.1} MiB, even placement {:.1} MiB",
        hs / MIB as f64,
        hu / MIB as f64
    );
    assert!(hs < 0.9 * hu);
    // Fraction with statistics: the most picked experts of each layer.
    let f = Placement::new(&info, Fill::Fraction(0.1), Some(&st)).unwrap();
    for (lp, ls) in f.layers.iter().zip(&st.layers) {
        let mut order: Vec<usize> = (0..lp.n_expert).collect();
        order.sort_by(|&a, &b| ls.counts[b].cmp(&ls.counts[a]).then(a.cmp(&b)));
        let k = lp.n_slots();
        assert_eq!(k, 26);
        assert!(order[..k].iter().all(|&e| lp.remap[e] != COLD));
    }
}

#[test]
fn stats_file_round_trip() {
    let info = {
        let f = ModelFile::open(fixture("model-q4_0.gguf")).unwrap();
        MoeInfo::from_file(&f, expert_names(&f)).unwrap()
    };
    let mut st = ExpertStats::new(&info);
    st.record(0, &[1, 2, 1, 7, 3, 99]); // 3 tokens of top-2; 99 is padding
    st.record(5, &[1, 2]); // not a MoE layer: ignored
    let l0 = st.layer(0).unwrap();
    assert_eq!(l0.tokens, 3);
    assert_eq!(l0.counts, vec![0, 2, 1, 1, 0, 0, 0, 1]);
    let dir = std::env::temp_dir().join(format!("lathe-moe-stats-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("stats.json");
    st.save(&path).unwrap();
    let back = ExpertStats::load(&path).unwrap();
    assert_eq!(back, st);
    back.check(&info, &path).unwrap();
    let text = std::fs::read_to_string(&path).unwrap();
    assert!(
        text.contains("\"format\": \"lathe-expert-stats\""),
        "{text}"
    );
    // A file for another model is refused with the file named.
    let mut other = st.clone();
    other.layers[0].counts.push(0);
    other.save(&path).unwrap();
    let e = ExpertStats::load(&path)
        .unwrap()
        .check(&info, &path)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("stats.json") && e.contains("9 counts for 8 experts"),
        "{e}"
    );
    std::fs::write(&path, "{\"format\": \"x\"}").unwrap();
    assert!(ExpertStats::load(&path).is_err());
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn layout_of_the_fixtures() {
    for (file, dt) in [
        ("model-q4_0.gguf", DType::Q4_0),
        ("model-f32.gguf", DType::F32),
    ] {
        let f = ModelFile::open(fixture(file)).unwrap();
        let info = MoeInfo::from_file(&f, expert_names(&f)).unwrap();
        assert_eq!((info.n_layer, info.n_used, info.layers.len()), (4, 2, 4));
        let m = &info.layers[0];
        assert_eq!(
            (m.n_expert, m.gate.dtype, m.gate.rows, m.gate.cols),
            (8, dt, 32, 64)
        );
        assert_eq!((m.down.rows, m.down.cols), (64, 32));
        let total: u64 = f.tensors().map(|t| t.data.len() as u64).sum();
        assert_eq!(info.other_bytes + info.expert_bytes(), total);
        let w = ExpertWeights::from_file(&f, info.names, m).unwrap();
        assert_eq!(w.n_expert(), 8);
        assert_eq!(w.gate.expert(3).unwrap().len() as u64, m.gate.bytes());
    }
    // The HF checkpoint keeps one tensor per expert: same layout, bytes straight from it.
    let hf = ModelFile::open(fixture("")).unwrap();
    let info = MoeInfo::from_file(&hf, expert_names(&hf)).unwrap();
    assert_eq!((info.n_layer, info.n_used, info.layers.len()), (4, 2, 4));
    assert_eq!(info.layers[2].down.dtype, DType::F32);
    let w = ExpertWeights::from_file(&hf, info.names, &info.layers[2]).unwrap();
    let t = hf
        .require("model.layers.2.mlp.experts.5.down_proj.weight")
        .unwrap();
    assert_eq!(&*w.down.expert(5).unwrap(), t.data);
    let only = ExpertWeights::from_file_only(&hf, info.names, &info.layers[2], &[5]).unwrap();
    assert_eq!(&*only.down.expert(5).unwrap(), t.data);
    assert!(only.down.expert(4).is_err());
}

// ---------------------------------------------------------------------------------------
// Residency cache

/// A layer-sweep trace: `steps` tokens × `n_layer` layers, each picking `k` distinct experts
/// from a per-layer Zipf-like popularity over a per-layer permutation, with bursts: the
/// popularity rotates every `phase` tokens (topics change).
fn sweep_trace(
    n_layer: usize,
    n_expert: usize,
    k: usize,
    steps: usize,
    seed: u64,
) -> Vec<Vec<Vec<u32>>> {
    let mut rng = Rng(seed);
    let perms: Vec<Vec<u32>> = (0..n_layer)
        .map(|_| {
            let mut p: Vec<u32> = (0..n_expert as u32).collect();
            for i in (1..n_expert).rev() {
                p.swap(i, rng.below(i + 1));
            }
            p
        })
        .collect();
    let w: Vec<f64> = (0..n_expert)
        .map(|r| 1.0 / ((r + 1) as f64).powf(1.1))
        .collect();
    let cdf: Vec<f64> = w
        .iter()
        .scan(0.0, |s, x| {
            *s += x;
            Some(*s)
        })
        .collect();
    let tot = *cdf.last().unwrap();
    (0..steps)
        .map(|t| {
            (0..n_layer)
                .map(|l| {
                    let shift = t / 200; // slow drift of the favourites
                    let mut v = Vec::new();
                    while v.len() < k {
                        let u = (rng.next() >> 11) as f64 / (1u64 << 53) as f64 * tot;
                        let r = cdf.partition_point(|&c| c < u).min(n_expert - 1);
                        let e = perms[l][(r + shift) % n_expert];
                        if !v.contains(&e) {
                            v.push(e);
                        }
                    }
                    v
                })
                .collect()
        })
        .collect()
}

fn uniform_info(n_layer: usize, n_expert: usize, k: usize) -> MoeInfo {
    MoeInfo {
        path: "trace".into(),
        arch: "synthetic".into(),
        n_layer,
        n_used: k,
        layers: (0..n_layer)
            .map(|l| layer(l, n_expert, DType::Q4_K))
            .collect(),
        names: lathe::models::registry::FAMILIES[0].experts,
        other_bytes: 0,
        other_decode_bytes: 0,
    }
}

fn replay(cache: &mut ResidencyCache, trace: &[Vec<Vec<u32>>], check_floor: bool) -> usize {
    let mut uploads = 0;
    for (t, tok) in trace.iter().enumerate() {
        let mut this_step = 0;
        for (l, ids) in tok.iter().enumerate() {
            let before = cache.remap(l).unwrap().to_vec();
            let ups = cache.observe(l, ids);
            this_step += ups.len();
            for u in &ups {
                assert_eq!(u.layer, l);
                assert_eq!(before[u.expert as usize], COLD, "uploaded a hot expert");
                assert_eq!(cache.remap(l).unwrap()[u.expert as usize], u.slot);
                if let Some((el, ee)) = u.evicted {
                    assert_eq!(cache.remap(el).unwrap()[ee as usize], COLD);
                }
            }
            if check_floor {
                for m in 0..tok.len() {
                    assert!(
                        cache.held(m).unwrap() >= cache.floor(m).unwrap(),
                        "token {t} layer {m}: {} slots below floor {}",
                        cache.held(m).unwrap(),
                        cache.floor(m).unwrap()
                    );
                }
            }
        }
        if check_floor {
            assert!(this_step <= CacheConfig::default().max_uploads_per_step);
        }
        uploads += this_step;
    }
    uploads
}

#[test]
fn residency_floor_beats_global_lru_on_a_layer_sweep() {
    // (layers, experts, top-k, share of slots): a roomy arena, and one with fewer slots than
    // picks per sweep (72 < 24·8), where a global LRU evicts what the next token needs.
    for (nl, ne, k, share) in [(24, 64, 4, 0.25), (24, 64, 8, 0.05)] {
        let info = uniform_info(nl, ne, k);
        let p = Placement::new(&info, Fill::Fraction(share), None).unwrap();
        let trace = sweep_trace(nl, ne, k, 1500, 11);
        let mut ours = ResidencyCache::new(&p, CacheConfig::default());
        let up_ours = replay(&mut ours, &trace, true);
        let mut lru = ResidencyCache::new(&p, CacheConfig::global_lru());
        let up_lru = replay(&mut lru, &trace, false);
        let mut fixed = ResidencyCache::new(
            &p,
            CacheConfig {
                max_uploads_per_step: 0,
                ..CacheConfig::default()
            },
        );
        replay(&mut fixed, &trace, true);
        eprintln!(
            "layer sweep, {nl} layers x {ne} experts, top-{k}, {}% slots, {} tokens: \
             floor LRU hit {:.1}% ({up_ours} uploads), global LRU hit {:.1}% ({up_lru} \
             uploads), static placement {:.1}%",
            share * 100.0,
            trace.len(),
            100.0 * ours.hit_rate(),
            100.0 * lru.hit_rate(),
            100.0 * fixed.hit_rate()
        );
        assert_eq!(ours.steps() as usize, trace.len() - 1);
        assert!(
            ours.hit_rate() > lru.hit_rate(),
            "policy must beat the plain global LRU"
        );
        assert!(
            ours.hit_rate() > 2.0 * fixed.hit_rate(),
            "adapting must pay"
        );
        assert!(up_ours * 10 < up_lru, "uploads: {up_ours} vs {up_lru}");
        let floor = p.layers[0].n_slots() / 2;
        assert!(ours
            .hits()
            .iter()
            .all(|h| h.slots >= floor && h.hits + h.misses == 1500 * k as u64));
    }
}

#[test]
fn residency_borrows_above_the_floor_and_skips_single_picks() {
    // Two layers of 8 experts, 4 slots each; layer 1 always picks the same 2 cold experts,
    // layer 0 spreads over all 8.
    let info = uniform_info(2, 8, 2);
    let p = Placement::new(&info, Fill::Fraction(0.5), None).unwrap();
    let mut c = ResidencyCache::new(&p, CacheConfig::default());
    assert_eq!(c.floor(0), Some(2));
    // First pick of a cold expert: no upload.
    assert!(c.observe(0, &[6, 7]).is_empty());
    let up = c.observe(1, &[5, 6]);
    assert!(up.is_empty(), "{up:?}");
    // Next token: 6, 7 of layer 0 are repeats now.
    let up = c.observe(0, &[6, 7]);
    assert_eq!(up.len(), 2);
    // The slots came from layer 0 itself or layer 1 above its floor, the LRU first.
    for u in &up {
        assert!(u.evicted.is_some());
    }
    for step in 0..20u32 {
        c.observe(0, &[step % 8, (step + 3) % 8]);
        c.observe(1, &[5, 6]);
        assert!(c.held(0).unwrap() >= 2 && c.held(1).unwrap() >= 2);
    }
    let r1 = c.remap(1).unwrap();
    assert!(
        r1[5] != COLD && r1[6] != COLD,
        "layer 1's repeated picks got slots"
    );
    // A prefill batch picking one expert twice uploads it at once.
    let mut c = ResidencyCache::new(&p, CacheConfig::default());
    let up = c.observe(0, &[7, 1, 7, 2]);
    assert_eq!(up.iter().map(|u| u.expert).collect::<Vec<_>>(), vec![7]);
    assert_eq!(c.uploads(), 1);
}

// ---------------------------------------------------------------------------------------
// Cold path (CPU)

/// Reference: dequantize the expert, f64 SwiGLU FFN.
fn reference_ffn(w: &ExpertWeights<'_>, e: usize, x: &[f32], limit: Option<f32>) -> Vec<f64> {
    let deq = |m: &ExpertMats<'_>| {
        let n = (m.shape.rows * m.shape.cols) as usize;
        lathe::quant::dequantize_to_vec(m.shape.dtype, &m.expert(e).unwrap(), n).unwrap()
    };
    let (g, u, d) = (deq(&w.gate), deq(&w.up), deq(&w.down));
    let (ne, ff) = (w.n_embd(), w.n_ff());
    let h: Vec<f64> = (0..ff)
        .map(|r| {
            let dot = |m: &[f32]| {
                (0..ne)
                    .map(|c| m[r * ne + c] as f64 * x[c] as f64)
                    .sum::<f64>()
            };
            let (mut gv, mut uv) = (dot(&g), dot(&u));
            if let Some(l) = limit {
                gv = gv.min(l as f64);
                uv = uv.clamp(-l as f64, l as f64);
            }
            gv / (1.0 + (-gv).exp()) * uv
        })
        .collect();
    (0..ne)
        .map(|r| (0..ff).map(|c| d[r * ff + c] as f64 * h[c]).sum())
        .collect()
}

fn random_pairs(rng: &mut Rng, n_tokens: usize, n_expert: usize, k: usize) -> (Vec<u32>, Vec<f32>) {
    let mut ids = Vec::new();
    let mut w = Vec::new();
    for _ in 0..n_tokens {
        ids.extend(rng.distinct(n_expert, k));
        w.extend((0..k).map(|_| 0.5 + 0.5 * rng.f()));
    }
    (ids, w)
}

#[test]
fn cold_path_matches_dequantized_reference() {
    for file in ["model-q4_0.gguf", "model-f32.gguf"] {
        let f = ModelFile::open(fixture(file)).unwrap();
        let info = MoeInfo::from_file(&f, expert_names(&f)).unwrap();
        let mut rng = Rng(42);
        for m in &info.layers {
            let w = ExpertWeights::from_file(&f, info.names, m).unwrap();
            let (ne, k, nt) = (w.n_embd(), info.n_used, 5);
            let x: Vec<f32> = (0..nt * ne).map(|_| rng.f() * 2.0).collect();
            let (ids, wts) = random_pairs(&mut rng, nt, w.n_expert(), k);
            for limit in [None, Some(0.05f32)] {
                // Every pair cold, weighted by the router weight.
                let pairs: Vec<ColdPair> = ids
                    .iter()
                    .enumerate()
                    .map(|(q, &e)| ColdPair {
                        token: (q / k) as u32,
                        slot: (q % k) as u32,
                        expert: e,
                        weight: wts[q],
                    })
                    .collect();
                let mut out = vec![0f32; pairs.len() * ne];
                expert_rows(&w, &x, &pairs, limit, &mut out).unwrap();
                let mut worst = 0f64;
                for (c, p) in pairs.iter().enumerate() {
                    let t = p.token as usize;
                    let r = reference_ffn(&w, p.expert as usize, &x[t * ne..(t + 1) * ne], limit);
                    for (i, &rv) in r.iter().enumerate() {
                        let want = rv * p.weight as f64;
                        let err = (out[c * ne + i] as f64 - want).abs();
                        worst = worst.max(err / (1.0 + want.abs()));
                        assert!(
                            err <= 1e-5 * (1.0 + want.abs()),
                            "{file} layer {} pair {c} row {i}: {} vs {want} (limit {limit:?})",
                            m.layer,
                            out[c * ne + i]
                        );
                    }
                }
                eprintln!(
                    "{file} layer {} limit {limit:?}: max rel err {worst:.2e}",
                    m.layer
                );
            }
            // Grouping is invisible: one pair at a time gives the same rows bit for bit.
            let pairs = cold_pairs(&vec![COLD; w.n_expert()], &ids, k);
            let mut all = vec![0f32; pairs.len() * ne];
            expert_rows(&w, &x, &pairs, None, &mut all).unwrap();
            for (c, p) in pairs.iter().enumerate() {
                let mut one = vec![0f32; ne];
                expert_rows(&w, &x, std::slice::from_ref(p), None, &mut one).unwrap();
                assert_eq!(one, all[c * ne..(c + 1) * ne]);
            }
        }
    }
}

#[test]
fn cold_path_rejects_bad_pairs() {
    let f = ModelFile::open(fixture("model-q4_0.gguf")).unwrap();
    let info = MoeInfo::from_file(&f, expert_names(&f)).unwrap();
    let w = ExpertWeights::from_file(&f, info.names, &info.layers[0]).unwrap();
    let x = vec![0.5f32; 2 * 64];
    let p = |token, expert| ColdPair {
        token,
        slot: 0,
        expert,
        weight: 1.0,
    };
    let mut out = vec![0f32; 64];
    assert!(expert_rows(&w, &x, &[p(2, 0)], None, &mut out).is_err());
    assert!(expert_rows(&w, &x, &[p(0, 8)], None, &mut out).is_err());
    assert!(expert_rows(&w, &x[..100], &[p(0, 0)], None, &mut out).is_err());
    assert!(expert_rows(&w, &x, &[p(0, 0), p(1, 1)], None, &mut out).is_err());
    assert!(expert_rows(&w, &x, &[p(1, 7)], None, &mut out).is_ok());
}

// ---------------------------------------------------------------------------------------
// Block-scaled release experts (DeepSeek: packed MXFP4, FP8 + 128×128 block scale)

/// A safetensors file of `(name, dtype, shape, bytes)`.
fn write_safetensors(path: &Path, tensors: &[(String, &str, Vec<u64>, Vec<u8>)]) {
    let mut header = serde_json::Map::new();
    let mut off = 0usize;
    for (name, dt, shape, bytes) in tensors {
        let end = off + bytes.len();
        let v = serde_json::json!({"dtype": dt, "shape": shape, "data_offsets": [off, end]});
        header.insert(name.clone(), v);
        off = end;
    }
    let mut h = serde_json::Value::Object(header).to_string().into_bytes();
    while !h.len().is_multiple_of(8) {
        h.push(b' ');
    }
    let mut out = (h.len() as u64).to_le_bytes().to_vec();
    out.extend(h);
    for (_, _, _, bytes) in tensors {
        out.extend(bytes);
    }
    std::fs::write(path, out).unwrap();
}

/// FP8 e4m3 codes without NaN (0x7F, 0xFF).
fn fp8_codes(rng: &mut Rng, n: usize) -> Vec<u8> {
    (0..n)
        .map(|_| match rng.below(256) as u8 {
            b if b & 0x7f == 0x7f => 0x38,
            b => b,
        })
        .collect()
}

/// FFN widths of the synthetic checkpoint: layer 0 FP8 (every dimension a multiple of 128),
/// layer 1 packed MXFP4 (multiples of 32).
const SC_EMBD: u64 = 256;
const SC_FF_FP8: u64 = 128;
const SC_FF_FP4: u64 = 96;
const SC_EXPERTS: usize = 3;

/// A DeepSeek-release-style checkpoint: bf16 embedding, one FP8 linear with its F32 block
/// scale, layer 0 with FP8 experts (scales F32 / BF16 / E8M0 for w1 / w3 / w2), layer 1 with
/// packed MXFP4 experts (I8 pairs, U8 E8M0 scales).
fn write_scaled_checkpoint(dir: &Path) {
    let mut rng = Rng(7);
    let _ = std::fs::remove_dir_all(dir);
    std::fs::create_dir_all(dir).unwrap();
    let cfg = serde_json::json!({
        "architectures": ["DeepseekV4ForCausalLM"],
        "n_layers": 2,
        "n_activated_experts": 2,
    });
    std::fs::write(dir.join("config.json"), cfg.to_string()).unwrap();
    let mut t: Vec<(String, &str, Vec<u64>, Vec<u8>)> = Vec::new();
    let bytes = |rng: &mut Rng, n: u64| (0..n).map(|_| rng.below(256) as u8).collect::<Vec<_>>();
    t.push((
        "embed.weight".into(),
        "BF16",
        vec![8, SC_EMBD],
        vec![0x3c; (16 * SC_EMBD) as usize],
    ));
    t.push((
        "layers.0.attn.wq_a.weight".into(),
        "F8_E4M3",
        vec![256, SC_EMBD],
        fp8_codes(&mut rng, (256 * SC_EMBD) as usize),
    ));
    let f32s = |v: &[f32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    t.push((
        "layers.0.attn.wq_a.scale".into(),
        "F32",
        vec![2, 2],
        f32s(&[0.01, 0.02, 0.03, 0.04]),
    ));
    for e in 0..SC_EXPERTS {
        let p = |w: &str| format!("layers.0.ffn.experts.{e}.{w}");
        let (f, d) = (SC_FF_FP8, SC_EMBD);
        t.push((
            p("w1.weight"),
            "F8_E4M3",
            vec![f, d],
            fp8_codes(&mut rng, (f * d) as usize),
        ));
        t.push((p("w1.scale"), "F32", vec![1, 2], f32s(&[0.004, 0.006])));
        t.push((
            p("w3.weight"),
            "F8_E4M3",
            vec![f, d],
            fp8_codes(&mut rng, (f * d) as usize),
        ));
        let bf = [0.005f32, 0.0075]
            .iter()
            .flat_map(|&x| half::bf16::from_f32(x).to_le_bytes())
            .collect();
        t.push((p("w3.scale"), "BF16", vec![1, 2], bf));
        t.push((
            p("w2.weight"),
            "F8_E4M3",
            vec![d, f],
            fp8_codes(&mut rng, (f * d) as usize),
        ));
        // E8M0 2^-8 and 2^-7 for the two 128-row bands.
        t.push((p("w2.scale"), "F8_E8M0", vec![2, 1], vec![119, 120]));
        let p = |w: &str| format!("layers.1.ffn.experts.{e}.{w}");
        let (f, d) = (SC_FF_FP4, SC_EMBD);
        for (w, rows, cols) in [("w1", f, d), ("w3", f, d), ("w2", d, f)] {
            t.push((
                p(&format!("{w}.weight")),
                "I8",
                vec![rows, cols / 2],
                bytes(&mut rng, rows * cols / 2),
            ));
            let sc = (0..rows * cols / 32)
                .map(|_| 122 + rng.below(6) as u8)
                .collect();
            t.push((p(&format!("{w}.scale")), "U8", vec![rows, cols / 32], sc));
        }
    }
    write_safetensors(&dir.join("model.safetensors"), &t);
}

/// f64 SwiGLU FFN over dequantized `[ff, ne]` gate / up and `[ne, ff]` down.
fn ffn_f64(g: &[f32], u: &[f32], d: &[f32], ne: usize, ff: usize, x: &[f32]) -> Vec<f64> {
    let dot = |m: &[f32], r: usize, v: &[f64], n: usize| {
        (0..n).map(|c| m[r * n + c] as f64 * v[c]).sum::<f64>()
    };
    let xd: Vec<f64> = x.iter().map(|&v| v as f64).collect();
    let h: Vec<f64> = (0..ff)
        .map(|r| {
            let (gv, uv) = (dot(g, r, &xd, ne), dot(u, r, &xd, ne));
            gv / (1.0 + (-gv).exp()) * uv
        })
        .collect();
    (0..ne).map(|r| dot(d, r, &h, ff)).collect()
}

/// The scanned layout, the uploaded byte count and the cold path of block-scaled release
/// experts: MoeInfo describes them in the GPU's types (`F8_E4M3_B128`, MXFP4), the cold rows
/// match an f64 FFN over the scales' own dequantization (`safetensors::scaled`, not the
/// repack), and the rows repacked per task equal whole-expert repacks bit for bit.
#[test]
fn block_scaled_release_experts() {
    use lathe::safetensors::{dequant_fp8_block, dequant_mxfp4_packed};
    let dir = std::env::temp_dir().join(format!("lathe-moe-scaled-{}", std::process::id()));
    write_scaled_checkpoint(&dir);
    let f = ModelFile::open(&dir).unwrap();
    let info = MoeInfo::from_file(&f, expert_names(&f)).unwrap();
    assert_eq!((info.n_layer, info.n_used, info.layers.len()), (2, 2, 2));
    let shape = |dtype, rows, cols| MatShape { dtype, rows, cols };
    let (m0, m1) = (&info.layers[0], &info.layers[1]);
    assert_eq!(m0.gate, shape(DType::F8_E4M3_B128, SC_FF_FP8, SC_EMBD));
    assert_eq!(m0.down, shape(DType::F8_E4M3_B128, SC_EMBD, SC_FF_FP8));
    assert_eq!(m1.up, shape(DType::MXFP4, SC_FF_FP4, SC_EMBD));
    assert_eq!(m1.down, shape(DType::MXFP4, SC_EMBD, SC_FF_FP4));
    // FP8 experts grow by 132/128 on the GPU; packed MXFP4 keeps its byte count.
    assert_eq!(m0.expert_bytes(), 3 * SC_FF_FP8 * SC_EMBD / 128 * 132);
    assert_eq!(m1.expert_bytes(), 3 * SC_FF_FP4 * SC_EMBD / 32 * 17);
    // Uploaded non-expert bytes: the bf16 embedding as stored, the FP8 linear as
    // F8_E4M3_B128 with its scale folded in.
    assert_eq!(info.other_bytes, 16 * SC_EMBD + 256 * 2 * 132);
    assert!(info.names.is_expert("layers.0.ffn.experts.2.w2.scale"));
    assert!(!info.names.is_expert("layers.0.attn.wq_a.scale"));

    let ModelFile::Hf(h) = &f else {
        panic!("a directory opens as a HF checkpoint")
    };
    let mut rng = Rng(11);
    for m in &info.layers {
        let w = ExpertWeights::from_file(&f, info.names, m).unwrap();
        let (ne, ff, k, nt) = (w.n_embd(), w.n_ff(), 2, 6);
        let names = ["w1", "w3", "w2"];
        // Each expert's three matrices dequantized from the stored tensors and scales.
        let deq = |e: usize, i: usize| -> Vec<f32> {
            let name = format!("layers.{}.ffn.experts.{e}.{}.weight", m.layer, names[i]);
            let t = h.require(&name).unwrap();
            let s = lathe::safetensors::find_block_scale(h, &name).unwrap();
            let (rows, cols) = if i == 2 { (ne, ff) } else { (ff, ne) };
            let mut out = vec![0f32; rows * cols];
            match t.dtype {
                DType::F8_E4M3 => dequant_fp8_block(&t, &s, &mut out).unwrap(),
                _ => dequant_mxfp4_packed(&t, &s, &mut out).unwrap(),
            }
            out
        };
        let x: Vec<f32> = (0..nt * ne).map(|_| rng.f()).collect();
        let (ids, wts) = random_pairs(&mut rng, nt, w.n_expert(), k);
        let pairs: Vec<ColdPair> = ids
            .iter()
            .enumerate()
            .map(|(q, &e)| ColdPair {
                token: (q / k) as u32,
                slot: (q % k) as u32,
                expert: e,
                weight: wts[q],
            })
            .collect();
        let mut out = vec![0f32; pairs.len() * ne];
        expert_rows(&w, &x, &pairs, None, &mut out).unwrap();
        let refs: Vec<[Vec<f32>; 3]> = (0..w.n_expert())
            .map(|e| [deq(e, 0), deq(e, 1), deq(e, 2)])
            .collect();
        let mut worst = 0f64;
        for (c, p) in pairs.iter().enumerate() {
            let t = p.token as usize;
            let [g, u, d] = &refs[p.expert as usize];
            let r = ffn_f64(g, u, d, ne, ff, &x[t * ne..(t + 1) * ne]);
            let scale = 1.0 + r.iter().fold(0f64, |a, v| a.max(v.abs()));
            for (i, &rv) in r.iter().enumerate() {
                let err = (out[c * ne + i] as f64 - rv * p.weight as f64).abs() / scale;
                worst = worst.max(err);
            }
        }
        eprintln!("layer {} ({}): max err {worst:.2e}", m.layer, m.gate.dtype);
        assert!(
            worst <= 1e-5,
            "layer {}: cold rows off by {worst:.2e}",
            m.layer
        );

        // Whole-expert reads equal the loaders' whole-tensor repack; partial row ranges
        // (across FP8's 128-row bands) are slices of them; the same rows from those bytes
        // give the same outputs bit for bit.
        let mut owned: Vec<Vec<Vec<u8>>> = Vec::new();
        for kind in lathe::moe::Kind::ALL {
            let mats = w.mats(kind);
            let rb = mats.shape.row_bytes() as usize;
            let all: Vec<Vec<u8>> = (0..w.n_expert())
                .map(|e| mats.expert(e).unwrap().into_owned())
                .collect();
            assert_eq!(all[0].len() as u64, mats.shape.bytes());
            // 98..158 of the 256-row down matrices crosses FP8's band boundary at 128.
            let r0 = mats.shape.rows as usize / 2 - 30;
            let part = mats.rows(1, r0, 60).unwrap();
            assert_eq!(&*part, &all[1][r0 * rb..(r0 + 60) * rb], "{kind:?}");
            assert!(mats.rows(0, mats.shape.rows as usize - 1, 2).is_err());
            owned.push(all);
        }
        let parts = |i: usize| {
            let s = w.mats(lathe::moe::Kind::ALL[i]).shape;
            let v = owned[i].iter().map(|b| b.as_slice()).collect();
            ExpertMats::from_parts(s, "repacked", v).unwrap()
        };
        let wp = ExpertWeights::new(m.layer, parts(0), parts(1), parts(2)).unwrap();
        let mut again = vec![0f32; out.len()];
        expert_rows(&wp, &x, &pairs, None, &mut again).unwrap();
        assert_eq!(again, out, "layer {}", m.layer);
        // Only the experts a call needs are looked up; the others are errors, not panics.
        let only = ExpertWeights::from_file_only(&f, info.names, m, &[1]).unwrap();
        assert_eq!(only.down.expert(1).unwrap(), w.down.expert(1).unwrap());
        assert!(only.gate.expert(0).is_err() && only.up.rows(2, 0, 1).is_err());
        let p1: Vec<ColdPair> = pairs.iter().filter(|p| p.expert == 1).copied().collect();
        let mut one = vec![0f32; p1.len() * ne];
        expert_rows(&only, &x, &p1, None, &mut one).unwrap();
        let mut full = vec![0f32; p1.len() * ne];
        expert_rows(&w, &x, &p1, None, &mut full).unwrap();
        assert_eq!(one, full);
        let p0: Vec<ColdPair> = pairs.iter().filter(|p| p.expert == 0).copied().collect();
        let mut zero = vec![0f32; p0.len() * ne];
        assert!(p0.is_empty() || expert_rows(&only, &x, &p0, None, &mut zero).is_err());
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// Scales the repack refuses (E8M0 0xFF is NaN) are an error of the cold path, not a panic;
/// a scale of the wrong shape is refused when the experts are described.
#[test]
fn block_scaled_experts_refuse_bad_scales() {
    let path = Path::new("(test)");
    let (rows, cols) = (32u64, 64u64);
    let wshape = [rows, cols / 2];
    let sshape = [rows, cols / 32];
    let bad_shape = [rows, cols / 16];
    let wdata = vec![0x21u8; (rows * cols / 2) as usize];
    let mut sdata = vec![127u8; (rows * cols / 32) as usize];
    sdata[5] = 0xff;
    let long = vec![127u8; (rows * cols / 16) as usize];
    let tr = |name, dtype, shape, data| lathe::tensor::TensorRef {
        name,
        dtype,
        shape,
        data,
        path,
    };
    let w = tr("w", DType::I8, &wshape[..], &wdata[..]);
    let s = tr("w.scale", DType::U8, &sshape[..], &sdata[..]);
    let sh = MatShape {
        dtype: DType::MXFP4,
        rows,
        cols,
    };
    let m = ExpertMats::from_scaled(sh, "w", vec![(w, s)]).unwrap();
    assert!(m.rows(0, 0, 1).is_ok(), "row 0 has good scales");
    assert!(m.rows(0, 2, 1).is_err(), "row 2 holds the NaN scale");
    let s_bad = tr("w.scale", DType::U8, &bad_shape[..], &long[..]);
    assert!(ExpertMats::from_scaled(sh, "w", vec![(w, s_bad)]).is_err());
    let fp8 = MatShape {
        dtype: DType::F8_E4M3_B128,
        ..sh
    };
    assert!(ExpertMats::from_scaled(fp8, "w", vec![(w, s)]).is_err());
    // The cold path reports it.
    let down = MatShape {
        dtype: DType::MXFP4,
        rows: cols,
        cols: rows,
    };
    let dshape = [cols, rows / 2];
    let dsshape = [cols, rows / 32];
    let ddata = vec![0x21u8; (rows * cols / 2) as usize];
    let dsdata = vec![127u8; (rows * cols / 32) as usize];
    let d = tr("d", DType::I8, &dshape[..], &ddata[..]);
    let ds = tr("d.scale", DType::U8, &dsshape[..], &dsdata[..]);
    let mk = |sh, t| ExpertMats::from_scaled(sh, "x", vec![t]).unwrap();
    let ew = ExpertWeights::new(0, mk(sh, (w, s)), mk(sh, (w, s)), mk(down, (d, ds))).unwrap();
    let x = vec![0.5f32; cols as usize];
    let pair = ColdPair {
        token: 0,
        slot: 0,
        expert: 0,
        weight: 1.0,
    };
    let mut out = vec![0f32; cols as usize];
    assert!(expert_rows(&ew, &x, &[pair], None, &mut out).is_err());
}

// ---------------------------------------------------------------------------------------
// GPU pieces

/// The adapter, as every other GPU test file gets it: none is a failure (CI has lavapipe).
fn gpu() -> Gpu {
    Gpu::new(&AdapterChoice::Auto).expect("a wgpu adapter (lavapipe in CI)")
}

#[test]
fn remap_and_scatter_kernels_match_the_cpu() {
    let gpu = gpu();
    let info = uniform_info(3, 37, 4);
    let p = Placement::new(&info, Fill::Fraction(0.4), None).unwrap();
    let tables = remap_tables(&gpu, &p).unwrap();
    let mut rng = Rng(3);
    // 1000 ids at offset 5, some out of range (padding); slots written at offset 9.
    let n = 1000usize;
    let mut ids: Vec<u32> = (0..n + 5).map(|_| rng.below(37) as u32).collect();
    ids[7] = 40;
    ids[8] = u32::MAX;
    let ib = gpu.upload(bytemuck::cast_slice(&ids), "ids").unwrap();
    let sb = gpu
        .upload(bytemuck::cast_slice(&vec![0xABCDu32; n + 12]), "slots")
        .unwrap();
    let (ids_v, slots_v) = (Operand::new(&ib, 5), Operand::new(&sb, 9));
    let mut pass = gpu.pass();
    remap(&mut pass, &tables, 1, ids_v, slots_v, n as u32).unwrap();
    pass.submit().unwrap();
    let got = gpu.read_u32(&sb, 0, n + 12).unwrap();
    let want = remap_ids(&p.layer(1).unwrap().remap, &ids[5..]);
    assert_eq!(&got[9..9 + n], &want[..]);
    assert!(
        got[..9].iter().chain(&got[9 + n..]).all(|&v| v == 0xABCD),
        "guards"
    );
    assert_eq!(want[2], COLD);
    // A rewritten table is what the next submission sees.
    let mut t1 = p.layer(1).unwrap().remap.clone();
    t1.iter_mut().for_each(|s| *s = COLD);
    t1[ids[5] as usize] = 3;
    tables.write(&gpu, 1, &t1).unwrap();
    let mut pass = gpu.pass();
    remap(&mut pass, &tables, 1, ids_v, slots_v, n as u32).unwrap();
    pass.submit().unwrap();
    assert_eq!(gpu.read_u32(&sb, 9, n).unwrap(), remap_ids(&t1, &ids[5..]));
    assert!(tables.write(&gpu, 1, &t1[..3]).is_err());
    assert!(tables.write(&gpu, 7, &t1).is_err());

    // scatter_rows: 5 rows of 7 into a [12, stride 9] buffer at offset 4; index 50 skipped.
    let rows: Vec<f32> = (0..5 * 7).map(|i| i as f32 + 0.5).collect();
    let index = [3u32, 0, 11, 50, 6];
    let rb = gpu.upload_f32(&rows, "rows").unwrap();
    let xb = gpu.upload(bytemuck::cast_slice(&index), "index").unwrap();
    let ob = gpu.upload_f32(&vec![-1f32; 4 + 12 * 9], "out").unwrap();
    let mut pass = gpu.pass();
    let (rv, xv, ov) = (
        Operand::new(&rb, 0),
        Operand::new(&xb, 0),
        Operand::strided(&ob, 4, 9),
    );
    scatter_rows(&mut pass, rv, xv, 5, 7, ov, 12).unwrap();
    pass.submit().unwrap();
    let got = gpu.read_f32(&ob, 0, 4 + 12 * 9).unwrap();
    let mut want = vec![-1f32; 4 + 12 * 9];
    for (r, &dst) in index.iter().enumerate() {
        if dst < 12 {
            for c in 0..7 {
                want[4 + dst as usize * 9 + c] = rows[r * 7 + c];
            }
        }
    }
    assert_eq!(got, want);
}

#[test]
fn arena_slots_hold_the_mapped_bytes() {
    let gpu = gpu();
    // Aligned slots: the q4_0 fixture (3456-byte experts), half the experts hot.
    let f = ModelFile::open(fixture("model-q4_0.gguf")).unwrap();
    let info = MoeInfo::from_file(&f, expert_names(&f)).unwrap();
    let p = Placement::new(&info, Fill::Fraction(0.5), None).unwrap();
    let weights: Vec<ExpertWeights<'_>> = info
        .layers
        .iter()
        .map(|m| ExpertWeights::from_file(&f, info.names, m).unwrap())
        .collect();
    let arena = new_arena(&gpu, &p).unwrap();
    fill_arena(&arena, &gpu, &p, &weights, &mut |_, _| {}).unwrap();
    let g = arena.group(0).unwrap();
    assert_eq!(g.n_slots, 16);
    for (lp, w) in p.layers.iter().zip(&weights) {
        for (e, s) in lp.hot() {
            for kind in lathe::moe::Kind::ALL {
                let t = g.get(kind as usize);
                let eb = w.mats(kind).shape.bytes();
                let got = gpu
                    .read_bytes(&t.parts[0].buffer, s as u64 * eb, eb)
                    .unwrap();
                assert_eq!(
                    got,
                    &*w.mats(kind).expert(e as usize).unwrap(),
                    "slot {s} {kind:?}"
                );
            }
        }
    }

    // Unaligned slots: Q8_0 gate/up of 33 rows (1122 bytes), F16 down (2112 bytes). Fill
    // every slot, then overwrite slot 1 and check its neighbours kept their bytes.
    let mut rng = Rng(5);
    let (ff, ne, n_exp) = (33u64, 32u64, 4usize);
    let mk = |rng: &mut Rng, dt: DType, rows: u64, cols: u64| -> Vec<u8> {
        let x: Vec<f32> = (0..rows * cols * n_exp as u64).map(|_| rng.f()).collect();
        lathe::quant::quantize(dt, &x).unwrap()
    };
    let gb = mk(&mut rng, DType::Q8_0, ff, ne);
    let ub = mk(&mut rng, DType::Q8_0, ff, ne);
    let db = mk(&mut rng, DType::F16, ne, ff);
    let mats = |b: &'static [u8], dt: DType, rows: u64, cols: u64| {
        let s = MatShape {
            dtype: dt,
            rows,
            cols,
        };
        ExpertMats::from_parts(s, "synthetic", b.chunks(s.bytes() as usize).collect()).unwrap()
    };
    let (gb, ub, db): (&'static [u8], &'static [u8], &'static [u8]) =
        (gb.leak(), ub.leak(), db.leak());
    let w = ExpertWeights::new(
        0,
        mats(gb, DType::Q8_0, ff, ne),
        mats(ub, DType::Q8_0, ff, ne),
        mats(db, DType::F16, ne, ff),
    )
    .unwrap();
    assert_eq!(w.gate.shape.bytes() % 4, 2, "an unaligned slot size");
    let info = MoeInfo {
        path: "synthetic".into(),
        arch: "synthetic".into(),
        n_layer: 1,
        n_used: 1,
        layers: vec![MoeLayerInfo {
            layer: 0,
            n_expert: n_exp,
            gate: w.gate.shape,
            up: w.up.shape,
            down: w.down.shape,
        }],
        names: lathe::models::registry::FAMILIES[0].experts,
        other_bytes: 0,
        other_decode_bytes: 0,
    };
    let p = Placement::new(&info, Fill::Fraction(1.0), None).unwrap();
    let arena = new_arena(&gpu, &p).unwrap();
    fill_arena(&arena, &gpu, &p, std::slice::from_ref(&w), &mut |_, _| {}).unwrap();
    write_expert(&arena, &gpu, 0, 1, &w, 3).unwrap(); // slot 1 now holds expert 3
    let g = arena.group(0).unwrap();
    for kind in lathe::moe::Kind::ALL {
        let eb = w.mats(kind).shape.bytes();
        let all = gpu
            .read_bytes(&g.get(kind as usize).parts[0].buffer, 0, eb * 4)
            .unwrap();
        for (s, e) in [(0usize, 0usize), (1, 3), (2, 2), (3, 3)] {
            assert_eq!(
                &all[s * eb as usize..(s + 1) * eb as usize],
                &*w.mats(kind).expert(e).unwrap(),
                "{kind:?} slot {s}"
            );
        }
    }
    assert!(write_expert(&arena, &gpu, 0, 4, &w, 0).is_err());
    assert!(write_expert(&arena, &gpu, 0, 0, &w, 4).is_err());
}

/// The recipe of `moe/mod.rs` end to end on the q4_0 fixture: the routed sum with all
/// experts hot, with half of them cold (CPU rows scattered into the per-pair buffer), and the
/// f64 reference agree.
#[test]
fn mixed_placement_equals_gpu_only() {
    let gpu = gpu();
    let f = ModelFile::open(fixture("model-q4_0.gguf")).unwrap();
    mixed_placement_case(&gpu, &f, 1, "qwen35moe-tiny q4_0");
}

/// The same for DeepSeek's block-scaled release experts: arena slots filled from repacked
/// FP8 (`F8_E4M3_B128`) and packed MXFP4 experts, read by the indexed matvec, beside cold
/// rows repacked per task on the CPU.
#[test]
fn mixed_placement_of_block_scaled_experts() {
    let gpu = gpu();
    let dir = std::env::temp_dir().join(format!("lathe-moe-scaled-gpu-{}", std::process::id()));
    write_scaled_checkpoint(&dir);
    let f = ModelFile::open(&dir).unwrap();
    mixed_placement_case(&gpu, &f, 0, "synthetic FP8 experts");
    mixed_placement_case(&gpu, &f, 1, "synthetic packed MXFP4 experts");
    drop(f);
    std::fs::remove_dir_all(&dir).ok();
}

/// MoE layer `li` of `f` under an all-hot and a half-cold arena (steps 4-7 of the recipe in
/// `moe/mod.rs`): both equal an f64 reference of the routed sum, and each other.
fn mixed_placement_case(gpu: &Gpu, f: &ModelFile, li: usize, what: &str) {
    let info = MoeInfo::from_file(f, expert_names(f)).unwrap();
    let m = &info.layers[li];
    let w = ExpertWeights::from_file(f, info.names, m).unwrap();
    let (ne, ff, k, n) = (w.n_embd(), w.n_ff(), info.n_used, 5usize);
    let mut rng = Rng(99);
    let x: Vec<f32> = (0..n * ne).map(|_| rng.f()).collect();
    let (ids, wts) = random_pairs(&mut rng, n, w.n_expert(), k);
    let pairs_n = (n * k) as u32;

    let xb = gpu.upload_f32(&x, "h").unwrap();
    let idb = gpu.upload(bytemuck::cast_slice(&ids), "moe_ids").unwrap();
    let wb = gpu.upload_f32(&wts, "moe_w").unwrap();
    let run = |fraction: f64| -> (Vec<f32>, usize) {
        let sub = MoeInfo {
            layers: vec![m.clone()],
            ..info.clone()
        };
        let p = Placement::new(&sub, Fill::Fraction(fraction), None).unwrap();
        let arena = new_arena(gpu, &p).unwrap();
        fill_arena(&arena, gpu, &p, std::slice::from_ref(&w), &mut |_, _| {}).unwrap();
        let tables = remap_tables(gpu, &p).unwrap();
        let g = arena.group(0).unwrap();
        let buf = |n: usize, l: &str| gpu.buffer(n as u64 * 4, l).unwrap();
        let (slots, fg, fu, o) = (
            buf(n * k, "slots"),
            buf(n * k * ff, "fg"),
            buf(n * k * ff, "fu"),
            buf(n * k * ff, "o"),
        );
        let moe_out = buf(n * k * ne, "moe_out");
        let y = buf(n * ne, "y");
        // 4. remap
        let mut pass = gpu.pass();
        let (ids_v, slots_v) = (Operand::new(&idb, 0), Operand::new(&slots, 0));
        remap(&mut pass, &tables, m.layer, ids_v, slots_v, pairs_n).unwrap();
        // 5. the one readback (ids and the FFN input rows)
        pass.submit().unwrap();
        let (rid, rx) = read_back(gpu, (&idb, 0, pairs_n), (&xb, 0, (n * ne) as u32)).unwrap();
        assert_eq!(
            (rid.as_slice(), rx.as_slice()),
            (ids.as_slice(), x.as_slice())
        );
        let pairs = cold_pairs(&p.layers[0].remap, &rid, k);
        // 6. hot experts on the arena with slot ids
        let opts = MatvecOpts::default();
        let mut pass = gpu.pass();
        for (t, out) in [(&g.gate, &fg), (&g.up, &fu)] {
            matvec::matvec_indexed(
                &mut pass,
                t,
                Operand::new(&xb, 0),
                &matvec::Pairs {
                    ids: Operand::new(&slots, 0),
                    n_tokens: n as u32,
                    n_used: k as u32,
                    x_per_pair: false,
                },
                Operand::new(out, 0),
                &opts,
            )
            .unwrap();
        }
        ew::swiglu(
            &mut pass,
            pairs_n,
            ff as u32,
            Operand::new(&o, 0),
            Operand::new(&fg, 0),
            Operand::new(&fu, 0),
            None,
        )
        .unwrap();
        matvec::matvec_indexed(
            &mut pass,
            &g.down,
            Operand::new(&o, 0),
            &matvec::Pairs {
                ids: Operand::new(&slots, 0),
                n_tokens: n as u32,
                n_used: k as u32,
                x_per_pair: true,
            },
            Operand::new(&moe_out, 0),
            &opts,
        )
        .unwrap();
        pass.submit().unwrap();
        // 7. cold experts on the CPU meanwhile, scattered into moe_out, then the combine
        let mut rows = vec![0f32; pairs.len() * ne];
        expert_rows(&w, &rx, &pairs, None, &mut rows).unwrap();
        let mut pass = gpu.pass();
        if !pairs.is_empty() {
            let index: Vec<u32> = pairs.iter().map(|c| c.token * k as u32 + c.slot).collect();
            let cr = gpu.upload_f32(&rows, "cold_rows").unwrap();
            let ci = gpu
                .upload(bytemuck::cast_slice(&index), "cold_index")
                .unwrap();
            scatter_rows(
                &mut pass,
                Operand::new(&cr, 0),
                Operand::new(&ci, 0),
                pairs.len() as u32,
                ne as u32,
                Operand::new(&moe_out, 0),
                pairs_n,
            )
            .unwrap();
        }
        for s in 0..k as u32 {
            ew::axpy_row(
                &mut pass,
                n as u32,
                ne as u32,
                Operand::new(&y, 0),
                Operand::strided(&wb, s, k as u32),
                Operand::strided(&moe_out, s * ne as u32, k as u32 * ne as u32),
            )
            .unwrap();
        }
        pass.submit().unwrap();
        (gpu.read_f32(&y, 0, n * ne).unwrap(), pairs.len())
    };
    let (hot, n_cold_hot) = run(1.0);
    let (mixed, n_cold) = run(0.5);
    assert_eq!(n_cold_hot, 0);
    assert!(
        n_cold > 0 && n_cold < n * k,
        "{n_cold} cold pairs of {}",
        n * k
    );
    // f64 reference of the routed sum; f32 accumulation error is relative to the row's
    // magnitude (the synthetic FP8 experts' rows reach the hundreds).
    let mut worst = (0f64, 0f64);
    for t in 0..n {
        let mut acc = vec![0f64; ne];
        for s in 0..k {
            let r = reference_ffn(&w, ids[t * k + s] as usize, &x[t * ne..(t + 1) * ne], None);
            for i in 0..ne {
                acc[i] += wts[t * k + s] as f64 * r[i];
            }
        }
        let row = acc.iter().fold(0f64, |a, v| a.max(v.abs()));
        for i in 0..ne {
            let (h, mx) = (hot[t * ne + i] as f64, mixed[t * ne + i] as f64);
            let tol = 1e-5 * (1.0 + acc[i].abs()).max(row / 10.0);
            assert!(
                (h - acc[i]).abs() <= tol,
                "{what}: all-hot t{t} i{i}: {h} vs {}",
                acc[i]
            );
            assert!(
                (mx - h).abs() <= tol,
                "{what}: mixed vs all-hot t{t} i{i}: {mx} vs {h}"
            );
            worst.0 = worst.0.max((h - acc[i]).abs());
            worst.1 = worst.1.max((mx - h).abs());
        }
    }
    eprintln!(
        "{what}: {n_cold} of {} pairs cold: all-hot vs f64 max err {:.2e}, mixed vs all-hot \
         {:.2e}",
        n * k,
        worst.0,
        worst.1
    );
    // combine_slots states the same sum on the CPU.
    let mut rows = vec![0f32; n * k * ne];
    let all_cold = vec![COLD; w.n_expert()];
    expert_rows(&w, &x, &cold_pairs(&all_cold, &ids, k), None, &mut rows).unwrap();
    let mut cpu = vec![0f32; n * ne];
    combine_slots(&mut cpu, &rows, &wts, k);
    for (t, (cr, hr)) in cpu.chunks(ne).zip(hot.chunks(ne)).enumerate() {
        let row = hr.iter().fold(0f32, |a, v| a.max(v.abs()));
        for (a, b) in cr.iter().zip(hr) {
            let tol = 1e-5 * (1.0 + b.abs()).max(row / 10.0);
            assert!(
                (a - b).abs() <= tol,
                "{what}: combine_slots t{t}: {a} vs {b}"
            );
        }
    }
}

// ---------------------------------------------------------------------------------------
// lathe plan

fn plan(args: &[&str]) -> String {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_lathe"))
        .arg("plan")
        .arg("-m")
        .arg(fixture("model-q4_0.gguf"))
        .args(args)
        .output()
        .expect("run lathe plan");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "lathe plan {args:?} failed: {}\n{stdout}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

/// (layer, experts, slots) rows of the placement table.
fn table(s: &str) -> Vec<(usize, usize, usize)> {
    s.lines()
        .filter_map(|l| {
            let v: Vec<&str> = l.split_whitespace().collect();
            (v.len() == 7 && v[0].parse::<usize>().is_ok()).then(|| {
                (
                    v[0].parse().unwrap(),
                    v[1].parse().unwrap(),
                    v[2].parse().unwrap(),
                )
            })
        })
        .collect()
}

#[test]
fn plan_command_prints_a_sane_table() {
    let all = plan(&["--gpu-mem", "1GiB"]);
    eprintln!("{all}");
    let t = table(&all);
    assert_eq!(t.iter().map(|r| r.0).collect::<Vec<_>>(), vec![0, 1, 2, 3]);
    assert!(t.iter().all(|&(_, e, s)| e == 8 && s == 8), "{all}");
    assert!(all.contains("host reads: 0 B"), "{all}");
    assert!(all.contains("tok/s"), "{all}");
    assert!(all.contains("(--gpu-mem)"), "{all}");
    // every expert fits: no prefill estimate for cold ones; the batch is the loader's
    assert!(all.contains("no cold experts"), "{all}");
    assert!(all.contains("batch 512,"), "{all}");

    let quarter = plan(&["--gpu-experts", "0.25", "--ctx", "128"]);
    assert!(
        quarter.contains("cold experts of a 512-token batch"),
        "{quarter}"
    );
    let t = table(&quarter);
    assert!(t.iter().all(|&(_, _, s)| s == 2), "{quarter}");
    assert!(!quarter.contains("host reads: 0 B"), "{quarter}");

    // A budget that holds part of the experts: spread evenly (slots differ by at most one).
    // (~600 KiB go beside the experts: weights, KV, state, the forward's scratch, margin.)
    // Without prompt streaming, whose slots (a whole layer's 8 experts here) would take the
    // experts' share of this budget.
    let args = [
        "--gpu-mem",
        "640KiB",
        "--ctx",
        "64",
        "--batch",
        "1",
        "--expert-stream",
        "never",
    ];
    let part = plan(&[&args[..], &["--cold-layers", "spread"]].concat());
    let t = table(&part);
    let (lo, hi) = (
        t.iter().map(|r| r.2).min().unwrap(),
        t.iter().map(|r| r.2).max().unwrap(),
    );
    assert!(hi - lo <= 1 && hi > 0 && lo < 8, "{part}");
    assert!(part.contains("--cold-layers whole"), "{part}");
    assert!(part.contains("--expert-stream never"), "{part}");
    // The default (auto) weighs the hops: here whole layers, at most one of them mixed,
    // the hot ones last.
    let auto = plan(&args);
    let t = table(&auto);
    let mixed = t.iter().filter(|r| r.2 > 0 && r.2 < r.1).count();
    assert!(mixed <= 1, "{auto}");
    let first_hot = t.iter().position(|r| r.2 > 0).unwrap_or(t.len());
    assert!(t[first_hot..].iter().skip(1).all(|r| r.2 == r.1), "{auto}");

    // Bad input is one error line naming the problem.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_lathe"))
        .args(["plan", "-m"])
        .arg(fixture("model-q4_0.gguf"))
        .args(["--gpu-mem", "lots"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("size `lots`"));
}

/// `lathe plan` and a load budget alike (`models::model_budget`), and a DeepSeek-V4 file's KV is
/// estimated at f32, the cache type its `auto` resolves to.
#[test]
fn plan_command_agrees_with_the_loader() {
    let dsv4 = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/models/dsv4-tiny");
    let path = dsv4.join("model-q8_0.gguf");
    let run = |args: &[&str]| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_lathe"))
            .args(["plan", "-m"])
            .arg(&path)
            .args(["--gpu-mem", "1GiB", "--ctx", "512"])
            .args(args)
            .output()
            .unwrap();
        assert!(out.status.success(), "{out:?}");
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let line = |s: &str, what: &str| -> String {
        let l = s.lines().find(|l| l.trim_start().starts_with(what));
        l.unwrap_or_else(|| panic!("no `{what}` in\n{s}"))
            .trim_start()
            .trim_start_matches(what)
            .trim()
            .to_string()
    };
    let auto = run(&[]);
    eprintln!("{auto}");
    assert!(auto.contains("KV f32 (auto)"), "{auto}");
    assert_eq!(
        line(&auto, "KV cache"),
        line(&run(&["--kv-type", "f32"]), "KV cache")
    );
    let f16 = run(&["--kv-type", "f16"]);
    assert!(f16.contains("KV f16,"), "{f16}");
    assert_ne!(line(&auto, "KV cache"), line(&f16, "KV cache"));
    // The loader's budget for the same run (statistics keep the offload, and so its report,
    // although every expert fits).
    let e = lathe::engine::Engine::load(
        &path,
        &lathe::engine::LoadOptions {
            gpu_mem: vec![GIB],
            ctx: 512,
            max_seqs: 1,
            collect_expert_stats: true,
            ..Default::default()
        },
    )
    .unwrap();
    let mem = e.placement_report().unwrap().memory.unwrap();
    let left = line(&auto, "left for experts");
    assert!(
        mem.ends_with(&format!("; {left} for expert slots")),
        "loader: {mem}; lathe plan: {left}"
    );
}

/// The load progress counts the arena's uploads: with half the experts offloaded it still
/// ends at the file's bytes, never steps back, and moves while the arena fills.
#[test]
fn load_progress_counts_arena_uploads() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/models/dsv4-tiny/model-q8_0.gguf");
    let f = ModelFile::open(&path).unwrap();
    let total: u64 = f.tensors().map(|t| t.data.len() as u64).sum();
    let experts: u64 = f
        .tensors()
        .filter(|t| expert_names(&f).is_expert(t.name))
        .map(|t| t.data.len() as u64)
        .sum();
    assert!(experts > 0);
    let calls = std::sync::Arc::new(std::sync::Mutex::new(Vec::<(u64, u64)>::new()));
    let c = calls.clone();
    let opts = lathe::engine::LoadOptions {
        gpu_experts: Some(0.5),
        progress: Some(std::sync::Arc::new(move |d, t| {
            c.lock().unwrap().push((d, t))
        })),
        ..Default::default()
    };
    let e = lathe::engine::Engine::load(&path, &opts).unwrap();
    assert!(e.placement_report().unwrap().hot_share < 1.0);
    let calls = calls.lock().unwrap();
    assert_eq!(calls.last(), Some(&(total, total)), "{calls:?}");
    assert!(calls.windows(2).all(|w| w[0].0 <= w[1].0), "{calls:?}");
    assert!(
        calls.iter().all(|&(d, t)| t == total && d <= t),
        "{calls:?}"
    );
    // Positions strictly inside the experts' share: the arena's uploads.
    let inside = calls
        .iter()
        .filter(|&&(d, _)| d > total - experts && d < total)
        .count();
    assert!(inside > 0, "no progress while the arena filled: {calls:?}");
}

/// `--cold-layers whole`: whole layers hot from the last one down, at most one mixed layer,
/// within the budget; the decode estimate counts one hop per layer with cold experts, so on
/// uniform routing (no expert more popular than another) whole layers win by the hops they
/// save, and `auto` picks them; with hops free, spreading never loses.
#[test]
fn whole_cold_layers_take_fewer_hops() {
    use lathe::engine::ColdLayers;
    use lathe::moe::offload::place;
    use lathe::moe::Costs;
    let info = uniform_info(8, 16, 4);
    let eb = info.layers[0].expert_bytes();
    let budget = eb * (16 * 3 + 5);
    let w = Placement::whole_layers(&info, Fill::Budget(budget), None).unwrap();
    let hot: Vec<usize> = w.layers.iter().map(|l| l.n_slots()).collect();
    assert_eq!(hot, vec![0, 0, 0, 0, 5, 16, 16, 16]);
    assert!(w.arena_bytes() <= budget);
    let s = Placement::new(&info, Fill::Budget(budget), None).unwrap();
    assert!(s.layers.iter().all(|l| l.n_slots() > 0 && l.n_slots() < 16));
    let c = Costs::default();
    let (tw, ts) = (
        w.decode_seconds(&info, None, &c),
        s.decode_seconds(&info, None, &c),
    );
    assert!(tw < ts, "whole {tw} vs spread {ts}");
    // Five layers with cold picks against eight: three hops saved, the CPU's bytes nearly
    // equal (the same number of cold experts).
    assert!((ts - tw - 3.0 * c.hop_s).abs() < 0.5 * c.hop_s, "{ts} {tw}");
    let auto = place(&info, Fill::Budget(budget), None, ColdLayers::Auto).unwrap();
    assert_eq!(auto, w);
    let free = Costs { hop_s: 0.0, ..c };
    assert!(s.decode_seconds(&info, None, &free) <= w.decode_seconds(&info, None, &free) + 1e-12);
    // A share under --gpu-experts stays per layer unless whole layers are asked for.
    let f = place(&info, Fill::Fraction(0.5), None, ColdLayers::Auto).unwrap();
    assert!(f.layers.iter().all(|l| l.n_slots() == 8));
    let f = place(&info, Fill::Fraction(0.5), None, ColdLayers::Whole).unwrap();
    let hot: Vec<usize> = f.layers.iter().map(|l| l.n_slots()).collect();
    assert_eq!(hot, vec![0, 0, 0, 0, 16, 16, 16, 16]);
}

/// `Engine::warm_up`'s scratch passes leave an offload's routing statistics and traffic
/// counters as load left them; the passes after it count as before.
#[test]
fn warm_up_leaves_expert_counts_as_loaded() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/models/dsv4-tiny/model-q8_0.gguf");
    let opts = lathe::engine::LoadOptions {
        gpu_experts: Some(0.5),
        collect_expert_stats: true,
        max_seqs: 4,
        ..Default::default()
    };
    let mut e = lathe::engine::Engine::load(&path, &opts).unwrap();
    let picks = |e: &lathe::engine::Engine| -> u64 {
        let s = e.offload().unwrap().stats().unwrap();
        s.layers.iter().flat_map(|l| l.counts.iter()).sum()
    };
    assert_eq!(picks(&e), 0);
    e.warm_up(4, 30).unwrap();
    let r = e.placement_report().unwrap();
    assert_eq!(picks(&e), 0, "warm-up picks counted");
    assert_eq!((r.cold_pairs, r.streamed_pairs), (0, 0), "{r:?}");
    let mut seq = e.new_seq().unwrap();
    e.forward(&mut seq, &[1, 2, 3, 4, 5], false).unwrap();
    assert!(picks(&e) > 0, "a real pass's picks");
}
