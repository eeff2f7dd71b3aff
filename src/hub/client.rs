//! The few Hub requests lathe makes, on ureq (blocking, rustls):
//! - `GET {endpoint}/api/models/{repo}/revision/main?blobs=true`: the commit `main` points at
//!   and every file with its size, git blob id and, for LFS files, sha256 (huggingface_hub's
//!   `model_info(files_metadata=True)`);
//! - `GET {endpoint}/{repo}/resolve/{commit}/{file}`, following the redirect to the CDN, with
//!   `Range: bytes=N-` to resume a partial download.

use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::time::Duration;

use sha1::Sha1;
use sha2::{Digest, Sha256};
use ureq::http::Uri;

use super::cache::RepoCache;
use super::{HubConfig, Progress};
use crate::Error;

/// Why a request failed: the network (the Hub unreachable or the transfer cut), the Hub's
/// refusal, a corrupted transfer, or a local error (already naming its file).
pub enum Fail {
    Network(String),
    Status {
        code: u16,
        /// huggingface_hub's `X-Error-Code` (RepoNotFound, GatedRepo, EntryNotFound, ...).
        error_code: Option<String>,
        message: Option<String>,
    },
    /// The bytes are not the file the listing describes (the partial is deleted).
    Corrupt(String),
    Other(Error),
}

/// One file of the repo at a commit.
#[derive(Debug, Clone)]
pub struct RemoteFile {
    pub path: String,
    pub size: u64,
    /// The sha256 of an LFS file (its `X-Linked-Etag`).
    pub sha256: Option<String>,
    /// The git blob id (the `ETag` of a file stored in git itself).
    pub blob_id: Option<String>,
}

impl RemoteFile {
    /// The blob name huggingface_hub gives the file: its etag, which is the sha256 for an LFS
    /// file and the git blob id otherwise.
    pub fn etag(&self) -> String {
        self.sha256
            .clone()
            .or_else(|| self.blob_id.clone())
            .unwrap_or_default()
    }
}

pub struct RepoInfo {
    pub commit: String,
    pub files: Vec<RemoteFile>,
}

pub struct Client {
    agent: ureq::Agent,
    endpoint: String,
    token: Option<String>,
}

/// Redirects one request may take (ureq's default).
const MAX_REDIRECTS: usize = 10;

/// Where a `Location` leads from `base`: an absolute URL, a path on the same host, or a path
/// relative to `base`'s folder (RFC 9110 §10.2.2 allows all three).
fn redirect_target(base: &Uri, location: &str) -> Option<Uri> {
    if let Ok(u) = location.parse::<Uri>() {
        if u.scheme().is_some() && u.authority().is_some() {
            return Some(u);
        }
    }
    let origin = format!("{}://{}", base.scheme_str()?, base.authority()?);
    let path = if location.starts_with('/') {
        location.to_string()
    } else {
        let dir = base.path().rsplit_once('/').map_or("", |(d, _)| d);
        format!("{dir}/{location}")
    };
    format!("{origin}{path}").parse().ok()
}

/// Scheme, host and port (the scheme's default when none is written) all equal.
fn same_origin(a: &Uri, b: &Uri) -> bool {
    let port = |u: &Uri| {
        u.port_u16().or(match u.scheme_str() {
            Some("https") => Some(443),
            Some("http") => Some(80),
            _ => None,
        })
    };
    a.scheme() == b.scheme()
        && a.host().map(str::to_ascii_lowercase) == b.host().map(str::to_ascii_lowercase)
        && port(a) == port(b)
}

/// Bytes read from the network per write (and per progress update).
const CHUNK: usize = 1 << 20;

fn is_hex(s: &str, len: usize) -> bool {
    s.len() == len && s.bytes().all(|b| b.is_ascii_hexdigit())
}

/// Percent-encodes a repo path for a URL, keeping `/` (RFC 3986 unreserved bytes stay).
fn encode_path(path: &str) -> String {
    let mut out = String::with_capacity(path.len());
    for b in path.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~/".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

impl Client {
    pub fn new(cfg: &HubConfig) -> Self {
        let agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            // Redirects are followed in `get`, which compares the port as well (ureq's
            // same-host rule compares host names only).
            .max_redirects(0)
            .timeout_connect(Some(Duration::from_secs(10)))
            // A stalled transfer fails (and resumes on the next run) instead of hanging.
            .timeout_recv_response(Some(Duration::from_secs(60)))
            .timeout_per_read(Some(Duration::from_secs(60)))
            .user_agent(concat!("lathe/", env!("CARGO_PKG_VERSION")))
            .build()
            .new_agent();
        Client {
            agent,
            endpoint: cfg.endpoint.clone(),
            token: cfg.token.clone(),
        }
    }

    /// GET `url`, following up to [`MAX_REDIRECTS`] redirects. `HF_TOKEN` goes along only
    /// while scheme, host and port stay those of the request before (huggingface_hub's
    /// `_should_keep_auth`/requests' `should_strip_auth`): a renamed repo keeps it, the CDN
    /// and another port of the same host never see it.
    fn get(&self, url: &str, range_from: u64) -> Result<ureq::http::Response<ureq::Body>, Fail> {
        let mut uri: Uri = url
            .parse()
            .map_err(|e| Fail::Other(Error::Invalid(format!("{url}: not a URL: {e}"))))?;
        let mut token = self.token.as_deref();
        let mut hops = 0;
        let resp = loop {
            let mut req = self.agent.get(uri.clone());
            if let Some(t) = token {
                req = req.header("Authorization", format!("Bearer {t}"));
            }
            if range_from > 0 {
                req = req.header("Range", format!("bytes={range_from}-"));
            }
            let resp = req.call().map_err(|e| Fail::Network(e.to_string()))?;
            let location = resp.headers().get("Location").and_then(|v| v.to_str().ok());
            let (true, Some(location)) = (resp.status().is_redirection(), location) else {
                break resp;
            };
            hops += 1;
            let next = redirect_target(&uri, location).filter(|_| hops <= MAX_REDIRECTS);
            let Some(next) = next else {
                return Err(Fail::Network(format!(
                    "{uri}: redirected more than {MAX_REDIRECTS} times, or to `{location}`, which is not a URL"
                )));
            };
            if !same_origin(&uri, &next) {
                token = None;
            }
            uri = next;
        };
        let code = resp.status().as_u16();
        if code >= 400 {
            let header = |k: &str| {
                resp.headers()
                    .get(k)
                    .and_then(|v| v.to_str().ok())
                    .map(str::to_string)
            };
            return Err(Fail::Status {
                code,
                error_code: header("X-Error-Code"),
                message: header("X-Error-Message"),
            });
        }
        Ok(resp)
    }

    pub fn repo_info(&self, repo: &str) -> Result<RepoInfo, Fail> {
        let url = format!(
            "{}/api/models/{}/revision/main?blobs=true",
            self.endpoint,
            encode_path(repo)
        );
        let mut resp = self.get(&url, 0)?;
        let text = resp
            .body_mut()
            .with_config()
            .limit(64 << 20)
            .read_to_string()
            .map_err(|e| Fail::Network(format!("{url}: {e}")))?;
        let bad = |what: &str| Fail::Other(Error::Invalid(format!("{url}: {what}")));
        let json: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| bad(&format!("not JSON: {e}")))?;
        let commit = json["sha"]
            .as_str()
            .filter(|s| is_hex(s, 40))
            .ok_or_else(|| bad("no commit `sha` in the answer"))?
            .to_string();
        let siblings = json["siblings"]
            .as_array()
            .ok_or_else(|| bad("no `siblings` list in the answer"))?;
        let mut files = Vec::with_capacity(siblings.len());
        let mut seen = std::collections::HashSet::new();
        for s in siblings {
            let path = s["rfilename"]
                .as_str()
                .filter(|p| super::valid_file_path(p))
                .ok_or_else(|| bad(&format!("sibling {s} has no valid `rfilename` (a relative path without `.` or `..` parts or control characters)")))?;
            if !seen.insert(path) {
                return Err(bad(&format!(
                    "the listing names {path} twice; the Hub lists each file once, so this answer is not one to download from"
                )));
            }
            let sha256 = s["lfs"]["sha256"]
                .as_str()
                .filter(|h| is_hex(h, 64))
                .map(str::to_ascii_lowercase);
            let blob_id = s["blobId"]
                .as_str()
                .filter(|h| is_hex(h, 40))
                .map(str::to_ascii_lowercase);
            if sha256.is_none() && blob_id.is_none() {
                return Err(bad(&format!("{path}: neither an LFS sha256 nor a blobId")));
            }
            let size = s["lfs"]["size"]
                .as_u64()
                .or(s["size"].as_u64())
                .unwrap_or(0);
            files.push(RemoteFile {
                path: path.to_string(),
                size,
                sha256,
                blob_id,
            });
        }
        Ok(RepoInfo { commit, files })
    }

    /// Downloads `file` into `blobs/<etag>`: appends to `<etag>.incomplete` (resuming what
    /// is there), checks size and sha256, then renames. Interrupted (network, Ctrl-C), the
    /// partial file stays for the next run; corrupted, it is deleted.
    pub fn download(
        &self,
        repo: &str,
        commit: &str,
        file: &RemoteFile,
        cache: &RepoCache,
        progress: &mut dyn Progress,
    ) -> Result<(), Fail> {
        let etag = file.etag();
        let partial = cache.partial(&etag);
        let io = |e: std::io::Error| Fail::Other(Error::io(&partial, e));
        std::fs::create_dir_all(cache.blobs_dir()).map_err(io)?;
        let mut out = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&partial)
            .map_err(io)?;
        // Two processes appending to one partial file would corrupt it.
        out.try_lock().map_err(|_| {
            Fail::Other(Error::Invalid(format!(
                "{}: another process is downloading {} into this file; wait for it to finish",
                partial.display(),
                file.path
            )))
        })?;
        let mut have = out.metadata().map_err(io)?.len();
        if have > file.size {
            out.set_len(0).map_err(io)?;
            have = 0;
        }
        let mut hasher = Check::new(file);
        if have > 0 {
            hash_prefix(&mut out, have, &mut hasher).map_err(io)?;
        }
        progress.start(&file.path, file.size, have);
        let mut part = Partial { out, have, hasher };
        let result = self.transfer(repo, commit, file, &mut part, progress);
        let Partial { out, have, hasher } = part;
        let result = result.and_then(|()| {
            if have != file.size {
                return Err(Fail::Network(format!(
                    "{}: the transfer ended at {have} of {} bytes",
                    file.path, file.size
                )));
            }
            hasher.verify(file)?;
            out.sync_all().map_err(io)
        });
        drop(out);
        progress.finish(result.is_ok());
        match result {
            Ok(()) => {
                let blob = cache.blob(&etag);
                std::fs::rename(&partial, &blob).map_err(|e| Fail::Other(Error::io(&blob, e)))
            }
            Err(fail) => {
                // A corrupted file must not be resumed, and a refusal before the first byte
                // leaves no empty partial; an interrupted transfer keeps its bytes.
                if matches!(fail, Fail::Corrupt(_)) || have == 0 {
                    let _ = std::fs::remove_file(&partial);
                }
                Err(fail)
            }
        }
    }

    fn transfer(
        &self,
        repo: &str,
        commit: &str,
        file: &RemoteFile,
        part: &mut Partial,
        progress: &mut dyn Progress,
    ) -> Result<(), Fail> {
        let Partial { out, have, hasher } = part;
        if *have == file.size {
            return Ok(());
        }
        let url = format!(
            "{}/{}/resolve/{commit}/{}",
            self.endpoint,
            encode_path(repo),
            encode_path(&file.path)
        );
        let resp = self.get(&url, *have)?;
        let io = |e: std::io::Error| Fail::Other(Error::io(&file.path, e));
        let resumed = resp.status().as_u16() == 206
            && resp
                .headers()
                .get("Content-Range")
                .and_then(|v| v.to_str().ok())
                .is_some_and(|v| v.starts_with(&format!("bytes {have}-")));
        if !resumed && *have > 0 {
            // The server sent the whole file: start over.
            out.set_len(0).map_err(io)?;
            *have = 0;
            *hasher = Check::new(file);
            progress.start(&file.path, file.size, 0);
        }
        out.seek(SeekFrom::Start(*have)).map_err(io)?;
        let mut body = resp.into_body().into_reader();
        let mut buf = vec![0u8; CHUNK];
        loop {
            let n = match body.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(Fail::Network(format!("{}: {e}", file.path))),
            };
            if *have + n as u64 > file.size {
                return Err(Fail::Corrupt(format!(
                    "{}: the Hub sent more than the {} bytes it listed",
                    file.path, file.size
                )));
            }
            out.write_all(&buf[..n]).map_err(io)?;
            hasher.update(&buf[..n]);
            *have += n as u64;
            progress.advance(*have);
        }
        Ok(())
    }
}

/// A download in progress: the partial file appended to, the bytes it holds, and the hash
/// of those bytes so far.
struct Partial {
    out: File,
    have: u64,
    hasher: Check,
}

/// The hash a download is checked against: the LFS sha256 (`X-Linked-Etag`), or for a file
/// kept in git itself its blob id, the sha1 of `blob <size>\0` and the content (as
/// `git hash-object` computes it).
enum Check {
    Lfs(Sha256),
    Git(Sha1),
}

impl Check {
    fn new(file: &RemoteFile) -> Self {
        if file.sha256.is_some() {
            Check::Lfs(Sha256::new())
        } else {
            let mut h = Sha1::new();
            h.update(format!("blob {}\0", file.size));
            Check::Git(h)
        }
    }

    fn update(&mut self, bytes: &[u8]) {
        match self {
            Check::Lfs(h) => h.update(bytes),
            Check::Git(h) => h.update(bytes),
        }
    }

    fn verify(self, file: &RemoteFile) -> Result<(), Fail> {
        let (kind, got, want) = match self {
            Check::Lfs(h) => ("sha256", format!("{:x}", h.finalize()), &file.sha256),
            Check::Git(h) => ("git blob id", format!("{:x}", h.finalize()), &file.blob_id),
        };
        match want {
            Some(want) if &got != want => Err(Fail::Corrupt(format!(
                "{}: {kind} {got} does not match the Hub's {want}: the download was corrupted and is deleted; run again",
                file.path
            ))),
            _ => Ok(()),
        }
    }
}

/// Feeds the first `len` bytes of `f` (a resumed partial download) to `hasher`.
fn hash_prefix(f: &mut File, len: u64, hasher: &mut Check) -> std::io::Result<()> {
    f.seek(SeekFrom::Start(0))?;
    let mut buf = vec![0u8; CHUNK];
    let mut left = len;
    while left > 0 {
        let n = f.read(&mut buf[..(left.min(CHUNK as u64) as usize)])?;
        if n == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        hasher.update(&buf[..n]);
        left -= n as u64;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn redirects_resolve_and_keep_the_token_only_on_the_same_origin() {
        let base: Uri = "http://127.0.0.1:8000/a/resolve/main/x.gguf"
            .parse()
            .unwrap();
        let to = |l: &str| redirect_target(&base, l).unwrap();
        assert_eq!(to("/cdn/x").to_string(), "http://127.0.0.1:8000/cdn/x");
        assert_eq!(
            to("y.gguf").to_string(),
            "http://127.0.0.1:8000/a/resolve/main/y.gguf"
        );
        assert!(same_origin(&base, &to("/cdn/x")));
        assert!(!same_origin(&base, &to("http://127.0.0.1:8001/cdn/x")));
        assert!(!same_origin(&base, &to("https://127.0.0.1:8000/cdn/x")));
        let https: Uri = "https://hf.co/x".parse().unwrap();
        assert!(same_origin(&https, &"https://HF.co:443/y".parse().unwrap()));
    }

    #[test]
    fn git_files_are_checked_against_their_blob_id() {
        // `printf 'hello\n' | git hash-object --stdin`
        let file = RemoteFile {
            path: "hello.txt".into(),
            size: 6,
            sha256: None,
            blob_id: Some("ce013625030ba8dba906f756967f9e9ca394464a".into()),
        };
        let mut c = Check::new(&file);
        c.update(b"hello\n");
        assert!(c.verify(&file).is_ok());
        let mut c = Check::new(&file);
        c.update(b"hellO\n");
        assert!(matches!(c.verify(&file), Err(Fail::Corrupt(_))));
    }

    #[test]
    fn paths_are_percent_encoded_except_slashes() {
        assert_eq!(encode_path("a b/c+d.gguf"), "a%20b/c%2Bd.gguf");
        assert_eq!(
            encode_path("Q4_K_M/x-00001-of-00002.gguf"),
            "Q4_K_M/x-00001-of-00002.gguf"
        );
    }
}
