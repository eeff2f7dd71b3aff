//! Models by name: `owner/repo[:QUANT]` fetched from the Hugging Face Hub into the cache that
//! Python's `huggingface_hub` uses, so either side reuses the other's downloads.
//!
//! Cache layout (huggingface_hub's `file_download.py`, "cache-system"):
//! `<cache>/models--owner--repo/blobs/<etag>` holds each file once (the etag of an LFS file is
//! its sha256, of a small git file its git blob id), `snapshots/<commit>/<path>` is a relative
//! symlink to the blob, `refs/main` holds the commit `main` pointed at when last fetched.
//! A blob is written as `blobs/<etag>.incomplete`, resumed with `Range: bytes=N-`, and renamed
//! into place only after its hash matched the Hub's (the LFS sha256; for a small file kept in
//! git, its git blob id), so a blob path never holds a partial or corrupted file.
//!
//! This module is a front-end helper at the level of the file formats: it knows file names,
//! not models; the CLI resolves `-m` through it before anything is loaded.

pub mod cache;
mod client;
pub mod select;

use std::path::PathBuf;

use crate::{Error, Result};
use cache::RepoCache;
use client::{Client, Fail, RemoteFile};
use select::Choice;

/// Where and how to reach the Hub: huggingface_hub's environment conventions
/// (`constants.py`), read once by the front end.
#[derive(Debug, Clone)]
pub struct HubConfig {
    /// `HF_ENDPOINT`, default `https://huggingface.co`.
    pub endpoint: String,
    /// `HF_HUB_CACHE`, else `$HF_HOME/hub`, else `$XDG_CACHE_HOME/huggingface/hub`, else
    /// `~/.cache/huggingface/hub`.
    pub cache_dir: PathBuf,
    /// `HF_TOKEN`, else the file `HF_TOKEN_PATH`, else `$HF_HOME/token` (what `hf auth login`
    /// writes).
    pub token: Option<String>,
    /// `HF_HUB_OFFLINE` set to 1/ON/YES/TRUE: no request at all, the cache only.
    pub offline: bool,
}

impl HubConfig {
    /// The configuration from this process's environment.
    pub fn from_env() -> Self {
        Self::from_vars(|k| std::env::var(k).ok().filter(|v| !v.is_empty()))
    }

    /// The configuration from a variable lookup (for tests: no process-wide state).
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Self {
        let home = var("HOME").map(PathBuf::from).unwrap_or_default();
        let hf_home = var("HF_HOME").map(PathBuf::from).unwrap_or_else(|| {
            var("XDG_CACHE_HOME")
                .map(PathBuf::from)
                .unwrap_or_else(|| home.join(".cache"))
                .join("huggingface")
        });
        let cache_dir = var("HF_HUB_CACHE")
            .or_else(|| var("HUGGINGFACE_HUB_CACHE"))
            .map(PathBuf::from)
            .unwrap_or_else(|| hf_home.join("hub"));
        let token_file = var("HF_TOKEN_PATH")
            .map(PathBuf::from)
            .unwrap_or_else(|| hf_home.join("token"));
        let token = var("HF_TOKEN").or_else(|| {
            std::fs::read_to_string(token_file)
                .ok()
                .map(|t| t.trim().to_string())
                .filter(|t| !t.is_empty())
        });
        let truthy = |v: String| {
            ["1", "ON", "YES", "TRUE"]
                .iter()
                .any(|t| v.trim().eq_ignore_ascii_case(t))
        };
        HubConfig {
            endpoint: var("HF_ENDPOINT")
                .unwrap_or_else(|| "https://huggingface.co".into())
                .trim_end_matches('/')
                .to_string(),
            cache_dir,
            token,
            offline: var("HF_HUB_OFFLINE").is_some_and(truthy),
        }
    }
}

/// A model named on the Hub: `owner/repo`, `owner/repo:QUANT`, `hf://owner/repo[:QUANT]` or
/// `hf://owner/repo/path/file.gguf`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelRef {
    pub repo: String,
    /// The quant type asked for (`Q4_K_M`), matched case-insensitively against file names.
    pub quant: Option<String>,
    /// One file of the repo asked for by path (a GGUF, or any part of a split one).
    pub file: Option<String>,
}

impl std::fmt::Display for ModelRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.repo)?;
        if let Some(q) = &self.quant {
            write!(f, ":{q}")?;
        }
        if let Some(p) = &self.file {
            write!(f, "/{p}")?;
        }
        Ok(())
    }
}

/// A repo id as huggingface_hub's `validate_repo_id` accepts it: `owner/name`, each of
/// letters, digits, `-`, `_` and `.`, not starting or ending with `-` or `.`, without `--`
/// or `..`, the name at most 96 characters.
fn valid_repo_id(id: &str) -> bool {
    let Some((owner, name)) = id.split_once('/') else {
        return false;
    };
    let part = |s: &str, max: usize| {
        !s.is_empty()
            && s.len() <= max
            && s.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b))
            && !s.starts_with(['-', '.'])
            && !s.ends_with(['-', '.'])
            && !s.contains("--")
            && !s.contains("..")
    };
    part(owner, 96) && part(name, 96)
}

/// A file path inside a repo as lathe writes it into the cache: relative, `/`-separated,
/// without empty, `.` or `..` parts (each would point the snapshot's link somewhere else:
/// `a/./b` at the cache root's `blobs/`, `..` out of the snapshot), and without control
/// characters (a newline breaks `lathe ls`' lines, ESC drives the terminal).
fn valid_file_path(path: &str) -> bool {
    !path.is_empty()
        && !path.chars().any(char::is_control)
        && !path
            .split('/')
            .any(|c| c.is_empty() || c == "." || c == "..")
}

/// `text` with the `user:password@` of any URL in it replaced by `***@` (HF_ENDPOINT may carry
/// credentials; error messages name the endpoint).
pub fn redact_credentials(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.find("://") {
        let (head, tail) = rest.split_at(at + 3);
        out.push_str(head);
        let authority_end = tail
            .find(|c: char| c == '/' || c == '?' || c == '#' || c.is_whitespace())
            .unwrap_or(tail.len());
        match tail[..authority_end].rfind('@') {
            Some(userinfo_end) => {
                out.push_str("***");
                rest = &tail[userinfo_end..];
            }
            None => rest = tail,
        }
    }
    out.push_str(rest);
    out
}

fn valid_quant(q: &str) -> bool {
    !q.is_empty()
        && q.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_".contains(&b))
}

impl ModelRef {
    /// Reads a `-m` argument as a Hub name. `Ok(None)`: not a Hub name (a path, to be opened
    /// as one). `hf://` always means the Hub, so a malformed one is an error; a bare
    /// `owner/repo` is a Hub name only when it looks like one (a single `/`, no file
    /// extension of a model file), since it may also be a mistyped path.
    pub fn parse(arg: &str) -> Result<Option<ModelRef>> {
        if let Some(rest) = arg.strip_prefix("hf://") {
            return Self::parse_hf_url(rest).map(Some).ok_or_else(|| {
                Error::Invalid(format!(
                    "{arg}: not a Hub model; write hf://owner/repo, hf://owner/repo:QUANT or hf://owner/repo/file.gguf"
                ))
            });
        }
        let (repo, quant) = match arg.split_once(':') {
            Some((r, q)) => (r, Some(q)),
            None => (arg, None),
        };
        let lower = repo.to_ascii_lowercase();
        let model_file = [".gguf", ".safetensors", ".json", ".bin"]
            .iter()
            .any(|x| lower.ends_with(x));
        if !valid_repo_id(repo) || model_file || quant.is_some_and(|q| !valid_quant(q)) {
            return Ok(None);
        }
        Ok(Some(ModelRef {
            repo: repo.to_string(),
            quant: quant.map(str::to_string),
            file: None,
        }))
    }

    fn parse_hf_url(rest: &str) -> Option<ModelRef> {
        let mut parts = rest.splitn(3, '/');
        let owner = parts.next()?;
        let name = parts.next()?;
        let file = parts.next().filter(|f| !f.is_empty());
        let (name, quant) = match (name.split_once(':'), file) {
            (Some((n, q)), None) if valid_quant(q) => (n, Some(q.to_string())),
            (Some(_), _) => return None,
            (None, _) => (name, None),
        };
        let repo = format!("{owner}/{name}");
        let file_ok = file.is_none_or(valid_file_path);
        (valid_repo_id(&repo) && file_ok).then(|| ModelRef {
            repo,
            quant,
            file: file.map(str::to_string),
        })
    }
}

/// What a download reports while it runs (the front end draws it).
pub trait Progress {
    /// A file starts: `total` bytes, of which `done` are already on disk (a resumed partial).
    fn start(&mut self, _file: &str, _total: u64, _done: u64) {}
    /// `done` bytes of the current file are on disk.
    fn advance(&mut self, _done: u64) {}
    /// The current file ended: `done` when it is complete and verified.
    fn finish(&mut self, _done: bool) {}
    /// Something the user should know (e.g. the Hub is unreachable, the cache is used).
    fn note(&mut self, _msg: &str) {}
}

/// The local path of `model`: downloaded into the cache when missing (not in offline mode),
/// else taken from the cache. A GGUF model resolves to its file (the first part of a split
/// one, the others beside it), a safetensors model to its snapshot directory.
pub fn resolve(cfg: &HubConfig, model: &ModelRef, progress: &mut dyn Progress) -> Result<PathBuf> {
    let cache = RepoCache::new(&cfg.cache_dir, &model.repo);
    if cfg.offline {
        return from_cache(&cache, model).map_err(|e| {
            hub_error(
                model,
                format!(
                    "{e}; HF_HUB_OFFLINE is set, so nothing is downloaded: unset it, or run `lathe pull {model}` where the Hub is reachable"
                ),
            )
        });
    }
    let client = Client::new(cfg);
    let info = match client.repo_info(&model.repo) {
        Ok(info) => info,
        Err(Fail::Network(why)) => {
            // huggingface_hub falls back to the cache when the Hub cannot be reached.
            return match from_cache(&cache, model) {
                Ok(path) => {
                    progress.note(&redact_credentials(&format!(
                        "{}: cannot reach {} ({why}); using the cached snapshot",
                        model.repo, cfg.endpoint
                    )));
                    Ok(path)
                }
                Err(_) => Err(hub_error(
                    model,
                    format!(
                        "cannot reach {} ({why}) and the model is not in the cache ({}); check the network or HF_ENDPOINT (HF_HUB_OFFLINE=1 runs from the cache only)",
                        cfg.endpoint,
                        cfg.cache_dir.display()
                    ),
                )),
            };
        }
        Err(fail) => return Err(status_error(cfg, model, None, fail)),
    };

    let listing: Vec<(&str, u64)> = info
        .files
        .iter()
        .map(|f| (f.path.as_str(), f.size))
        .collect();
    let choice = select::choose(&listing, model).map_err(|what| hub_error(model, what))?;
    let by_path = |p: &str| info.files.iter().find(|f| f.path == p);
    let fetcher = Fetcher {
        client: &client,
        cfg,
        cache: &cache,
        model,
        commit: &info.commit,
    };
    let wanted: Vec<&RemoteFile> = choice.files().iter().filter_map(|p| by_path(p)).collect();
    fetcher.fetch_all(&wanted, progress)?;
    // Shards named by a safetensors index are known only once the index is here.
    if let Choice::Safetensors {
        index: Some(index), ..
    } = &choice
    {
        let snap = cache.snapshot(&info.commit);
        let shards = select::index_shards(&snap.join(index)).map_err(|w| hub_error(model, w))?;
        let wanted = shards
            .iter()
            .map(|s| {
                by_path(s).ok_or_else(|| {
                    hub_error(
                        model,
                        format!("{index} names shard `{s}`, which the repo does not have"),
                    )
                })
            })
            .collect::<Result<Vec<_>>>()?;
        fetcher.fetch_all(&wanted, progress)?;
    }
    cache
        .write_ref(&info.commit)
        .map_err(|e| hub_error(model, e.to_string()))?;
    Ok(choice.local_path(&cache.snapshot(&info.commit)))
}

/// The model from the snapshot `refs/main` names, when every file it needs is there.
fn from_cache(cache: &RepoCache, model: &ModelRef) -> std::result::Result<PathBuf, String> {
    let commit = cache
        .read_ref()
        .ok_or_else(|| format!("not in the cache ({})", cache.dir().display()))?;
    let snap = cache.snapshot(&commit);
    let present = cache.snapshot_files(&commit);
    let listing: Vec<(&str, u64)> = present.iter().map(|(p, s)| (p.as_str(), *s)).collect();
    let choice = select::choose(&listing, model).map_err(|e| format!("cached snapshot: {e}"))?;
    let mut need: Vec<String> = choice.files().to_vec();
    if let Choice::Safetensors {
        index: Some(index), ..
    } = &choice
    {
        need.extend(select::index_shards(&snap.join(index))?);
    }
    let missing: Vec<&String> = need.iter().filter(|f| !snap.join(f).is_file()).collect();
    if !missing.is_empty() {
        return Err(format!(
            "the cached snapshot {} lacks {}",
            snap.display(),
            missing
                .iter()
                .map(|s| s.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        ));
    }
    Ok(choice.local_path(&snap))
}

/// Every Hub error passes here: credentials in a URL are redacted and control characters (in
/// names from the Hub or the cache) escaped.
fn hub_error(model: &ModelRef, what: String) -> Error {
    Error::Hub {
        repo: model.to_string(),
        what: crate::error::escaped(&redact_credentials(&what)),
    }
}

/// The error for a refused request, in huggingface_hub's terms (`X-Error-Code`: RepoNotFound,
/// GatedRepo, EntryNotFound; the Hub answers 401 for a repo that is missing or private).
fn status_error(cfg: &HubConfig, model: &ModelRef, file: Option<&str>, fail: Fail) -> Error {
    let at = file.map(|f| format!("{f}: ")).unwrap_or_default();
    let what = match fail {
        Fail::Network(why) => format!(
            "{at}the transfer from {} failed ({why}); run the command again to resume the download",
            cfg.endpoint
        ),
        Fail::Status {
            code,
            error_code,
            message,
        } => {
            let msg = message.map(|m| format!(" ({m})")).unwrap_or_default();
            let no_token = cfg.token.is_none();
            match (error_code.as_deref(), code) {
                (Some("GatedRepo"), _) if no_token => format!(
                    "{at}a gated repo: accept its terms on the Hub, then set HF_TOKEN (or run `hf auth login`){msg}"
                ),
                (Some("GatedRepo"), _) => format!(
                    "{at}a gated repo, and the token in HF_TOKEN has no access: accept its terms on the Hub{msg}"
                ),
                (Some("EntryNotFound"), _) => format!("{at}no such file in the repo{msg}"),
                (Some("RevisionNotFound"), _) => format!("{at}no revision `main`{msg}"),
                (_, 401 | 403) if no_token => format!(
                    "{at}repository not found, or private or gated (HTTP {code}), and no local path of that name: check the name, or set HF_TOKEN{msg}"
                ),
                (_, 401 | 403) => format!(
                    "{at}access refused with the token in HF_TOKEN (HTTP {code}){msg}"
                ),
                (Some("RepoNotFound"), _) | (_, 404) if file.is_none() => {
                    format!(
                        "repository not found on {} (HTTP {code}), and no local path of that name{msg}",
                        cfg.endpoint
                    )
                }
                _ => format!("{at}HTTP {code} from {}{msg}", cfg.endpoint),
            }
        }
        Fail::Corrupt(what) => what,
        Fail::Other(e) => e.to_string(),
    };
    hub_error(model, what)
}

const GIB: f64 = (1u64 << 30) as f64;

/// What the downloads of one resolution share.
struct Fetcher<'a> {
    client: &'a Client,
    cfg: &'a HubConfig,
    cache: &'a RepoCache,
    model: &'a ModelRef,
    commit: &'a str,
}

impl Fetcher<'_> {
    /// Makes `snapshots/<commit>/<file>` point at a verified blob for each file, downloading
    /// the missing ones after checking the disk has room for all of them.
    fn fetch_all(&self, files: &[&RemoteFile], progress: &mut dyn Progress) -> Result<()> {
        self.check_space(files)?;
        for file in files {
            let etag = file.etag();
            if !self.cache.blob(&etag).exists() {
                self.client
                    .download(&self.model.repo, self.commit, file, self.cache, progress)
                    .map_err(|fail| status_error(self.cfg, self.model, Some(&file.path), fail))?;
            }
            self.cache
                .link(self.commit, &file.path, &etag)
                .map_err(|e| hub_error(self.model, format!("{}: {e}", file.path)))?;
        }
        Ok(())
    }

    /// Refuses before downloading when the disk holding the cache lacks room for what is left.
    fn check_space(&self, files: &[&RemoteFile]) -> Result<()> {
        let cache = self.cache;
        let left: u64 = files
            .iter()
            .filter(|f| !cache.blob(&f.etag()).exists())
            .map(|f| f.size.saturating_sub(cache.partial_len(&f.etag())))
            .sum();
        if left == 0 {
            return Ok(());
        }
        let dir = cache.blobs_dir();
        std::fs::create_dir_all(&dir).map_err(|e| Error::io(&dir, e))?;
        match cache::free_space(&dir) {
            Some(free) if free < left => Err(hub_error(
                self.model,
                format!(
                    "needs {:.2} GiB more in {} but only {:.2} GiB are free (HF_HUB_CACHE moves the cache, now {})",
                    left as f64 / GIB,
                    dir.display(),
                    free as f64 / GIB,
                    self.cfg.cache_dir.display()
                ),
            )),
            _ => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn credentials_are_redacted_and_dot_parts_refused() {
        assert_eq!(
            redact_credentials("cannot reach https://u:pw@hub.example:8443/api (x) or http://a@b"),
            "cannot reach https://***@hub.example:8443/api (x) or http://***@b"
        );
        assert_eq!(redact_credentials("http://h/a@b"), "http://h/a@b");
        for bad in ["a/./b", "./a", "a/..", "a//b", "", "a\nb", "a\u{1b}b"] {
            assert!(!valid_file_path(bad), "{bad:?}");
        }
        assert!(valid_file_path("sub/model.gguf"));
    }

    use std::path::Path;

    fn r(repo: &str, quant: Option<&str>, file: Option<&str>) -> Option<ModelRef> {
        Some(ModelRef {
            repo: repo.into(),
            quant: quant.map(Into::into),
            file: file.map(Into::into),
        })
    }

    #[test]
    fn model_arguments_parse_as_hub_names_or_paths() {
        let p = |s: &str| ModelRef::parse(s).unwrap();
        assert_eq!(
            p("unsloth/Qwen3.5-4B-GGUF"),
            r("unsloth/Qwen3.5-4B-GGUF", None, None)
        );
        assert_eq!(p("a/b:q4_k_m"), r("a/b", Some("q4_k_m"), None));
        assert_eq!(p("a/b:UD-Q4_K_XL"), r("a/b", Some("UD-Q4_K_XL"), None));
        assert_eq!(p("hf://a/b"), r("a/b", None, None));
        assert_eq!(p("hf://a/b:Q8_0"), r("a/b", Some("Q8_0"), None));
        assert_eq!(
            p("hf://a/b/sub/m-Q8_0.gguf"),
            r("a/b", None, Some("sub/m-Q8_0.gguf"))
        );
        // Paths stay paths.
        for s in [
            "model.gguf",
            "dir/model.gguf",
            "./a/b",
            "/abs/x",
            "a/b/c",
            "a/config.json",
            "a--b/c",
            "-a/b",
            "a/b:",
        ] {
            assert_eq!(p(s), None, "{s}");
        }
        assert!(ModelRef::parse("hf://a").is_err());
        assert!(ModelRef::parse("hf://a/b/../x.gguf").is_err());
        assert!(ModelRef::parse("hf://a/b:Q4/x.gguf").is_err());
    }

    #[test]
    fn config_follows_huggingface_hub_conventions() {
        let env = |pairs: &'static [(&'static str, &'static str)]| {
            HubConfig::from_vars(move |k| {
                pairs
                    .iter()
                    .find(|(n, _)| *n == k)
                    .map(|(_, v)| v.to_string())
            })
        };
        let c = env(&[("HOME", "/home/u")]);
        assert_eq!(c.cache_dir, Path::new("/home/u/.cache/huggingface/hub"));
        assert_eq!(c.endpoint, "https://huggingface.co");
        assert!(!c.offline);
        let c = env(&[
            ("HOME", "/h"),
            ("HF_HOME", "/hf"),
            ("HF_HUB_OFFLINE", "yes"),
        ]);
        assert_eq!(c.cache_dir, Path::new("/hf/hub"));
        assert!(c.offline);
        let c = env(&[
            ("HF_HOME", "/hf"),
            ("HF_HUB_CACHE", "/c"),
            ("HF_ENDPOINT", "http://127.0.0.1:9/"),
            ("HF_TOKEN", "hf_x"),
            ("HF_HUB_OFFLINE", "0"),
        ]);
        assert_eq!(c.cache_dir, Path::new("/c"));
        assert_eq!(c.endpoint, "http://127.0.0.1:9");
        assert_eq!(c.token.as_deref(), Some("hf_x"));
        assert!(!c.offline);
    }
}
