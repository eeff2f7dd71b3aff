//! Buffers: activations, uploads straight from the mmap, readback, and weight tensors
//! split across buffers when they exceed the adapter's binding limit.

use super::Gpu;
use crate::tensor::TensorRef;
use crate::{DType, Error, Result};

/// Errors unless rows `off + i·stride + [0, len)`, i < n, of 4-byte elements (f32 or u32)
/// lie in `buf` and their end fits a u32 element offset; `op` and `what` name the kernel and
/// the operand. The one bounds check of the kernel wrappers.
pub fn check_span(
    op: &str,
    what: &str,
    buf: &wgpu::Buffer,
    off: impl Into<u64>,
    stride: impl Into<u64>,
    n: impl Into<u64>,
    len: impl Into<u64>,
) -> Result<()> {
    let (off, stride, n, len) = (off.into(), stride.into(), n.into(), len.into());
    let end = off + n.max(1).saturating_sub(1) * stride + len;
    if end * 4 <= buf.size() && end <= u32::MAX as u64 {
        return Ok(());
    }
    let held = buf.size() / 4;
    Err(Error::Invalid(if n <= 1 && off == 0 {
        format!("{op}: {what} needs {end} elements, its buffer holds {held}")
    } else {
        format!(
            "{op}: {what} needs {end} elements (offset {off}, stride {stride}, {n} rows of \
             {len}), its buffer holds {held}"
        )
    }))
}

/// [`check_span`] of `end` elements from the buffer's start.
pub fn check_len(op: &str, what: &str, buf: &wgpu::Buffer, end: u64) -> Result<()> {
    check_span(op, what, buf, 0u64, 0u64, 1u64, end)
}

/// Errors unless `w` is one F32 buffer of `len` elements (a small weight vector a kernel
/// reads whole).
pub fn check_f32(op: &str, w: &GpuTensor, len: u64) -> Result<()> {
    if w.dtype != DType::F32 || w.n_rows() * w.row_len() != len || w.parts.len() != 1 {
        return Err(Error::Invalid(format!(
            "{op}: `{}` is {} {:?}, expected F32 with {len} elements in one buffer",
            w.name, w.dtype, w.shape
        )));
    }
    Ok(())
}

const STORAGE: wgpu::BufferUsages = wgpu::BufferUsages::STORAGE
    .union(wgpu::BufferUsages::COPY_DST)
    .union(wgpu::BufferUsages::COPY_SRC);

impl Gpu {
    /// A zeroed storage buffer of `bytes` (rounded up to 4). Out-of-memory becomes an error.
    pub fn buffer(&self, bytes: u64, label: &str) -> Result<wgpu::Buffer> {
        let size = bytes.max(4).next_multiple_of(4);
        if size > self.limits.max_buffer_size {
            return Err(Error::Gpu(format!(
                "{label}: buffer of {size} bytes exceeds the adapter's max_buffer_size {}",
                self.limits.max_buffer_size
            )));
        }
        let scope = self.device.push_error_scope(wgpu::ErrorFilter::OutOfMemory);
        let b = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some(label),
            size,
            usage: STORAGE,
            mapped_at_creation: false,
        });
        if let Some(e) = pollster::block_on(scope.pop()) {
            return Err(Error::Gpu(format!(
                "{label}: out of GPU memory allocating {size} bytes: {e}"
            )));
        }
        Ok(b)
    }

    /// A storage buffer holding `data` (padded with zeros to a multiple of 4 bytes).
    pub fn upload(&self, data: &[u8], label: &str) -> Result<wgpu::Buffer> {
        let b = self.buffer(data.len() as u64, label)?;
        self.write(&b, 0, data);
        Ok(b)
    }

    /// Write bytes at `offset` (ordered before the next submit). Pads to 4 bytes.
    pub fn write(&self, buf: &wgpu::Buffer, offset: u64, data: &[u8]) {
        if data.is_empty() {
            return;
        }
        if data.len().is_multiple_of(4) {
            self.queue.write_buffer(buf, offset, data);
        } else {
            let mut v = data.to_vec();
            v.resize(data.len().next_multiple_of(4), 0);
            self.queue.write_buffer(buf, offset, &v);
        }
    }

    pub fn upload_f32(&self, data: &[f32], label: &str) -> Result<wgpu::Buffer> {
        self.upload(bytemuck::cast_slice(data), label)
    }

    /// Copy `len` bytes at `offset` back to the host (waits for all submitted work).
    pub fn read_bytes(&self, buf: &wgpu::Buffer, offset: u64, len: u64) -> Result<Vec<u8>> {
        let len4 = len.next_multiple_of(4);
        let staging = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("lathe.readback"),
            size: len4.max(4),
            usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        let mut enc = self.device.create_command_encoder(&Default::default());
        enc.copy_buffer_to_buffer(buf, offset, &staging, 0, len4);
        self.queue.submit([enc.finish()]);
        let slice = staging.slice(..);
        let (tx, rx) = std::sync::mpsc::channel();
        slice.map_async(wgpu::MapMode::Read, move |r| {
            let _ = tx.send(r);
        });
        self.wait()?;
        rx.recv()
            .map_err(|_| Error::Gpu("readback: map callback never ran".into()))?
            .map_err(|e| Error::Gpu(format!("readback: {e}")))?;
        let v = slice
            .get_mapped_range()
            .map_err(|e| Error::Gpu(format!("readback: {e:?}")))?
            .to_vec();
        staging.unmap();
        Ok(v[..len as usize].to_vec())
    }

    pub fn read_f32(&self, buf: &wgpu::Buffer, offset_elems: u64, n: usize) -> Result<Vec<f32>> {
        let b = self.read_bytes(buf, offset_elems * 4, n as u64 * 4)?;
        Ok(bytemuck::pod_collect_to_vec(&b))
    }

    pub fn read_u32(&self, buf: &wgpu::Buffer, offset_elems: u64, n: usize) -> Result<Vec<u32>> {
        let b = self.read_bytes(buf, offset_elems * 4, n as u64 * 4)?;
        Ok(bytemuck::pod_collect_to_vec(&b))
    }

    /// Upload a weight tensor from the mmap, split by whole rows (whole matrices for 3-D
    /// expert stacks) into parts no larger than the binding limit.
    pub fn upload_tensor(&self, t: &TensorRef<'_>) -> Result<GpuTensor> {
        let shape: Vec<u64> = t.shape.to_vec();
        // The unit that never straddles two parts: a row for matrices, a whole matrix for
        // stacks of experts (so an indexed matmul finds each expert in one buffer).
        let unit_rows = if shape.len() >= 3 {
            shape[shape.len() - 2]
        } else {
            1
        };
        let n_rows = t.n_rows();
        let row_bytes = t.row_bytes() as u64;
        let unit_bytes = row_bytes * unit_rows;
        let max = self.max_binding() & !3;
        if unit_bytes > max {
            return Err(Error::tensor(
                t.path,
                t.name,
                format!("one unit of {unit_bytes} bytes exceeds the adapter's binding limit {max}"),
            ));
        }
        let units_per_part = (max / unit_bytes.max(1)).max(1);
        let n_units = n_rows / unit_rows.max(1);
        let mut parts = Vec::new();
        let mut u = 0;
        while u < n_units || (n_units == 0 && parts.is_empty()) {
            let nu = units_per_part.min(n_units - u);
            let r0 = u * unit_rows;
            let nr = nu * unit_rows;
            let bytes = &t.data[(r0 * row_bytes) as usize..((r0 + nr) * row_bytes) as usize];
            let buffer = self.upload(bytes, t.name)?;
            parts.push(TensorPart {
                buffer,
                row_start: r0,
                n_rows: nr,
            });
            u += nu.max(1);
            if n_units == 0 {
                break;
            }
        }
        Ok(GpuTensor {
            name: t.name.to_string(),
            dtype: t.dtype,
            shape,
            parts,
        })
    }
}

impl Gpu {
    /// Several 2-D weights of one type and width as one `[Σ rows, cols]` tensor, rows in the
    /// order given: products that read the same input become one matvec over it, each
    /// member's outputs a column range of the result. Bytes go from the mmap straight into
    /// row ranges of the parts (split by whole rows, as [`Gpu::upload_tensor`]); no host
    /// copy of the weights.
    pub fn upload_concat(&self, ts: &[TensorRef<'_>], name: &str) -> Result<GpuTensor> {
        self.upload_concat_parts(ts, name, self.max_binding())
    }

    /// [`Gpu::upload_concat`] with parts of at most `max_part_bytes` (tests split small
    /// tensors with it; the adapter's binding limit still applies).
    #[doc(hidden)]
    pub fn upload_concat_parts(
        &self,
        ts: &[TensorRef<'_>],
        name: &str,
        max_part_bytes: u64,
    ) -> Result<GpuTensor> {
        let Some(first) = ts.first() else {
            return Err(Error::Invalid(format!(
                "{name}: concatenation of no tensors"
            )));
        };
        for t in ts {
            if t.shape.len() != 2 || t.dtype != first.dtype || t.row_len() != first.row_len() {
                return Err(Error::tensor(
                    t.path,
                    t.name,
                    format!(
                        "{} {:?} cannot be concatenated by rows with {} {:?} ({})",
                        t.dtype, t.shape, first.dtype, first.shape, first.name
                    ),
                ));
            }
        }
        let row_bytes = first.row_bytes() as u64;
        let n_rows: u64 = ts.iter().map(|t| t.n_rows()).sum();
        let max = max_part_bytes.min(self.max_binding()) & !3;
        if row_bytes > max {
            return Err(Error::tensor(
                first.path,
                first.name,
                format!("one row of {row_bytes} bytes exceeds the binding limit {max}"),
            ));
        }
        let rows_per_part = (max / row_bytes.max(1)).max(1);
        let mut parts = Vec::new();
        let mut r0 = 0;
        while r0 < n_rows {
            let nr = rows_per_part.min(n_rows - r0);
            let buffer = self.buffer(nr * row_bytes, name)?;
            let mut w = AlignedWriter::new(self, &buffer);
            // Member rows overlapping [r0, r0 + nr), in order.
            let mut m0 = 0;
            for t in ts {
                let (lo, hi) = (r0.max(m0), (r0 + nr).min(m0 + t.n_rows()));
                if lo < hi {
                    let (a, b) = ((lo - m0) * row_bytes, (hi - m0) * row_bytes);
                    w.push(&t.data[a as usize..b as usize]);
                }
                m0 += t.n_rows();
            }
            w.finish();
            parts.push(TensorPart {
                buffer,
                row_start: r0,
                n_rows: nr,
            });
            r0 += nr;
        }
        Ok(GpuTensor {
            name: name.to_string(),
            dtype: first.dtype,
            shape: vec![n_rows, first.row_len()],
            parts,
        })
    }
}

/// Sequential writes into a buffer at 4-byte aligned offsets and lengths (what
/// `Queue::write_buffer` requires), whatever the lengths of the pieces: the up to 3 bytes
/// of a piece that do not fill a word wait for the next piece's first bytes.
struct AlignedWriter<'a> {
    gpu: &'a Gpu,
    buf: &'a wgpu::Buffer,
    off: u64,
    carry: [u8; 4],
    n_carry: usize,
}

impl<'a> AlignedWriter<'a> {
    fn new(gpu: &'a Gpu, buf: &'a wgpu::Buffer) -> Self {
        AlignedWriter {
            gpu,
            buf,
            off: 0,
            carry: [0; 4],
            n_carry: 0,
        }
    }

    fn push(&mut self, mut data: &[u8]) {
        if self.n_carry > 0 {
            let take = (4 - self.n_carry).min(data.len());
            self.carry[self.n_carry..self.n_carry + take].copy_from_slice(&data[..take]);
            self.n_carry += take;
            data = &data[take..];
            if self.n_carry < 4 {
                return;
            }
            self.gpu.write(self.buf, self.off, &self.carry);
            self.off += 4;
            self.n_carry = 0;
        }
        let body = data.len() & !3;
        self.gpu.write(self.buf, self.off, &data[..body]);
        self.off += body as u64;
        let rest = &data[body..];
        self.carry[..rest.len()].copy_from_slice(rest);
        self.n_carry = rest.len();
    }

    /// Write the last partial word (zero-padded).
    fn finish(mut self) {
        if self.n_carry > 0 {
            self.carry[self.n_carry..].fill(0);
            self.gpu.write(self.buf, self.off, &self.carry);
        }
    }
}

/// A weight on the GPU, in its stored type. Shape outermost first; rows contiguous.
#[derive(Clone, Debug)]
pub struct GpuTensor {
    pub name: String,
    pub dtype: DType,
    pub shape: Vec<u64>,
    /// Row ranges (of the tensor flattened to 2-D) in separate buffers, in order.
    pub parts: Vec<TensorPart>,
}

#[derive(Clone, Debug)]
pub struct TensorPart {
    pub buffer: wgpu::Buffer,
    pub row_start: u64,
    pub n_rows: u64,
}

impl GpuTensor {
    pub fn row_len(&self) -> u64 {
        *self.shape.last().unwrap_or(&1)
    }
    pub fn n_rows(&self) -> u64 {
        self.shape.iter().product::<u64>() / self.row_len().max(1)
    }
    pub fn row_bytes(&self) -> u64 {
        self.row_len() / self.dtype.block_size() as u64 * self.dtype.block_bytes() as u64
    }
    pub fn bytes(&self) -> u64 {
        self.row_bytes() * self.n_rows()
    }
}
