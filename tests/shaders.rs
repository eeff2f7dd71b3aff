//! Every WGSL kernel variant lathe compiles must also translate to SPIR-V, MSL and HLSL, so
//! the Metal and DX12 backends cannot silently break on a machine that only runs Vulkan.
//! The variants are the ones a real run compiles: fixture models run prefill and decode on
//! lavapipe, then every compiled pipeline's final WGSL goes through naga's back ends.
//!
//! The same variants check the uniforms: each `var<uniform>` struct, as naga lays it out,
//! has the size the wrapper asserts for its Rust twin (`size_of::<Params>() == N` in
//! `src/gpu/<family>.rs`), so a field added on one side only fails here.

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

/// `(name, N)` of every `size_of::<name>() == N` assert in `src/gpu/<family>.rs`.
fn rust_sizes(family: &str) -> Vec<(String, u64)> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("src/gpu")
        .join(format!("{family}.rs"));
    let text = std::fs::read_to_string(path).unwrap_or_default();
    text.match_indices("size_of::<")
        .filter_map(|(i, m)| {
            let rest = &text[i + m.len()..];
            let (name, after) = rest.split_once('>')?;
            let n: String = after
                .strip_prefix("() == ")?
                .chars()
                .take_while(char::is_ascii_digit)
                .collect();
            Some((name.to_string(), n.parse().ok()?))
        })
        .collect()
}

/// `SHADER_FLAG` → `ShaderFlag`.
fn camel(flag: &str) -> String {
    flag.split('_')
        .map(|w| {
            let w = w.to_ascii_lowercase();
            let mut c = w.chars();
            c.next()
                .map(|f| f.to_ascii_uppercase().to_string() + c.as_str())
                .unwrap_or_default()
        })
        .collect()
}

/// Each uniform struct of `spec`'s module against its Rust twin: the struct of the same name,
/// or for a variant chosen by a flag (`#if STORE`) `StoreParams` / `Store<name>`, in the
/// wrapper files of the families whose source `spec` contains (matmul's holds matvec's).
fn check_uniforms(spec: &lathe::gpu::PipelineSpec, wgsl: &str) -> Result<usize, String> {
    let label = &spec.label;
    let module = naga::front::wgsl::parse_str(wgsl)
        .map_err(|e| format!("{label}: parse: {}", e.emit_to_string(wgsl)))?;
    let mut sizes = Vec::new();
    for (family, src) in lathe::gpu::SHADERS {
        if spec.source.contains(src) {
            sizes.extend(rust_sizes(family));
        }
    }
    // the products' shared pieces declare matvec.rs's uniforms
    let pieces = lathe::gpu::PIECES;
    if pieces
        .iter()
        .any(|(n, _)| spec.source.contains(&format!("#include \"{n}\"")))
    {
        sizes.extend(rust_sizes("matvec"));
    }
    let flags: Vec<String> = spec
        .defines
        .iter()
        .filter(|(_, v)| v == "true")
        .map(|(n, _)| camel(n))
        .collect();
    let mut checked = 0;
    for (_, g) in module.global_variables.iter() {
        if g.space != naga::AddressSpace::Uniform {
            continue;
        }
        let ty = &module.types[g.ty];
        let name = ty.name.clone().unwrap_or_default();
        let wgsl_size = ty.inner.size(module.to_ctx()) as u64;
        let mut candidates: Vec<String> = flags
            .iter()
            .flat_map(|f| [format!("{f}{name}"), format!("{f}Params")])
            .collect();
        candidates.push(name.clone());
        let twin = candidates
            .iter()
            .find_map(|c| sizes.iter().find(|(n, _)| n == c))
            .ok_or_else(|| format!("{label}: no Rust size assert for uniform struct {name}"))?;
        if twin.1 != wgsl_size {
            return Err(format!(
                "{label}: WGSL {name} is {wgsl_size} bytes, Rust {} is {}",
                twin.0, twin.1
            ));
        }
        checked += 1;
    }
    Ok(checked)
}

#[test]
fn compiled_variants_translate_to_every_backend() {
    let fx = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/models");
    let mut failures = Vec::new();
    let mut n = 0;
    let mut uniforms = 0;
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
            let wgsl = spec.wgsl().unwrap();
            if let Err(m) = translate(&spec.label, &wgsl) {
                failures.push(m);
            }
            match check_uniforms(&spec, &wgsl) {
                Ok(k) => uniforms += k,
                Err(m) => failures.push(m),
            }
        }
    }
    eprintln!("{n} compiled variants checked, {uniforms} uniform structs against Rust");
    assert!(
        n > 10,
        "expected the forward passes to compile many variants"
    );
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    assert!(
        uniforms >= n,
        "every variant binds at least one uniform struct"
    );
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
        let cols = lathe::selftest::odd_cols(dt);
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

/// A dev command, not a check: writes every variant that the fixture runs, the selftest and
/// the cooperative-matrix specs make to `CARGO_TARGET_TMPDIR/shader-dump/`, for comparing two
/// trees' shaders (`cargo test --test shaders -- --ignored dump_variants`, then `diff -r`):
/// `wgsl.txt` the preprocessed WGSL of each variant, `spirv.txt` a hash of naga's SPIR-V of the
/// variant's entry point alone after `naga::compact` (what reaches a driver, whatever unused
/// functions the source holds).
#[test]
#[ignore]
fn dump_variants() {
    use std::fmt::Write;
    let fx = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/models");
    let mut specs = Vec::new();
    let mut models: Vec<_> = std::fs::read_dir(&fx)
        .unwrap()
        .flat_map(|d| std::fs::read_dir(d.unwrap().path()).into_iter().flatten())
        .map(|f| f.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "gguf"))
        .filter(|p| !p.file_name().unwrap().to_str().unwrap().starts_with("mtp"))
        .collect();
    models.sort();
    for model in &models {
        let mut e = Engine::load(model, &LoadOptions::default()).unwrap();
        let mut seq = e.new_seq().unwrap();
        let toks: Vec<u32> = (0..70).map(|i| (i * 7 % 250) as u32).collect();
        e.forward(&mut seq, &toks, false).unwrap();
        e.forward(&mut seq, &[3], false).unwrap();
        specs.extend(e.gpu.compiled_specs());
    }
    let gpu = lathe::gpu::Gpu::new(&lathe::gpu::AdapterChoice::Auto).unwrap();
    let checks = lathe::selftest::run(&gpu, false, |_| {});
    assert!(checks.iter().all(|c| c.passed), "selftest failed");
    specs.extend(gpu.compiled_specs());
    for dt in lathe::selftest::TYPES {
        if dt != lathe::DType::F32 {
            let cols = lathe::selftest::odd_cols(dt);
            specs.extend(lathe::gpu::coopmat::variant_specs(dt, cols).unwrap());
        }
    }
    let head = |s: &lathe::gpu::PipelineSpec| {
        format!(
            "=== {} entry={} unchecked={} defines={:?}\n",
            s.label, s.entry, s.unchecked, s.defines
        )
    };
    let mut heads: Vec<(String, lathe::gpu::PipelineSpec)> =
        specs.into_iter().map(|s| (head(&s), s)).collect();
    heads.sort_by(|a, b| a.0.cmp(&b.0));
    heads.dedup_by(|a, b| a.0 == b.0);
    let (mut wgsl_out, mut spv_out) = (String::new(), String::new());
    for (h, spec) in &heads {
        let wgsl = spec.wgsl().unwrap();
        writeln!(spv_out, "{h}{}", spirv_hash(&entry_spirv(spec))).unwrap();
        wgsl_out.push_str(h);
        wgsl_out.push_str(&wgsl);
    }
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("shader-dump");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("wgsl.txt"), wgsl_out).unwrap();
    std::fs::write(dir.join("spirv.txt"), spv_out).unwrap();
    eprintln!(
        "{} variants of {} models written to {}",
        heads.len(),
        models.len(),
        dir.display()
    );
}

/// naga's SPIR-V of `spec`'s entry point alone after `naga::compact`.
fn entry_spirv(spec: &lathe::gpu::PipelineSpec) -> Vec<u32> {
    let text = spec.wgsl().unwrap();
    let mut module = naga::front::wgsl::parse_str(&text).unwrap();
    module.entry_points.retain(|e| e.name == spec.entry);
    naga::compact::compact(&mut module, naga::compact::KeepUnused::No);
    let info = naga::valid::Validator::new(
        naga::valid::ValidationFlags::all(),
        naga::valid::Capabilities::all(),
    )
    .validate(&module)
    .unwrap();
    naga::back::spv::write_vec(&module, &info, &naga::back::spv::Options::default(), None).unwrap()
}

/// A SPIR-V module as (its instructions' opcodes and lengths but the type declarations', the
/// type declarations' opcodes sorted, its OpName strings in order): what stays when type
/// declarations move and IDs are renumbered with them.
fn shape(spv: &[u32]) -> (Vec<u32>, Vec<u32>, Vec<Vec<u32>>) {
    let (mut ops, mut types, mut names) = (Vec::new(), Vec::new(), Vec::new());
    let mut i = 5;
    while i < spv.len() {
        let (n, op) = ((spv[i] >> 16) as usize, spv[i] & 0xffff);
        // OpTypeVoid (19) ..= OpTypeForwardPointer (39)
        if (19..=39).contains(&op) {
            types.push(spv[i]);
        } else {
            ops.push(spv[i]);
        }
        // OpName (5): target id, then the literal string
        if op == 5 {
            names.push(spv[i + 2..i + n].to_vec());
        }
        i += n.max(1);
    }
    types.sort_unstable();
    (ops, types, names)
}

fn spirv_hash(spv: &[u32]) -> String {
    use std::hash::{Hash, Hasher};
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    spv.hash(&mut hasher);
    format!("{} words, hash {:016x}", spv.len(), hasher.finish())
}

/// A dev command beside [`dump_variants`]: every variant of a previous dump
/// (`CARGO_TARGET_TMPDIR/shader-dump-base/`, a copy of that dump made on another tree, with
/// that tree's matvec.wgsl, matmul.wgsl and matmul_coop.wgsl in `old/`) whose entry point only
/// one family source defines (the `main` entry points are skipped), made again from its
/// label's defines on this tree's sources and compared by the SPIR-V hash of
/// [`dump_variants`], without a device. Where the hashes differ, the old source (matvec.wgsl
/// followed by the family's file) is compiled here too: its hash must be the dump's, and the
/// new module must be the old one but for where type declarations stand ([`shape`]): naga
/// declares a type where it is first used, and a family that leaves out unused pieces first
/// uses some types later (e.g. `vec3<u32>` in its own entry point, not matvec's).
#[test]
#[ignore]
fn compare_with_base_dump() {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("shader-dump-base");
    let spirv = std::fs::read_to_string(dir.join("spirv.txt")).unwrap();
    let old = |f: &str| std::fs::read_to_string(dir.join("old").join(f)).unwrap();
    let old_mv = old("matvec.wgsl");
    let old_mm: &'static str = Box::leak((old_mv.clone() + &old("matmul.wgsl")).into_boxed_str());
    let old_coop: &'static str = Box::leak((old_mv + &old("matmul_coop.wgsl")).into_boxed_str());
    let sources: Vec<(&str, String)> = lathe::gpu::SHADERS
        .iter()
        .map(|(_, s)| (*s, lathe::gpu::expand_includes(s).unwrap()))
        .collect();
    let (mut same, mut reordered, mut skipped, mut differ) = (0, 0, 0, Vec::new());
    let mut lines = spirv.lines();
    while let (Some(line), Some(hash)) = (lines.next(), lines.next()) {
        let rest = line.strip_prefix("=== ").unwrap();
        let (label, rest) = rest.split_once(" entry=").unwrap();
        let (entry, rest) = rest.split_once(" unchecked=").unwrap();
        let (unchecked, defs) = rest.split_once(" defines=").unwrap();
        let fdef = format!("fn {entry}(");
        let found: Vec<&&str> = sources
            .iter()
            .filter(|(_, e)| e.contains(&fdef))
            .map(|(s, _)| s)
            .collect();
        if found.len() != 1 {
            skipped += 1;
            continue;
        }
        let defines: Vec<(String, String)> = defs
            .trim_start_matches('[')
            .trim_end_matches(']')
            .split("), (")
            .filter(|d| !d.is_empty())
            .map(|d| {
                let d = d.trim_start_matches('(').trim_end_matches(')');
                let (n, v) = d.split_once(", ").unwrap();
                (
                    n.trim_matches('"').to_string(),
                    v.trim_matches('"').to_string(),
                )
            })
            .collect();
        let mut spec = lathe::gpu::PipelineSpec::new(label, found[0], "main");
        spec.entry = Box::leak(entry.to_string().into_boxed_str());
        spec.defines = defines;
        spec.unchecked = unchecked == "true";
        let new = entry_spirv(&spec);
        if spirv_hash(&new) == hash {
            same += 1;
            continue;
        }
        spec.source = if entry.starts_with("matmul_coop") || entry == "coop_x" {
            old_coop
        } else {
            old_mm
        };
        let was = entry_spirv(&spec);
        let old_same = spirv_hash(&was) == hash;
        let (ka, kb) = (shape(&was), shape(&new));
        if old_same && ka == kb {
            reordered += 1;
        } else {
            differ.push(format!(
                "{label} ({entry}): {hash} -> {} (old source reproduces the dump: {old_same})",
                spirv_hash(&new)
            ));
        }
    }
    eprintln!(
        "{same} variants with the same SPIR-V, {reordered} the same up to where types are \
         declared, {} differ, {skipped} skipped",
        differ.len()
    );
    assert!(differ.is_empty(), "{}", differ.join("\n"));
    assert!(same > 0);
}

/// A dev command beside [`compare_with_base_dump`]: the variants that two fixture runs compile
/// on this tree, by label, entry point and defines, all in the previous dump (the typed keys
/// make the labels and defines they made before; `quantize_x` has lost its `QUANT_X` flag).
#[test]
#[ignore]
fn live_specs_in_base_dump() {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("shader-dump-base");
    let spirv = std::fs::read_to_string(dir.join("spirv.txt")).unwrap();
    let fx = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/models");
    let (mut found, mut missing) = (0, Vec::new());
    for model in [
        "qwen35moe-dims/model-q4_k_m.gguf",
        "dsv4-tiny/model-q8_0.gguf",
    ] {
        let mut e = Engine::load(&fx.join(model), &LoadOptions::default()).unwrap();
        let mut seq = e.new_seq().unwrap();
        let toks: Vec<u32> = (0..70).map(|i| (i * 7 % 500) as u32).collect();
        e.forward(&mut seq, &toks, false).unwrap();
        e.forward(&mut seq, &[3], false).unwrap();
        for s in e.gpu.compiled_specs() {
            let mut defines = s.defines.clone();
            if s.entry == "quantize_x" {
                defines.insert(0, ("QUANT_X".into(), "true".into()));
            }
            let head = format!(
                "=== {} entry={} unchecked={} defines={:?}",
                s.label, s.entry, s.unchecked, defines
            );
            if spirv.lines().any(|l| l == head) {
                found += 1;
            } else {
                missing.push(head);
            }
        }
    }
    eprintln!("{found} live variants in the dump, {} not", missing.len());
    assert!(missing.is_empty(), "{}", missing.join("\n"));
}
