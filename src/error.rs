//! lathe's error type. Every error a user can cause names the file and the tensor, key or
//! field involved, so the CLI can print one line that says what is wrong and where.

use std::path::{Path, PathBuf};

/// Result with lathe's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A malformed or truncated file: `what` says which header field, key or tensor.
    #[error("{}: {what}", path.display())]
    Format { path: PathBuf, what: String },
    #[error("{}: missing tensor `{}`", path.display(), shown(name))]
    MissingTensor { path: PathBuf, name: String },
    #[error("{}: tensor `{}`: {what}", path.display(), shown(name))]
    Tensor {
        path: PathBuf,
        name: String,
        what: String,
    },
    /// A missing or bad configuration / metadata key.
    #[error("{}: key `{}`: {what}", path.display(), shown(key))]
    Config {
        path: PathBuf,
        key: String,
        what: String,
    },
    #[error("unsupported: {0}")]
    Unsupported(String),
    /// GPU setup or execution failed (no adapter, out of memory, device lost).
    #[error("gpu: {0}")]
    Gpu(String),
    /// A model named on the Hugging Face Hub that cannot be fetched: `repo` is
    /// `owner/repo[:QUANT]`, `what` names the file when one is involved.
    #[error("{repo}: {what}")]
    Hub { repo: String, what: String },
    /// A bad argument or request from the caller.
    #[error("{0}")]
    Invalid(String),
}

/// Longest name (key, tensor) an error message shows, in characters.
const MAX_SHOWN: usize = 96;

/// A name from a file as an error message shows it: control characters escaped (a name
/// may hold newlines or terminal escapes) and cut after [`MAX_SHOWN`] characters with its
/// length in bytes, so a 64 KiB key does not become a 188 KB line.
pub fn shown(name: &str) -> String {
    shown_of(name, name.len())
}

/// [`shown`] for bytes that may not be UTF-8 (invalid sequences become U+FFFD).
pub fn shown_bytes(bytes: &[u8]) -> String {
    // Four bytes per character at most: enough for what is shown.
    let cut = &bytes[..bytes.len().min(4 * MAX_SHOWN)];
    let s = shown_of(&String::from_utf8_lossy(cut), bytes.len());
    if cut.len() < bytes.len() && !s.ends_with("bytes)") {
        return format!("{s}… ({} bytes)", bytes.len());
    }
    s
}

/// Text from a file or a server (a template's `raise_exception` message, a Hub file name) as
/// a message shows it whole: control characters escaped (`\n`, `\u{1b}`), so it cannot break
/// a line or drive the terminal.
pub fn escaped(text: &str) -> String {
    text.chars()
        .flat_map(|c| {
            let esc = c.is_control().then(|| c.escape_default());
            esc.into_iter()
                .flatten()
                .chain((!c.is_control()).then_some(c))
        })
        .collect()
}

/// `name` escaped and cut; `len` is the length in bytes of the whole name.
fn shown_of(name: &str, len: usize) -> String {
    let mut out = String::new();
    for (n, c) in name.chars().enumerate() {
        if n == MAX_SHOWN {
            out.push_str(&format!("… ({len} bytes)"));
            break;
        }
        if c.is_control() {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
    }
    out
}

/// Opens `path` for reading when it is a regular file (links followed): opening a FIFO
/// blocks until a writer comes, and a device (`/dev/zero`) never ends, so either is an error
/// naming the path instead of a hang.
pub fn open_regular(path: &Path) -> Result<std::fs::File> {
    let meta = std::fs::metadata(path).map_err(|e| Error::io(path, e))?;
    if !meta.is_file() {
        return Err(Error::format(
            path,
            "not a regular file (a FIFO, device or socket cannot be read as a model)",
        ));
    }
    std::fs::File::open(path).map_err(|e| Error::io(path, e))
}

impl Error {
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io {
            path: path.into(),
            source,
        }
    }
    pub fn format(path: impl Into<PathBuf>, what: impl Into<String>) -> Self {
        Error::Format {
            path: path.into(),
            what: what.into(),
        }
    }
    pub fn tensor(
        path: impl Into<PathBuf>,
        name: impl Into<String>,
        what: impl Into<String>,
    ) -> Self {
        Error::Tensor {
            path: path.into(),
            name: name.into(),
            what: what.into(),
        }
    }
    pub fn config(
        path: impl Into<PathBuf>,
        key: impl Into<String>,
        what: impl Into<String>,
    ) -> Self {
        Error::Config {
            path: path.into(),
            key: key.into(),
            what: what.into(),
        }
    }
}
