//! Compiled pipelines kept between runs: wgpu's [`wgpu::PipelineCache`] (Vulkan only), read
//! from and written to one file per adapter and driver in the user's cache directory
//! (`$XDG_CACHE_HOME/lathe/pipelines`, else `~/.cache/lathe/pipelines`: the XDG base
//! directory convention, as `hub` follows it for the Hugging Face cache).
//!
//! The file is lathe's header (magic, length, sha256 of the payload) and the bytes
//! `PipelineCache::get_data` returned. It is written as wgpu's docs ask: to a temporary file
//! in the same directory, then renamed over the old one, so a reader sees a whole file or
//! the previous one; two processes saving at once each rename a whole file. A file that is
//! truncated, extended or corrupted fails the check and is ignored (the run compiles as if
//! there were none, and saves a good one); wgpu then checks its own header (adapter, wgpu
//! version) and the driver its own (vendor, device, pipeline cache UUID).

use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};

const MAGIC: &[u8; 8] = b"LATHEPC1";
/// Magic, payload length (u64 LE), sha256 of the payload.
const HEADER: usize = 8 + 8 + 32;

pub(crate) struct DiskCache {
    cache: wgpu::PipelineCache,
    path: PathBuf,
    /// Pipelines were created since the cache was read or last saved.
    dirty: AtomicBool,
}

/// `$XDG_CACHE_HOME/lathe/pipelines` (when set to an absolute path, as the XDG spec asks),
/// else `$HOME/.cache/lathe/pipelines`; `None` without either.
pub fn cache_dir() -> Option<PathBuf> {
    let var = |k| {
        std::env::var_os(k)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    };
    let base = var("XDG_CACHE_HOME")
        .filter(|p| p.is_absolute())
        .or_else(|| var("HOME").map(|h| h.join(".cache")))?;
    Some(base.join("lathe").join("pipelines"))
}

/// The file of one adapter and driver: wgpu's key (backend, vendor, device) and a hash of
/// the adapter's name and driver strings, so a driver update starts a new file instead of
/// offering the driver data it would refuse.
fn file_name(info: &wgpu::AdapterInfo) -> Option<String> {
    let key = wgpu::util::pipeline_cache_key(info)?;
    let mut h = Sha256::new();
    for s in [&info.name, &info.driver, &info.driver_info] {
        h.update(s.as_bytes());
        h.update([0]);
    }
    let d = h.finalize();
    let hex: String = d[..8].iter().map(|b| format!("{b:02x}")).collect();
    Some(format!("{key}_{hex}.bin"))
}

/// The payload of a cache file's bytes, or `None` when they are not a whole, intact file.
pub fn unwrap(file: &[u8]) -> Option<&[u8]> {
    if file.len() < HEADER || &file[..8] != MAGIC {
        return None;
    }
    let len = u64::from_le_bytes(file[8..16].try_into().ok()?);
    let payload = &file[HEADER..];
    (payload.len() as u64 == len && Sha256::digest(payload)[..] == file[16..HEADER])
        .then_some(payload)
}

/// `payload` with the header [`unwrap`] checks.
pub fn wrap(payload: &[u8]) -> Vec<u8> {
    let mut v = Vec::with_capacity(HEADER + payload.len());
    v.extend_from_slice(MAGIC);
    v.extend_from_slice(&(payload.len() as u64).to_le_bytes());
    v.extend_from_slice(&Sha256::digest(payload));
    v.extend_from_slice(payload);
    v
}

/// Writes `bytes` to `path` through a temporary file in the same directory and a rename.
fn write_atomic(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir)?;
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    std::fs::write(&tmp, bytes)
        .and_then(|()| std::fs::rename(&tmp, path))
        .inspect_err(|_| {
            let _ = std::fs::remove_file(&tmp);
        })
}

impl DiskCache {
    /// The cache of `device`'s adapter, primed from its file when that is intact; `None`
    /// where the backend has no pipeline cache (GL, Metal, DX12) or there is no cache dir.
    pub(crate) fn open(
        device: &wgpu::Device,
        info: &wgpu::AdapterInfo,
        features: wgpu::Features,
    ) -> Option<DiskCache> {
        if !features.contains(wgpu::Features::PIPELINE_CACHE) {
            return None;
        }
        let path = cache_dir()?.join(file_name(info)?);
        let file = std::fs::read(&path).ok();
        let data = file.as_deref().and_then(unwrap);
        // SAFETY: `data` passed lathe's check, so it is the bytes an earlier run got from
        // `PipelineCache::get_data`; wgpu validates its header against this adapter and
        // wgpu version, and `fallback` makes an empty cache when that fails.
        let cache = unsafe {
            device.create_pipeline_cache(&wgpu::PipelineCacheDescriptor {
                label: Some("lathe pipelines"),
                data,
                fallback: true,
            })
        };
        Some(DiskCache {
            cache,
            path,
            dirty: AtomicBool::new(false),
        })
    }

    pub(crate) fn cache(&self) -> &wgpu::PipelineCache {
        &self.cache
    }

    /// A pipeline was created through the cache: the file is out of date.
    pub(crate) fn touch(&self) {
        self.dirty.store(true, Ordering::Relaxed);
    }

    /// Writes the cache to its file when pipelines were created since it was read or saved.
    pub(crate) fn save(&self) -> std::io::Result<()> {
        if !self.dirty.swap(false, Ordering::Relaxed) {
            return Ok(());
        }
        match self.cache.get_data() {
            Some(data) => write_atomic(&self.path, &wrap(&data)),
            None => Ok(()),
        }
    }

    pub(crate) fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for DiskCache {
    /// Pipelines compiled after the last save (a kernel first used mid-run) are kept too.
    fn drop(&mut self) {
        if let Err(e) = self.save() {
            eprintln!(
                "note: could not save the pipeline cache {}: {e}",
                self.path.display()
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{unwrap, wrap};

    #[test]
    fn damaged_files_are_refused() {
        let payload = b"pipeline bytes".repeat(10);
        let file = wrap(&payload);
        assert_eq!(unwrap(&file), Some(&payload[..]));
        assert_eq!(unwrap(&file[..file.len() - 1]), None, "truncated");
        assert_eq!(unwrap(&file[..20]), None, "truncated in the header");
        assert_eq!(unwrap(b""), None, "empty");
        let mut longer = file.clone();
        longer.push(0);
        assert_eq!(unwrap(&longer), None, "extended");
        let mut flipped = file.clone();
        *flipped.last_mut().unwrap() ^= 1;
        assert_eq!(unwrap(&flipped), None, "corrupted");
        let mut magic = file;
        magic[0] = b'X';
        assert_eq!(unwrap(&magic), None, "not lathe's file");
    }
}
