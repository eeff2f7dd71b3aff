//! What a model's routed experts look like (per MoE layer: count, stored type and shape of
//! the gate, up and down matrices) and where their bytes are in the mapped file.
//!
//! Expert tensors are read where the file keeps them: GGUF stacks `blk.N.ffn_{gate,up,down}
//! _exps.weight` `[n_expert, rows, cols]` (llama.cpp's layout for both Qwen3.5-MoE and
//! DeepSeek-V4), Hugging Face Qwen checkpoints one tensor per expert
//! (`model.layers.N.mlp.experts.E.{gate,up,down}_proj.weight`). DeepSeek's release keeps
//! experts as packed e2m1 pairs (`layers.N.ffn.experts.E.w{1,3,2}.weight`, I8 `[rows, cols/2]`)
//! plus E8M0 scales `[rows, cols/32]`: [`MoeInfo`] describes them as the MXFP4 matrices the
//! loader repacks them into (same byte count), but [`ExpertWeights::from_file`] cannot hand out
//! their bytes: build [`ExpertWeights`] from the repacked bytes with [`ExpertMats::from_parts`].

use crate::models::ModelFile;
use crate::tensor::TensorRef;
use crate::{DType, Error, Result};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// The three matrices of a SwiGLU expert: `down(silu(gate·x) ⊙ up·x)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Kind {
    Gate,
    Up,
    Down,
}

impl Kind {
    pub const ALL: [Kind; 3] = [Kind::Gate, Kind::Up, Kind::Down];
    pub fn name(self) -> &'static str {
        match self {
            Kind::Gate => "gate",
            Kind::Up => "up",
            Kind::Down => "down",
        }
    }
}

/// One expert's matrix: `rows × cols` elements of `dtype` (rows contiguous, ggml blocks).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct MatShape {
    pub dtype: DType,
    pub rows: u64,
    pub cols: u64,
}

impl MatShape {
    /// Bytes of one stored row (0 when `cols` is not a whole number of blocks).
    pub fn row_bytes(&self) -> u64 {
        self.dtype.bytes_for(self.cols).unwrap_or(0)
    }
    /// Bytes of one expert's matrix.
    pub fn bytes(&self) -> u64 {
        self.row_bytes() * self.rows
    }
}

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
    /// Bytes of every tensor that is not a routed expert (what must sit on the GPU beside
    /// the expert arena).
    pub other_bytes: u64,
    /// What a decode step reads of those: all of them, except one row of the token
    /// embedding when the model has a separate output head.
    pub other_decode_bytes: u64,
}

/// Routed-expert tensor names: (layer, expert or `None` for a stack, kind, DeepSeek packed).
fn parse_expert_name(name: &str) -> Option<(usize, Option<usize>, Kind, bool)> {
    let num = |s: &str| s.parse::<usize>().ok();
    if let Some(rest) = name.strip_prefix("blk.") {
        let (l, rest) = rest.split_once('.')?;
        let kind = match rest {
            "ffn_gate_exps.weight" => Kind::Gate,
            "ffn_up_exps.weight" => Kind::Up,
            "ffn_down_exps.weight" => Kind::Down,
            _ => return None,
        };
        return Some((num(l)?, None, kind, false));
    }
    if let Some(rest) = name.strip_prefix("model.layers.") {
        let (l, rest) = rest.split_once('.')?;
        let rest = rest.strip_prefix("mlp.experts.")?;
        let (e, rest) = rest.split_once('.')?;
        let kind = match rest {
            "gate_proj.weight" => Kind::Gate,
            "up_proj.weight" => Kind::Up,
            "down_proj.weight" => Kind::Down,
            _ => return None,
        };
        return Some((num(l)?, Some(num(e)?), kind, false));
    }
    if let Some(rest) = name.strip_prefix("layers.") {
        let (l, rest) = rest.split_once('.')?;
        let rest = rest.strip_prefix("ffn.experts.")?;
        let (e, rest) = rest.split_once('.')?;
        let kind = match rest {
            "w1.weight" => Kind::Gate,
            "w3.weight" => Kind::Up,
            "w2.weight" => Kind::Down,
            _ => return None,
        };
        return Some((num(l)?, Some(num(e)?), kind, true));
    }
    None
}

/// True for a routed expert tensor name (GGUF stack, HF per-expert matrix, DeepSeek packed
/// weight or its scale): what a loader leaves to the expert arena.
pub fn is_expert_tensor(name: &str) -> bool {
    parse_expert_name(name).is_some() || is_packed_scale(name)
}

/// The scale tensor of DeepSeek's packed experts (`…w1.scale` beside `…w1.weight`).
fn is_packed_scale(name: &str) -> bool {
    name.strip_suffix(".scale")
        .and_then(|b| parse_expert_name(&format!("{b}.weight")))
        .is_some_and(|p| p.3)
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
            let k = match h.cfg_opt_u64("num_experts_per_tok")? {
                Some(k) => Some(k),
                None => h.cfg_opt_u64("n_activated_experts")?,
            };
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
    /// Scan `f`'s tensor names for routed experts. A model without them gives no layers.
    pub fn from_file(f: &ModelFile) -> Result<MoeInfo> {
        let path = f.path();
        let mut found: BTreeMap<usize, Found> = BTreeMap::new();
        let mut other_bytes = 0u64;
        let mut other_decode = 0u64;
        let head = has_output_head(f);
        let bad = |t: &TensorRef<'_>, what: String| Error::tensor(t.path, t.name, what);
        for t in f.tensors() {
            let Some((l, e, kind, packed)) = parse_expert_name(t.name) else {
                if is_packed_scale(t.name) {
                    // Counted with its weight: packed pairs + scale = MXFP4 bytes.
                    continue;
                }
                let b = t.data.len() as u64;
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
                    let s = if packed {
                        // Two e2m1 values per stored byte (DeepSeek's release layout).
                        MatShape {
                            dtype: DType::MXFP4,
                            rows: t.shape[0],
                            cols: t.shape[1] * 2,
                        }
                    } else {
                        MatShape {
                            dtype: t.dtype,
                            rows: t.shape[0],
                            cols: t.shape[1],
                        }
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
            other_bytes,
            other_decode_bytes: other_decode,
        })
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

/// One kind of matrix (gate, up or down) of every expert of a layer, as stored bytes.
#[derive(Clone, Debug)]
pub struct ExpertMats<'a> {
    pub shape: MatShape,
    /// For error messages.
    pub name: String,
    /// `[n_expert]` slices of exactly `shape.bytes()` bytes each.
    experts: Vec<&'a [u8]>,
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
            experts: t.data.chunks_exact(eb).collect(),
        })
    }

    /// One slice per expert (HF per-expert tensors, bytes repacked at load).
    pub fn from_parts(shape: MatShape, name: &str, experts: Vec<&'a [u8]>) -> Result<Self> {
        if shape.bytes() == 0 {
            return Err(Error::Invalid(format!(
                "{name}: {}x{} {} is not whole blocks",
                shape.rows, shape.cols, shape.dtype
            )));
        }
        if let Some((e, b)) = experts
            .iter()
            .enumerate()
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
            experts,
        })
    }

    pub fn n_expert(&self) -> usize {
        self.experts.len()
    }
    /// Expert `e`'s matrix bytes. Panics when `e` is out of range (callers check ids).
    pub fn expert(&self, e: usize) -> &'a [u8] {
        self.experts[e]
    }
    /// Row `r` of expert `e`.
    pub fn row(&self, e: usize, r: usize) -> &'a [u8] {
        let rb = self.shape.row_bytes() as usize;
        &self.experts[e][r * rb..(r + 1) * rb]
    }
}

/// A layer's experts as stored bytes: what the cold path and arena uploads read.
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

    /// The experts of MoE layer `info` straight from the mapped file (no copy).
    pub fn from_file(f: &'a ModelFile, info: &MoeLayerInfo) -> Result<Self> {
        let l = info.layer;
        let mats = |kind: Kind| -> Result<ExpertMats<'a>> {
            let (kg, kh) = match kind {
                Kind::Gate => ("gate", "gate_proj"),
                Kind::Up => ("up", "up_proj"),
                Kind::Down => ("down", "down_proj"),
            };
            if let Some(t) = f.tensor(&format!("blk.{l}.ffn_{kg}_exps.weight")) {
                return ExpertMats::from_stack(&t);
            }
            let first = format!("model.layers.{l}.mlp.experts.0.{kh}.weight");
            if f.tensor(&first).is_some() {
                let mut parts = Vec::with_capacity(info.n_expert);
                for e in 0..info.n_expert {
                    let t = f.require(&format!("model.layers.{l}.mlp.experts.{e}.{kh}.weight"))?;
                    parts.push(t.data);
                }
                return ExpertMats::from_parts(info.shape(kind), &first, parts);
            }
            if f.tensor(&format!("layers.{l}.ffn.experts.0.w1.weight"))
                .is_some()
            {
                return Err(Error::Unsupported(format!(
                    "{}: layer {l}: DeepSeek's packed experts must be repacked to MXFP4 \
                     (ExpertMats::from_parts over the loader's bytes)",
                    f.path().display()
                )));
            }
            Err(Error::MissingTensor {
                path: f.path(),
                name: format!("blk.{l}.ffn_{kg}_exps.weight"),
            })
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
