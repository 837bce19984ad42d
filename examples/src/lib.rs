//! Shared code of the dlock examples, so that the tests run exactly what the
//! programs run.

pub mod stock;
