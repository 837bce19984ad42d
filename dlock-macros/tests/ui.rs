//! Compile-time behaviour of `#[distributed_lock]`: what compiles, and the
//! errors for what does not (snapshots in `ui/fail/*.stderr`; regenerate
//! with `TRYBUILD=overwrite` and review the diff).

#[test]
fn ui() {
    let t = trybuild::TestCases::new();
    t.pass("tests/ui/pass/*.rs");
    t.compile_fail("tests/ui/fail/*.rs");
}
