//! What the fuzz targets in `fuzz/` run, and what the corpus replay tests run on stable:
//! not an API. Each function takes arbitrary bytes and panics only on a broken invariant.

use lapin::protocol::basic::parse_properties;
use lapin::types::parsing::parse_long_long_uint;

use crate::inspect::{announces_content, check_content_header, check_delivery_method};
use crate::tap::{Frames, Refusals};

/// The checks the tap makes before lapin parses a message: no panic on any bytes, and a
/// content header they pass is one lapin parses, all of it (lapin is asked only then: on
/// what they refuse it may recurse without bound).
pub fn inspect(data: &[u8]) {
    let _ = announces_content(data);
    let _ = check_delivery_method(data);
    if check_content_header(data).is_ok() {
        let parsed = data
            .get(4..)
            .and_then(|rest| parse_long_long_uint(rest).ok())
            .map(|(rest, _)| parse_properties(rest));
        assert!(
            matches!(parsed, Some(Ok((rest, _))) if rest.is_empty()),
            "a content header the check passed is one lapin cannot parse"
        );
    }
}

/// The tap's frame reader, fed the same bytes at once and in reads of a size the first
/// byte draws: no panic, the same outcome, and the same bytes out when nothing was kept
/// from lapin (a refusal's mark holds a per-tap secret, so marked output differs).
pub fn tap(data: &[u8]) {
    let Some((&step, stream)) = data.split_first() else {
        return;
    };
    let whole = run(stream, stream.len().max(1));
    let pieces = run(stream, usize::from(step % 64) + 1);
    assert_eq!(
        whole.0.is_ok(),
        pieces.0.is_ok(),
        "the reads changed the outcome"
    );
    if whole.0.is_ok() && whole.2 == 0 && pieces.2 == 0 {
        assert_eq!(whole.1, pieces.1, "the reads changed what lapin is given");
    }
}

/// What the tap gives lapin for `stream` read `step` bytes at a time, and how many
/// messages it kept from lapin.
fn run(stream: &[u8], step: usize) -> (std::io::Result<()>, Vec<u8>, usize) {
    let refusals = Refusals::new();
    let mut frames = Frames::new(None);
    let mut out = Vec::new();
    let mut buf = [0u8; 512];
    for chunk in stream.chunks(step) {
        if let Err(e) = frames.feed(chunk, &refusals) {
            return (Err(e), out, refusals.issued());
        }
        while frames.has_output() {
            let n = frames.read_into(&mut buf);
            out.extend_from_slice(&buf[..n]);
        }
    }
    frames.finish();
    while frames.has_output() {
        let n = frames.read_into(&mut buf);
        out.extend_from_slice(&buf[..n]);
    }
    (Ok(()), out, refusals.issued())
}

/// The AMQP 1.0 sections reader this crate reads headers with (`transport_kit::amqp10`, for
/// messages RabbitMQ converted from AMQP 1.0): no panic on any bytes.
pub fn amqp10_sections(data: &[u8]) {
    let _ = transport_kit::amqp10::decode_application_properties(data);
    let _ = transport_kit::amqp10::decode_message_id(data);
}
