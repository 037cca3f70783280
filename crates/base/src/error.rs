//! The server's own errors: bad requests and faults. A failed gate is not an error; it is a report.
//! An [`Error`] is a kind ([`ErrorKind`]: usage, input, internal) and a message saying what to fix.

use std::fmt;

/// What went wrong, which decides the CLI exit status and the MCP error shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    /// The request is wrong (bad argument, unknown id, path outside the workspace): exit 2.
    Usage,
    /// An input could not be read or is malformed (missing config.json, corrupt safetensors, invalid
    /// contract file): exit 2.
    Input,
    /// The server itself failed (I/O, a child process it could not start): exit 2.
    Internal,
}

/// An error that says what to fix.
#[derive(Debug, Clone)]
pub struct Error {
    /// Category.
    pub kind: ErrorKind,
    /// Human-readable message naming the file, field or argument and what to change.
    pub message: String,
}

impl Error {
    /// A bad request.
    pub fn usage(message: impl Into<String>) -> Self {
        Error { kind: ErrorKind::Usage, message: message.into() }
    }
    /// An unreadable or malformed input.
    pub fn input(message: impl Into<String>) -> Self {
        Error { kind: ErrorKind::Input, message: message.into() }
    }
    /// A fault of the server.
    pub fn internal(message: impl Into<String>) -> Self {
        Error { kind: ErrorKind::Internal, message: message.into() }
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for Error {}

/// Result alias used across the library.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Attach context to a foreign error (I/O, JSON, TOML, SQLite, ...): the one way a library error becomes
/// an [`Error`] whose message says where it happened. Each method maps `Err(e)` to an error of its
/// kind whose message is `"{what}: {e}"`; `what` is computed only on the error path.
///
/// ```
/// use metainfer_base::error::{Context, ErrorKind};
/// let e = "x".parse::<u32>().usage_ctx(|| "--threads x".to_owned()).unwrap_err();
/// assert_eq!((e.kind, e.message.as_str()), (ErrorKind::Usage, "--threads x: invalid digit found in string"));
/// ```
pub trait Context<T> {
    /// An unreadable or malformed input ([`ErrorKind::Input`]), e.g. `.ctx(|| format!("reading {path}"))`.
    fn ctx(self, what: impl FnOnce() -> String) -> Result<T>;
    /// A bad request ([`ErrorKind::Usage`]): the argument or path the caller gave.
    fn usage_ctx(self, what: impl FnOnce() -> String) -> Result<T>;
    /// A fault of the server itself ([`ErrorKind::Internal`]).
    fn internal_ctx(self, what: impl FnOnce() -> String) -> Result<T>;
}

impl<T, E: fmt::Display> Context<T> for std::result::Result<T, E> {
    fn ctx(self, what: impl FnOnce() -> String) -> Result<T> {
        self.map_err(|e| Error::input(format!("{}: {e}", what())))
    }
    fn usage_ctx(self, what: impl FnOnce() -> String) -> Result<T> {
        self.map_err(|e| Error::usage(format!("{}: {e}", what())))
    }
    fn internal_ctx(self, what: impl FnOnce() -> String) -> Result<T> {
        self.map_err(|e| Error::internal(format!("{}: {e}", what())))
    }
}
