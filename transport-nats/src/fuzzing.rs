//! What the fuzz targets in `fuzz/` run, and what the corpus replay tests run on stable:
//! not an API. Each function takes arbitrary bytes and panics only on a broken invariant.

use crate::codec::{decode_value, encode_value, read_headers};
use crate::header_block::{ClientFailure, check_header_block, header_map};

/// A header block as the server stores it: checked without a panic, and a block the check
/// passes (or passes but for its status line) is read into headers, and those into the
/// engine's properties and headers.
pub fn header_block(data: &[u8]) {
    let checked = check_header_block(data);
    let readable = match &checked {
        Ok(()) => true,
        Err(e) => e.failure() == ClientFailure::ReadAsStatus,
    };
    let map = header_map(data);
    assert_eq!(
        map.is_ok(),
        readable,
        "the check and the reader disagree: {checked:?}"
    );
    if let Ok(map) = map {
        let _ = read_headers(Some(&map));
    }
}

/// The codec of header values: any text decodes without a panic, and what it decodes to
/// encodes to a text that decodes the same.
pub fn header_value(data: &[u8]) {
    let text = String::from_utf8_lossy(data);
    let value = decode_value(&text);
    let encoded = encode_value(&value);
    let again = encode_value(&decode_value(&encoded));
    assert_eq!(encoded, again, "a value did not survive its own encoding");
}
