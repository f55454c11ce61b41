//! One reader of AMQP 1.0 encodings, for every place bytes in that encoding come in from the
//! network.
//!
//! There is one walk of the encoding (format codes, fixed and variable widths, lists, maps,
//! arrays, described values), with an explicit stack and a depth limit: nested bytes cost
//! heap, not call stack, and are refused past the limit. It never panics and never trusts a
//! size or a count beyond the bytes that are there. Two uses are built on it:
//!
//! * **The check** ([`check_message`], [`check_values`]): that bytes are a valid encoding
//!   nested no deeper than [`MAX_DEPTH`], without building any value, before a decoder that
//!   recurses once per level (fe2o3-amqp's) sees them. What is wrong, and where, is a
//!   [`Refusal`].
//! * **The sections RabbitMQ 3.x hands AMQP 0-9-1 clients** in the headers
//!   [`APP_PROPERTIES_HEADER`] and [`PROPERTIES_HEADER`]:
//!   [`decode_application_properties`] into [`Headers`](retry_core::Headers),
//!   [`decode_message_id`], and [`encode_application_properties`] for the way back. Each
//!   value is stepped over to find where it ends (described values followed no deeper than
//!   [`MAX_DESCRIBED`], lists, maps and arrays not looked inside) and then decoded; one that
//!   application properties should not hold is kept as its raw bytes.
//!
//! ```
//! use retry_core::{HeaderValue, Headers};
//! use transport_kit::amqp10::{
//!     Why, check_message, decode_application_properties, encode_application_properties,
//! };
//!
//! let headers: Headers = [("x-retry-attempts", HeaderValue::Int(2))].into_iter().collect();
//! let (section, left_out) = encode_application_properties(headers.iter());
//! assert!(left_out.is_empty());
//! // A section on its own is a message: it passes the check, and decodes to what it holds.
//! assert_eq!(check_message(&section), Ok(()));
//! assert_eq!(decode_application_properties(&section)?.headers, headers);
//!
//! // An `amqp-value` section holding described values nested 100 deep, each described by
//! // the code 1: the section is one level and 63 of them fit below it; the 64th is refused
//! // where its value starts.
//! let mut deep = vec![0x00, 0x53, 0x77];
//! for _ in 0..100 {
//!     deep.extend([0x00, 0x53, 0x01]);
//! }
//! deep.push(0x40);
//! let refusal = check_message(&deep).unwrap_err();
//! assert_eq!(refusal.why, Why::TooDeep);
//! assert_eq!(refusal.at, 3 + 64 * 3);
//! # Ok::<(), transport_kit::amqp10::SectionError>(())
//! ```

mod check;
mod codes;
mod sections;
mod walk;

pub use check::{check_message, check_values};
pub use sections::{
    APP_PROPERTIES_HEADER, AppProperties, MessageId, PROPERTIES_HEADER, SectionError,
    decode_application_properties, decode_message_id, encode_application_properties, hyphenated,
};
pub use walk::{MAX_DEPTH, MAX_DESCRIBED, Refusal, Why};
