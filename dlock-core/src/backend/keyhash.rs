//! One 64-bit hash of a key, for every backend that needs a short,
//! stable name for it.

/// A key's 64-bit identifier (a server lock id, a long name's tail): the first 8 bytes of SHA-256 over the
/// prefix, a 0 byte and the key, stable across processes, versions and
/// platforms.
///
/// SHA-256 rather than a fast non-cryptographic hash (dlock used FNV-1a
/// before its first release): keys that collide cannot be made by
/// construction from a key's structure, only found by brute force.
///
/// Two keys that hash alike share one server lock: they contend as if they
/// were one key (a wait that was not needed), and are never both held. A
/// semaphore or read-write lock counts the other key's holders as its own,
/// so each stays within its own limit: a collision costs throughput, never
/// exclusion. With `n` keys in use at once the chance of any collision is
/// about `n² / 2⁶⁵`.
///
/// # Examples
///
/// ```
/// use dlock_core::backend::key_hash;
///
/// assert_eq!(key_hash("", ""), 0x6e34_0b9c_ffb3_7a98);
/// assert_ne!(key_hash("a", ""), key_hash("", "a"));
/// ```
pub fn key_hash(prefix: &str, key: &str) -> u64 {
    use sha2::{Digest, Sha256};
    let digest = Sha256::new()
        .chain_update(prefix)
        .chain_update([0])
        .chain_update(key)
        .finalize();
    let mut first = [0; 8];
    first.copy_from_slice(&digest[..8]);
    u64::from_be_bytes(first)
}
