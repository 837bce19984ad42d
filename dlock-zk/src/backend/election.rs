//! Holders: a proclaimed value in our node's data, and the first child of
//! a key's parent read as its holder.

use dlock_core::{
    backend::{Holder, Mode, MAX_HOLDER_NOTE},
    Result,
};
use zookeeper_client::{Client, Error as ZkError, Stat};

use super::{backend_error, mode_of, queue::OURS, sequence};

/// The first byte of a proclaimed node's data, without a note.
const PROCLAIMED: u8 = 1;
/// The first byte of a proclaimed node's data, with a note.
const PROCLAIMED_NOTED: u8 = 2;
/// Separates [`OURS`] from the holder's note in a new node's data.
const NOTE: u8 = 0x1f;

/// The data our node is created with: [`OURS`], then `0x1F` and the
/// holder's note, if it has one.
pub(super) fn created(note: &str) -> Vec<u8> {
    let mut data = OURS.to_vec();
    if !note.is_empty() {
        data.push(NOTE);
        data.extend_from_slice(note.as_bytes());
    }
    data
}

/// The data of a node whose holder proclaimed `value`: with a note,
/// marker 2, [`OURS`], the note's length (notes are at most
/// [`MAX_HOLDER_NOTE`] bytes) and the note; without one, marker 1; then
/// the value.
pub(super) fn with_proclaimed(note: &str, value: &[u8]) -> Vec<u8> {
    let mut data = Vec::with_capacity(value.len() + note.len() + OURS.len() + 2);
    match u8::try_from(note.len()) {
        Ok(len) if len > 0 => {
            data.push(PROCLAIMED_NOTED);
            data.extend_from_slice(OURS);
            data.push(len);
            data.extend_from_slice(note.as_bytes());
        }
        _ => data.push(PROCLAIMED),
    }
    data.extend_from_slice(value);
    data
}

/// A note as dlock writes one: 1 to [`MAX_HOLDER_NOTE`] bytes of UTF-8.
fn is_note(note: &[u8]) -> bool {
    (1..=MAX_HOLDER_NOTE).contains(&note.len()) && std::str::from_utf8(note).is_ok()
}

/// A node's note and proclaimed value, each if it has one.
type NoteAndValue<'a> = (Option<&'a [u8]>, Option<&'a [u8]>);

/// The note and the proclaimed value a node's data holds, if it is in
/// one of the forms dlock writes; `None` if it is not (a Curator
/// client's data).
fn note_and_value(data: &[u8]) -> Option<NoteAndValue<'_>> {
    if data == OURS {
        return Some((None, None));
    }
    if let Some(note) = data
        .strip_prefix(OURS)
        .and_then(|d| d.strip_prefix(&[NOTE]))
    {
        return is_note(note).then_some((Some(note), None));
    }
    match data.split_first()? {
        (&PROCLAIMED, value) => Some((None, Some(value))),
        (&PROCLAIMED_NOTED, rest) => {
            let (&len, rest) = rest.strip_prefix(OURS)?.split_first()?;
            let len = usize::from(len);
            let (note, value) = (rest.get(..len)?, rest.get(len..)?);
            is_note(note).then_some((Some(note), Some(value)))
        }
        _ => None,
    }
}

/// The holder a node's data and stat show: its czxid as the fence, what
/// it proclaimed, if it has, its note, and its age (from its creation
/// time on the server's clock).
pub(super) fn holder_of(data: &[u8], stat: &Stat) -> Holder {
    let (note, proclaimed) = note_and_value(data).unwrap_or_default();
    let mut holder = Holder::new(
        Some(u64::try_from(stat.czxid).unwrap_or(0)),
        proclaimed.map(<[u8]>::to_vec),
    );
    if let Some(note) = note {
        holder = holder.with_note(String::from_utf8_lossy(note));
    }
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH);
    let created = u64::try_from(stat.ctime).ok();
    if let (Ok(now), Some(created)) = (now, created) {
        let age = u64::try_from(now.as_millis()).unwrap_or(u64::MAX);
        holder = holder.with_age(std::time::Duration::from_millis(
            age.saturating_sub(created),
        ));
    }
    holder
}

/// Whether a node's data is what dlock writes (before or after a
/// proclaim), in full, not a Curator client's: a forced release of a
/// Curator holder would go unseen by it.
pub(super) fn written_by_dlock(data: &[u8]) -> bool {
    note_and_value(data).is_some()
}

/// The children of `parent`; `None` if it does not exist.
pub(super) async fn children(client: &Client, parent: &str) -> Result<Option<Vec<String>>> {
    match client.list_children(parent).await {
        Ok(children) => Ok(Some(children)),
        Err(ZkError::NoNode) => Ok(None),
        Err(e) => Err(backend_error(e)),
    }
}

/// The child of a plain lock's parent that holds it: the first by
/// sequence, as acquisition orders them (an unreadable name last).
pub(super) fn holding(children: Vec<String>) -> Option<String> {
    children
        .into_iter()
        .filter(|c| mode_of(c) == Some(Mode::Exclusive))
        .min_by_key(|c| sequence(c).unwrap_or(i64::MAX))
}

/// Brings the server this session reads from up to date with the leader
/// (`sync`): a follower serves reads from its own copy, which may lag, so
/// without it a holder released through another server could still be
/// read as holding.
pub(super) async fn synced(client: &Client, path: &str) -> Result<()> {
    match client.sync(path).await {
        Ok(()) | Err(ZkError::NoNode) => Ok(()),
        Err(e) => Err(backend_error(e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A node's data says its note before and after a proclaim, its
    /// value after, and is told from a Curator client's in every form.
    #[test]
    fn notes_and_values_read_back_from_every_form_of_our_data() {
        let stat = Stat {
            czxid: 9,
            mzxid: 9,
            pzxid: 9,
            ctime: 0,
            mtime: 0,
            version: 0,
            cversion: 0,
            aversion: 0,
            ephemeral_owner: 0,
            data_length: 0,
            num_children: 0,
        };
        for (data, note, value) in [
            (created("web-1:42"), Some("web-1:42"), None),
            (created(""), None, None),
            (
                with_proclaimed("web-1:42", b"10.0.0.7"),
                Some("web-1:42"),
                Some(&b"10.0.0.7"[..]),
            ),
            (with_proclaimed("", b"\x02x"), None, Some(&b"\x02x"[..])),
        ] {
            let holder = holder_of(&data, &stat);
            assert_eq!(holder.note(), note, "{data:?}");
            assert_eq!(holder.value(), value, "{data:?}");
            assert_eq!(holder.fence(), Some(9));
            assert!(written_by_dlock(&data), "{data:?}");
        }
        assert!(!written_by_dlock(b"10.0.0.7"));
        assert!(!written_by_dlock(b"dlockish"));
        // A Curator client's data that only starts like ours.
        for data in [
            &b"\x02\x03abc"[..],
            b"\x02dlock\x09short",
            b"\x02dlock\x02\xff\xfe",
            b"\x02dlock\x00",
            b"dlock\x1f",
            b"dlock\x1f\xff",
        ] {
            assert!(!written_by_dlock(data), "{data:?}");
        }
    }
}
