//! GPU runtime basics on whatever adapter the machine has (lavapipe in CI).

use lathe::gpu::operand::Operand;
use lathe::gpu::{elementwise, AdapterChoice, Gpu};

#[test]
fn add_odd_length_and_offsets() {
    let gpu = Gpu::new(&AdapterChoice::Auto).expect("a wgpu adapter (lavapipe in CI)");
    eprintln!("{}", gpu.report());
    let n = 1_000_003usize;
    let a: Vec<f32> = (0..n + 5).map(|i| i as f32 * 0.5).collect();
    let b: Vec<f32> = (0..n).map(|i| -(i as f32) * 0.25 + 1.0).collect();
    let ab = gpu.upload_f32(&a, "a").unwrap();
    let bb = gpu.upload_f32(&b, "b").unwrap();
    let yb = gpu.buffer((n as u64 + 7) * 4, "y").unwrap();
    let mut pass = gpu.pass();
    let (y, a_v, b_v) = (
        Operand::new(&yb, 7),
        Operand::new(&ab, 5),
        Operand::new(&bb, 0),
    );
    elementwise::add_rows(&mut pass, 1, n as u32, y, a_v, b_v).unwrap();
    pass.submit().unwrap();
    let y = gpu.read_f32(&yb, 0, n + 7).unwrap();
    assert!(
        y[..7].iter().all(|&v| v == 0.0),
        "guard elements before the output were written"
    );
    for i in 0..n {
        assert_eq!(y[7 + i], a[5 + i] + b[i], "at {i}");
    }
}

#[test]
fn shader_errors_are_errors_not_panics() {
    let gpu = Gpu::new(&AdapterChoice::Auto).unwrap();
    let spec = lathe::gpu::PipelineSpec::new("broken", "fn main( {", "main");
    let err = gpu.pipeline(&spec).unwrap_err().to_string();
    assert!(err.contains("broken"), "{err}");
}

/// Pipelines are cached by source, entry point and defines; the label only names them.
#[test]
fn pipelines_are_keyed_by_variant_not_label() {
    const SRC: &str = "@group(0) @binding(0) var<storage, read_write> y: array<f32>;
@compute @workgroup_size(1) fn main() { y[0] = f32(X); }";
    let gpu = Gpu::new(&AdapterChoice::Auto).unwrap();
    let spec =
        |label: &str, x: u32| lathe::gpu::PipelineSpec::new(label, SRC, "main").define("X", x);
    let a = gpu.pipeline(&spec("same_label", 1)).unwrap();
    let b = gpu.pipeline(&spec("same_label", 2)).unwrap();
    let c = gpu.pipeline(&spec("another_label", 1)).unwrap();
    assert!(
        !std::sync::Arc::ptr_eq(&a, &b),
        "two variants shared a pipeline by label"
    );
    assert!(std::sync::Arc::ptr_eq(&a, &c), "one variant compiled twice");
}

/// Threads listing adapters, reading their memory and opening devices at once (several
/// devices of one process, or tests side by side) each get what they asked for. NVIDIA's
/// driver (580, H200) crashed the process on this while every adapter list made and dropped
/// its own Vulkan instance.
#[test]
fn threads_list_adapters_and_open_devices_at_once() {
    let threads: Vec<_> = (0..4)
        .map(|_| {
            std::thread::spawn(|| {
                for _ in 0..4 {
                    assert!(!lathe::gpu::list_adapters().is_empty(), "no adapter");
                    let _ = lathe::gpu::adapter_memory(0);
                }
                Gpu::new(&AdapterChoice::Auto).map(|g| g.report())
            })
        })
        .collect();
    for t in threads {
        let report = t.join().expect("thread").expect("device");
        assert!(report.contains("adapter"), "{report}");
    }
}
