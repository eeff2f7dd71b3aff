//! Pipeline cache and the small WGSL preprocessor that makes kernel variants.
//!
//! Variants come from one entry `.wgsl` file per family: the wrapper's typed key turns into
//! `const NAME = value;` lines prepended to the source and `#if NAME` / `#ifdef NAME` /
//! `#ifndef NAME` / `#else` / `#endif` line blocks. The key's text is the label of the
//! shader module and pipeline, so validation errors and captures name the variant.
//! Code that several families share is a piece of [`PIECES`], which a file takes in with
//! `#include "name"` (expanded before the `#if` blocks, each piece once per module).

use crate::{Error, Result};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// Everything that makes one pipeline. Built by a kernel wrapper from its typed key.
#[derive(Clone, Debug)]
pub struct PipelineSpec {
    /// The variant's name in errors, captures and profiles, e.g. `matvec_Q4_K_wg256_r2`
    /// (the cache keys on source, entry and defines, not on it).
    pub label: String,
    /// The family's WGSL source (`include_str!`).
    pub source: &'static str,
    /// `(NAME, value)`: `value` is WGSL text (`64`, `1.0`, `true`).
    pub defines: Vec<(String, String)>,
    pub entry: &'static str,
    /// Compile without naga's runtime bounds checks ([`PipelineSpec::unchecked`]).
    pub unchecked: bool,
}

impl PipelineSpec {
    pub fn new(label: impl Into<String>, source: &'static str, entry: &'static str) -> Self {
        PipelineSpec {
            label: label.into(),
            source,
            defines: Vec::new(),
            entry,
            unchecked: false,
        }
    }
    /// Compile without runtime bounds checks: for kernels whose every index into workgroup
    /// arrays and storage buffers is in range by construction (constant tile offsets plus
    /// subgroup and lane ids below the workgroup's size). wgpu-hal's Vulkan backend otherwise
    /// compiles every workgroup-array index with naga's `Restrict` policy (a clamp per
    /// access), and storage indices too where the device lacks robustBufferAccess2. The
    /// caller's comment says why its indices are in range.
    pub fn unchecked(mut self) -> Self {
        self.unchecked = true;
        self
    }
    pub fn define(mut self, name: &str, value: impl ToString) -> Self {
        self.defines.push((name.to_string(), value.to_string()));
        self
    }
    /// The final WGSL text.
    pub fn wgsl(&self) -> Result<String> {
        preprocess(self.source, &self.defines)
            .map_err(|e| Error::Gpu(format!("{}: {e}", self.label)))
    }
}

/// A wrapper's typed pipeline key: named fields that select one variant (no strings but
/// [`StaticName`]s, so a lookup hashes a few words), and the two things derived from them, the
/// variant's label and its defines, so that the name in errors and captures always says what
/// was compiled. [`Gpu::pipeline_for`](super::Gpu::pipeline_for) looks a key up and makes
/// its [`PipelineKey::spec`] on first use.
pub trait PipelineKey: std::hash::Hash + Eq + Send + Sync + 'static {
    /// The family's entry WGSL file (`include_str!`).
    fn source(&self) -> &'static str;
    fn entry(&self) -> &'static str;
    /// The variant's name, e.g. `topk_k8_pairs_final`.
    fn label(&self) -> String;
    /// The variant's defines on `spec` ([`PipelineSpec::define`], in the order the shader's
    /// consts are declared).
    fn defines(&self, spec: PipelineSpec) -> PipelineSpec;
    /// Compile without runtime bounds checks ([`PipelineSpec::unchecked`]).
    fn unchecked(&self) -> bool {
        false
    }
    fn spec(&self) -> PipelineSpec {
        let spec = PipelineSpec::new(self.label(), self.source(), self.entry());
        let spec = self.defines(spec);
        if self.unchecked() {
            spec.unchecked()
        } else {
            spec
        }
    }
}

/// `(name, text)` of `shaders/pieces/<name>.wgsl`.
macro_rules! piece {
    ($name:literal) => {
        (
            $name,
            include_str!(concat!("../../shaders/pieces/", $name, ".wgsl")),
        )
    };
}

/// The shared WGSL pieces (`shaders/pieces/`) by the name `#include` gives, in the order
/// matvec.wgsl includes them: the products' bindings, activation loads, fused prologues,
/// raw weight bytes and block decoders (one piece per stored type), the prefill chunk gathers
/// and matvec's row sums, stores and reductions; then the row norms' items and weights.
pub const PIECES: &[(&str, &str)] = &[
    piece!("bindings"),
    piece!("x_int8"),
    piece!("x_f32"),
    piece!("prologue"),
    piece!("weight_bytes"),
    piece!("decoders"),
    piece!("decode_f32"),
    piece!("decode_f16"),
    piece!("decode_bf16"),
    piece!("decode_q4_0"),
    piece!("decode_q4_1"),
    piece!("decode_q5_0"),
    piece!("decode_q5_1"),
    piece!("decode_q8_0"),
    piece!("decode_q2_k"),
    piece!("decode_q3_k"),
    piece!("decode_q4_k"),
    piece!("decode_q5_k"),
    piece!("decode_q6_k"),
    piece!("decode_iq4_nl"),
    piece!("decode_iq4_xs"),
    piece!("decode_mxfp4"),
    piece!("decode_f8_e4m3_b128"),
    piece!("decode_mv32"),
    piece!("prefill_chunks"),
    piece!("mv_rows"),
    piece!("mv_store"),
    piece!("mv_reduce"),
    piece!("mv_idx"),
    piece!("norm_items"),
];

/// `src` with every `#include "name"` line replaced by that piece of [`PIECES`] (itself
/// expanded), each piece once: a second include of a piece adds nothing, as a C header's
/// include guard would, so pieces can include what they need.
pub fn expand_includes(src: &str) -> std::result::Result<String, String> {
    fn expand<'a>(
        src: &'a str,
        from: &str,
        seen: &mut Vec<&'a str>,
        out: &mut String,
    ) -> std::result::Result<(), String> {
        for (i, line) in src.lines().enumerate() {
            let Some(rest) = line.trim_start().strip_prefix("#include") else {
                out.push_str(line);
                out.push('\n');
                continue;
            };
            let name = rest
                .trim()
                .strip_prefix('"')
                .and_then(|r| r.strip_suffix('"'))
                .ok_or_else(|| {
                    format!("{from}line {}: #include wants a quoted piece name", i + 1)
                })?;
            let (name, text) = PIECES
                .iter()
                .find(|(n, _)| *n == name)
                .ok_or_else(|| format!("{from}line {}: no shader piece \"{name}\"", i + 1))?;
            if !seen.contains(name) {
                seen.push(name);
                expand(text, &format!("piece \"{name}\" "), seen, out)?;
            }
        }
        Ok(())
    }
    let mut out = String::with_capacity(src.len());
    expand(src, "", &mut Vec::new(), &mut out)?;
    Ok(out)
}

fn truthy(defs: &[(String, String)], name: &str) -> bool {
    defs.iter()
        .find(|(n, _)| n == name)
        .is_some_and(|(_, v)| v != "0" && v != "false")
}

/// Expand `#include`s ([`expand_includes`]) and `#if/#ifdef/#ifndef/#else/#endif`, and
/// prepend the defines as WGSL consts. `enable` directives go first wherever a file declares
/// them after included pieces (WGSL wants them before any declaration).
pub fn preprocess(src: &str, defs: &[(String, String)]) -> std::result::Result<String, String> {
    let src = &expand_includes(src)?;
    let mut out = String::with_capacity(src.len() + 256);
    for line in src.lines() {
        if line.starts_with("enable ") {
            out.push_str(line);
            out.push('\n');
        }
    }
    for (n, v) in defs {
        // Booleans are flags for `#if`, not consts (they would be unused and shadow nothing).
        if v != "true" && v != "false" {
            out.push_str(&format!("const {n} = {v};\n"));
        }
    }
    // Stack of (this branch active, any branch taken so far, parent active).
    let mut stack: Vec<(bool, bool)> = Vec::new();
    let active = |s: &Vec<(bool, bool)>| s.iter().all(|(a, _)| *a);
    for (i, line) in src.lines().enumerate() {
        let t = line.trim_start();
        if let Some(rest) = t.strip_prefix('#') {
            let mut parts = rest.split_whitespace();
            let dir = parts.next().unwrap_or("");
            let arg = parts.next().unwrap_or("");
            match dir {
                "if" | "ifdef" => {
                    let c = if dir == "if" {
                        truthy(defs, arg)
                    } else {
                        defs.iter().any(|(n, _)| n == arg)
                    };
                    stack.push((c, c));
                }
                "ifndef" => {
                    let c = !defs.iter().any(|(n, _)| n == arg);
                    stack.push((c, c));
                }
                "else" => {
                    let top = stack
                        .last_mut()
                        .ok_or_else(|| format!("line {}: #else without #if", i + 1))?;
                    *top = (!top.1, true);
                }
                "endif" => {
                    stack
                        .pop()
                        .ok_or_else(|| format!("line {}: #endif without #if", i + 1))?;
                }
                _ => return Err(format!("line {}: unknown directive #{dir}", i + 1)),
            }
            out.push('\n');
            continue;
        }
        if active(&stack) && !line.starts_with("enable ") {
            out.push_str(line);
        }
        out.push('\n');
    }
    if !stack.is_empty() {
        return Err("unterminated #if".into());
    }
    Ok(out)
}

/// Compiled pipelines by what makes them: the family's source, the entry point and the
/// defines ([`PipelineSpec::same_variant`]); the label only names a variant in errors and
/// captures, so two variants can never share a pipeline through a label.
#[derive(Default)]
pub(crate) struct PipelineCache {
    /// By [`PipelineSpec::key`]; a bucket holds the variants whose keys collide.
    pub(super) map: Mutex<HashMap<u64, Vec<Compiled>>>,
    /// By the wrappers' typed keys ([`Gpu::pipeline_for`](super::Gpu::pipeline_for)): one
    /// `HashMap<K, pipeline>` per key type.
    pub(super) typed: Mutex<HashMap<std::any::TypeId, Box<dyn std::any::Any + Send + Sync>>>,
}

/// A `&'static str` compared and hashed by address (an entry point or a define list of a
/// wrapper's own constants): a typed key's field that costs no string hashing.
#[derive(Clone, Copy, Debug)]
pub struct StaticName(pub &'static str);

impl PartialEq for StaticName {
    fn eq(&self, o: &StaticName) -> bool {
        std::ptr::eq(self.0, o.0)
    }
}
impl Eq for StaticName {}
impl std::hash::Hash for StaticName {
    fn hash<H: std::hash::Hasher>(&self, h: &mut H) {
        (self.0.as_ptr() as usize, self.0.len()).hash(h);
    }
}

/// A wrapper's static define list (`&'static [(NAME, value)]`), by address as [`StaticName`].
#[derive(Clone, Copy, Debug)]
pub struct StaticDefines(pub &'static [(&'static str, &'static str)]);

impl PartialEq for StaticDefines {
    fn eq(&self, o: &StaticDefines) -> bool {
        std::ptr::eq(self.0, o.0)
    }
}
impl Eq for StaticDefines {}
impl std::hash::Hash for StaticDefines {
    fn hash<H: std::hash::Hasher>(&self, h: &mut H) {
        (self.0.as_ptr() as usize, self.0.len()).hash(h);
    }
}

/// A compiled pipeline and the spec it came from.
pub(super) type Compiled = (Arc<wgpu::ComputePipeline>, PipelineSpec);

impl PipelineSpec {
    /// True when `self` and `o` make the same pipeline: the same source (one `include_str!`
    /// per family, compared by address), entry point and defines.
    pub fn same_variant(&self, o: &PipelineSpec) -> bool {
        std::ptr::eq(self.source, o.source)
            && self.entry == o.entry
            && self.defines == o.defines
            && self.unchecked == o.unchecked
    }

    /// Hash of what [`same_variant`](Self::same_variant) compares.
    pub(super) fn key(&self) -> u64 {
        use std::hash::{Hash, Hasher};
        let mut h = std::collections::hash_map::DefaultHasher::new();
        (self.source.as_ptr() as usize, self.source.len()).hash(&mut h);
        self.entry.hash(&mut h);
        self.defines.hash(&mut h);
        self.unchecked.hash(&mut h);
        h.finish()
    }
}

#[cfg(test)]
mod tests {
    use super::{expand_includes, preprocess, PipelineSpec, PIECES};

    #[test]
    fn includes_expand_once_and_name_a_missing_piece() {
        // a piece twice, and again inside another: its text once, where it was first included
        let out =
            expand_includes("a\n#include \"decode_q4_k\"\n#include \"decoders\"\nb\n").unwrap();
        assert_eq!(out.matches("#if TY_Q4_K").count(), 1);
        assert!(out.find("#if TY_Q4_K") < out.find("#if TY_Q6_K"));
        assert!(out.starts_with("a\n") && out.ends_with("\nb\n"));
        assert!(!out.contains("#include"));
        let e = PipelineSpec::new("v", "x\n  #include \"nope\"\n", "main")
            .wgsl()
            .unwrap_err()
            .to_string();
        assert!(e.contains("v: line 2: no shader piece \"nope\""), "{e}");
        let e = expand_includes("#include decoders\n").unwrap_err();
        assert!(
            e.contains("line 1: #include wants a quoted piece name"),
            "{e}"
        );
    }

    /// Every piece is included by an entry file or another piece: none is dead.
    #[test]
    fn every_piece_is_included() {
        for (name, _) in PIECES {
            let inc = format!("#include \"{name}\"");
            let used = crate::gpu::SHADERS
                .iter()
                .map(|(_, s)| s)
                .chain(PIECES.iter().map(|(_, s)| s))
                .any(|s| s.lines().any(|l| l.trim() == inc));
            assert!(used, "piece {name} is included nowhere");
        }
    }

    #[test]
    fn preprocess_branches() {
        let src = "a\n#if X\nb\n#else\nc\n#endif\n#ifdef Y\nd\n#endif\ne";
        let defs = vec![
            ("X".to_string(), "1".to_string()),
            ("N".to_string(), "4".to_string()),
        ];
        let out = preprocess(src, &defs).unwrap();
        assert!(out.contains("const N = 4;"));
        assert!(out.contains("b") && !out.contains("\nc\n") && !out.contains("d"));
        assert!(preprocess("#if X\n", &defs).is_err());
        assert!(preprocess("#endif\n", &defs).is_err());
    }
}
