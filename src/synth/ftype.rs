//! Which stored type each tensor gets: the converter's choice (`convert_hf_to_gguf.py
//! --outtype`) for the float file types, then llama-quantize's per-tensor rules
//! (`src/llama-quant.cpp`: `tensor_allows_quantization`, `llama_tensor_get_type_impl`,
//! `tensor_type_fallback`) for the quantized ones, replicated for the file types below.

use crate::{DType, Error, Result};

/// A whole-file type as llama.cpp names it (`llama_ftype`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[allow(non_camel_case_types)]
pub enum FileType {
    F32,
    F16,
    BF16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q4_K_S,
    Q4_K_M,
    Q5_K_S,
    Q5_K_M,
    Q6_K,
    MXFP4_MOE,
}

impl FileType {
    pub const ALL: [FileType; 14] = [
        FileType::F32,
        FileType::F16,
        FileType::BF16,
        FileType::Q4_0,
        FileType::Q4_1,
        FileType::Q5_0,
        FileType::Q5_1,
        FileType::Q8_0,
        FileType::Q4_K_S,
        FileType::Q4_K_M,
        FileType::Q5_K_S,
        FileType::Q5_K_M,
        FileType::Q6_K,
        FileType::MXFP4_MOE,
    ];

    /// The name llama-quantize takes, lower case (`q4_k_m`).
    pub fn name(self) -> &'static str {
        use FileType as F;
        match self {
            F::F32 => "f32",
            F::F16 => "f16",
            F::BF16 => "bf16",
            F::Q4_0 => "q4_0",
            F::Q4_1 => "q4_1",
            F::Q5_0 => "q5_0",
            F::Q5_1 => "q5_1",
            F::Q8_0 => "q8_0",
            F::Q4_K_S => "q4_k_s",
            F::Q4_K_M => "q4_k_m",
            F::Q5_K_S => "q5_k_s",
            F::Q5_K_M => "q5_k_m",
            F::Q6_K => "q6_k",
            F::MXFP4_MOE => "mxfp4_moe",
        }
    }

    /// `general.file_type`: llama.cpp's `enum llama_ftype` value.
    pub fn llama_id(self) -> u32 {
        use FileType as F;
        match self {
            F::F32 => 0,
            F::F16 => 1,
            F::Q4_0 => 2,
            F::Q4_1 => 3,
            F::Q8_0 => 7,
            F::Q5_0 => 8,
            F::Q5_1 => 9,
            F::Q4_K_S => 14,
            F::Q4_K_M => 15,
            F::Q5_K_S => 16,
            F::Q5_K_M => 17,
            F::Q6_K => 18,
            F::BF16 => 32,
            F::MXFP4_MOE => 38,
        }
    }

    /// The type most tensors get (`llama_ftype_get_default_type`).
    pub fn default_type(self) -> DType {
        use FileType as F;
        match self {
            F::F32 => DType::F32,
            F::F16 => DType::F16,
            F::BF16 => DType::BF16,
            F::Q4_0 => DType::Q4_0,
            F::Q4_1 => DType::Q4_1,
            F::Q5_0 => DType::Q5_0,
            F::Q5_1 => DType::Q5_1,
            F::Q8_0 => DType::Q8_0,
            F::Q4_K_S | F::Q4_K_M => DType::Q4_K,
            F::Q5_K_S | F::Q5_K_M => DType::Q5_K,
            F::Q6_K => DType::Q6_K,
            F::MXFP4_MOE => DType::MXFP4,
        }
    }

    /// A converter output type (no llama-quantize step).
    pub fn is_float(self) -> bool {
        matches!(self, FileType::F32 | FileType::F16 | FileType::BF16)
    }
}

impl std::fmt::Display for FileType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for FileType {
    type Err = Error;
    fn from_str(s: &str) -> Result<FileType> {
        FileType::ALL
            .into_iter()
            .find(|t| t.name().eq_ignore_ascii_case(s))
            .ok_or_else(|| {
                let names: Vec<&str> = FileType::ALL.iter().map(|t| t.name()).collect();
                Error::Invalid(format!("--type {s}: expected one of {}", names.join(", ")))
            })
    }
}

/// The shape llama-quantize writes: `ggml_n_dims` drops trailing `ne` of 1, i.e. leading
/// ones of an outermost-first shape (`[1, 2048]` becomes `[2048]`).
pub(crate) fn trimmed(shape: &[u64]) -> Vec<u64> {
    let lead = shape.iter().take_while(|&&d| d == 1).count();
    let lead = lead.min(shape.len() - 1);
    shape[lead..].to_vec()
}

/// llama-quantize's broad tensor categories (`tensor_get_category`), matched on the name.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Category {
    TokenEmbd,
    Output,
    AttnQkv,
    AttnKvB,
    AttnV,
    AttnK,
    AttnQ,
    AttnOutput,
    FfnUp,
    FfnGate,
    FfnDown,
    Other,
}

fn category(name: &str) -> Category {
    use Category as C;
    if name == "output.weight" {
        return C::Output;
    }
    if name == "token_embd.weight" || name == "per_layer_token_embd.weight" {
        return C::TokenEmbd;
    }
    let order = [
        ("attn_qkv.weight", C::AttnQkv),
        ("attn_kv_b.weight", C::AttnKvB),
        ("attn_v.weight", C::AttnV),
        ("attn_k.weight", C::AttnK),
        ("attn_q.weight", C::AttnQ),
        ("attn_output.weight", C::AttnOutput),
        ("ffn_up", C::FfnUp),
        ("ffn_gate", C::FfnGate),
        ("ffn_down", C::FfnDown),
    ];
    order
        .into_iter()
        .find(|(pat, _)| name.contains(pat))
        .map_or(C::Other, |(_, c)| c)
}

fn is_attn_v_like(c: Category) -> bool {
    matches!(c, Category::AttnV | Category::AttnQkv | Category::AttnKvB)
}

/// `tensor_allows_quantization` for the tensor names of the architectures synth writes.
fn allows_quantization(name: &str, shape: &[u64]) -> bool {
    // Only 2-D and 3-D tensors (after dropping trailing ne of 1).
    if trimmed(shape).len() < 2 {
        return false;
    }
    name.ends_with("weight")
        && !name.contains("_norm.weight")
        && !name.contains("ffn_gate_inp.weight")
        && !name.contains("ffn_gate_tid2eid.weight")
        && !name.contains("ssm_conv1d")
        // Gemma-4 E2B/E4B's embedding projection stays as converted ("not too big").
        && !name.contains("per_layer_model_proj")
}

/// `use_more_bits`: the first and last eighth of the layers, and every third in between.
fn use_more_bits(i: i64, n: i64) -> bool {
    i < n / 8 || i >= 7 * n / 8 || (i - n / 8).rem_euclid(3) == 2
}

/// The layer of `blk.N.…`, for llama.cpp's `weight_name_comparer` and `layer_info`.
pub(crate) fn layer_of(name: &str) -> Option<i64> {
    let rest = name.strip_prefix("blk.")?;
    let end = rest.find('.')?;
    rest[..end].parse().ok()
}

/// llama-quantize's tensor order: non-layer tensors first, then by layer, by name inside.
pub(crate) fn quantize_order(a: &str, b: &str) -> std::cmp::Ordering {
    let la = layer_of(a).unwrap_or(-1);
    let lb = layer_of(b).unwrap_or(-1);
    la.cmp(&lb).then_with(|| a.cmp(b))
}

/// What llama-quantize needs to know about the model besides the tensor list.
pub(crate) struct QuantModel {
    /// `hparams.n_layer_all`: `block_count`, MTP blocks included.
    pub n_layer: usize,
    /// `hparams.n_expert` (0 for dense models).
    pub n_expert: usize,
}

/// One tensor as llama-quantize sees it: name, the type in the input (converter) file,
/// shape outermost first, and a forced type (`--tensor-type` override) if any.
pub(crate) struct QuantInput<'a> {
    pub name: &'a str,
    pub dtype: DType,
    pub shape: &'a [u64],
    pub forced: Option<DType>,
}

/// The type llama-quantize writes for each tensor. `tensors` must be in
/// [`quantize_order`]: the counters behind `use_more_bits` advance in that order.
pub(crate) fn quantized_types(
    tensors: &[QuantInput<'_>],
    model: &QuantModel,
    ftype: FileType,
) -> Result<Vec<DType>> {
    debug_assert!(!ftype.is_float());
    let default = ftype.default_type();
    let n_attention_wv = tensors
        .iter()
        .filter(|t| is_attn_v_like(category(t.name)))
        .count() as i64;
    let tied = !tensors.iter().any(|t| t.name == "output.weight");
    let n_layer = model.n_layer as i64;
    let mut i_attention_wv = 0i64;
    let mut i_ffn_down = 0i64;
    let mut out = Vec::with_capacity(tensors.len());
    for t in tensors {
        if !allows_quantization(t.name, t.shape) {
            out.push(t.dtype);
            continue;
        }
        let cat = category(t.name);
        let ncols = *t.shape.last().expect("shapes are not empty");
        let mut ty = default;
        if let Some(forced) = t.forced {
            ty = forced;
        } else if cat == Category::Output || (tied && cat == Category::TokenEmbd) {
            // The output head (or a tied embedding) keeps more bits.
            ty = if ftype == FileType::MXFP4_MOE || !ncols.is_multiple_of(ty.block_size() as u64) {
                DType::Q8_0
            } else if ty != DType::Q8_0 {
                DType::Q6_K
            } else {
                ty
            };
        } else if ftype == FileType::MXFP4_MOE {
            let ne2 = if t.shape.len() >= 3 {
                t.shape[t.shape.len() - 3]
            } else {
                1
            };
            ty = if ne2 > 1 { DType::MXFP4 } else { DType::Q8_0 };
        } else if cat == Category::TokenEmbd {
            // No rule for the file types synth writes.
        } else if is_attn_v_like(cat) {
            if matches!(ftype, FileType::Q4_K_M | FileType::Q5_K_M)
                && use_more_bits(i_attention_wv, n_attention_wv)
            {
                ty = DType::Q6_K;
            } else if ftype == FileType::Q4_K_S && i_attention_wv < 4 {
                ty = DType::Q5_K;
            }
            if model.n_expert == 8 {
                ty = DType::Q8_0;
            }
            i_attention_wv += 1;
        } else if cat == Category::AttnK {
            if model.n_expert == 8 {
                ty = DType::Q8_0;
            }
        } else if cat == Category::FfnDown {
            // MoE models take the layer from the name (experts need not be in layer order).
            let i_layer = if model.n_expert > 1 {
                // DeepSeek-V4's MTP block (`mtp.0.`, no `blk.` number) counts as the last.
                let mtp = t.name.starts_with("mtp.").then_some(n_layer - 1);
                let l = layer_of(t.name).or(mtp).ok_or_else(|| {
                    Error::Invalid(format!("{}: no layer number in the name", t.name))
                })?;
                if l < 0 || l >= n_layer {
                    return Err(Error::Invalid(format!(
                        "{}: layer {l} outside [0, {n_layer})",
                        t.name
                    )));
                }
                l
            } else {
                i_ffn_down
            };
            match ftype {
                FileType::Q4_K_M | FileType::Q5_K_M if use_more_bits(i_layer, n_layer) => {
                    ty = DType::Q6_K
                }
                FileType::Q4_K_S if i_layer < n_layer / 8 => ty = DType::Q5_K,
                _ => {}
            }
            i_ffn_down += 1;
        } else if cat == Category::AttnOutput
            && model.n_expert == 8
            && matches!(ftype, FileType::Q4_K_S | FileType::Q4_K_M)
        {
            ty = DType::Q5_K;
        }
        out.push(fallback(t.name, ty, ncols)?);
    }
    Ok(out)
}

/// `tensor_type_fallback`: a row length the block size does not divide takes a type of
/// 32-element blocks instead, or F16 when even that does not divide it (a 32-block type
/// goes straight to F16).
fn fallback(name: &str, ty: DType, ncols: u64) -> Result<DType> {
    if ncols.is_multiple_of(ty.block_size() as u64) {
        return Ok(ty);
    }
    let next = match ty {
        DType::Q2_K | DType::Q3_K => DType::Q4_0,
        DType::Q4_K => DType::Q5_0,
        DType::Q5_K => DType::Q5_1,
        DType::Q6_K => DType::Q8_0,
        DType::IQ4_XS => DType::IQ4_NL,
        other if other.block_size() <= 32 => other,
        other => {
            return Err(Error::Invalid(format!(
                "{name}: rows of {ncols} are not whole {other} blocks, and llama-quantize has no \
                 fallback type for {other}"
            )))
        }
    };
    Ok(if ncols.is_multiple_of(next.block_size() as u64) {
        next
    } else {
        DType::F16
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn use_more_bits_matches_llama_quantize() {
        // 4 layers: the last two (n/8 = 0, 7n/8 = 3, and (2 - 0) % 3 == 2).
        let picks: Vec<bool> = (0..4).map(|i| use_more_bits(i, 4)).collect();
        assert_eq!(picks, [false, false, true, true]);
        // 32 layers: 0..4, 28..32, and 4 + 2, 4 + 5, ...
        let more: Vec<i64> = (0..32).filter(|&i| use_more_bits(i, 32)).collect();
        assert_eq!(
            more,
            [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31]
        );
    }

    #[test]
    fn quantize_order_sorts_layers_numerically() {
        let mut names = vec![
            "blk.10.attn_norm.weight",
            "output.weight",
            "blk.2.ffn_up.weight",
            "blk.2.attn_norm.weight",
            "token_embd.weight",
        ];
        names.sort_by(|a, b| quantize_order(a, b));
        assert_eq!(
            names,
            [
                "output.weight",
                "token_embd.weight",
                "blk.2.attn_norm.weight",
                "blk.2.ffn_up.weight",
                "blk.10.attn_norm.weight"
            ]
        );
    }

    #[test]
    fn file_types_parse_and_fall_back() {
        assert_eq!("Q4_K_M".parse::<FileType>().unwrap(), FileType::Q4_K_M);
        assert!("q3_k_xl".parse::<FileType>().is_err());
        assert_eq!(fallback("x", DType::Q4_K, 128).unwrap(), DType::Q5_0);
        assert_eq!(fallback("x", DType::Q6_K, 128).unwrap(), DType::Q8_0);
        assert_eq!(fallback("x", DType::Q4_K, 48).unwrap(), DType::F16);
        assert_eq!(fallback("x", DType::Q8_0, 48).unwrap(), DType::F16);
        assert_eq!(trimmed(&[1, 256]), [256]);
        assert_eq!(trimmed(&[1]), [1]);
    }
}
