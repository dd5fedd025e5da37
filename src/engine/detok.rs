//! The text of a reply as it grows, one short decode per token instead of decoding the whole
//! reply again at every step (a 512-token answer was decoded 512 times, each longer).
//!
//! The window technique of TGI and vLLM: the new tokens are decoded together with a few
//! tokens before them (their context) and the text they add is what the window's decode
//! has past the context's. The context absorbs what a decoder does at the start of a text
//! (SentencePiece drops the leading space of its first piece), and text is committed only
//! when it does not end in a replacement character (a multi-byte character whose bytes are
//! split across tokens, completed by a later one).

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
