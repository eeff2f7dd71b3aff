//! lathe's error type. Every error a user can cause names the file and the tensor, key or
//! field involved, so the CLI can print one line that says what is wrong and where.

use std::path::PathBuf;

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
    #[error("{}: missing tensor `{name}`", path.display())]
    MissingTensor { path: PathBuf, name: String },
    #[error("{}: tensor `{name}`: {what}", path.display())]
    Tensor {
        path: PathBuf,
        name: String,
        what: String,
    },
    /// A missing or bad configuration / metadata key.
    #[error("{}: key `{key}`: {what}", path.display())]
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
