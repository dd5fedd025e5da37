//! The text of a reply as it grows, one short decode per token instead of decoding the whole
//! reply again at every step (a 512-token answer was decoded 512 times, each longer).
//!
//! The window technique of TGI and vLLM: the new tokens are decoded together with a few
//! tokens before them (their context) and the text they add is what the window's decode
//! has past the context's. The context absorbs what a decoder does at the start of a text
//! (SentencePiece drops the leading space of its first piece), and text is committed only
//! when it does not end in a replacement character (a multi-byte character whose bytes are
//! split across tokens, completed by a later one).

use tokenizers::decoders::DecoderWrapper;
use tokenizers::Tokenizer;

/// The decoded text of a growing token sequence.
#[derive(Debug, Default)]
pub struct IncrementalText {
    text: String,
    /// Bytes of `text` that later tokens no longer change.
    committed: usize,
    /// The window starts at token `start`; tokens `start..read` are its context.
    start: usize,
    read: usize,
    /// The decode of the context tokens.
    context: String,
}

impl IncrementalText {
    /// The text of the tokens so far: what decoding them all at once gives.
    pub fn text(&self) -> &str {
        &self.text
    }

    /// Brings the text up to `ids` (the tokens so far: the previous ones and any new ones).
    pub fn update<E>(
        &mut self,
        ids: &[u32],
        decode: impl Fn(&[u32]) -> Result<String, E>,
    ) -> Result<(), E> {
        let window = decode(&ids[self.start..])?;
        let Some(added) = window.strip_prefix(self.context.as_str()) else {
            // A decoder that rewrote the context: decode everything, and start the next
            // window after it.
            self.text = decode(ids)?;
            self.committed = self.text.len();
            self.start = 0;
            self.read = ids.len();
            self.context = self.text.clone();
            return Ok(());
        };
        self.text.truncate(self.committed);
        self.text.push_str(added);
        if !added.is_empty() && !added.ends_with(char::REPLACEMENT_CHARACTER) {
            self.committed = self.text.len();
            self.start = self.read;
            self.read = ids.len();
            self.context = decode(&ids[self.start..self.read])?;
        }
        Ok(())
    }
}

/// The bytes a token stands for, as OpenAI's `bytes` field gives them: a token that holds
/// part of a character has that part, so the bytes of a reply's tokens joined are its text
/// exactly (decoding one such token alone gives U+FFFD). Read from the vocabulary: byte-level
/// BPE writes each byte as one character of the GPT-2 table, SentencePiece writes `<0xNN>` for
/// a byte and `▁` for a space; added tokens stand for their decoded text (nothing for special
/// ones).
pub(crate) fn token_bytes(tokenizer: &Tokenizer, id: u32) -> Vec<u8> {
    let decoded = || {
        tokenizer
            .decode(&[id], true)
            .map(String::into_bytes)
            .unwrap_or_default()
    };
    if tokenizer
        .get_added_vocabulary()
        .get_added_tokens_decoder()
        .contains_key(&id)
    {
        return decoded();
    }
    let Some(piece) = tokenizer.id_to_token(id) else {
        return decoded();
    };
    if let Some(byte) = byte_fallback(&piece) {
        return vec![byte];
    }
    if is_byte_level(tokenizer.get_decoder()) {
        let table = super::byte_level::unicode_to_byte();
        if let Some(bytes) = piece.chars().map(|c| table.get(&c).copied()).collect() {
            return bytes;
        }
        return decoded();
    }
    piece.replace('\u{2581}', " ").into_bytes()
}

/// The byte of a SentencePiece byte-fallback piece (`<0x0A>`).
fn byte_fallback(piece: &str) -> Option<u8> {
    let hex = piece.strip_prefix("<0x")?.strip_suffix('>')?;
    (hex.len() == 2).then(|| u8::from_str_radix(hex, 16).ok())?
}

fn is_byte_level(decoder: Option<&DecoderWrapper>) -> bool {
    match decoder {
        Some(DecoderWrapper::ByteLevel(_)) => true,
        Some(DecoderWrapper::Sequence(seq)) => {
            seq.get_decoders().iter().any(|d| is_byte_level(Some(d)))
        }
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokenizers::Tokenizer;

    /// Pushes the tokens of `text` one at a time: after each, the text is the decode of
    /// all tokens so far.
    fn follows_the_whole_decode(tok: &Tokenizer, text: &str) {
        let ids = tok.encode(text, false).unwrap().get_ids().to_vec();
        assert!(ids.len() > 3, "{text:?} is {} tokens", ids.len());
        let decode = |ids: &[u32]| tok.decode(ids, true);
        let mut inc = IncrementalText::default();
        for n in 1..=ids.len() {
            inc.update(&ids[..n], decode).unwrap();
            assert_eq!(
                inc.text(),
                decode(&ids[..n]).unwrap(),
                "{text:?} after {n} tokens"
            );
        }
    }

    /// Joined over a text's tokens, the tokens' bytes are the text exactly, also where a
    /// token holds part of a character (decoded alone, such a token is U+FFFD).
    fn token_bytes_rebuild(tok: &Tokenizer, text: &str) {
        let ids = tok.encode(text, false).unwrap().get_ids().to_vec();
        let joined: Vec<u8> = ids.iter().flat_map(|&id| token_bytes(tok, id)).collect();
        assert_eq!(String::from_utf8_lossy(&joined), text, "{ids:?}");
        let partial = ids
            .iter()
            .filter(|&&id| tok.decode(&[id], true).unwrap().contains('\u{FFFD}'))
            .count();
        assert!(partial > 0, "{text:?}: no token holds part of a character");
    }

    #[test]
    fn token_bytes_of_byte_level_and_byte_fallback_tokenizers() {
        let text = "日本語 🎉 café";
        token_bytes_rebuild(&crate::engine::tiny::tiny_tokenizer().unwrap(), text);
        let qwen = Tokenizer::from_file(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/fixtures/families/qwen2/tokenizer.json"
        ))
        .unwrap();
        token_bytes_rebuild(&qwen, text);
        // SentencePiece with byte fallback: `▁` for spaces, `<0xNN>` for the bytes of
        // characters not in the vocabulary.
        use tokenizers::decoders::byte_fallback::ByteFallback;
        use tokenizers::decoders::fuse::Fuse;
        use tokenizers::decoders::sequence::Sequence;
        use tokenizers::models::bpe::BPE;
        use tokenizers::normalizers::replace::Replace;
        let mut vocab: tokenizers::models::bpe::Vocab = (0..=255u8)
            .map(|b| (format!("<0x{b:02X}>"), u32::from(b)))
            .collect();
        for (i, piece) in ["▁", "c", "a", "f", "é", "▁c", "af"].iter().enumerate() {
            vocab.insert((*piece).to_string(), 256 + i as u32);
        }
        let merges = vec![
            ("▁".to_string(), "c".to_string()),
            ("a".to_string(), "f".to_string()),
        ];
        let bpe = BPE::builder()
            .vocab_and_merges(vocab, merges)
            .byte_fallback(true)
            .build()
            .unwrap();
        let mut spm = Tokenizer::new(bpe);
        spm.with_normalizer(Some(Replace::new(" ", "▁").unwrap()))
            .unwrap();
        spm.with_decoder(Some(Sequence::new(vec![
            Replace::new("▁", " ").unwrap().into(),
            ByteFallback::default().into(),
            Fuse::default().into(),
        ])));
        token_bytes_rebuild(&spm, text);
    }

    #[test]
    fn byte_tokens_split_characters_and_the_text_still_matches() {
        // One token per byte: accents, CJK and emoji arrive a byte at a time.
        let tok = crate::engine::tiny::tiny_tokenizer().unwrap();
        for text in [
            "L'Étoile, la Cité",
            "東京は 晴れ 🌤️ today",
            "plain ascii words",
        ] {
            follows_the_whole_decode(&tok, text);
        }
    }

    #[test]
    fn a_sentencepiece_decoder_keeps_its_spaces_between_windows() {
        use tokenizers::decoders::metaspace::Metaspace as MetaspaceDecoder;
        use tokenizers::models::wordlevel::WordLevel;
        use tokenizers::pre_tokenizers::metaspace::{Metaspace, PrependScheme};
        let words = ["▁Hello", "▁world", "▁again", "▁and", "▁more", "!", "[UNK]"];
        let vocab = words
            .iter()
            .enumerate()
            .map(|(i, w)| (w.to_string(), i as u32))
            .collect();
        let model = WordLevel::builder()
            .vocab(vocab)
            .unk_token("[UNK]".into())
            .build()
            .unwrap();
        let mut tok = Tokenizer::new(model);
        tok.with_pre_tokenizer(Some(Metaspace::new('▁', PrependScheme::Always, true)));
        tok.with_decoder(Some(MetaspaceDecoder::new(
            '▁',
            PrependScheme::Always,
            true,
        )));
        follows_the_whole_decode(&tok, "Hello world again and more world Hello");
    }
}
