//! Every WGSL kernel variant lathe compiles must also translate to SPIR-V, MSL and HLSL, so
//! the Metal and DX12 backends cannot silently break on a machine that only runs Vulkan.
//! The variants are the ones a real run compiles: fixture models run prefill and decode on
//! lavapipe, then every compiled pipeline's final WGSL goes through naga's back ends.

use lathe::engine::{Engine, LoadOptions};
use std::path::Path;

fn translate(label: &str, wgsl: &str) -> Result<(), String> {
    let module = naga::front::wgsl::parse_str(wgsl)
        .map_err(|e| format!("{label}: parse: {}", e.emit_to_string(wgsl)))?;
    let info = naga::valid::Validator::new(
        naga::valid::ValidationFlags::all(),
        naga::valid::Capabilities::all(),
    )
    .validate(&module)
    .map_err(|e| format!("{label}: validate: {}", e.emit_to_string(wgsl)))?;
    naga::back::spv::write_vec(&module, &info, &naga::back::spv::Options::default(), None)
        .map_err(|e| format!("{label}: SPIR-V: {e}"))?;
    let mut msl = String::new();
    let pipeline_opts = naga::back::msl::PipelineOptions::default();
    naga::back::msl::Writer::new(&mut msl)
        .write(
            &module,
            &info,
            &naga::back::msl::Options::default(),
            &pipeline_opts,
        )
        .map_err(|e| format!("{label}: MSL: {e}"))?;
    let mut hlsl = String::new();
    let hopts = naga::back::hlsl::Options::default();
    naga::back::hlsl::Writer::new(&mut hlsl, &hopts, &Default::default())
        .write(&module, &info, None)
        .map_err(|e| format!("{label}: HLSL: {e}"))?;
    Ok(())
}

#[test]
fn compiled_variants_translate_to_every_backend() {
    let fx = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/models");
    let mut failures = Vec::new();
    let mut n = 0;
    for model in [
        "qwen35-tiny/model-q4_0.gguf",
        "qwen35moe-tiny/model-q8_0.gguf",
        "qwen35-dims/model-q4_k_m.gguf",
        "dsv4-tiny/model-q8_0.gguf",
    ] {
        let mut e = Engine::load(&fx.join(model), &LoadOptions::default()).unwrap();
        let mut seq = e.new_seq().unwrap();
        let toks: Vec<u32> = (0..70).map(|i| (i * 7 % 500) as u32).collect();
        e.forward(&mut seq, &toks, false).unwrap();
        e.forward(&mut seq, &[3], false).unwrap();
        for spec in e.gpu.compiled_specs() {
            n += 1;
            if let Err(m) = translate(&spec.label, &spec.wgsl().unwrap()) {
                failures.push(m);
            }
        }
    }
    eprintln!("{n} compiled variants checked");
    assert!(
        n > 10,
        "expected the forward passes to compile many variants"
    );
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// The cooperative-matrix kernels never compile on lavapipe (no cooperative matrices), so their
/// every variant goes through naga here without a device: validation and SPIR-V (the backend
/// that runs them: Vulkan's VK_KHR_cooperative_matrix). naga 30 writes no cooperative matrices
/// for HLSL (its writer has `unimplemented!()` there) and wgpu offers the feature on Vulkan and
/// Metal only, so HLSL is not asked; MSL is reported but not required (naga 30 supports only
/// Metal's 8x8 simdgroup matrices, while the kernels use 16x16).
#[test]
fn coop_variants_validate_and_translate_to_spirv() {
    use lathe::gpu::coopmat;
    use lathe::DType;
    let mut n = 0;
    let mut failures = Vec::new();
    for dt in lathe::selftest::TYPES {
        if dt == DType::F32 {
            continue;
        }
        let cols = match dt {
            DType::F16 | DType::BF16 => 161,
            _ if dt.block_size() == 256 => 768,
            DType::F8_E4M3_B128 => 384,
            _ => 160,
        };
        for spec in coopmat::variant_specs(dt, cols).unwrap() {
            n += 1;
            let wgsl = spec.wgsl().unwrap();
            let module = match naga::front::wgsl::parse_str(&wgsl) {
                Ok(m) => m,
                Err(e) => {
                    failures.push(format!(
                        "{}: parse: {}",
                        spec.label,
                        e.emit_to_string(&wgsl)
                    ));
                    continue;
                }
            };
            let info = match naga::valid::Validator::new(
                naga::valid::ValidationFlags::all(),
                naga::valid::Capabilities::all(),
            )
            .validate(&module)
            {
                Ok(i) => i,
                Err(e) => {
                    failures.push(format!(
                        "{}: validate: {} {:?}",
                        spec.label,
                        e.emit_to_string(&wgsl),
                        e.as_inner()
                    ));
                    continue;
                }
            };
            if let Err(e) = naga::back::spv::write_vec(
                &module,
                &info,
                &naga::back::spv::Options::default(),
                None,
            ) {
                failures.push(format!("{}: SPIR-V: {e}", spec.label));
            }
        }
    }
    eprintln!("{n} cooperative-matrix variants checked");
    assert!(n >= 16 * 8, "expected every type's variants, got {n}");
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
