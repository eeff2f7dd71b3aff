//! huggingface_hub's cache directory of one repo (`models--owner--repo`), and the `ls` / `rm`
//! views over the whole cache.

use std::path::{Path, PathBuf};

use super::select;
use crate::{Error, Result};

/// The cache folder of one model repo.
pub struct RepoCache {
    dir: PathBuf,
}

/// `models--owner--repo`, as huggingface_hub's `repo_folder_name` names it.
fn folder_name(repo: &str) -> String {
    format!("models--{}", repo.replace('/', "--"))
}

/// `owner/repo` back from a folder name (repo ids never contain `--`).
fn repo_of_folder(name: &str) -> Option<String> {
    let rest = name.strip_prefix("models--")?;
    let (owner, repo) = rest.split_once("--")?;
    Some(format!("{owner}/{repo}"))
}

impl RepoCache {
    pub fn new(cache_dir: &Path, repo: &str) -> Self {
        RepoCache {
            dir: cache_dir.join(folder_name(repo)),
        }
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn blobs_dir(&self) -> PathBuf {
        self.dir.join("blobs")
    }

    pub fn blob(&self, etag: &str) -> PathBuf {
        self.blobs_dir().join(etag)
    }

    /// Where a blob is written until its hash is checked (huggingface_hub's name for it, so
    /// either tool resumes the other's partial download).
    pub fn partial(&self, etag: &str) -> PathBuf {
        self.blobs_dir().join(format!("{etag}.incomplete"))
    }

    pub fn partial_len(&self, etag: &str) -> u64 {
        std::fs::metadata(self.partial(etag)).map_or(0, |m| m.len())
    }

    pub fn snapshot(&self, commit: &str) -> PathBuf {
        self.dir.join("snapshots").join(commit)
    }

    /// The commit `refs/main` holds.
    pub fn read_ref(&self) -> Option<String> {
        let text = std::fs::read_to_string(self.dir.join("refs/main")).ok()?;
        let commit = text.trim();
        (!commit.is_empty() && !commit.contains(['/', '\\'])).then(|| commit.to_string())
    }

    pub fn write_ref(&self, commit: &str) -> Result<()> {
        let refs = self.dir.join("refs");
        std::fs::create_dir_all(&refs).map_err(|e| Error::io(&refs, e))?;
        let path = refs.join("main");
        std::fs::write(&path, commit).map_err(|e| Error::io(&path, e))
    }

    /// Points `snapshots/<commit>/<file>` at `blobs/<etag>` with a relative symlink, as
    /// huggingface_hub does (`_create_symlink`), replacing an older link.
    pub fn link(&self, commit: &str, file: &str, etag: &str) -> Result<()> {
        let pointer = self.snapshot(commit).join(file);
        let parent = pointer.parent().expect("a snapshot file has a parent");
        std::fs::create_dir_all(parent).map_err(|e| Error::io(parent, e))?;
        let depth = file.split('/').count();
        let target = format!("{}blobs/{etag}", "../".repeat(depth + 1));
        if std::fs::read_link(&pointer).is_ok_and(|t| t == Path::new(&target)) {
            return Ok(());
        }
        if pointer.symlink_metadata().is_ok() {
            std::fs::remove_file(&pointer).map_err(|e| Error::io(&pointer, e))?;
        }
        make_link(&target, &self.blob(etag), &pointer)
    }

    /// The files of a snapshot whose content is present (a link to a missing blob does not
    /// count), as (path inside the repo, size), sorted.
    pub fn snapshot_files(&self, commit: &str) -> Vec<(String, u64)> {
        let mut out = Vec::new();
        walk(&self.snapshot(commit), "", &mut out);
        out.sort();
        out
    }
}

#[cfg(unix)]
fn make_link(target: &str, _blob: &Path, pointer: &Path) -> Result<()> {
    std::os::unix::fs::symlink(target, pointer).map_err(|e| Error::io(pointer, e))
}

/// Without symlinks huggingface_hub copies the blob into the snapshot; so do we.
#[cfg(not(unix))]
fn make_link(_target: &str, blob: &Path, pointer: &Path) -> Result<()> {
    std::fs::copy(blob, pointer)
        .map(|_| ())
        .map_err(|e| Error::io(pointer, e))
}

/// The files under `dir`, descending into real folders only: a symlink to a folder (two
/// `ln -s .` links make the walk grow exponentially, one lists `self/self/...`) is not a
/// file huggingface_hub writes, so it is skipped; links to files are followed, and a dangling
/// one is skipped.
fn walk(dir: &Path, prefix: &str, out: &mut Vec<(String, u64)>) {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return;
    };
    for ent in rd.flatten() {
        let Some(name) = ent.file_name().to_str().map(str::to_string) else {
            continue;
        };
        let rel = format!("{prefix}{name}");
        match (ent.file_type(), std::fs::metadata(ent.path())) {
            (Ok(t), Ok(_)) if t.is_dir() => walk(&ent.path(), &format!("{rel}/"), out),
            (Ok(_), Ok(m)) if m.is_file() => out.push((rel, m.len())),
            _ => {}
        }
    }
}

/// Bytes free for an unprivileged user on the filesystem holding `dir`.
#[cfg(unix)]
pub fn free_space(dir: &Path) -> Option<u64> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(dir.as_os_str().as_bytes()).ok()?;
    let mut st = std::mem::MaybeUninit::<libc::statvfs>::uninit();
    // SAFETY: `c` is a NUL-terminated path and `st` is written by statvfs before it is read.
    let rc = unsafe { libc::statvfs(c.as_ptr(), st.as_mut_ptr()) };
    if rc != 0 {
        return None;
    }
    // SAFETY: statvfs returned 0, so it filled `st`.
    let st = unsafe { st.assume_init() };
    #[allow(clippy::unnecessary_cast)] // the field widths differ between platforms
    Some(st.f_bavail as u64 * st.f_frsize as u64)
}

#[cfg(not(unix))]
pub fn free_space(_dir: &Path) -> Option<u64> {
    None
}

/// One file of a cached snapshot, for `lathe ls`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CachedFile {
    pub repo: String,
    pub file: String,
    pub size: u64,
    /// The quant type in a GGUF file's name; `None` for other files.
    pub quant: Option<String>,
}

/// Every model file in the cache: each repo's snapshots, the one `refs/main` names first,
/// a file listed once per repo. Repos written by Python tools appear too.
pub fn list(cache_dir: &Path) -> Result<Vec<CachedFile>> {
    let mut out = Vec::new();
    let rd = match std::fs::read_dir(cache_dir) {
        Ok(rd) => rd,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(out),
        Err(e) => return Err(Error::io(cache_dir, e)),
    };
    let mut repos: Vec<(String, PathBuf)> = rd
        .flatten()
        .filter_map(|e| Some((repo_of_folder(e.file_name().to_str()?)?, e.path())))
        .collect();
    repos.sort();
    for (repo, dir) in repos {
        let cache = RepoCache { dir };
        let main = cache.read_ref();
        let mut commits: Vec<String> = std::fs::read_dir(cache.dir.join("snapshots"))
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| e.file_name().to_str().map(str::to_string))
            .collect();
        commits.sort_by_key(|c| (Some(c) != main.as_ref(), c.clone()));
        let mut seen = std::collections::HashSet::new();
        for commit in commits {
            for (file, size) in cache.snapshot_files(&commit) {
                if seen.insert(file.clone()) {
                    out.push(CachedFile {
                        repo: repo.clone(),
                        quant: select::gguf_quant(&file),
                        file,
                        size,
                    });
                }
            }
        }
    }
    Ok(out)
}

/// What `remove` deleted.
#[derive(Debug, Default)]
pub struct Removed {
    /// Snapshot files (`owner/repo`, path) whose links were removed.
    pub files: Vec<(String, String)>,
    /// Bytes of blobs (and partial downloads) deleted.
    pub bytes: u64,
}

/// Removes a repo from the cache, or with `quant` only its GGUF files of that quant type
/// (and the blobs no other snapshot file uses).
pub fn remove(cache_dir: &Path, repo: &str, quant: Option<&str>) -> Result<Removed> {
    let cache = RepoCache::new(cache_dir, repo);
    if !cache.dir.is_dir() {
        return Err(Error::Hub {
            repo: repo.to_string(),
            what: format!("not in the cache ({})", cache_dir.display()),
        });
    }
    let mut removed = Removed::default();
    let snapshots = cache.dir.join("snapshots");
    let commits: Vec<String> = std::fs::read_dir(&snapshots)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().to_str().map(str::to_string))
        .collect();
    let Some(quant) = quant else {
        // remove_dir_all deletes links, never what they point at: a file whose link leads
        // out of the repo's folder stays, and is not reported removed.
        let inside = cache
            .dir
            .canonicalize()
            .map_err(|e| Error::io(&cache.dir, e))?;
        for commit in &commits {
            for (file, _) in cache.snapshot_files(commit) {
                let real = cache.snapshot(commit).join(&file).canonicalize();
                if real.is_ok_and(|r| r.starts_with(&inside)) {
                    removed.files.push((repo.to_string(), file));
                }
            }
        }
        removed.bytes = dir_bytes(&cache.blobs_dir());
        std::fs::remove_dir_all(&cache.dir).map_err(|e| Error::io(&cache.dir, e))?;
        return Ok(removed);
    };
    let mut links = Vec::new();
    for commit in &commits {
        links_under(&cache.snapshot(commit), &mut links);
    }
    let (doomed, kept): (Vec<_>, Vec<_>) = links.into_iter().partition(|p| {
        let name = p.file_name().unwrap_or_default().to_string_lossy();
        name.to_ascii_lowercase().ends_with(".gguf") && select::matches_quant(&name, quant)
    });
    if doomed.is_empty() {
        return Err(Error::Hub {
            repo: format!("{repo}:{quant}"),
            what: "no cached GGUF file of that quant type (see `lathe ls`)".into(),
        });
    }
    let blob_of = |p: &Path| -> Option<PathBuf> {
        let target = std::fs::read_link(p).ok()?;
        Some(cache.blobs_dir().join(target.file_name()?))
    };
    let still_used: std::collections::HashSet<PathBuf> =
        kept.iter().filter_map(|p| blob_of(p)).collect();
    for p in &doomed {
        let blob = blob_of(p);
        std::fs::remove_file(p).map_err(|e| Error::io(p, e))?;
        let rel = p
            .strip_prefix(&snapshots)
            .ok()
            .and_then(|r| {
                r.iter()
                    .skip(1)
                    .map(|c| c.to_str())
                    .collect::<Option<Vec<_>>>()
            })
            .map(|v| v.join("/"))
            .unwrap_or_default();
        removed.files.push((repo.to_string(), rel));
        if let Some(blob) = blob.filter(|b| !still_used.contains(b)) {
            if let Ok(m) = std::fs::metadata(&blob) {
                std::fs::remove_file(&blob).map_err(|e| Error::io(&blob, e))?;
                removed.bytes += m.len();
            }
        }
    }
    Ok(removed)
}

fn links_under(dir: &Path, out: &mut Vec<PathBuf>) {
    for ent in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let p = ent.path();
        match ent.file_type() {
            Ok(t) if t.is_dir() => links_under(&p, out),
            Ok(_) => out.push(p),
            Err(_) => {}
        }
    }
}

fn dir_bytes(dir: &Path) -> u64 {
    std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.metadata().ok())
        .filter(|m| m.is_file())
        .map(|m| m.len())
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn folder_names_round_trip() {
        assert_eq!(
            folder_name("unsloth/Qwen3.5-4B-GGUF"),
            "models--unsloth--Qwen3.5-4B-GGUF"
        );
        assert_eq!(
            repo_of_folder("models--unsloth--Qwen3.5-4B-GGUF").as_deref(),
            Some("unsloth/Qwen3.5-4B-GGUF")
        );
        assert_eq!(repo_of_folder("datasets--a--b"), None);
    }
}
