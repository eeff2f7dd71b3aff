//! What a kernel wrapper reads or writes: [`Operand`], rows of 32-bit elements (f32, or u32
//! ids and tables) in a buffer. Offsets and
//! strides count elements, not bytes, because every kernel's uniforms take them so (a buffer
//! binding is whole; the shader indexes `buf[off + r·stride + i]`).

use crate::Result;

/// Rows of a buffer: row `r` starts at element `off + r·stride`. `stride: None` means packed
/// rows (stride = the op's row length); `Some(0)` repeats one row for every row.
#[derive(Clone, Copy, Debug)]
pub struct Operand<'a> {
    pub buf: &'a wgpu::Buffer,
    /// In elements.
    pub off: u32,
    /// In elements; `None` = packed.
    pub stride: Option<u32>,
}

impl<'a> Operand<'a> {
    /// Packed rows starting at element `off`.
    pub fn new(buf: &'a wgpu::Buffer, off: u32) -> Self {
        Operand {
            buf,
            off,
            stride: None,
        }
    }
    /// Rows `stride` elements apart starting at element `off`.
    pub fn strided(buf: &'a wgpu::Buffer, off: u32, stride: u32) -> Self {
        Operand {
            buf,
            off,
            stride: Some(stride),
        }
    }
    /// The stride for rows of `row_len` elements.
    pub fn stride_for(&self, row_len: u32) -> u32 {
        self.stride.unwrap_or(row_len)
    }
    /// Last element index (exclusive) touched by `n_rows` rows of `row_len`, for bounds checks.
    pub(crate) fn end(&self, n_rows: u32, row_len: u32) -> u64 {
        if n_rows == 0 {
            return self.off as u64;
        }
        self.off as u64 + (n_rows as u64 - 1) * self.stride_for(row_len) as u64 + row_len as u64
    }
    /// Errors when the rows run past the end of the buffer (`what` names the operand).
    pub(crate) fn check(&self, op: &str, what: &str, n_rows: u32, row_len: u32) -> Result<()> {
        super::check_len(op, what, self.buf, self.end(n_rows, row_len))
    }
}
