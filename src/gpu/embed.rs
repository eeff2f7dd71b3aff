//! Embedding row gather (`shaders/embed.wgsl`): `y[t] = dequant(E[ids[t]])` for a table of
//! any stored type lathe reads (F32, F16, BF16, Q4_0..Q8_0, Q2_K..Q6_K, IQ4_NL, IQ4_XS,
//! MXFP4), split in parts or not. CPU reference: `cpu::ops::embed`.

use super::operand::Operand;
use super::{grid, Binding, GpuTensor, Pass, PipelineSpec};
use crate::{DType, Error, Result};

const SRC: &str = include_str!("../../shaders/embed.wgsl");
const WG: u32 = 256;

/// Uniforms of `embed.wgsl` (same fields, same order).
#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct Params {
    row_len: u32,
    n_tokens: u32,
    ids_off: u32,
    /// Output offset and row stride in elements.
    y_off: u32,
    y_stride: u32,
    /// Bytes per stored row.
    row_bytes: u32,
    part_start: u32,
    part_rows: u32,
    n_total_rows: u32,
    zero_invalid: u32,
    _pad: [u32; 2],
}
const _: () = assert!(std::mem::size_of::<Params>() == 48);

/// True for the table types the gather kernel decodes.
pub fn supported(dtype: DType) -> bool {
    use DType as T;
    matches!(
        dtype,
        T::F32
            | T::F16
            | T::BF16
            | T::Q4_0
            | T::Q4_1
            | T::Q5_0
            | T::Q5_1
            | T::Q8_0
            | T::Q2_K
            | T::Q3_K
            | T::Q4_K
            | T::Q5_K
            | T::Q6_K
            | T::IQ4_NL
            | T::IQ4_XS
            | T::MXFP4
    )
}

/// Gather `n_tokens` rows of `table` (`[n_rows, row_len]`) selected by the u32 ids at
/// `ids[ids_off..]` into `y` (rows of `row_len` f32). Ids ≥ the table's row count give zero
/// rows (the GPU cannot report them; callers validate token ids on the CPU).
pub fn embed(
    pass: &mut Pass<'_>,
    table: &GpuTensor,
    ids: &wgpu::Buffer,
    ids_off: u32,
    n_tokens: u32,
    y: Operand<'_>,
) -> Result<()> {
    let dt = table.dtype;
    if !supported(dt) {
        return Err(Error::Unsupported(format!(
            "embedding `{}` of type {dt}",
            table.name
        )));
    }
    let row_len = table.row_len();
    let row_bytes = dt.bytes_for(row_len).ok_or_else(|| {
        Error::Invalid(format!(
            "embedding `{}`: rows of {row_len} are not whole {dt} blocks",
            table.name
        ))
    })?;
    if row_len == 0 || row_len > u32::MAX as u64 || row_bytes > u32::MAX as u64 {
        return Err(Error::Invalid(format!(
            "embedding `{}`: row length {row_len}",
            table.name
        )));
    }
    let n_total = table.n_rows().min(u32::MAX as u64) as u32;
    if n_tokens == 0 {
        return Ok(());
    }
    let row_len = row_len as u32;
    y.check("embed", "y", n_tokens, row_len)?;
    if (ids_off as u64 + n_tokens as u64) * 4 > ids.size() {
        return Err(Error::Invalid(format!(
            "embed: {n_tokens} ids from {ids_off} run past the ids buffer ({} entries)",
            ids.size() / 4
        )));
    }
    let n = n_tokens as u64 * row_len as u64;
    if n > u32::MAX as u64 - WG as u64 {
        return Err(Error::Invalid(format!(
            "embed: {n} elements is too many for one dispatch"
        )));
    }
    #[derive(PartialEq, Eq, Hash)]
    struct Embed {
        /// The table's stored type.
        dtype: DType,
    }
    impl super::PipelineKey for Embed {
        fn source(&self) -> &'static str {
            SRC
        }
        fn entry(&self) -> &'static str {
            "main"
        }
        fn label(&self) -> String {
            format!("embed_{}", self.dtype.name())
        }
        fn defines(&self, spec: PipelineSpec) -> PipelineSpec {
            spec.define(&format!("T_{}", self.dtype.name()), true)
                .define("TYPE_SET", true)
        }
    }
    let pl = pass.gpu().pipeline_for(Embed { dtype: dt })?;
    for (k, part) in table.parts.iter().enumerate() {
        if part.n_rows * row_bytes > part.buffer.size() {
            return Err(Error::Invalid(format!(
                "embedding `{}`: part {k} claims {} rows but its buffer holds {} bytes",
                table.name,
                part.n_rows,
                part.buffer.size()
            )));
        }
        let params = Params {
            row_len,
            n_tokens,
            ids_off,
            y_off: y.off,
            y_stride: y.stride_for(row_len),
            row_bytes: row_bytes as u32,
            part_start: part.row_start.min(u32::MAX as u64) as u32,
            part_rows: part.n_rows.min(u32::MAX as u64) as u32,
            n_total_rows: n_total,
            zero_invalid: (k == 0) as u32,
            _pad: [0; 2],
        };
        let bindings = [
            Binding::from(y.buf),
            Binding::from(ids),
            Binding::from(&part.buffer),
        ];
        pass.dispatch(
            &pl,
            "embed",
            &params,
            &bindings,
            grid((n as u32).div_ceil(WG)),
        );
    }
    Ok(())
}
