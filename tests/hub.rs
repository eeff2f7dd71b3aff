//! Models by name against a mock Hugging Face Hub on 127.0.0.1 (started here, one per test):
//! `lathe pull`, `-m owner/repo:QUANT`, `ls` and `rm` with HF_ENDPOINT pointing at it and the
//! cache in a fresh HF_HOME. The mock speaks the few routes lathe uses as the Hub does:
//! `/api/models/{repo}/revision/main?blobs=true` (commit and files with sizes, git blob ids and
//! LFS sha256), `/{repo}/resolve/{rev}/{file}` (an LFS file redirects to a CDN path with
//! `X-Linked-Etag`, `X-Linked-Size`, `X-Repo-Commit`; a git file answers with its `ETag`), and
//! `Range: bytes=N-` on the file bodies.

use std::collections::{HashMap, HashSet};
use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::{Arc, Mutex};

use sha2::{Digest, Sha256};

const COMMIT: &str = "0123456789abcdef0123456789abcdef01234567";

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn tiny(name: &str) -> PathBuf {
    root().join("tests/fixtures/models/qwen35-tiny").join(name)
}

fn sha256_hex(data: &[u8]) -> String {
    format!("{:x}", Sha256::digest(data))
}

struct MockFile {
    path: String,
    data: Vec<u8>,
    lfs: bool,
    sha256: String,
    /// The git blob id: sha1 of `blob <size>\0` + content (`git hash-object`).
    blob_id: String,
    /// The size the listing claims, when it is not the data's (a file too big for the disk).
    listed_size: Option<u64>,
}

impl MockFile {
    fn new(path: &str, data: Vec<u8>) -> Self {
        // Git keeps small text files; LFS the weights (the Hub's .gitattributes does the same
        // by extension).
        let lfs = path.ends_with(".gguf") || path.ends_with(".safetensors");
        let mut git = sha1::Sha1::new();
        git.update(format!("blob {}\0", data.len()));
        git.update(&data);
        MockFile {
            path: path.into(),
            sha256: sha256_hex(&data),
            blob_id: format!("{:x}", git.finalize()),
            data,
            lfs,
            listed_size: None,
        }
    }
    fn from_disk(path: &str, src: &Path) -> Self {
        Self::new(path, std::fs::read(src).unwrap())
    }
}

#[derive(Default)]
struct Repo {
    files: Vec<MockFile>,
    gated: bool,
}

/// One request the mock saw.
#[derive(Debug, Clone)]
struct Seen {
    path: String,
    range: Option<String>,
    /// Whether the request carried an `Authorization` header.
    auth: bool,
}

#[derive(Default)]
struct State {
    repos: HashMap<String, Repo>,
    /// Files whose next download stops half-way (headers promise the whole file).
    cut: Mutex<HashSet<String>>,
    /// Files whose next download stalls half-way, the connection held open (the client is
    /// interrupted meanwhile).
    stall: Mutex<HashSet<String>>,
    /// Files served with one byte flipped (the listing keeps the true sha256).
    corrupt: HashSet<String>,
    seen: Mutex<Vec<Seen>>,
    /// Where LFS files redirect (`http://host:port`); None: this server's own `/cdn/`.
    cdn: Option<String>,
}

struct Hub {
    url: String,
    state: Arc<State>,
}

impl Hub {
    fn start(state: State) -> Hub {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let state = Arc::new(state);
        let st = state.clone();
        std::thread::spawn(move || {
            for conn in listener.incoming().flatten() {
                let st = st.clone();
                std::thread::spawn(move || handle(conn, &st));
            }
        });
        Hub { url, state }
    }

    fn seen(&self) -> Vec<Seen> {
        self.state.seen.lock().unwrap().clone()
    }

    fn downloads(&self) -> Vec<Seen> {
        self.seen()
            .into_iter()
            .filter(|s| !s.path.starts_with("/api/"))
            .collect()
    }
}

fn respond(s: &mut TcpStream, status: &str, headers: &[(String, String)], body: &[u8]) {
    let mut head = format!("HTTP/1.1 {status}\r\nConnection: close\r\n");
    for (k, v) in headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    head.push_str(&format!("Content-Length: {}\r\n\r\n", body.len()));
    let _ = s.write_all(head.as_bytes());
    let _ = s.write_all(body);
}

fn error(s: &mut TcpStream, status: &str, code: &str) {
    let h = [("X-Error-Code".to_string(), code.to_string())];
    respond(s, status, &h, b"{}");
}

fn handle(mut s: TcpStream, st: &State) {
    let mut reader = BufReader::new(s.try_clone().unwrap());
    let mut line = String::new();
    if reader.read_line(&mut line).is_err() {
        return;
    }
    let target = line.split_whitespace().nth(1).unwrap_or("").to_string();
    let mut headers = HashMap::new();
    loop {
        let mut h = String::new();
        if reader.read_line(&mut h).unwrap_or(0) == 0 || h.trim().is_empty() {
            break;
        }
        if let Some((k, v)) = h.split_once(':') {
            headers.insert(k.trim().to_ascii_lowercase(), v.trim().to_string());
        }
    }
    let path = target.split('?').next().unwrap().to_string();
    st.seen.lock().unwrap().push(Seen {
        path: path.clone(),
        range: headers.get("range").cloned(),
        auth: headers.contains_key("authorization"),
    });
    if let Some(rest) = path.strip_prefix("/cdn/") {
        let [owner, name, file] = rest.splitn(3, '/').collect::<Vec<_>>()[..] else {
            return error(&mut s, "404 Not Found", "EntryNotFound");
        };
        let repo = &st.repos[&format!("{owner}/{name}")];
        let f = repo.files.iter().find(|f| f.path == file).unwrap();
        return serve_bytes(&mut s, st, f, &headers, vec![]);
    }
    let parts: Vec<&str> = path.trim_start_matches('/').splitn(5, '/').collect();
    match parts.as_slice() {
        ["api", "models", owner, name, "revision/main"] => {
            let Some(repo) = st.repos.get(&format!("{owner}/{name}")) else {
                return error(&mut s, "404 Not Found", "RepoNotFound");
            };
            let siblings: Vec<serde_json::Value> = repo
                .files
                .iter()
                .map(|f| {
                    let size = f.listed_size.unwrap_or(f.data.len() as u64);
                    let mut v = serde_json::json!({
                        "rfilename": f.path, "blobId": f.blob_id, "size": size,
                    });
                    if f.lfs {
                        v["lfs"] = serde_json::json!({
                            "sha256": f.sha256, "size": size, "pointerSize": 134,
                        });
                    }
                    v
                })
                .collect();
            let body = serde_json::json!({
                "id": format!("{owner}/{name}"), "sha": COMMIT, "gated": repo.gated,
                "siblings": siblings,
            });
            respond(&mut s, "200 OK", &[], body.to_string().as_bytes());
        }
        [owner, name, "resolve", _rev, file] => {
            let Some(repo) = st.repos.get(&format!("{owner}/{name}")) else {
                return error(&mut s, "404 Not Found", "RepoNotFound");
            };
            if repo.gated && !headers.contains_key("authorization") {
                return error(&mut s, "401 Unauthorized", "GatedRepo");
            }
            let Some(f) = repo.files.iter().find(|f| f.path == *file) else {
                return error(&mut s, "404 Not Found", "EntryNotFound");
            };
            let mut h = vec![("X-Repo-Commit".to_string(), COMMIT.to_string())];
            if f.lfs {
                h.push(("X-Linked-Etag".into(), format!("\"{}\"", f.sha256)));
                h.push(("X-Linked-Size".into(), f.data.len().to_string()));
                h.push(("ETag".into(), format!("\"{}\"", f.blob_id)));
                let cdn = st.cdn.as_deref().unwrap_or("");
                h.push((
                    "Location".into(),
                    format!("{cdn}/cdn/{owner}/{name}/{file}"),
                ));
                respond(&mut s, "302 Found", &h, b"");
            } else {
                h.push(("ETag".into(), format!("\"{}\"", f.blob_id)));
                serve_bytes(&mut s, st, f, &headers, h);
            }
        }
        _ => error(&mut s, "404 Not Found", "EntryNotFound"),
    }
}

fn serve_bytes(
    s: &mut TcpStream,
    st: &State,
    f: &MockFile,
    headers: &HashMap<String, String>,
    mut h: Vec<(String, String)>,
) {
    let mut data = std::borrow::Cow::Borrowed(&f.data[..]);
    if st.corrupt.contains(&f.path) {
        let mid = data.len() / 2;
        data.to_mut()[mid] ^= 0x55;
    }
    let from: usize = headers
        .get("range")
        .and_then(|r| r.strip_prefix("bytes="))
        .and_then(|r| r.strip_suffix('-'))
        .and_then(|n| n.parse().ok())
        .unwrap_or(0);
    let status = if from > 0 {
        h.push((
            "Content-Range".into(),
            format!("bytes {from}-{}/{}", data.len() - 1, data.len()),
        ));
        "206 Partial Content"
    } else {
        "200 OK"
    };
    let body = &data[from..];
    let stall = st.stall.lock().unwrap().remove(&f.path);
    if stall || st.cut.lock().unwrap().remove(&f.path) {
        // Promise the whole body, send half, hang up: a dropped connection mid-download.
        let mut head = format!("HTTP/1.1 {status}\r\nConnection: close\r\n");
        for (k, v) in &h {
            head.push_str(&format!("{k}: {v}\r\n"));
        }
        head.push_str(&format!("Content-Length: {}\r\n\r\n", body.len()));
        let _ = s.write_all(head.as_bytes());
        let _ = s.write_all(&body[..body.len() / 2]);
        let _ = s.flush();
        if stall {
            std::thread::sleep(std::time::Duration::from_secs(30));
        }
        let _ = s.shutdown(std::net::Shutdown::Both);
        return;
    }
    respond(s, status, &h, body);
}

/// A fresh HF_HOME for one test.
fn home(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("lathe-hub-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn cache(home: &Path) -> PathBuf {
    home.join("hub")
}

/// Runs the built `lathe` with only the Hub settings given here: HF_HOME, HF_ENDPOINT and
/// `extra` (no token, offline flag or proxy inherited from the machine).
fn lathe(home: &Path, endpoint: &str, extra: &[(&str, &str)], args: &[&str]) -> Output {
    lathe_cmd(home, endpoint, extra, args)
        .output()
        .expect("run lathe")
}

fn lathe_cmd(home: &Path, endpoint: &str, extra: &[(&str, &str)], args: &[&str]) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_lathe"));
    for k in [
        "HF_TOKEN",
        "HF_TOKEN_PATH",
        "HF_HUB_OFFLINE",
        "HF_HUB_CACHE",
        "HUGGINGFACE_HUB_CACHE",
        "HTTP_PROXY",
        "http_proxy",
        "HTTPS_PROXY",
        "https_proxy",
        "ALL_PROXY",
        "all_proxy",
    ] {
        cmd.env_remove(k);
    }
    cmd.env("HF_HOME", home).env("HF_ENDPOINT", endpoint);
    for (k, v) in extra {
        cmd.env(k, v);
    }
    cmd.args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    cmd
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

#[track_caller]
fn ok(o: &Output) -> String {
    assert!(o.status.success(), "lathe failed: {}", stderr(o));
    stdout(o)
}

/// Exit status 1 with every `needle` in the error message.
#[track_caller]
fn fails_with(o: &Output, needles: &[&str]) {
    let err = stderr(o);
    assert_eq!(
        o.status.code(),
        Some(1),
        "stdout {} stderr {err}",
        stdout(o)
    );
    for n in needles {
        assert!(err.contains(n), "{n:?} missing in: {err}");
    }
}

fn tiny_repo() -> Repo {
    Repo {
        files: vec![
            MockFile::new("README.md", b"# qwen35 tiny\n".to_vec()),
            MockFile::from_disk("model-q4_0.gguf", &tiny("model-q4_0.gguf")),
            MockFile::from_disk("model-q8_0.gguf", &tiny("model-q8_0.gguf")),
        ],
        gated: false,
    }
}

fn state(repos: Vec<(&str, Repo)>) -> State {
    State {
        repos: repos.into_iter().map(|(n, r)| (n.to_string(), r)).collect(),
        ..Default::default()
    }
}

fn snapshot(home: &Path, repo: &str) -> PathBuf {
    cache(home)
        .join(format!("models--{}", repo.replace('/', "--")))
        .join("snapshots")
        .join(COMMIT)
}

fn blobs(home: &Path, repo: &str) -> PathBuf {
    cache(home)
        .join(format!("models--{}", repo.replace('/', "--")))
        .join("blobs")
}

fn run_tokens(home: &Path, endpoint: &str, extra: &[(&str, &str)], model: &str) -> String {
    ok(&lathe(
        home,
        endpoint,
        extra,
        &[
            "run",
            "-m",
            model,
            "--prompt-tokens",
            "1,2,3,4",
            "--temp",
            "0",
            "-n",
            "4",
        ],
    ))
}

#[test]
fn pull_then_run_from_the_cache_then_ls_and_rm() {
    let hub = Hub::start(state(vec![("test/tiny-GGUF", tiny_repo())]));
    let h = home("pull");
    let path = ok(&lathe(&h, &hub.url, &[], &["pull", "test/tiny-GGUF:q4_0"]));
    let path = PathBuf::from(path.trim());
    // huggingface_hub's layout: the snapshot file links to the blob named by its sha256.
    let q4 = std::fs::read(tiny("model-q4_0.gguf")).unwrap();
    assert_eq!(path, snapshot(&h, "test/tiny-GGUF").join("model-q4_0.gguf"));
    assert_eq!(
        std::fs::read_link(&path).unwrap(),
        Path::new("../../blobs").join(sha256_hex(&q4))
    );
    assert_eq!(std::fs::read(&path).unwrap(), q4);
    let refs = h.join("hub/models--test--tiny-GGUF/refs/main");
    assert_eq!(std::fs::read_to_string(refs).unwrap(), COMMIT);
    // Only the asked quant came down.
    let got: Vec<String> = hub.downloads().iter().map(|s| s.path.clone()).collect();
    assert!(got.iter().all(|p| p.contains("model-q4_0.gguf")), "{got:?}");
    assert!(!snapshot(&h, "test/tiny-GGUF")
        .join("model-q8_0.gguf")
        .exists());

    // `run -m owner/repo:QUANT` offline, from the cache, says what the file itself says.
    let offline = [("HF_HUB_OFFLINE", "1")];
    let by_name = run_tokens(&h, "http://127.0.0.1:9", &offline, "test/tiny-GGUF:Q4_0");
    let by_path = run_tokens(&h, &hub.url, &[], tiny("model-q4_0.gguf").to_str().unwrap());
    assert_eq!(by_name, by_path);
    assert_eq!(by_name.split_whitespace().count(), 4, "{by_name}");

    // A second pull online asks for the listing only: the blob is there.
    let before = hub.downloads().len();
    ok(&lathe(&h, &hub.url, &[], &["pull", "test/tiny-GGUF:Q4_0"]));
    assert_eq!(hub.downloads().len(), before);

    let ls = ok(&lathe(&h, &hub.url, &[], &["ls"]));
    let lines: Vec<Vec<&str>> = ls.lines().map(|l| l.split('\t').collect()).collect();
    assert_eq!(lines.len(), 1, "{ls}");
    assert_eq!(lines[0][0], "test/tiny-GGUF");
    assert_eq!(lines[0][1], "model-q4_0.gguf");
    assert_eq!(lines[0][3], "Q4_0");

    let rm = ok(&lathe(&h, &hub.url, &[], &["rm", "test/tiny-GGUF:Q4_0"]));
    assert!(rm.contains("model-q4_0.gguf"), "{rm}");
    assert!(!path.exists() && path.symlink_metadata().is_err());
    assert!(!blobs(&h, "test/tiny-GGUF").join(sha256_hex(&q4)).exists());
    assert_eq!(ok(&lathe(&h, &hub.url, &[], &["ls"])), "");
    fails_with(
        &lathe(&h, &hub.url, &[], &["rm", "test/tiny-GGUF:Q8_0"]),
        &["test/tiny-GGUF:Q8_0"],
    );
    ok(&lathe(&h, &hub.url, &[], &["rm", "test/tiny-GGUF"]));
    assert!(!h.join("hub/models--test--tiny-GGUF").exists());
}

#[test]
fn an_interrupted_download_resumes_with_a_range_request() {
    let st = state(vec![("test/tiny-GGUF", tiny_repo())]);
    st.cut.lock().unwrap().insert("model-q8_0.gguf".into());
    let hub = Hub::start(st);
    let h = home("resume");
    let q8 = std::fs::read(tiny("model-q8_0.gguf")).unwrap();
    let sha = sha256_hex(&q8);
    let o = lathe(&h, &hub.url, &[], &["pull", "test/tiny-GGUF:Q8_0"]);
    fails_with(&o, &["test/tiny-GGUF:Q8_0", "model-q8_0.gguf", "resume"]);
    let partial = blobs(&h, "test/tiny-GGUF").join(format!("{sha}.incomplete"));
    let have = std::fs::metadata(&partial).unwrap().len();
    assert!(have > 0 && have < q8.len() as u64, "{have} of {}", q8.len());
    assert!(!blobs(&h, "test/tiny-GGUF").join(&sha).exists());
    assert!(!snapshot(&h, "test/tiny-GGUF")
        .join("model-q8_0.gguf")
        .exists());

    let path = ok(&lathe(&h, &hub.url, &[], &["pull", "test/tiny-GGUF:Q8_0"]));
    assert_eq!(std::fs::read(path.trim()).unwrap(), q8);
    assert!(!partial.exists());
    // The second run asked the CDN for the rest only (the Hub's redirect keeps the header).
    let ranges: Vec<Option<String>> = hub
        .downloads()
        .iter()
        .filter(|s| s.path.starts_with("/cdn/"))
        .map(|s| s.range.clone())
        .collect();
    assert_eq!(
        ranges,
        [None, Some(format!("bytes={have}-"))],
        "{:?}",
        hub.seen()
    );
}

/// Ctrl-C (SIGINT) in the middle of a download leaves the partial blob, which the next run
/// resumes.
#[cfg(unix)]
#[test]
fn ctrl_c_leaves_a_resumable_partial() {
    let st = state(vec![("test/tiny-GGUF", tiny_repo())]);
    st.stall.lock().unwrap().insert("model-q8_0.gguf".into());
    let hub = Hub::start(st);
    let h = home("ctrlc");
    let q8 = std::fs::read(tiny("model-q8_0.gguf")).unwrap();
    let partial = blobs(&h, "test/tiny-GGUF").join(format!("{}.incomplete", sha256_hex(&q8)));
    let mut child = lathe_cmd(&h, &hub.url, &[], &["pull", "test/tiny-GGUF:Q8_0"])
        .spawn()
        .unwrap();
    let half = (q8.len() / 2) as u64;
    let t = std::time::Instant::now();
    while std::fs::metadata(&partial).map_or(0, |m| m.len()) < half {
        assert!(
            t.elapsed().as_secs() < 20,
            "the download never reached half-way"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    // SAFETY: kill(2) on our own child's pid, which has not been waited for yet.
    assert_eq!(unsafe { libc::kill(child.id() as i32, libc::SIGINT) }, 0);
    let status = child.wait().unwrap();
    assert!(!status.success());
    assert_eq!(std::fs::metadata(&partial).unwrap().len(), half);
    let path = ok(&lathe(&h, &hub.url, &[], &["pull", "test/tiny-GGUF:Q8_0"]));
    assert_eq!(std::fs::read(path.trim()).unwrap(), q8);
    let last = hub.downloads().last().cloned().unwrap();
    assert_eq!(last.range, Some(format!("bytes={half}-")), "{last:?}");
}

#[test]
fn a_corrupted_download_is_rejected_and_deleted() {
    let mut st = state(vec![("test/tiny-GGUF", tiny_repo())]);
    st.corrupt.insert("model-q4_0.gguf".into());
    let hub = Hub::start(st);
    let h = home("corrupt");
    let o = lathe(&h, &hub.url, &[], &["pull", "test/tiny-GGUF"]);
    fails_with(&o, &["test/tiny-GGUF", "model-q4_0.gguf", "sha256"]);
    let blobs = blobs(&h, "test/tiny-GGUF");
    let left: Vec<_> = std::fs::read_dir(&blobs)
        .unwrap()
        .flatten()
        .map(|e| e.file_name())
        .collect();
    assert!(left.is_empty(), "{left:?}");
    assert!(!snapshot(&h, "test/tiny-GGUF")
        .join("model-q4_0.gguf")
        .exists());

    // A small file kept in git is checked against its git blob id.
    let src = root().join("tests/fixtures/hf/qwen35-tiny");
    let mut st = state(vec![(
        "test/st",
        Repo {
            files: vec![
                MockFile::from_disk("config.json", &src.join("config.json")),
                MockFile::from_disk("model.safetensors", &src.join("model.safetensors")),
            ],
            gated: false,
        },
    )]);
    st.corrupt.insert("config.json".into());
    let hub = Hub::start(st);
    let o = lathe(&h, &hub.url, &[], &["pull", "test/st"]);
    fails_with(&o, &["test/st", "config.json", "git blob id"]);
    assert!(!snapshot(&h, "test/st").join("config.json").exists());
}

#[test]
fn offline_mode_uses_only_the_cache() {
    let hub = Hub::start(state(vec![("test/tiny-GGUF", tiny_repo())]));
    let h = home("offline");
    let offline = [("HF_HUB_OFFLINE", "1")];
    let o = lathe(&h, &hub.url, &offline, &["pull", "test/tiny-GGUF:Q8_0"]);
    fails_with(
        &o,
        &["test/tiny-GGUF:Q8_0", "HF_HUB_OFFLINE", "not in the cache"],
    );
    assert!(hub.seen().is_empty(), "{:?}", hub.seen());

    let online = ok(&lathe(&h, &hub.url, &[], &["pull", "test/tiny-GGUF:Q8_0"]));
    let n = hub.seen().len();
    assert_eq!(
        ok(&lathe(
            &h,
            &hub.url,
            &offline,
            &["pull", "test/tiny-GGUF:Q8_0"]
        )),
        online
    );
    // Another quant is not in the cache.
    let o = lathe(&h, &hub.url, &offline, &["pull", "test/tiny-GGUF:Q4_0"]);
    fails_with(&o, &["test/tiny-GGUF:Q4_0", "Q4_0", "Q8_0"]);
    assert_eq!(hub.seen().len(), n);

    // The Hub unreachable without offline mode: the cached snapshot serves, with a note;
    // a model not cached is an error naming the repo.
    let down = "http://127.0.0.1:9";
    let o = lathe(&h, down, &[], &["pull", "test/tiny-GGUF:Q8_0"]);
    assert_eq!(ok(&o), online);
    assert!(stderr(&o).contains("cannot reach"), "{}", stderr(&o));
    let o = lathe(&h, down, &[], &["pull", "test/other-GGUF"]);
    fails_with(&o, &["test/other-GGUF", "cannot reach", "HF_HUB_OFFLINE"]);
}

#[test]
fn split_ggufs_come_down_whole() {
    let split = root().join("tests/fixtures/gguf/split");
    let mut repo = Repo::default();
    for i in 1..=3 {
        repo.files.push(MockFile::from_disk(
            &format!("Q8_0/tiny-Q8_0-0000{i}-of-00003.gguf"),
            &split.join(format!("tiny-split-0000{i}-of-00003.gguf")),
        ));
    }
    repo.files
        .push(MockFile::new("mmproj-F16.gguf", vec![0; 64]));
    let hub = Hub::start(state(vec![("test/split-GGUF", repo)]));
    let h = home("split");
    // No Q4_K_M: the smallest quant lathe runs, every part, no projector.
    let path = ok(&lathe(&h, &hub.url, &[], &["pull", "test/split-GGUF"]));
    let path = PathBuf::from(path.trim());
    let snap = snapshot(&h, "test/split-GGUF");
    assert_eq!(path, snap.join("Q8_0/tiny-Q8_0-00001-of-00003.gguf"));
    assert!(!snap.join("mmproj-F16.gguf").exists());
    let got = lathe::gguf::GgufFile::open(&path).unwrap();
    let want = lathe::gguf::GgufFile::open(split.join("tiny-split-00001-of-00003.gguf")).unwrap();
    assert_eq!(got.shard_paths().count(), 3);
    assert_eq!(got.n_tensors(), want.n_tensors());
    // A nested file's link climbs one more level.
    assert!(std::fs::read_link(&path)
        .unwrap()
        .starts_with("../../../blobs"));
    // Naming a later part by URL fetches the same model.
    let by_url = ok(&lathe(
        &h,
        &hub.url,
        &[],
        &[
            "pull",
            "hf://test/split-GGUF/Q8_0/tiny-Q8_0-00003-of-00003.gguf",
        ],
    ));
    assert_eq!(PathBuf::from(by_url.trim()), path);
}

#[test]
fn a_safetensors_repo_brings_config_index_and_shards() {
    let src = root().join("tests/fixtures/safetensors/sharded");
    let mut repo = Repo::default();
    for f in [
        "config.json",
        "model.safetensors.index.json",
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ] {
        repo.files.push(MockFile::from_disk(f, &src.join(f)));
    }
    repo.files
        .push(MockFile::new("README.md", b"card".to_vec()));
    repo.files.push(MockFile::new(
        "original/consolidated.safetensors",
        vec![0; 16],
    ));
    let hub = Hub::start(state(vec![("test/sharded", repo)]));
    let h = home("safetensors");
    let dir = ok(&lathe(&h, &hub.url, &[], &["pull", "test/sharded"]));
    let dir = PathBuf::from(dir.trim());
    assert_eq!(dir, snapshot(&h, "test/sharded"));
    let mut names: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().into_string().unwrap())
        .collect();
    names.sort();
    assert_eq!(
        names,
        [
            "config.json",
            "model-00001-of-00002.safetensors",
            "model-00002-of-00002.safetensors",
            "model.safetensors.index.json"
        ]
    );
    let got = lathe::safetensors::HfModel::open(&dir).unwrap();
    let want = lathe::safetensors::HfModel::open(&src).unwrap();
    let names = |m: &lathe::safetensors::HfModel| {
        let mut v: Vec<String> = m.tensors().map(|t| t.name.to_string()).collect();
        v.sort();
        v
    };
    assert_eq!(names(&got), names(&want));
    // A quant type means nothing for a safetensors repo.
    fails_with(
        &lathe(&h, &hub.url, &[], &["pull", "test/sharded:Q4_K_M"]),
        &["test/sharded:Q4_K_M", "safetensors"],
    );
}

/// The cache as huggingface_hub writes it (`hf_hub_download`): a blob named by the sha256,
/// a relative symlink in the snapshot, the commit in refs/main. Written by Python with plain
/// file operations, so this needs only `python3`.
const PY_CACHE: &str = r#"
import hashlib, os, sys
cache, src, commit = sys.argv[1], sys.argv[2], sys.argv[3]
data = open(src, "rb").read()
sha = hashlib.sha256(data).hexdigest()
repo = os.path.join(cache, "models--test--py-GGUF")
for d in ("blobs", "refs", os.path.join("snapshots", commit)):
    os.makedirs(os.path.join(repo, d), exist_ok=True)
open(os.path.join(repo, "blobs", sha), "wb").write(data)
os.symlink(os.path.join("..", "..", "blobs", sha),
           os.path.join(repo, "snapshots", commit, "Tiny-Q4_0.gguf"))
open(os.path.join(repo, "refs", "main"), "w").write(commit)
"#;

#[test]
fn a_cache_written_by_python_is_read() {
    let h = home("python");
    std::fs::create_dir_all(cache(&h)).unwrap();
    let script = h.join("write_cache.py");
    std::fs::write(&script, PY_CACHE).unwrap();
    let q4 = tiny("model-q4_0.gguf");
    let py = Command::new("python3")
        .arg(&script)
        .arg(cache(&h))
        .arg(&q4)
        .arg(COMMIT)
        .status();
    match py {
        Ok(s) => assert!(s.success(), "the cache script failed"),
        Err(e) => {
            eprintln!("note: python3 not runnable ({e}): skipping the Python-written cache check");
            return;
        }
    }
    // Online against a Hub at the same commit: nothing is downloaded.
    let mut repo = Repo::default();
    repo.files.push(MockFile::from_disk("Tiny-Q4_0.gguf", &q4));
    let hub = Hub::start(state(vec![("test/py-GGUF", repo)]));
    let want = snapshot(&h, "test/py-GGUF").join("Tiny-Q4_0.gguf");
    let path = ok(&lathe(&h, &hub.url, &[], &["pull", "test/py-GGUF"]));
    assert_eq!(PathBuf::from(path.trim()), want);
    assert!(hub.downloads().is_empty(), "{:?}", hub.downloads());
    let offline = [("HF_HUB_OFFLINE", "1")];
    let path = ok(&lathe(
        &h,
        &hub.url,
        &offline,
        &["pull", "test/py-GGUF:Q4_0"],
    ));
    assert_eq!(PathBuf::from(path.trim()), want);
    let ls = ok(&lathe(&h, &hub.url, &[], &["ls"]));
    assert!(ls.starts_with("test/py-GGUF\tTiny-Q4_0.gguf\t"), "{ls}");
    assert!(ls.trim_end().ends_with("\tQ4_0"), "{ls}");
}

#[test]
fn errors_name_the_repo_and_the_file() {
    let mut gated = Repo {
        gated: true,
        ..Default::default()
    };
    gated.files.push(MockFile::from_disk(
        "model-q4_0.gguf",
        &tiny("model-q4_0.gguf"),
    ));
    let mut huge = MockFile::new("Huge-Q4_K_M.gguf", vec![0; 16]);
    huge.listed_size = Some(1 << 60);
    let hub = Hub::start(state(vec![
        ("test/tiny-GGUF", tiny_repo()),
        ("test/gated-GGUF", gated),
        (
            "test/huge-GGUF",
            Repo {
                files: vec![huge],
                gated: false,
            },
        ),
    ]));
    let h = home("errors");
    let pull = |extra: &[(&str, &str)], m: &str| lathe(&h, &hub.url, extra, &["pull", m]);
    fails_with(&pull(&[], "test/nope"), &["test/nope", "not found"]);
    fails_with(
        &pull(&[], "test/tiny-GGUF:Q5_K_M"),
        &["test/tiny-GGUF:Q5_K_M", "Q5_K_M", "Q4_0, Q8_0"],
    );
    fails_with(
        &pull(&[], "test/gated-GGUF"),
        &["test/gated-GGUF", "model-q4_0.gguf", "gated", "HF_TOKEN"],
    );
    ok(&pull(&[("HF_TOKEN", "hf_test")], "test/gated-GGUF"));
    // The token file `hf auth login` writes serves as well.
    let h2 = home("errors-token-file");
    std::fs::write(h2.join("token"), "hf_test\n").unwrap();
    ok(&lathe(&h2, &hub.url, &[], &["pull", "test/gated-GGUF"]));
    // An exabyte does not fit: refused before any byte is fetched.
    let before = hub.downloads().len();
    fails_with(&pull(&[], "test/huge-GGUF"), &["test/huge-GGUF", "free"]);
    assert_eq!(hub.downloads().len(), before);
    fails_with(
        &lathe(&h, "http://127.0.0.1:9", &[], &["pull", "test/tiny-GGUF"]),
        &["test/tiny-GGUF", "cannot reach"],
    );
    // A model argument that is not a Hub name, or an existing path, never reaches the Hub.
    let n = hub.seen().len();
    fails_with(
        &lathe(&h, &hub.url, &[], &["inspect", "no/such-file.gguf"]),
        &["no/such-file.gguf"],
    );
    let local = h.join("test");
    std::fs::create_dir_all(&local).unwrap();
    std::fs::copy(tiny("model-q4_0.gguf"), local.join("tiny-GGUF")).unwrap();
    let o = Command::new(env!("CARGO_BIN_EXE_lathe"))
        .current_dir(&h)
        .env("HF_HOME", &h)
        .env("HF_ENDPOINT", &hub.url)
        .args(["inspect", "test/tiny-GGUF"])
        .output()
        .unwrap();
    assert!(ok(&o).contains("qwen35"), "{}", stdout(&o));
    assert_eq!(hub.seen().len(), n);
}

/// Waits for `cmd` at most `limit`, killing it past that (a hang fails the test, not CI).
fn output_within(mut cmd: Command, limit: std::time::Duration) -> Output {
    let mut child = cmd.spawn().expect("run lathe");
    let t0 = std::time::Instant::now();
    while child.try_wait().unwrap().is_none() {
        if t0.elapsed() > limit {
            let _ = child.kill();
            panic!("lathe took more than {limit:?}");
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    child.wait_with_output().unwrap()
}

/// HF_TOKEN reaches the Hub and follows a redirect that keeps scheme, host and port (the
/// mock's own `/cdn/`), but not one to another port of the same host (ureq's same-host rule
/// compared host names only).
#[test]
fn the_token_does_not_follow_a_redirect_to_another_port() {
    let cdn = Hub::start(state(vec![("test/tiny-GGUF", tiny_repo())]));
    let mut st = state(vec![("test/tiny-GGUF", tiny_repo())]);
    st.cdn = Some(cdn.url.clone());
    let hub = Hub::start(st);
    let token = [("HF_TOKEN", "hf_secret")];
    let h = home("redirect-port");
    ok(&lathe(
        &h,
        &hub.url,
        &token,
        &["pull", "test/tiny-GGUF:Q4_0"],
    ));
    assert!(hub.seen().iter().all(|s| s.auth), "{:?}", hub.seen());
    let got = cdn.seen();
    assert!(!got.is_empty() && got.iter().all(|s| !s.auth), "{got:?}");
    // Same scheme, host and port: the token goes along.
    let same = Hub::start(state(vec![("test/tiny-GGUF", tiny_repo())]));
    let h = home("redirect-same");
    ok(&lathe(
        &h,
        &same.url,
        &token,
        &["pull", "test/tiny-GGUF:Q4_0"],
    ));
    let cdn_hits: Vec<Seen> = same.downloads();
    assert!(cdn_hits.iter().any(|s| s.path.starts_with("/cdn/")));
    assert!(cdn_hits.iter().all(|s| s.auth), "{cdn_hits:?}");
}

/// A cached snapshot with symlink loops (`ln -s . self`, twice) is listed, used offline and
/// removed at once, without `self/self/...` entries; `rm` reports removed only the files
/// inside the cache (not one that a link leads out to, which stays).
#[test]
fn symlink_loops_and_links_out_of_the_cache() {
    let hub = Hub::start(state(vec![("test/tiny-GGUF", tiny_repo())]));
    let h = home("loops");
    ok(&lathe(&h, &hub.url, &[], &["pull", "test/tiny-GGUF:Q4_0"]));
    let snap = snapshot(&h, "test/tiny-GGUF");
    std::os::unix::fs::symlink(".", snap.join("self")).unwrap();
    std::os::unix::fs::symlink(".", snap.join("again")).unwrap();
    let outside = h.join("outside.txt");
    std::fs::write(&outside, "not the cache's").unwrap();
    std::os::unix::fs::symlink(&outside, snap.join("outside.txt")).unwrap();
    let limit = std::time::Duration::from_secs(20);
    let ls = ok(&output_within(lathe_cmd(&h, &hub.url, &[], &["ls"]), limit));
    assert!(!ls.contains("self") && !ls.contains("again"), "{ls}");
    assert_eq!(ls.lines().count(), 2, "{ls}");
    let offline = [("HF_HUB_OFFLINE", "1")];
    let mut run = lathe_cmd(
        &h,
        "http://127.0.0.1:9",
        &offline,
        &["inspect", "test/tiny-GGUF:Q4_0"],
    );
    run.stdout(Stdio::null());
    ok(&output_within(run, limit));
    let rm = ok(&output_within(
        lathe_cmd(&h, &hub.url, &[], &["rm", "test/tiny-GGUF"]),
        limit,
    ));
    assert!(rm.contains("model-q4_0.gguf"), "{rm}");
    assert!(!rm.contains("outside.txt"), "{rm}");
    assert!(outside.exists());
}

/// Hub file names with `.` parts or control characters, or listed twice, are refused before
/// anything is written; cached names with control characters are escaped by `ls`; and
/// credentials in HF_ENDPOINT never reach an error message.
#[test]
fn hostile_names_and_endpoint_credentials() {
    let with = |extra: &str| {
        let mut r = tiny_repo();
        r.files.push(MockFile::new(extra, b"x".to_vec()));
        r
    };
    let hub = Hub::start(state(vec![
        ("test/dot-GGUF", with("sub/./README.md")),
        ("test/lead-GGUF", with("./README.md")),
        ("test/newline-GGUF", with("a\nb.md")),
        ("test/esc-GGUF", with("a\u{1b}[2Jb.md")),
        ("test/twice-GGUF", with("README.md")),
    ]));
    let h = home("names");
    for repo in [
        "test/dot-GGUF",
        "test/lead-GGUF",
        "test/newline-GGUF",
        "test/esc-GGUF",
    ] {
        let o = lathe(&h, &hub.url, &[], &["pull", repo]);
        fails_with(&o, &[repo, "no valid `rfilename`"]);
        assert!(!stderr(&o).contains('\u{1b}'), "{}", stderr(&o));
    }
    fails_with(
        &lathe(&h, &hub.url, &[], &["pull", "test/twice-GGUF"]),
        &["test/twice-GGUF", "README.md twice"],
    );
    for repo in ["test/dot-GGUF", "test/lead-GGUF", "test/twice-GGUF"] {
        assert!(!snapshot(&h, repo).exists(), "{repo}");
    }

    // A cache written by another tool with a tab and a newline in a name: one line, escaped.
    let hub2 = Hub::start(state(vec![("test/tiny-GGUF", tiny_repo())]));
    ok(&lathe(&h, &hub2.url, &[], &["pull", "test/tiny-GGUF:Q4_0"]));
    std::fs::write(snapshot(&h, "test/tiny-GGUF").join("odd\tname\n.md"), "x").unwrap();
    let ls = ok(&lathe(&h, &hub2.url, &[], &["ls"]));
    assert_eq!(ls.lines().count(), 2, "{ls}");
    assert!(ls.contains("odd\\tname\\n.md"), "{ls}");
    assert!(ls.lines().all(|l| l.split('\t').count() == 4), "{ls}");

    let o = lathe(
        &h,
        "http://user:hunter2@127.0.0.1:9",
        &[],
        &["pull", "test/nothing-GGUF"],
    );
    fails_with(&o, &["test/nothing-GGUF", "***@127.0.0.1:9"]);
    assert!(!stderr(&o).contains("hunter2"), "{}", stderr(&o));
}
