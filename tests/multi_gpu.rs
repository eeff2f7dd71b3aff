//! A model split over several devices (`--devices`, `models::chain`) gives the logits of the
//! model on one device. On lavapipe every device is made on the one CPU adapter
//! (`--devices 0,0`): each is its own `wgpu::Device` with its own buffers, so the residual
//! stream really crosses through the host. The parts run the same kernels on the same
//! values and the crossing copies f32 bytes, so the logits are bit-identical, and that is
//! what is asserted: every committed fixture family and format (GGUF, Hugging Face
//! safetensors, DeepSeek's release layout), the default split, uneven ones and one layer
//! per device, prefill then decode; with experts forced to the CPU too; and the bytes that
//! cross per step.

mod common;
use common::fixtures;
use lathe::engine::{logits_on, Engine, LoadOptions};
use lathe::gpu::AdapterChoice;
use lathe::moe::CacheConfig;
use std::path::{Path, PathBuf};

fn tokens(dir: &Path) -> Vec<u32> {
    let t = lathe::npy::read_i64(dir.join("tokens.npy")).unwrap();
    t.data.iter().map(|&v| v as u32).collect()
}

/// `n` devices on adapter 0 with layer shares `split` (`None`: the default).
fn on_devices(n: usize, split: Option<&[f64]>, base: &LoadOptions) -> LoadOptions {
    LoadOptions {
        devices: vec![AdapterChoice::Index(0); n],
        split: split.map(<[f64]>::to_vec),
        ..base.clone()
    }
}

/// Logits of every position: all but the last 3 tokens as one prefill, then 3 decode steps.
fn run(path: &Path, toks: &[u32], opts: &LoadOptions) -> Vec<f32> {
    let mut e = Engine::load(path, opts).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    logits_on(&mut e, toks, toks.len() - 3).unwrap()
}

/// Asserts `got` is `want` bit for bit, naming the first difference.
fn assert_same(label: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{label}: logit counts differ");
    if let Some(i) = (0..got.len()).find(|&i| got[i].to_bits() != want[i].to_bits()) {
        panic!(
            "{label}: logit {i} is {} on the split model, {} on one device",
            got[i], want[i]
        );
    }
}

/// `(label, path)` of each committed model format of fixture `name`.
fn formats(name: &str) -> Vec<(String, PathBuf)> {
    let dir = fixtures().join(name);
    let mut v: Vec<(String, PathBuf)> = ["model-q8_0.gguf", "model-q4_0.gguf"]
        .iter()
        .map(|f| (format!("{name}/{f}"), dir.join(f)))
        .filter(|(_, p)| p.exists())
        .take(1)
        .collect();
    for hf in ["model.safetensors", "upstream"] {
        if dir.join(hf).exists() {
            let p = if hf == "upstream" {
                dir.join(hf)
            } else {
                dir.clone()
            };
            v.push((format!("{name}/{hf}"), p));
        }
    }
    assert!(
        v.len() >= 2,
        "{name}: a GGUF file and a checkpoint expected"
    );
    v
}

/// Every split of `splits` (device shares) against one device, for each format of `name`.
fn check(name: &str, base: &LoadOptions, splits: &[Option<&[f64]>]) {
    let toks = tokens(&fixtures().join(name));
    for (label, path) in formats(name) {
        let want = run(&path, &toks, base);
        for split in splits {
            let n = split.map_or(2, <[f64]>::len);
            let got = run(&path, &toks, &on_devices(n, *split, base));
            assert_same(
                &format!("{label} on {n} devices, split {split:?}"),
                &got,
                &want,
            );
        }
    }
}

/// Splits of a 4-layer model: default (2 devices), uneven both ways, one layer per device,
/// and three devices unevenly.
const SPLITS: &[Option<&[f64]>] = &[
    None,
    Some(&[1.0, 3.0]),
    Some(&[3.0, 1.0]),
    Some(&[1.0, 1.0, 1.0, 1.0]),
    Some(&[2.0, 1.0, 1.0]),
];

#[test]
fn qwen35_split_matches_one_device() {
    check("qwen35-tiny", &LoadOptions::default(), SPLITS);
}

#[test]
fn qwen35moe_split_matches_one_device() {
    check("qwen35moe-tiny", &LoadOptions::default(), SPLITS);
}

#[test]
fn qwen3next_split_matches_one_device() {
    check("qwen3next-tiny", &LoadOptions::default(), &SPLITS[..2]);
}

/// DeepSeek-V4 runs 160 tokens (its compressors' windows): fewer splits keep it fast.
#[test]
fn deepseek4_split_matches_one_device() {
    check(
        "dsv4-tiny",
        &LoadOptions::default(),
        &[None, SPLITS[1], SPLITS[3]],
    );
}

/// Half of each layer's experts on the CPU, placed once (no uploads): every part places
/// its own layers' experts as the single device does, so the logits are the same bits.
fn cold_experts() -> LoadOptions {
    LoadOptions {
        gpu_experts: Some(0.5),
        expert_cache: Some(CacheConfig {
            max_uploads_per_step: 0,
            ..Default::default()
        }),
        ..Default::default()
    }
}

#[test]
fn qwen35moe_split_with_cold_experts_matches_one_device() {
    check("qwen35moe-tiny", &cold_experts(), &SPLITS[..4]);
}

#[test]
fn deepseek4_split_with_cold_experts_matches_one_device() {
    check("dsv4-tiny", &cold_experts(), &[SPLITS[2], SPLITS[3]]);
}

/// Under a budget that holds only a few experts, each device's part keeps experts on the
/// CPU, and the residency policy uploads as it goes: the logits meet the offload's own bar
/// against the all-GPU run (placement changes only the rounding of cold rows, see
/// tests/moe_exact.rs).
#[test]
fn split_with_cold_experts_and_uploads_stays_exact() {
    let dir = fixtures().join("qwen35moe-tiny");
    let path = dir.join("model-q8_0.gguf");
    let toks = tokens(&dir);
    let want = run(&path, &toks, &LoadOptions::default());
    let opts = LoadOptions {
        gpu_experts: Some(0.25),
        expert_cache: Some(CacheConfig::global_lru()),
        ..Default::default()
    };
    let e = Engine::load(&path, &on_devices(2, None, &opts)).unwrap();
    let hot = e.placement_report().unwrap().hot_share;
    assert!(hot < 1.0, "experts were meant to be cold, hot share {hot}");
    drop(e);
    let got = run(&path, &toks, &on_devices(2, None, &opts));
    let (mut se, mut ss) = (0f64, 0f64);
    for (a, b) in got.iter().zip(&want) {
        se += ((a - b) as f64).powi(2);
        ss += (*b as f64).powi(2);
    }
    let rel = (se / ss).sqrt();
    assert!(rel <= 1e-3, "relative RMS {rel} against the all-GPU run");
}

/// One copy of the residual stream per device boundary and round: `rows · width · 4` bytes
/// (width: `n_embd`, times DeepSeek-V4's `hc` copies).
#[test]
fn bytes_crossing_per_step() {
    for (name, width) in [("qwen35-tiny", 64), ("dsv4-tiny", 4 * 64)] {
        let dir = fixtures().join(name);
        let path = dir.join("model-q8_0.gguf");
        let toks = tokens(&dir);
        let mut e = Engine::load(&path, &on_devices(3, None, &LoadOptions::default())).unwrap();
        let mut seq = e.new_seq().unwrap();
        let h0 = e.hops().expect("a split model reports its hops");
        assert_eq!((h0.devices, h0.boundaries, h0.hops, h0.bytes), (3, 2, 0, 0));
        let p = toks.len() - 1;
        e.forward(&mut seq, &toks[..p], false).unwrap();
        let h1 = e.hops().unwrap().since(&h0);
        assert_eq!(h1.hops, 2, "{name}: prefill of {p} tokens, one round");
        assert_eq!(
            h1.bytes,
            (2 * p * width * 4) as u64,
            "{name}: prefill bytes"
        );
        let before = e.hops().unwrap();
        e.forward(&mut seq, &toks[p..], false).unwrap();
        let step = e.hops().unwrap().since(&before);
        assert_eq!(step.hops, 2, "{name}: one decode step");
        assert_eq!(
            step.bytes,
            (2 * width * 4) as u64,
            "{name}: a decode step moves one row per boundary"
        );
        assert!(step.us > 0.0, "{name}: the crossing is timed");
    }
}

/// One device's model reports no hops; a `--split` that leaves a device without a layer is
/// an error naming the counts.
#[test]
fn split_errors_and_single_device() {
    let path = fixtures().join("qwen35-tiny/model-q8_0.gguf");
    let e = Engine::load(&path, &LoadOptions::default()).unwrap();
    assert!(e.hops().is_none());
    drop(e);
    let err = Engine::load(&path, &on_devices(5, None, &LoadOptions::default()))
        .err()
        .expect("5 devices for 4 layers");
    assert!(err.to_string().contains("5 devices for 4 layers"), "{err}");
    let err = Engine::load(&path, &on_devices(2, Some(&[1.0]), &LoadOptions::default()))
        .err()
        .expect("one ratio for two devices");
    assert!(err.to_string().contains("1 ratios for 2 devices"), "{err}");
}

#[test]
fn split_layers_ranges() {
    use lathe::models::chain::split_layers;
    assert_eq!(split_layers(4, &[1.0, 1.0]).unwrap(), vec![0..2, 2..4]);
    assert_eq!(split_layers(4, &[1.0, 3.0]).unwrap(), vec![0..1, 1..4]);
    assert_eq!(
        split_layers(4, &[1.0; 4]).unwrap(),
        vec![0..1, 1..2, 2..3, 3..4]
    );
    // Every device keeps a layer even when its share rounds to none.
    assert_eq!(split_layers(4, &[100.0, 1.0]).unwrap(), vec![0..3, 3..4]);
    assert_eq!(split_layers(4, &[1.0, 100.0]).unwrap(), vec![0..1, 1..4]);
    assert_eq!(
        split_layers(43, &[141.0, 141.0]).unwrap(),
        vec![0..22, 22..43]
    );
    assert!(split_layers(4, &[1.0, 0.0]).is_err());
    assert!(split_layers(4, &[]).is_err());
}

fn lathe(args: &[&str]) -> std::process::Output {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_lathe"))
        .args(args)
        .output()
        .expect("run lathe");
    assert!(
        out.status.success(),
        "lathe {args:?} failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// `lathe logits --devices 0,0` (default split) writes the file `--device 0` writes, and
/// `--split` and one `--gpu-mem` per device reach the loader.
#[test]
fn cli_logits_devices_matches_device() {
    let dir = fixtures().join("qwen35moe-tiny");
    let model = dir.join("model-q8_0.gguf");
    let toks = dir.join("tokens.npy");
    let tmp = std::env::temp_dir().join(format!("lathe-multi-{}", std::process::id()));
    std::fs::create_dir_all(&tmp).unwrap();
    let run = |name: &str, extra: &[&str]| {
        let out = tmp.join(name);
        let mut args = vec![
            "logits",
            "-m",
            model.to_str().unwrap(),
            "--tokens",
            toks.to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
            "--prefill",
            "20",
        ];
        args.extend_from_slice(extra);
        let o = lathe(&args);
        (
            std::fs::read(&out).unwrap(),
            String::from_utf8_lossy(&o.stderr).into_owned(),
        )
    };
    let (one, _) = run("one.npy", &["--device", "0"]);
    let (two, log) = run("two.npy", &["--devices", "0,0"]);
    assert!(log.contains("device 1: layers 2..4"), "{log}");
    assert!(
        one == two,
        "--devices 0,0 wrote other logits than --device 0"
    );
    let (uneven, log) = run(
        "uneven.npy",
        &[
            "--devices",
            "0,0,0",
            "--split",
            "2,1,1",
            "--gpu-mem",
            "1GiB,2GiB,3GiB",
        ],
    );
    assert!(
        log.contains("device 0: layers 0..2") && log.contains("device 2: layers 3..4"),
        "{log}"
    );
    assert!(log.contains("memory 3.00 GiB (--gpu-mem)"), "{log}");
    assert!(
        one == uneven,
        "--split 2,1,1 wrote other logits than --device 0"
    );
    std::fs::remove_dir_all(&tmp).ok();
}

/// `lathe selftest --devices 0,0` checks each device and sums the counts.
#[test]
fn cli_selftest_checks_each_device() {
    let out = lathe(&[
        "selftest",
        "--devices",
        "0,0",
        "--json",
        "--matmul",
        "tiled",
    ]);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let devs = v["devices"].as_array().expect("one report per device");
    assert_eq!(devs.len(), 2);
    let each: Vec<u64> = devs.iter().map(|d| d["passed"].as_u64().unwrap()).collect();
    assert!(each[0] > 0 && each[0] == each[1], "{each:?}");
    assert_eq!(v["passed"].as_u64(), Some(each[0] + each[1]));
    assert_eq!(v["failed"].as_u64(), Some(0));
}

/// Several sequences at once: a batch split into micro-batches flows through the devices
/// one after another, and each sequence gets what one device gives that micro-batch; a
/// prompt longer than a pass (two rounds, the first device running the second while the
/// next runs the first) gives the one-device logits too.
#[test]
fn batches_micro_batches_and_rounds_match_one_device() {
    use lathe::engine::{Logits, Want};
    let path = fixtures().join("qwen35moe-tiny/model-q8_0.gguf");
    let prompts: Vec<Vec<u32>> = (0..4u32)
        .map(|i| (0..5 + 3 * i).map(|j| (i * 37 + j * 11) % 512).collect())
        .collect();
    // Two prefill steps of the whole batch, then a decode step of each.
    let batch = |e: &mut Engine, groups: usize| -> Vec<Vec<f32>> {
        let mut seqs: Vec<_> = prompts.iter().map(|_| e.new_seq().unwrap()).collect();
        let mut out = vec![Vec::new(); prompts.len()];
        let per = prompts.len() / groups;
        for step in 0..2 {
            for g in 0..groups {
                let mut items: Vec<(&mut lathe::engine::Seq, &[u32], Want)> = seqs
                    [g * per..(g + 1) * per]
                    .iter_mut()
                    .zip(&prompts[g * per..(g + 1) * per])
                    .map(|(s, p)| {
                        let t: &[u32] = if step == 0 { p } else { &p[..1] };
                        (s, t, Want::All)
                    })
                    .collect();
                for (k, l) in e
                    .forward_batch_with(&mut items)
                    .unwrap()
                    .into_iter()
                    .enumerate()
                {
                    let Logits::Full(v) = l else {
                        panic!("full logits")
                    };
                    out[g * per + k].extend(v);
                }
            }
        }
        out
    };
    for groups in [1, 2] {
        let mut one = Engine::load(&path, &LoadOptions::default()).unwrap();
        let want = batch(&mut one, groups);
        drop(one);
        let opts = LoadOptions {
            micro_batches: groups,
            ..on_devices(2, None, &LoadOptions::default())
        };
        let mut two = Engine::load(&path, &opts).unwrap();
        let got = batch(&mut two, 1);
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_same(&format!("{groups} micro-batches, sequence {i}"), g, w);
        }
    }
    // 600 tokens: two rounds of a 512-row pass.
    let long: Vec<u32> = (0..600u32).map(|j| (j * 7 + 3) % 512).collect();
    let want = run(&path, &long, &LoadOptions::default());
    let got = run(
        &path,
        &long,
        &on_devices(2, Some(&[1.0, 1.0]), &LoadOptions::default()),
    );
    assert_same("a prompt of two rounds", &got, &want);
}

/// `lathe plan --devices` prints each device's layers and placement, and a load with the
/// same memory per device and `--expert-stream` leaves as many experts on the CPU as it
/// reports (both set the prompt streaming slots aside unless `never`).
#[test]
fn plan_devices_agrees_with_the_loader() {
    let path = fixtures().join("qwen35moe-tiny/model-q8_0.gguf");
    let cold_in_plan = |mem: u64, stream: &str| -> usize {
        let m = format!("{mem}B");
        let out = lathe(&[
            "plan",
            "-m",
            path.to_str().unwrap(),
            "--devices",
            "0,0",
            "--gpu-mem",
            &m,
            "--expert-stream",
            stream,
            // The loader's run shape: `LoadOptions::default()` and Qwen3.5's pass of 512 rows.
            "--batch",
            "512",
            "--seqs",
            "4",
        ]);
        let s = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(s.contains("device 0: layers 0..2, embedding"), "{s}");
        assert!(s.contains("device 1: layers 2..4, output head"), "{s}");
        let line = s
            .lines()
            .find_map(|l| l.strip_prefix("experts on the CPU over all devices: "))
            .unwrap_or_else(|| panic!("no total in\n{s}"));
        line.split_whitespace().next().unwrap().parse().unwrap()
    };
    // A memory per device under which some experts but not all stay on the CPU.
    let (mut lo, mut hi) = (1u64 << 20, 1u64 << 30);
    let mem = loop {
        let mid = lo + (hi - lo) / 2;
        match cold_in_plan(mid, "auto") {
            0 => hi = mid,
            32 => lo = mid,
            _ => break mid,
        }
        assert!(hi - lo > 1, "no memory gives a partial placement");
    };
    for (flag, stream) in [
        ("auto", lathe::engine::ExpertStream::Auto),
        ("never", lathe::engine::ExpertStream::Never),
    ] {
        let cold = cold_in_plan(mem, flag);
        let opts = LoadOptions {
            gpu_mem: vec![mem, mem],
            expert_stream: stream,
            ..on_devices(2, None, &LoadOptions::default())
        };
        let e = Engine::load(&path, &opts).unwrap();
        let r = e.placement_report().expect("a MoE model");
        assert_eq!(r.total_experts, 32);
        assert_eq!(
            r.total_experts - r.hot_experts,
            cold,
            "--expert-stream {flag}: {r:?}"
        );
    }
}

#[test]
fn balanced_split_evens_bytes_over_memory() {
    use lathe::models::chain::{balanced_split, LayerBytes};
    use lathe::moe::{AdapterMemory, MemSource};
    let mem = |gib: u64, source| AdapterMemory {
        bytes: gib << 30,
        source,
    };
    let flag = |v: &[u64]| {
        v.iter()
            .map(|&g| mem(g, MemSource::Flag))
            .collect::<Vec<_>>()
    };
    let bytes = |layers: Vec<u64>, embedding, head| LayerBytes {
        layers,
        embedding,
        head,
        tied: false,
    };
    // Equal layers, nothing else: even halves; memory 2:1 gives 2:1.
    let b = bytes(vec![10; 6], 0, 0);
    assert_eq!(balanced_split(&b, &flag(&[24, 24])), vec![0..3, 3..6]);
    assert_eq!(balanced_split(&b, &flag(&[48, 24])), vec![0..4, 4..6]);
    // An unknown memory makes the shares equal.
    let unknown = vec![mem(48, MemSource::Flag), mem(8, MemSource::Assumed)];
    assert_eq!(balanced_split(&b, &unknown), vec![0..3, 3..6]);
    // A large head (DeepSeek-V4's 8-layer files: embedding and head ~ 2 layers each) moves
    // layers to the first device.
    let b = bytes(vec![10; 8], 5, 20);
    assert_eq!(balanced_split(&b, &flag(&[141, 141])), vec![0..5, 5..8]);
    // Every device keeps at least one layer.
    let b = bytes(vec![1, 1, 100], 0, 0);
    assert_eq!(
        balanced_split(&b, &flag(&[1, 1, 1])),
        vec![0..1, 1..2, 2..3]
    );
}
