//! A tensor as a model file stores it: borrowed bytes of an mmap plus its type and shape.
//! Both file formats hand these out; loaders and kernels take them.

use crate::DType;
use std::path::Path;

/// Shape convention everywhere in lathe: outermost dimension first, as NumPy and PyTorch
/// print it. A weight matrix `[rows, cols]` = `[out_features, in_features]`; a row is
/// contiguous. (GGUF stores `ne[0]` = cols first; the GGUF reader reverses it.)
#[derive(Clone, Copy, Debug)]
pub struct TensorRef<'a> {
    pub name: &'a str,
    pub dtype: DType,
    pub shape: &'a [u64],
    /// Exactly `dtype.bytes_for(n_elements)` bytes.
    pub data: &'a [u8],
    /// The file the bytes come from (for error messages).
    pub path: &'a Path,
}

impl<'a> TensorRef<'a> {
    pub fn n_elements(&self) -> u64 {
        self.shape.iter().product()
    }
    /// Length of the innermost (contiguous) dimension.
    pub fn row_len(&self) -> u64 {
        self.shape.last().copied().unwrap_or(1)
    }
    /// Number of rows (product of all but the innermost dimension).
    pub fn n_rows(&self) -> u64 {
        self.n_elements() / self.row_len().max(1)
    }
    /// Bytes of one row.
    pub fn row_bytes(&self) -> usize {
        (self.row_len() as usize / self.dtype.block_size()) * self.dtype.block_bytes()
    }
}

/// One matrix of a stack (e.g. one routed expert's gate): `rows × cols` elements of `dtype`
/// (rows contiguous, ggml blocks).
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
