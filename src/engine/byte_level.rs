//! GPT-2's byte-level table: byte-level BPE writes each byte as one printable character
//! (the tokenizers crate keeps its copy private).

use std::collections::HashMap;
use std::sync::OnceLock;

/// GPT-2's byte → printable-character table of byte-level BPE: printable bytes stand for
/// themselves, the other 68 for the characters from U+0100 on, in byte order.
pub(crate) fn byte_to_char() -> [char; 256] {
    let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
    let mut shifted = 0u32;
    std::array::from_fn(|b| {
        let b = b as u8;
        if printable(b) {
            char::from(b)
        } else {
            shifted += 1;
            char::from_u32(255 + shifted).unwrap_or(char::REPLACEMENT_CHARACTER)
        }
    })
}

/// [`byte_to_char`] inverted.
pub(crate) fn unicode_to_byte() -> &'static HashMap<char, u8> {
    static TABLE: OnceLock<HashMap<char, u8>> = OnceLock::new();
    TABLE.get_or_init(|| {
        byte_to_char()
            .into_iter()
            .enumerate()
            .map(|(b, c)| (c, b as u8))
            .collect()
    })
}
