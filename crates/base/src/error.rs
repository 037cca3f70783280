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

/// Attach context to I/O-like errors: `.ctx(|| format!("reading {path}"))`.
pub trait Context<T> {
    /// Turn the error into an [`ErrorKind::Input`] error prefixed with `what`.
    fn ctx(self, what: impl FnOnce() -> String) -> Result<T>;
}

impl<T, E: fmt::Display> Context<T> for std::result::Result<T, E> {
    fn ctx(self, what: impl FnOnce() -> String) -> Result<T> {
        self.map_err(|e| Error::input(format!("{}: {e}", what())))
    }
}
