//! The device limits a pass's buffers must fit. WebGPU bounds one buffer (`max_buffer_size`)
//! and one storage binding (`max_storage_buffer_binding_size`), not memory: lavapipe binds
//! 128 MiB of a 2 GiB buffer, and many integrated and mobile GPUs and some Metal devices are
//! as small. Kernels bind their activation, state and cache buffers whole, so each family
//! lists every buffer whose size follows the run (pass rows, sequences, context: its
//! `needs`), and the loader picks the pass length with [`fit_rows`]: a pass that would not
//! fit runs shorter, and a model that fits no pass gets an error naming the buffer at load,
//! not a validation error at its first pass.

use crate::{Error, Result};

/// How the kernels use a buffer: bound to a shader (both limits) or only a copy's source or
/// target (staging and readback: the buffer limit).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BufferUse {
    Bound,
    Copied,
}

/// One buffer a run allocates, by the label it is allocated under.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PassBuffer {
    pub label: &'static str,
    pub bytes: u64,
    pub usage: BufferUse,
}

impl PassBuffer {
    /// A buffer bound to shaders.
    pub fn bound(label: &'static str, bytes: u64) -> PassBuffer {
        PassBuffer {
            label,
            bytes,
            usage: BufferUse::Bound,
        }
    }

    /// A buffer only copied to or from.
    pub fn copied(label: &'static str, bytes: u64) -> PassBuffer {
        PassBuffer {
            label,
            bytes,
            usage: BufferUse::Copied,
        }
    }
}

/// The limits of one device on a single buffer and binding (bytes).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BufferLimits {
    /// `max_storage_buffer_binding_size`
    pub max_binding: u64,
    /// `max_buffer_size`
    pub max_buffer: u64,
}

/// A buffer over its limit, for an error message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OverLimit {
    pub label: &'static str,
    pub bytes: u64,
    pub limit: u64,
    /// The limit's name in `wgpu::Limits`.
    pub limit_name: &'static str,
}

impl std::fmt::Display for OverLimit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "buffer `{}` of {} bytes exceeds the adapter's {} of {} bytes",
            self.label, self.bytes, self.limit_name, self.limit
        )
    }
}

impl BufferLimits {
    /// The buffer limits of a device's `limits` (for a [`super::Gpu`], the ones it was
    /// created with: what its validation enforces).
    pub fn of(limits: &wgpu::Limits) -> BufferLimits {
        BufferLimits {
            max_binding: limits.max_storage_buffer_binding_size,
            max_buffer: limits.max_buffer_size,
        }
    }

    /// The first of `bufs` over its limit (sizes rounded up to 4 bytes, as `Gpu::buffer`
    /// allocates them); `None` when all fit.
    pub fn over(&self, bufs: &[PassBuffer]) -> Option<OverLimit> {
        bufs.iter().find_map(|b| {
            let bytes = b.bytes.max(4).next_multiple_of(4);
            let (limit, limit_name) = match b.usage {
                BufferUse::Bound if self.max_binding < self.max_buffer => {
                    (self.max_binding, "max_storage_buffer_binding_size")
                }
                _ => (self.max_buffer, "max_buffer_size"),
            };
            (bytes > limit).then_some(OverLimit {
                label: b.label,
                bytes,
                limit,
                limit_name,
            })
        })
    }
}

/// Rows of one pass: `want` halved (so a power-of-two length stays one, the tile sizes of the
/// products) until every buffer of `buffers(rows)` fits `limits`. An error naming the buffer
/// (with `what`, the model file) where even passes of one row do not fit.
pub fn fit_rows(
    want: usize,
    limits: BufferLimits,
    what: &std::path::Path,
    buffers: impl Fn(usize) -> Vec<PassBuffer>,
) -> Result<usize> {
    let mut rows = want.max(1);
    loop {
        match limits.over(&buffers(rows)) {
            None => return Ok(rows),
            Some(o) if rows == 1 => {
                return Err(Error::Unsupported(format!(
                    "{}: {o} even for passes of one token: use fewer sequences (--parallel) \
                     or a shorter context (--ctx), or a GPU with larger bindings",
                    what.display()
                )))
            }
            Some(_) => rows /= 2,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMITS: BufferLimits = BufferLimits {
        max_binding: 1000,
        max_buffer: 4000,
    };

    /// A pass halves until its largest bound buffer fits the binding limit; a copied one
    /// only needs the buffer limit; one that never fits is named with its size and limit.
    #[test]
    fn rows_halve_until_every_buffer_fits() {
        let bufs = |r: usize| {
            vec![
                PassBuffer::bound("x", r as u64 * 12),
                PassBuffer::copied("readback", r as u64 * 40),
            ]
        };
        let p = std::path::Path::new("m.gguf");
        assert_eq!(fit_rows(512, LIMITS, p, bufs).unwrap(), 64);
        assert_eq!(fit_rows(64, LIMITS, p, bufs).unwrap(), 64);
        let fixed = |_| vec![PassBuffer::bound("pool.cmp_store", 1001)];
        let e = fit_rows(512, LIMITS, p, fixed).unwrap_err().to_string();
        assert!(
            e.contains("m.gguf")
                && e.contains("`pool.cmp_store` of 1004 bytes")
                && e.contains("max_storage_buffer_binding_size of 1000 bytes"),
            "{e}"
        );
        let big = |_| vec![PassBuffer::copied("moe.upload", 4001)];
        let e = fit_rows(8, LIMITS, p, big).unwrap_err().to_string();
        assert!(e.contains("max_buffer_size of 4000 bytes"), "{e}");
    }
}
