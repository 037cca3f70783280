//! metainfer's bottom layer, which every other crate of the workspace may use and which uses none of
//! them: [`error`] (the error type: a kind and a message saying what to fix), [`util`] (atomic writes,
//! bounded reads of regular files, JSON-safe numbers), [`stats`] (timing spreads: median, min, max)
//! and [`beneath`] (directory handles every open stays beneath, resolved once per path argument).

pub mod beneath;
pub mod error;
pub mod stats;
pub mod util;
