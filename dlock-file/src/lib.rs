#![doc = include_str!("../README.md")]

mod backend;
mod config;

pub use backend::FileBackend;

/// The backend's name in errors and traces.
const NAME: &str = "file";
