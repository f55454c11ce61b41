//! What the fuzz targets in `fuzz/` run, and what the corpus replay tests run on stable:
//! not an API. Each function takes arbitrary bytes and panics only on a broken invariant.

use crate::tap::fuzz_frames;
use transport_kit::amqp10::{check_message, check_values};

/// The check this crate makes of encoded AMQP 1.0 values (`transport_kit::amqp10`), as a
/// message and as a run of values: no panic and no recursion, whatever the bytes.
pub fn scan(data: &[u8]) {
    let _ = check_message(data);
    let _ = check_values(data);
}

/// The frame tap, fed the same bytes at once and in reads of a size the first byte draws:
/// no panic, the same outcome, and for a stream it reads, the same bytes out and the same
/// transfers counted and refused, whatever the reads. (A stream it refuses fails the
/// connection; what was handed on before the failure may then differ by the reads.)
pub fn tap(data: &[u8]) {
    let Some((&step, stream)) = data.split_first() else {
        return;
    };
    let whole = fuzz_frames(stream, stream.len().max(1));
    let pieces = fuzz_frames(stream, usize::from(step % 64) + 1);
    assert_eq!(whole.0, pieces.0, "the reads changed the outcome");
    if whole.0 {
        let differs = whole.1.iter().zip(&pieces.1).position(|(a, b)| a != b);
        assert!(
            whole == pieces,
            "the reads changed what the tap did: lengths {} and {}, first difference at {differs:?}, transfers {} and {}, refused {} and {}",
            whole.1.len(),
            pieces.1.len(),
            whole.2,
            pieces.2,
            whole.3,
            pieces.3
        );
    }
}
