//! The format codes of the AMQP 1.0 type system, and the descriptors of a message's sections.
//!
//! A format code's subcategory (its high nibble) says how the data after it is laid out,
//! for every code, defined or not (AMQP 1.0, part 1, 1.2): a reader can step over a type it
//! does not know. Which codes the specification defines is a separate question.

/// How the data after a format code is laid out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Layout {
    /// That many bytes.
    Fixed(usize),
    /// A size (one byte, or four when `wide`), then that many bytes: binary, strings and
    /// symbols.
    Variable { wide: bool },
    /// A size, then within it a count (as wide as the size) and that many whole values:
    /// lists and maps.
    Compound { wide: bool },
    /// A size, then within it a count, one element constructor and the data of that many
    /// elements.
    Array { wide: bool },
}

/// The layout of `code`'s data by its subcategory; `None` below `0x40` (`0x00` marks a
/// described value, and `0x01` to `0x3f` are no format codes).
pub(crate) const fn layout(code: u8) -> Option<Layout> {
    Some(match code >> 4 {
        0x4 => Layout::Fixed(0),
        0x5 => Layout::Fixed(1),
        0x6 => Layout::Fixed(2),
        0x7 => Layout::Fixed(4),
        0x8 => Layout::Fixed(8),
        0x9 => Layout::Fixed(16),
        0xa => Layout::Variable { wide: false },
        0xb => Layout::Variable { wide: true },
        0xc => Layout::Compound { wide: false },
        0xd => Layout::Compound { wide: true },
        0xe => Layout::Array { wide: false },
        0xf => Layout::Array { wide: true },
        _ => return None,
    })
}

/// The format codes AMQP 1.0 defines, null to array32. `0x00`, the described-value marker,
/// is not one.
const DEFINED_CODES: [u8; 39] = [
    0x40, 0x41, 0x42, 0x43, 0x44, 0x45, 0x50, 0x51, 0x52, 0x53, 0x54, 0x55, 0x56, 0x60, 0x61, 0x70,
    0x71, 0x72, 0x73, 0x74, 0x80, 0x81, 0x82, 0x83, 0x84, 0x94, 0x98, 0xa0, 0xa1, 0xa3, 0xb0, 0xb1,
    0xb3, 0xc0, 0xc1, 0xd0, 0xd1, 0xe0, 0xf0,
];

/// The layout of every code AMQP 1.0 defines, by code; `None` for the others.
static DEFINED: [Option<Layout>; 256] = {
    let mut table = [None; 256];
    let mut i = 0;
    while i < DEFINED_CODES.len() {
        let code = DEFINED_CODES[i];
        table[code as usize] = layout(code);
        i += 1;
    }
    table
};

/// Whether AMQP 1.0 defines `code` as a format code.
pub(crate) fn is_defined(code: u8) -> bool {
    defined_layout(code).is_some()
}

/// The layout of `code` if AMQP 1.0 defines it.
pub(crate) fn defined_layout(code: u8) -> Option<Layout> {
    DEFINED[usize::from(code)]
}

/// The data width of a defined fixed-width code; `None` for every other code.
pub(crate) fn fixed_width(code: u8) -> Option<usize> {
    match defined_layout(code) {
        Some(Layout::Fixed(width)) => Some(width),
        _ => None,
    }
}

/// Whether a variable-width code holds text (a string or a symbol), which must be UTF-8.
pub(crate) fn is_text(code: u8) -> bool {
    matches!(code, 0xa1 | 0xa3 | 0xb1 | 0xb3)
}

/// Whether a compound code is a map, whose count of values must be even.
pub(crate) fn is_map(code: u8) -> bool {
    matches!(code, 0xc1 | 0xd1)
}

/// The descriptor code of the `properties` section.
pub(crate) const PROPERTIES: u64 = 0x73;

/// The descriptor code of the `application-properties` section.
pub(crate) const APPLICATION_PROPERTIES: u64 = 0x74;

/// The sections of a message by descriptor code, from `0x70` (`header`) to `0x78`
/// (`footer`), with the symbolic name each may be described by instead.
const SECTION_NAMES: [&[u8]; 9] = [
    b"amqp:header:list",
    b"amqp:delivery-annotations:map",
    b"amqp:message-annotations:map",
    b"amqp:properties:list",
    b"amqp:application-properties:map",
    b"amqp:data:binary",
    b"amqp:amqp-sequence:list",
    b"amqp:amqp-value:*",
    b"amqp:footer:map",
];

/// The section whose descriptor code is `code`, as that code.
pub(crate) fn section_by_code(code: u64) -> Option<u64> {
    (0x70..=0x78).contains(&code).then_some(code)
}

/// The descriptor code of the section whose symbolic name is `name`.
pub(crate) fn section_by_name(name: &[u8]) -> Option<u64> {
    (0x70..)
        .zip(SECTION_NAMES)
        .find_map(|(code, n)| (n == name).then_some(code))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defined_codes_are_laid_out_as_the_specification_says() {
        // The widths the specification lists for the defined fixed-width codes.
        for (codes, width) in [
            (&[0x40, 0x41, 0x42, 0x43, 0x44, 0x45][..], 0),
            (&[0x50, 0x51, 0x52, 0x53, 0x54, 0x55, 0x56], 1),
            (&[0x60, 0x61], 2),
            (&[0x70, 0x71, 0x72, 0x73, 0x74], 4),
            (&[0x80, 0x81, 0x82, 0x83, 0x84], 8),
            (&[0x94, 0x98], 16),
        ] {
            for &code in codes {
                assert_eq!(fixed_width(code), Some(width), "{code:#04x}");
            }
        }
        let defined = (0..=u8::MAX).filter(|&c| is_defined(c)).count();
        assert_eq!(defined, 39);
        assert_eq!(fixed_width(0x46), None, "laid out, but not defined");
        assert_eq!(layout(0x46), Some(Layout::Fixed(0)));
        assert_eq!(layout(0x3f), None);
    }

    #[test]
    fn sections_are_found_by_code_and_by_name() {
        assert_eq!(section_by_code(0x74), Some(APPLICATION_PROPERTIES));
        assert_eq!(section_by_code(0x79), None);
        assert_eq!(section_by_name(b"amqp:properties:list"), Some(PROPERTIES));
        assert_eq!(section_by_name(b"amqp:footer:map"), Some(0x78));
        assert_eq!(section_by_name(b"amqp:footer"), None);
    }
}
