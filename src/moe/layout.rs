//! What a model's routed experts look like (per MoE layer: count, stored type and shape of
//! the gate, up and down matrices) and where their bytes are in the mapped file.
//!
//! Expert tensors are read where the file keeps them, under the names its family gives
//! ([`ExpertNames`]): GGUF stacks `[n_expert, rows, cols]` (llama.cpp's layout), stacks whose
//! gate and up matrices are one tensor ([`FusedStacks`]), or checkpoints with one tensor per
//! expert. Block-scaled release experts are described as
//! the type the loaders repack them into, which is what the GPU stores:
//! - packed e2m1 pairs (I8/U8 `[rows, cols/2]` + E8M0 `.scale` `[rows, cols/32]`): ggml MXFP4
//!   (the same byte count);
//! - FP8 e4m3 (`[rows, cols]` + a 128×128 block scale): `F8_E4M3_B128` (132/128 of the
//!   FP8 bytes).
//!
//! [`ExpertMats`] reads those experts one at a time, repacking on demand (a few rows for the
//! CPU's cold path, one expert for an arena upload): no second copy of the experts is held
//! in memory, and the repack is the loaders' own (`safetensors::scaled`), so the bytes are
//! the ones an all-GPU load uploads.

pub use crate::cpu::moe::Kind;
use crate::model_file::ModelFile;
use crate::safetensors::scaled::{
    find_block_scale, repack_fp8_block_to_b128, repack_mxfp4_to_ggml, FP8_BLOCK, MXFP4_BLOCK,
};
pub use crate::tensor::MatShape;
use crate::tensor::TensorRef;
use crate::{DType, Error, Result};
use std::borrow::Cow;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// One MoE layer's routed experts.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MoeLayerInfo {
    /// Model layer (`blk.N`).
    pub layer: usize,
    pub n_expert: usize,
    /// `[n_ff_exp, n_embd]` (gate, up) and `[n_embd, n_ff_exp]` (down) per expert.
    pub gate: MatShape,
    pub up: MatShape,
    pub down: MatShape,
}

impl MoeLayerInfo {
    pub fn shape(&self, kind: Kind) -> MatShape {
        match kind {
            Kind::Gate => self.gate,
            Kind::Up => self.up,
            Kind::Down => self.down,
        }
    }
    pub fn shapes(&self) -> [MatShape; 3] {
        [self.gate, self.up, self.down]
    }
    /// Bytes of one expert (gate + up + down): the size of one arena slot of this layer.
    pub fn expert_bytes(&self) -> u64 {
        self.gate.bytes() + self.up.bytes() + self.down.bytes()
    }
    pub fn n_embd(&self) -> u64 {
        self.gate.cols
    }
    pub fn n_ff(&self) -> u64 {
        self.gate.rows
    }
}

/// The routed experts of a model file, and the bytes of everything else.
#[derive(Clone, Debug)]
pub struct MoeInfo {
    pub path: PathBuf,
    pub arch: String,
    /// Blocks of the model (MoE or not).
    pub n_layer: usize,
    /// Experts each token picks per MoE layer (top-k).
    pub n_used: usize,
    /// MoE layers in ascending layer order.
    pub layers: Vec<MoeLayerInfo>,
    /// The names its experts were found under (its family's).
    pub names: &'static ExpertNames,
    /// Bytes of every tensor that is not a routed expert (what must sit on the GPU beside
    /// the expert arena).
    pub other_bytes: u64,
    /// What a decode step reads of those: all of them, except one row of the token
    /// embedding when the model has a separate output head.
    pub other_decode_bytes: u64,
}

/// Where a family's files keep their routed experts, as name templates (`{l}` the layer,
/// `{e}` the expert; per kind gate, up, down). The families give theirs
/// (`models::registry::Family::experts`): this layer knows the layouts, not the names.
#[derive(Debug)]
pub struct ExpertNames {
    /// Stacks `[n_expert, rows, cols]` (GGUF's, and checkpoints that keep them so, as
    /// Step's `moe.gate_proj.weight`), `{l}` only, in the order a file is looked up.
    pub stacks: &'static [[&'static str; 3]],
    /// Stacks with gate and up fused, in the order a file is looked up.
    pub fused: &'static [FusedStacks],
    /// Checkpoints with one tensor per expert, in the order a file is looked up.
    pub each: &'static [EachExpert],
    /// Tensors the family reads on the host per pass, never uploaded (Gemma-4's per-layer
    /// token table): not in the GPU budget.
    pub host: &'static [&'static str],
}

/// Stacks whose gate and up matrices are one tensor `[n_expert, 2·n_ff, n_embd]`, gate rows
/// first (llama.cpp's `ffn_gate_up_exps`, transformers' `experts.gate_up_proj`), beside a
/// down stack `[n_expert, n_embd, n_ff]`; `{l}` only. Each half is read in place: an expert's
/// gate and up are contiguous row ranges of its fused matrix.
#[derive(Debug)]
pub struct FusedStacks {
    pub gate_up: &'static str,
    pub down: &'static str,
}

/// One naming of per-expert matrices.
#[derive(Debug)]
pub struct EachExpert {
    /// Gate, up, down, with `{l}` and `{e}`.
    pub names: [&'static str; 3],
    /// Block-scaled I8/U8 weights under these names are packed e2m1 pairs (MXFP4).
    pub packed: bool,
}

/// `(l, e)` when `name` is `template` with decimal numbers in its `{l}` / `{e}`.
fn match_template(template: &str, name: &str) -> Option<(usize, Option<usize>)> {
    let (mut l, mut e) = (None, None);
    let (mut tpl, mut rest) = (template, name);
    while let Some(i) = tpl.find('{') {
        rest = rest.strip_prefix(&tpl[..i])?;
        let (key, after) = tpl[i + 1..].split_once('}')?;
        let n = rest
            .find(|c: char| !c.is_ascii_digit())
            .unwrap_or(rest.len());
        let v = rest[..n].parse::<usize>().ok()?;
        match key {
            "l" => l = Some(v),
            "e" => e = Some(v),
            _ => return None,
        }
        (tpl, rest) = (after, &rest[n..]);
    }
    (rest == tpl).then_some((l?, e))
}

fn fill(template: &str, l: usize, e: usize) -> String {
    template
        .replace("{l}", &l.to_string())
        .replace("{e}", &e.to_string())
}

impl ExpertNames {
    /// The names a stack of `kind` in layer `l` may have.
    fn stacks(&self, l: usize, kind: Kind) -> impl Iterator<Item = String> + '_ {
        self.stacks
            .iter()
            .map(move |s| fill(s[kind as usize], l, 0))
    }

    /// Routed-expert tensor names: (layer, expert or `None` for a stack, kind, packed).
    fn parse(&self, name: &str) -> Option<(usize, Option<usize>, Kind, bool)> {
        for s in self.stacks {
            for (t, kind) in s.iter().zip(Kind::ALL) {
                if let Some((l, None)) = match_template(t, name) {
                    return Some((l, None, kind, false));
                }
            }
        }
        for f in self.fused {
            if let Some((l, None)) = match_template(f.down, name) {
                return Some((l, None, Kind::Down, false));
            }
        }
        for each in self.each {
            for (t, kind) in each.names.iter().zip(Kind::ALL) {
                if let Some((l, Some(e))) = match_template(t, name) {
                    return Some((l, Some(e), kind, each.packed));
                }
            }
        }
        None
    }

    /// True for a routed expert tensor name (GGUF stack, per-expert matrix or the block
    /// scale of a per-expert matrix): what a loader leaves to the expert arena.
    pub fn is_expert(&self, name: &str) -> bool {
        self.parse(name).is_some() || self.is_scale(name) || self.fused_layer(name).is_some()
    }

    /// The layer of a fused gate+up stack named `name`.
    fn fused_layer(&self, name: &str) -> Option<usize> {
        self.fused
            .iter()
            .find_map(|f| match match_template(f.gate_up, name) {
                Some((l, None)) => Some(l),
                _ => None,
            })
    }

    /// The scale tensor of a per-expert matrix (`X.scale` or `X.weight_scale_inv` beside
    /// `X.weight`).
    fn is_scale(&self, name: &str) -> bool {
        scaled_weight_name(name)
            .and_then(|w| self.parse(&w))
            .is_some_and(|p| p.1.is_some())
    }
}

/// The weight a block-scale tensor name belongs to (`X.scale` or `X.weight_scale_inv` →
/// `X.weight`, the two namings `safetensors::find_block_scale` accepts).
fn scaled_weight_name(name: &str) -> Option<String> {
    let base = name
        .strip_suffix(".scale")
        .or_else(|| name.strip_suffix(".weight_scale_inv"))?;
    Some(format!("{base}.weight"))
}

/// Bytes of `t` as the loaders put it on the GPU: an FP8 e4m3 weight becomes `F8_E4M3_B128`
/// (an f32 scale per 128 columns: 132/128 of its bytes) and its block scale is folded into
/// those bytes (0 of its own); everything else as stored.
fn uploaded_bytes(f: &ModelFile, t: &TensorRef<'_>) -> u64 {
    let stored = t.data.len() as u64;
    if t.dtype == DType::F8_E4M3 {
        return DType::F8_E4M3_B128
            .bytes_for(t.row_len())
            .map_or(stored, |rb| rb * t.n_rows());
    }
    let is_fp8_scale = scaled_weight_name(t.name)
        .and_then(|w| f.tensor(&w))
        .is_some_and(|w| w.dtype == DType::F8_E4M3);
    if is_fp8_scale {
        0
    } else {
        stored
    }
}

fn is_embedding(name: &str) -> bool {
    matches!(
        name,
        "token_embd.weight" | "model.embed_tokens.weight" | "embed.weight"
    )
}

fn has_output_head(f: &ModelFile) -> bool {
    ["output.weight", "lm_head.weight", "head.weight"]
        .iter()
        .any(|n| f.tensor(n).is_some())
}

/// `(n_used, n_layer)` from GGUF metadata or config.json.
fn counts(f: &ModelFile) -> Result<(Option<u64>, Option<u64>)> {
    match f {
        ModelFile::Gguf(g) => {
            let arch = g.architecture()?;
            Ok((
                g.opt_u64(&format!("{arch}.expert_used_count"))?,
                g.opt_u64(&format!("{arch}.block_count"))?,
            ))
        }
        ModelFile::Hf(h) => {
            // Qwen's and Llama's, DeepSeek's, Gemma-4's, Step's config key.
            let mut k = None;
            for key in [
                "num_experts_per_tok",
                "n_activated_experts",
                "top_k_experts",
                "moe_top_k",
            ] {
                if k.is_none() {
                    k = h.cfg_opt_u64(key)?;
                }
            }
            let n = match h.cfg_opt_u64("num_hidden_layers")? {
                Some(n) => Some(n),
                None => h.cfg_opt_u64("n_layers")?,
            };
            Ok((k, n))
        }
    }
}

#[derive(Default)]
struct Found {
    /// Per kind: (stack shape) or per-expert shapes.
    stack: BTreeMap<Kind, (MatShape, u64)>,
    each: BTreeMap<Kind, BTreeMap<usize, MatShape>>,
}

impl MoeInfo {
    /// Scan `f`'s tensor names for routed experts named as `names` (its family's). A model
    /// without them gives no layers.
    pub fn from_file(f: &ModelFile, names: &'static ExpertNames) -> Result<MoeInfo> {
        let path = f.path();
        let mut found: BTreeMap<usize, Found> = BTreeMap::new();
        let mut other_bytes = 0u64;
        let mut other_decode = 0u64;
        let head = has_output_head(f);
        let bad = |t: &TensorRef<'_>, what: String| Error::tensor(t.path, t.name, what);
        for t in f.tensors() {
            if let Some(l) = names.fused_layer(t.name) {
                let [n, rows2, cols] = t.shape[..] else {
                    return Err(bad(
                        &t,
                        format!("fused expert stack of shape {:?}", t.shape),
                    ));
                };
                if !rows2.is_multiple_of(2) {
                    return Err(bad(&t, format!("fused gate+up stack of {rows2} rows")));
                }
                let s = MatShape {
                    dtype: t.dtype,
                    rows: rows2 / 2,
                    cols,
                };
                let entry = found.entry(l).or_default();
                for kind in [Kind::Gate, Kind::Up] {
                    if entry.stack.insert(kind, (s, n)).is_some() {
                        return Err(bad(&t, format!("a second {} stack", kind.name())));
                    }
                }
                continue;
            }
            let Some((l, e, kind, packed)) = names.parse(t.name) else {
                if names.is_scale(t.name) {
                    // Counted with its weight (in the repacked type).
                    continue;
                }
                if names.host.contains(&t.name) {
                    continue;
                }
                let b = uploaded_bytes(f, &t);
                other_bytes += b;
                other_decode += if is_embedding(t.name) && head {
                    b / t.shape.first().copied().unwrap_or(1).max(1)
                } else {
                    b
                };
                continue;
            };
            let entry = found.entry(l).or_default();
            match e {
                None => {
                    if t.shape.len() != 3 {
                        return Err(bad(&t, format!("expert stack of shape {:?}", t.shape)));
                    }
                    let s = MatShape {
                        dtype: t.dtype,
                        rows: t.shape[1],
                        cols: t.shape[2],
                    };
                    entry.stack.insert(kind, (s, t.shape[0]));
                }
                Some(e) => {
                    if t.shape.len() != 2 {
                        return Err(bad(&t, format!("expert matrix of shape {:?}", t.shape)));
                    }
                    let (rows, cols) = (t.shape[0], t.shape[1]);
                    let s = match t.dtype {
                        // Two e2m1 values per stored byte (DeepSeek's release layout),
                        // repacked into ggml's MXFP4 blocks.
                        DType::I8 | DType::U8 if packed => MatShape {
                            dtype: DType::MXFP4,
                            rows,
                            cols: cols * 2,
                        },
                        // FP8 with a 128×128 block scale, repacked into 128-column blocks.
                        DType::F8_E4M3 => MatShape {
                            dtype: DType::F8_E4M3_B128,
                            rows,
                            cols,
                        },
                        dtype => MatShape { dtype, rows, cols },
                    };
                    entry.each.entry(kind).or_default().insert(e, s);
                }
            }
        }
        let mut layers = Vec::new();
        for (l, fd) in found {
            layers.push(layer_info(&path, l, fd)?);
        }
        let (k, n_layer) = counts(f)?;
        let n_layer = n_layer
            .map(|n| n as usize)
            .unwrap_or_else(|| layers.last().map_or(0, |m| m.layer + 1));
        let n_used = match k {
            Some(k) => k as usize,
            None if layers.is_empty() => 0,
            None => {
                return Err(Error::config(
                    &path,
                    "expert_used_count / num_experts_per_tok",
                    "missing in a model with routed experts",
                ))
            }
        };
        if let Some(m) = layers.iter().find(|m| n_used == 0 || n_used > m.n_expert) {
            return Err(Error::config(
                &path,
                "expert_used_count",
                format!(
                    "{n_used} experts used of {} (layer {})",
                    m.n_expert, m.layer
                ),
            ));
        }
        Ok(MoeInfo {
            path,
            arch: f.architecture()?,
            n_layer,
            n_used,
            layers,
            names,
            other_bytes,
            other_decode_bytes: other_decode,
        })
    }

    /// Keep what one device's part of a split model holds (`models::chain`): the MoE
    /// layers of `part`'s range, and the bytes of the other tensors it uploads.
    pub fn restrict(&mut self, f: &ModelFile, part: &crate::model_file::PartSpec) {
        use crate::model_file::PartSpec;
        self.layers.retain(|m| part.layers.contains(&m.layer));
        let head = has_output_head(f);
        let embd = f
            .tensors()
            .map(|t| t.name)
            .find(|n| is_embedding(n) || *n == "model.language_model.embed_tokens.weight")
            .unwrap_or_default()
            .to_string();
        let (mut other, mut decode) = (0, 0);
        for t in f.tensors() {
            if self.names.is_expert(t.name) || self.names.host.contains(&t.name) {
                continue;
            }
            let role = PartSpec::role(t.name, self.n_layer, &embd, !head);
            if !part.holds(role) {
                continue;
            }
            let b = uploaded_bytes(f, &t);
            other += b;
            decode += if t.name == embd && head {
                b / t.shape.first().copied().unwrap_or(1).max(1)
            } else {
                b
            };
        }
        self.other_bytes = other;
        self.other_decode_bytes = decode;
    }

    /// The MoE layer with model layer number `layer`.
    pub fn layer(&self, layer: usize) -> Option<&MoeLayerInfo> {
        self.layers.iter().find(|m| m.layer == layer)
    }

    /// Bytes of all routed experts.
    pub fn expert_bytes(&self) -> u64 {
        self.layers
            .iter()
            .map(|m| m.expert_bytes() * m.n_expert as u64)
            .sum()
    }
}

fn layer_info(path: &Path, l: usize, fd: Found) -> Result<MoeLayerInfo> {
    let what = |s: String| Error::format(path, format!("layer {l} routed experts: {s}"));
    let mut shapes = [None; 3];
    let mut n_expert = None;
    for (i, kind) in Kind::ALL.into_iter().enumerate() {
        let (s, n) = match (fd.stack.get(&kind), fd.each.get(&kind)) {
            (Some(_), Some(_)) => {
                return Err(what(format!(
                    "{} experts both stacked and one tensor each",
                    kind.name()
                )))
            }
            (Some(&(s, n)), None) => (s, n),
            (None, Some(each)) => {
                let n = each.len() as u64;
                if each.keys().enumerate().any(|(i, &e)| i != e) {
                    return Err(what(format!(
                        "{} experts are not numbered 0..{n}",
                        kind.name()
                    )));
                }
                let s = each[&0];
                if let Some((e, o)) = each.iter().find(|(_, o)| **o != s) {
                    return Err(what(format!(
                        "{} expert {e} is {:?}, expert 0 is {s:?}",
                        kind.name(),
                        o
                    )));
                }
                (s, n)
            }
            (None, None) => return Err(what(format!("no {} experts", kind.name()))),
        };
        if s.row_bytes() == 0 || s.rows == 0 {
            return Err(what(format!(
                "{} matrix {}x{} of {} is not whole blocks",
                kind.name(),
                s.rows,
                s.cols,
                s.dtype
            )));
        }
        if *n_expert.get_or_insert(n) != n {
            return Err(what(format!(
                "{n} {} experts, {} gate experts",
                kind.name(),
                n_expert.unwrap_or(0)
            )));
        }
        shapes[i] = Some(s);
    }
    let [Some(gate), Some(up), Some(down)] = shapes else {
        unreachable!("every kind set above")
    };
    if gate.rows != up.rows
        || gate.cols != up.cols
        || down.rows != gate.cols
        || down.cols != gate.rows
    {
        return Err(what(format!(
            "gate {}x{}, up {}x{}, down {}x{} do not form a SwiGLU FFN",
            gate.rows, gate.cols, up.rows, up.cols, down.rows, down.cols
        )));
    }
    let n_expert = n_expert.unwrap_or(0) as usize;
    if n_expert == 0 || n_expert > u32::MAX as usize / 2 {
        return Err(what(format!("{n_expert} experts")));
    }
    Ok(MoeLayerInfo {
        layer: l,
        n_expert,
        gate,
        up,
        down,
    })
}

/// Where the bytes of an [`ExpertMats`] come from.
#[derive(Clone, Debug)]
enum Source<'a> {
    /// `[n_expert]` slices of exactly `shape.bytes()` bytes each, in `shape.dtype` (`None`:
    /// an expert not looked up, see [`ExpertWeights::from_file_only`]).
    Stored(Vec<Option<&'a [u8]>>),
    /// Per expert a block-scaled weight and its scale as a release stores them, repacked
    /// into `shape.dtype` when read: packed e2m1 pairs (I8/U8 `[rows, cols/2]`, E8M0
    /// `[rows, cols/32]`) into MXFP4, FP8 e4m3 (`[rows, cols]`, scale
    /// `[ceil(rows/128), cols/128]`) into `F8_E4M3_B128`.
    Scaled(Vec<Option<(TensorRef<'a>, TensorRef<'a>)>>),
}

/// One kind of matrix (gate, up or down) of every expert of a layer, in the type the GPU
/// stores (`shape.dtype`).
#[derive(Clone, Debug)]
pub struct ExpertMats<'a> {
    pub shape: MatShape,
    /// For error messages.
    pub name: String,
    src: Source<'a>,
}

impl<'a> ExpertMats<'a> {
    /// A GGUF stack `[n_expert, rows, cols]`.
    pub fn from_stack(t: &TensorRef<'a>) -> Result<ExpertMats<'a>> {
        if t.shape.len() != 3 {
            return Err(Error::tensor(
                t.path,
                t.name,
                format!("expert stack of shape {:?}", t.shape),
            ));
        }
        let shape = MatShape {
            dtype: t.dtype,
            rows: t.shape[1],
            cols: t.shape[2],
        };
        let eb = shape.bytes() as usize;
        let n = t.shape[0] as usize;
        if eb == 0 || eb.checked_mul(n) != Some(t.data.len()) {
            return Err(Error::tensor(
                t.path,
                t.name,
                format!(
                    "{} bytes do not hold {n} experts of {}x{} {}",
                    t.data.len(),
                    shape.rows,
                    shape.cols,
                    shape.dtype
                ),
            ));
        }
        Ok(ExpertMats {
            shape,
            name: t.name.to_string(),
            src: Source::Stored(t.data.chunks_exact(eb).map(Some).collect()),
        })
    }

    /// The gate (`Kind::Gate`) or up half of a fused stack `[n_expert, 2·rows, cols]`
    /// ([`FusedStacks`]): per expert its first or last `rows` rows, borrowed in place.
    pub fn from_fused(t: &TensorRef<'a>, kind: Kind) -> Result<ExpertMats<'a>> {
        let bad = |what: String| Error::tensor(t.path, t.name, what);
        let [n, rows2, cols] = t.shape[..] else {
            return Err(bad(format!("fused expert stack of shape {:?}", t.shape)));
        };
        let shape = MatShape {
            dtype: t.dtype,
            rows: rows2 / 2,
            cols,
        };
        let half = shape.bytes() as usize;
        let eb = 2 * half;
        if kind == Kind::Down
            || !rows2.is_multiple_of(2)
            || half == 0
            || eb.checked_mul(n as usize) != Some(t.data.len())
        {
            return Err(bad(format!(
                "{} bytes do not hold {n} fused gate+up experts of {rows2}x{cols} {} \
                 ({} half)",
                t.data.len(),
                t.dtype,
                kind.name()
            )));
        }
        let off = if kind == Kind::Gate { 0 } else { half };
        Self::stored(
            shape,
            t.name,
            t.data
                .chunks_exact(eb)
                .map(|c| Some(&c[off..off + half]))
                .collect(),
        )
    }

    /// One slice per expert, in `shape.dtype` (HF per-expert tensors, or bytes repacked by
    /// the caller).
    pub fn from_parts(shape: MatShape, name: &str, experts: Vec<&'a [u8]>) -> Result<Self> {
        Self::stored(shape, name, experts.into_iter().map(Some).collect())
    }

    /// [`from_parts`](Self::from_parts) with some experts left out (`None`).
    fn stored(shape: MatShape, name: &str, experts: Vec<Option<&'a [u8]>>) -> Result<Self> {
        if shape.bytes() == 0 {
            return Err(Error::Invalid(format!(
                "{name}: {}x{} {} is not whole blocks",
                shape.rows, shape.cols, shape.dtype
            )));
        }
        if let Some((e, b)) = experts
            .iter()
            .enumerate()
            .filter_map(|(e, b)| Some((e, (*b)?)))
            .find(|(_, b)| b.len() as u64 != shape.bytes())
        {
            return Err(Error::Invalid(format!(
                "{name}: expert {e} has {} bytes, a {}x{} {} matrix takes {}",
                b.len(),
                shape.rows,
                shape.cols,
                shape.dtype,
                shape.bytes()
            )));
        }
        Ok(ExpertMats {
            shape,
            name: name.to_string(),
            src: Source::Stored(experts),
        })
    }

    /// Block-scaled release experts, one `(weight, scale)` pair per expert, read as
    /// `shape.dtype` (MXFP4 for packed e2m1 pairs, `F8_E4M3_B128` for FP8): each read
    /// repacks only what it returns. Checks every pair's types and shapes.
    pub fn from_scaled(
        shape: MatShape,
        name: &str,
        experts: Vec<(TensorRef<'a>, TensorRef<'a>)>,
    ) -> Result<Self> {
        Self::scaled(shape, name, experts.into_iter().map(Some).collect())
    }

    /// [`from_scaled`](Self::from_scaled) with some experts left out (`None`).
    fn scaled(
        shape: MatShape,
        name: &str,
        experts: Vec<Option<(TensorRef<'a>, TensorRef<'a>)>>,
    ) -> Result<Self> {
        let (rows, cols) = (shape.rows, shape.cols);
        let want = |w: &TensorRef<'_>, s: &TensorRef<'_>| -> Option<([u64; 2], [u64; 2])> {
            match shape.dtype {
                DType::MXFP4
                    if matches!(w.dtype, DType::I8 | DType::U8)
                        && matches!(s.dtype, DType::F8_E8M0 | DType::U8)
                        && cols.is_multiple_of(MXFP4_BLOCK as u64) =>
                {
                    Some(([rows, cols / 2], [rows, cols / MXFP4_BLOCK as u64]))
                }
                DType::F8_E4M3_B128
                    if w.dtype == DType::F8_E4M3
                        && matches!(
                            s.dtype,
                            DType::F32 | DType::BF16 | DType::F16 | DType::F8_E8M0 | DType::U8
                        )
                        && cols.is_multiple_of(FP8_BLOCK as u64) =>
                {
                    let b = FP8_BLOCK as u64;
                    Some(([rows, cols], [rows.div_ceil(b), cols / b]))
                }
                _ => None,
            }
        };
        for (w, s) in experts.iter().flatten() {
            let Some((ws, ss)) = want(w, s) else {
                return Err(Error::tensor(
                    w.path,
                    w.name,
                    format!(
                        "{} with a {} scale cannot be read as {} {rows}x{cols} ({name})",
                        w.dtype, s.dtype, shape.dtype
                    ),
                ));
            };
            if w.shape != ws || s.shape != ss {
                return Err(Error::tensor(
                    w.path,
                    w.name,
                    format!(
                        "shape {:?} with scale `{}` {:?}: {} {rows}x{cols} wants {ws:?} and \
                         {ss:?}",
                        w.shape, s.name, s.shape, shape.dtype
                    ),
                ));
            }
        }
        if shape.bytes() == 0 || experts.is_empty() {
            return Err(Error::Invalid(format!(
                "{name}: {} experts of {rows}x{cols} {}",
                experts.len(),
                shape.dtype
            )));
        }
        Ok(ExpertMats {
            shape,
            name: name.to_string(),
            src: Source::Scaled(experts),
        })
    }

    pub fn n_expert(&self) -> usize {
        match &self.src {
            Source::Stored(v) => v.len(),
            Source::Scaled(v) => v.len(),
        }
    }

    /// Expert `e`'s matrix in `shape.dtype` (`shape.bytes()` bytes): borrowed from the
    /// mapped file when stored so, repacked otherwise.
    pub fn expert(&self, e: usize) -> Result<Cow<'a, [u8]>> {
        self.rows(e, 0, self.shape.rows as usize)
    }

    /// Rows `r0..r0 + n` of expert `e` in `shape.dtype` (`n · shape.row_bytes()` bytes):
    /// borrowed when stored so, else repacked (those rows only). Errors on a range outside
    /// the matrix and on scales the repack refuses (an E8M0 NaN).
    pub fn rows(&self, e: usize, r0: usize, n: usize) -> Result<Cow<'a, [u8]>> {
        let rb = self.shape.row_bytes() as usize;
        let (rows, cols) = (self.shape.rows as usize, self.shape.cols as usize);
        if e >= self.n_expert() || r0 + n > rows {
            return Err(Error::Invalid(format!(
                "{}: rows {r0}..{} of expert {e} (of {}, {rows} rows)",
                self.name,
                r0 + n,
                self.n_expert()
            )));
        }
        let not_read = || Error::Invalid(format!("{}: expert {e} was not looked up", self.name));
        let (w, s) = match &self.src {
            Source::Stored(v) => {
                let b = v[e].ok_or_else(not_read)?;
                return Ok(Cow::Borrowed(&b[r0 * rb..(r0 + n) * rb]));
            }
            Source::Scaled(v) => v[e].as_ref().ok_or_else(not_read)?,
        };
        // The rows as tensors of their own, so the loaders' whole-tensor repacks serve.
        match self.shape.dtype {
            DType::MXFP4 => {
                let (wb, sb) = (cols / 2, cols / MXFP4_BLOCK);
                let ws = [n as u64, wb as u64];
                let ss = [n as u64, sb as u64];
                let wt = TensorRef {
                    shape: &ws,
                    data: &w.data[r0 * wb..(r0 + n) * wb],
                    ..*w
                };
                let st = TensorRef {
                    shape: &ss,
                    data: &s.data[r0 * sb..(r0 + n) * sb],
                    ..*s
                };
                Ok(Cow::Owned(repack_mxfp4_to_ggml(&wt, &st)?))
            }
            DType::F8_E4M3_B128 => {
                // One repack per 128-row band (rows of one band share a scale row).
                let nb = cols / FP8_BLOCK;
                let sb = s.dtype.bytes_for(nb as u64).unwrap_or(0) as usize;
                let mut out = Vec::with_capacity(n * rb);
                let mut r = r0;
                while r < r0 + n {
                    let band = r / FP8_BLOCK;
                    let end = ((band + 1) * FP8_BLOCK).min(r0 + n);
                    let ws = [(end - r) as u64, cols as u64];
                    let ss = [1, nb as u64];
                    let wt = TensorRef {
                        shape: &ws,
                        data: &w.data[r * cols..end * cols],
                        ..*w
                    };
                    let st = TensorRef {
                        shape: &ss,
                        data: &s.data[band * sb..(band + 1) * sb],
                        ..*s
                    };
                    out.extend(repack_fp8_block_to_b128(&wt, &st)?);
                    r = end;
                }
                Ok(Cow::Owned(out))
            }
            dt => Err(Error::Invalid(format!(
                "{}: no repack of block-scaled experts into {dt}",
                self.name
            ))),
        }
    }
}

/// A layer's experts in the GPU's stored types: what the cold path and arena uploads read.
#[derive(Clone, Debug)]
pub struct ExpertWeights<'a> {
    pub layer: usize,
    pub gate: ExpertMats<'a>,
    pub up: ExpertMats<'a>,
    pub down: ExpertMats<'a>,
}

impl<'a> ExpertWeights<'a> {
    /// Checks that the three kinds form one SwiGLU FFN per expert.
    pub fn new(
        layer: usize,
        gate: ExpertMats<'a>,
        up: ExpertMats<'a>,
        down: ExpertMats<'a>,
    ) -> Result<Self> {
        let (g, u, d) = (gate.shape, up.shape, down.shape);
        let n = gate.n_expert();
        if up.n_expert() != n || down.n_expert() != n || n == 0 {
            return Err(Error::Invalid(format!(
                "layer {layer}: {n} gate, {} up, {} down experts",
                up.n_expert(),
                down.n_expert()
            )));
        }
        if g.rows != u.rows || g.cols != u.cols || d.rows != g.cols || d.cols != g.rows {
            return Err(Error::Invalid(format!(
                "layer {layer}: gate {}x{}, up {}x{}, down {}x{} do not form a SwiGLU FFN",
                g.rows, g.cols, u.rows, u.cols, d.rows, d.cols
            )));
        }
        Ok(ExpertWeights {
            layer,
            gate,
            up,
            down,
        })
    }

    /// The experts of MoE layer `info` from the mapped file: stored bytes are borrowed (no
    /// copy); block-scaled release experts are read through their scales
    /// ([`ExpertMats::from_scaled`]: repacked a few rows or one expert at a time).
    pub fn from_file(f: &'a ModelFile, names: &ExpertNames, info: &MoeLayerInfo) -> Result<Self> {
        Self::read(f, names, info, None)
    }

    /// [`from_file`](Self::from_file) looking up only `experts` (the others give errors when
    /// read): a checkpoint with one tensor per expert costs a few name lookups per expert,
    /// which the cold path, needing a handful of experts per call, should not pay for all.
    pub fn from_file_only(
        f: &'a ModelFile,
        names: &ExpertNames,
        info: &MoeLayerInfo,
        experts: &[u32],
    ) -> Result<Self> {
        Self::read(f, names, info, Some(experts))
    }

    fn read(
        f: &'a ModelFile,
        names: &ExpertNames,
        info: &MoeLayerInfo,
        only: Option<&[u32]>,
    ) -> Result<Self> {
        let l = info.layer;
        let want = |e: usize| only.is_none_or(|o| o.contains(&(e as u32)));
        let mats = |kind: Kind| -> Result<ExpertMats<'a>> {
            if let Some(t) = names.stacks(l, kind).find_map(|s| f.tensor(&s)) {
                return ExpertMats::from_stack(&t);
            }
            for fu in names.fused {
                let (name, fused) = match kind {
                    Kind::Down => (fu.down, false),
                    Kind::Gate | Kind::Up => (fu.gate_up, true),
                };
                if let Some(t) = f.tensor(&fill(name, l, 0)) {
                    return match fused {
                        true => ExpertMats::from_fused(&t, kind),
                        false => ExpertMats::from_stack(&t),
                    };
                }
            }
            // One tensor per expert: the first of the family's namings the file uses.
            let Some((template, t0)) = names.each.iter().find_map(|each| {
                let t = each.names[kind as usize];
                f.tensor(&fill(t, l, 0)).map(|t0| (t, t0))
            }) else {
                return Err(Error::MissingTensor {
                    path: f.path(),
                    name: names.stacks(l, kind).collect::<Vec<_>>().join(" or "),
                });
            };
            let name = |e: usize| fill(template, l, e);
            let first = name(0);
            let ts = (0..info.n_expert)
                .map(|e| want(e).then(|| f.require(&name(e))).transpose())
                .collect::<Result<Vec<_>>>()?;
            let shape = info.shape(kind);
            if !matches!(t0.dtype, DType::I8 | DType::U8 | DType::F8_E4M3) {
                let parts = ts.iter().map(|t| t.map(|t| t.data)).collect();
                return ExpertMats::stored(shape, &first, parts);
            }
            let ModelFile::Hf(h) = f else {
                return Err(Error::tensor(
                    t0.path,
                    t0.name,
                    "block-scaled expert in a GGUF file",
                ));
            };
            let mut pairs = Vec::with_capacity(ts.len());
            for t in ts {
                let Some(t) = t else {
                    pairs.push(None);
                    continue;
                };
                let scale = find_block_scale(h, t.name).ok_or_else(|| {
                    Error::tensor(
                        t.path,
                        t.name,
                        "block-scaled expert without a `.scale` / `.weight_scale_inv` tensor",
                    )
                })?;
                pairs.push(Some((t, scale)));
            }
            ExpertMats::scaled(shape, &first, pairs)
        };
        let w = ExpertWeights::new(l, mats(Kind::Gate)?, mats(Kind::Up)?, mats(Kind::Down)?)?;
        if w.gate.shape != info.gate || w.up.shape != info.up || w.down.shape != info.down {
            return Err(Error::Invalid(format!(
                "{}: layer {l}: expert shapes differ from the layout scanned",
                f.path().display()
            )));
        }
        Ok(w)
    }

    pub fn mats(&self, kind: Kind) -> &ExpertMats<'a> {
        match kind {
            Kind::Gate => &self.gate,
            Kind::Up => &self.up,
            Kind::Down => &self.down,
        }
    }
    pub fn n_expert(&self) -> usize {
        self.gate.n_expert()
    }
    /// Model width (`x` and output rows).
    pub fn n_embd(&self) -> usize {
        self.gate.shape.cols as usize
    }
    /// Expert FFN width.
    pub fn n_ff(&self) -> usize {
        self.gate.shape.rows as usize
    }
}

impl crate::cpu::moe::Experts for ExpertWeights<'_> {
    fn layer(&self) -> usize {
        self.layer
    }
    fn n_expert(&self) -> usize {
        ExpertWeights::n_expert(self)
    }
    fn shape(&self, kind: Kind) -> MatShape {
        self.mats(kind).shape
    }
    fn rows(&self, kind: Kind, e: usize, r0: usize, n: usize) -> Result<Cow<'_, [u8]>> {
        self.mats(kind).rows(e, r0, n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    static NAMES: ExpertNames = ExpertNames {
        stacks: &[["s.{l}.gate", "s.{l}.up", "s.{l}.down"]],
        fused: &[FusedStacks {
            gate_up: "f.{l}.gate_up",
            down: "f.{l}.down",
        }],
        each: &[EachExpert {
            names: [
                "p.{l}.x.{e}.g.weight",
                "p.{l}.x.{e}.u.weight",
                "p.{l}.x.{e}.d.weight",
            ],
            packed: true,
        }],
        host: &[],
    };

    #[test]
    fn templates_match_numbers_only_where_placed() {
        assert_eq!(NAMES.parse("s.12.up"), Some((12, None, Kind::Up, false)));
        assert_eq!(
            NAMES.parse("p.3.x.40.d.weight"),
            Some((3, Some(40), Kind::Down, true))
        );
        for not in [
            "s..up",
            "s.1a.up",
            "s.1.up.weight",
            "p.3.x..d.weight",
            "q.3.x.4.d.weight",
        ] {
            assert_eq!(NAMES.parse(not), None, "{not}");
        }
        assert!(NAMES.is_expert("p.3.x.40.g.scale"));
        assert!(
            !NAMES.is_expert("s.3.gate.scale"),
            "a stack has no block scale"
        );
        assert_eq!(
            NAMES.stacks(7, Kind::Down).collect::<Vec<_>>(),
            ["s.7.down"]
        );
        assert_eq!(NAMES.parse("f.5.down"), Some((5, None, Kind::Down, false)));
        assert_eq!(NAMES.fused_layer("f.5.gate_up"), Some(5));
        assert!(NAMES.is_expert("f.5.gate_up") && !NAMES.is_expert("f.5.gate"));
        assert_eq!(fill(NAMES.each[0].names[1], 2, 9), "p.2.x.9.u.weight");
    }
}
