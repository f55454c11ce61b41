//! What the fuzz targets in `fuzz/` run, and what the corpus replay tests run on stable:
//! not an API. Each function takes arbitrary bytes and panics only on a broken invariant.

use super::auth::{COOKIE, SessionId, cookies};
use super::http::{fields, json_fields, list_options, selection};
use super::index::Key;
use super::packed::{pack, unpack};

/// The index's packed form, read from any bytes: no panic, and what it reads packs to bytes
/// that read back to the same packing.
pub fn packed(data: &[u8]) {
    let Some((properties, headers)) = unpack(data) else {
        return;
    };
    let once = pack(&properties, &headers);
    let (properties, headers) = unpack(&once).expect("what pack writes, unpack reads");
    assert_eq!(pack(&properties, &headers), once, "packing is not stable");
}

/// The console's form and query parsing, and its JSON bodies, on any bytes: no panic; a
/// key or session id that parses is written back as it came (in lower case).
pub fn form(data: &[u8]) {
    let parsed = fields(data);
    let _ = selection(&parsed, false);
    let _ = selection(&parsed, true);
    let _ = list_options(&parsed);
    for (_, value) in &parsed {
        if let Some(key) = Key::parse(value) {
            assert_eq!(key.hex(), value.to_ascii_lowercase());
        }
        if let Some(id) = SessionId::parse(value) {
            assert_eq!(id.hex(), value.to_ascii_lowercase());
        }
    }
    let _ = json_fields(data);
    let header = String::from_utf8_lossy(data);
    let _ = cookies(&header, COOKIE).count();
}
