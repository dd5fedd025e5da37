//! Training data: TRL preference pairs → token ids with the model's own chat template
//!. The prompt is rendered with the generation prompt, prompt + completion whole;
//! the first must be a token prefix of the second (hard error otherwise); no BOS/EOS is ever
//! added to what the template writes. Histories too long for `max_length` lose their oldest
//! whole turns after the opening (the system message and the first user message — the task,
//! or a game's rules — always stay); a pair that still does not fit is dropped and counted —
//! one side of a pair is never cut alone. A model without a chat template (a base model)
//! trains on text instead: see [`tokenize_text_pair`].

use std::path::{Path, PathBuf};

use crate::dataset::{read_pairs_parquet, DatasetError, PairRow};
use crate::engine::ChatCodec;
use crate::llm::ChatMessage;

#[derive(Debug, thiserror::Error)]
pub enum DataError {
    #[error(transparent)]
    Dataset(#[from] DatasetError),
    #[error("{path}: {message}")]
    Input { path: PathBuf, message: String },
    #[error("{path}, row {row}: {message}")]
    Row {
        path: PathBuf,
        row: usize,
        message: String,
    },
}

/// One preference pair as token ids. `prompt` ends where the completions start (with the
/// generation prompt); `chosen` / `rejected` are the completion tokens only.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TokenizedPair {
    pub prompt: Vec<u32>,
    pub chosen: Vec<u32>,
    pub rejected: Vec<u32>,
}

/// Where the pairs of a `--data` argument are: the training file and, if present, the
/// evaluation file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DataFiles {
    pub train: PathBuf,
    pub eval: Option<PathBuf>,
}

/// Resolves `--data`: a parquet file; a directory with `train.parquet` (and `test.parquet`);
/// or a `generate_conv` run directory with `pairs/train.parquet`.
pub fn locate_data(path: &Path) -> Result<DataFiles, DataError> {
    let input = |message: String| DataError::Input {
        path: path.to_path_buf(),
        message,
    };
    if path.is_file() {
        return Ok(DataFiles {
            train: path.to_path_buf(),
            eval: None,
        });
    }
    if !path.is_dir() {
        return Err(input("does not exist".into()));
    }
    for dir in [path.to_path_buf(), path.join("pairs")] {
        let train = dir.join("train.parquet");
        if train.is_file() {
            let test = dir.join("test.parquet");
            return Ok(DataFiles {
                train,
                eval: test.is_file().then_some(test),
            });
        }
    }
    Err(input(
        "no train.parquet in it or in its pairs/ folder (expected a pairs parquet file, a \
         pairs directory or a generate_conv run directory)"
            .into(),
    ))
}

/// Pair rows of a parquet file; an empty file is an error.
pub fn read_pairs(path: &Path) -> Result<Vec<PairRow>, DataError> {
    let rows = read_pairs_parquet(path)?;
    if rows.is_empty() {
        return Err(DataError::Input {
            path: path.to_path_buf(),
            message: "the dataset is empty (no rows)".into(),
        });
    }
    Ok(rows)
}

/// What tokenization did to a dataset.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct TokenizeStats {
    pub rows: usize,
    pub kept: usize,
    /// Rows that lost old turns to fit.
    pub truncated: usize,
    /// Rows that do not fit even with the shortest history.
    pub dropped_too_long: usize,
    /// Tokens of the kept examples (an SFT sequence; a pair's prompt, chosen and rejected):
    /// with `kept`, the mean an optimizer step reads per example, to match arms' compute.
    #[serde(default)]
    pub tokens: usize,
}

impl TokenizeStats {
    /// Counts one row: kept (its tokens, whether truncated) or dropped as too long.
    fn count(&mut self, kept: Option<(usize, bool)>) {
        match kept {
            Some((tokens, truncated)) => {
                self.kept += 1;
                self.tokens += tokens;
                self.truncated += usize::from(truncated);
            }
            None => self.dropped_too_long += 1,
        }
    }
}

/// An upper bound on the bytes of text one token covers: the longest entry of the vocabulary
/// (byte-level and SentencePiece pieces spell each byte with at least one byte).
pub(crate) fn max_token_bytes(codec: &ChatCodec) -> usize {
    codec
        .tokenizer
        .get_vocab(true)
        .keys()
        .map(String::len)
        .max()
        .unwrap_or(1)
        .max(1)
}

/// Whether `messages` cannot fit in `max_length` tokens whatever the tokenizer does: more
/// bytes than `max_length` of the longest tokens cover. Decided before tokenizing, so a 1 GB
/// reply is dropped as too long without rendering it (that cost 16 GiB and an abort).
fn surely_too_long<'a>(
    messages: impl IntoIterator<Item = &'a ChatMessage>,
    max_length: usize,
    token_bytes: usize,
) -> bool {
    let bytes: usize = messages.into_iter().map(|m| m.content.len()).sum();
    bytes > max_length.saturating_mul(token_bytes)
}

/// The messages no truncation removes: the opening (system messages and the first user
/// message) and the last message.
fn never_dropped(messages: &[ChatMessage]) -> impl Iterator<Item = &ChatMessage> {
    let system = messages.iter().take_while(|m| m.role == "system").count();
    let opening = (system + 1).min(messages.len());
    let last = messages.len().saturating_sub(1).max(opening);
    messages[..opening].iter().chain(messages.get(last))
}

/// Token ids of `messages` rendered by the template (no special tokens added).
pub(crate) fn render_ids(
    codec: &ChatCodec,
    messages: &[ChatMessage],
    generation_prompt: bool,
) -> Result<Vec<u32>, String> {
    let text = codec
        .render(messages, generation_prompt)
        .map_err(|e| e.to_string())?;
    codec.encode(&text)
}

/// `full` must start with `prefix`; returns the rest.
pub(crate) fn suffix_after(prefix: &[u32], full: &[u32], what: &str) -> Result<Vec<u32>, String> {
    if full.len() <= prefix.len() || full[..prefix.len()] != *prefix {
        let at = prefix
            .iter()
            .zip(full)
            .position(|(a, b)| a != b)
            .unwrap_or(prefix.len().min(full.len()));
        return Err(format!(
            "the tokenized prompt is not a prefix of the tokenized prompt + {what} (they differ \
             at token {at}); the chat template renders the prompt differently when a reply \
             follows"
        ));
    }
    Ok(full[prefix.len()..].to_vec())
}

/// The pair's token ids for one history; errors are prefix violations or template failures.
fn tokenize_once(
    codec: &ChatCodec,
    prompt: &[ChatMessage],
    row: &PairRow,
) -> Result<TokenizedPair, String> {
    if !codec.template.is_present() {
        return tokenize_text_pair(codec, prompt, row);
    }
    let prompt_ids = render_ids(codec, prompt, true)?;
    let side = |completion: &[ChatMessage], what: &str| -> Result<Vec<u32>, String> {
        let mut all = prompt.to_vec();
        all.extend_from_slice(completion);
        suffix_after(&prompt_ids, &render_ids(codec, &all, false)?, what)
    };
    Ok(TokenizedPair {
        chosen: side(&row.chosen, "chosen")?,
        rejected: side(&row.rejected, "rejected")?,
        prompt: prompt_ids,
    })
}

/// A pair for a model without a chat template (a base model), as TRL tokenizes its standard
/// (plain-string) form: the prompt as the tokenizer encodes raw text (with the BOS it adds,
/// as `tokenizer(text)` does), each completion's text encoded alone after it, then the
/// end-of-text id. Only a prompt of one message and completions of one message each (the
/// standard form as read) are text; a conversation needs a template.
fn tokenize_text_pair(
    codec: &ChatCodec,
    prompt: &[ChatMessage],
    row: &PairRow,
) -> Result<TokenizedPair, String> {
    let no_template = || {
        format!(
            "{}; without one only plain-text pairs train (one prompt string, one chosen and \
             one rejected string)",
            codec.template.missing_reason()
        )
    };
    let ([p], [chosen], [rejected]) = (prompt, &row.chosen[..], &row.rejected[..]) else {
        return Err(no_template());
    };
    let eos = *codec
        .eos_ids
        .first()
        .ok_or("the tokenizer names no end-of-text token to close a completion with")?;
    let encode = |text: &str, specials: bool| -> Result<Vec<u32>, String> {
        codec
            .tokenizer
            .encode(text, specials)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| format!("tokenizing: {e}"))
    };
    let completion = |m: &ChatMessage| -> Result<Vec<u32>, String> {
        let mut ids = encode(&m.content, false)?;
        ids.push(eos);
        Ok(ids)
    };
    Ok(TokenizedPair {
        prompt: encode(&p.content, true)?,
        chosen: completion(chosen)?,
        rejected: completion(rejected)?,
    })
}

/// The history with its oldest droppable turn removed, or `None` when nothing can go.
///
/// The opening always stays: the leading system messages and the first user message (the
/// task, or a game's rules — a model trained without them learns a different task). After
/// it, the oldest assistant reply and the user message that answers it go together, so
/// roles still alternate; the last user message (what the completion answers) is never
/// dropped.
pub fn drop_oldest_turn(messages: &[ChatMessage]) -> Option<Vec<ChatMessage>> {
    let system = messages.iter().take_while(|m| m.role == "system").count();
    let opening = system + usize::from(messages.get(system).is_some_and(|m| m.role == "user"));
    let after = &messages[opening..];
    // The oldest turn after the opening: up to and including its first user message.
    let answer = after
        .iter()
        .enumerate()
        .skip(1)
        .find(|(_, m)| m.role == "user")
        .map(|(i, _)| i)?;
    if answer + 1 >= after.len() {
        return None;
    }
    let mut out = messages[..opening].to_vec();
    out.extend_from_slice(&after[answer + 1..]);
    Some(out)
}

fn check_row(row: &PairRow) -> Result<(), String> {
    if row.prompt.is_empty() {
        return Err("empty prompt".into());
    }
    for (name, side) in [("chosen", &row.chosen), ("rejected", &row.rejected)] {
        if side.is_empty() || side.iter().all(|m| m.content.is_empty()) {
            return Err(format!("empty {name} completion"));
        }
    }
    Ok(())
}

/// Tokenizes every row; `Ok(None)` entries were dropped for length. Errors name file and row.
pub fn tokenize_pairs(
    codec: &ChatCodec,
    rows: &[PairRow],
    max_length: usize,
    path: &Path,
) -> Result<(Vec<TokenizedPair>, TokenizeStats), DataError> {
    let mut stats = TokenizeStats {
        rows: rows.len(),
        ..Default::default()
    };
    let mut out = Vec::with_capacity(rows.len());
    let token_bytes = max_token_bytes(codec);
    for (i, row) in rows.iter().enumerate() {
        let row_err = |message: String| DataError::Row {
            path: path.to_path_buf(),
            row: i,
            message,
        };
        check_row(row).map_err(row_err)?;
        if [&row.chosen, &row.rejected]
            .iter()
            .any(|side| surely_too_long(side.iter(), max_length, token_bytes))
        {
            stats.dropped_too_long += 1;
            continue;
        }
        let mut prompt = row.prompt.clone();
        let mut truncated = false;
        loop {
            let pair = tokenize_once(codec, &prompt, row).map_err(row_err)?;
            let longest = pair.prompt.len() + pair.chosen.len().max(pair.rejected.len());
            if longest <= max_length {
                stats.tokens += pair.prompt.len() + pair.chosen.len() + pair.rejected.len();
                out.push(pair);
                stats.kept += 1;
                stats.truncated += usize::from(truncated);
                break;
            }
            match drop_oldest_turn(&prompt) {
                Some(shorter) => {
                    prompt = shorter;
                    truncated = true;
                }
                None => {
                    stats.dropped_too_long += 1;
                    break;
                }
            }
        }
    }
    Ok((out, stats))
}

/// A conversation for supervised fine-tuning: ids and which of them carry the loss (the
/// assistant messages' tokens, end-of-turn included).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TokenizedSeq {
    pub ids: Vec<u32>,
    pub loss_mask: Vec<bool>,
}

/// SFT tokenization of one conversation: each assistant message's span is found by rendering
/// the history before it with the generation prompt (a prefix, checked) and through it.
pub fn tokenize_conversation(
    codec: &ChatCodec,
    messages: &[ChatMessage],
) -> Result<TokenizedSeq, String> {
    tokenize_trained_from(codec, messages, 0)
}

/// [`tokenize_conversation`] with the loss on the assistant messages from index `first` on:
/// a completion after a prompt trains, the prompt's own assistant turns do not.
fn tokenize_trained_from(
    codec: &ChatCodec,
    messages: &[ChatMessage],
    first: usize,
) -> Result<TokenizedSeq, String> {
    let ids = render_ids(codec, messages, false)?;
    let mut loss_mask = vec![false; ids.len()];
    for (i, m) in messages.iter().enumerate().skip(first) {
        if m.role != "assistant" {
            continue;
        }
        let start = render_ids(codec, &messages[..i], true)?;
        let through = render_ids(codec, &messages[..=i], false)?;
        suffix_after(&start, &through, "assistant message")?;
        if ids.len() < through.len() || ids[..through.len()] != through[..] {
            return Err("the conversation's tokens do not extend its own prefix".into());
        }
        for flag in &mut loss_mask[start.len()..through.len()] {
            *flag = true;
        }
    }
    if !loss_mask.iter().any(|&f| f) {
        return Err("no assistant message to train on".into());
    }
    Ok(TokenizedSeq { ids, loss_mask })
}

/// SFT examples from pair rows: prompt + chosen with the loss on the chosen messages only
/// (TRL's completion-only loss for prompt–completion data: earlier assistant turns of a
/// multi-turn prompt are context, possibly another model's, not targets), with the same turn
/// truncation as DPO.
pub fn tokenize_sft(
    codec: &ChatCodec,
    rows: &[PairRow],
    max_length: usize,
    path: &Path,
) -> Result<(Vec<TokenizedSeq>, TokenizeStats), DataError> {
    let mut stats = TokenizeStats {
        rows: rows.len(),
        ..Default::default()
    };
    let mut out = Vec::new();
    let token_bytes = max_token_bytes(codec);
    for (i, row) in rows.iter().enumerate() {
        let row_err = |message: String| DataError::Row {
            path: path.to_path_buf(),
            row: i,
            message,
        };
        check_row(row).map_err(row_err)?;
        let seq = fit_conversation(
            codec,
            row.prompt.clone(),
            &row.chosen,
            max_length,
            token_bytes,
        )
        .map_err(row_err)?;
        let kept = seq.map(|(s, truncated)| {
            let tokens = s.ids.len();
            out.push(s);
            (tokens, truncated)
        });
        stats.count(kept);
    }
    Ok((out, stats))
}

/// SFT examples from whole conversations (`sft.parquet`): loss on every assistant message,
/// oldest turns dropped while the conversation is longer than `max_length`.
pub fn tokenize_sft_conversations(
    codec: &ChatCodec,
    convs: &[Vec<ChatMessage>],
    max_length: usize,
    path: &Path,
) -> Result<(Vec<TokenizedSeq>, TokenizeStats), DataError> {
    let mut stats = TokenizeStats {
        rows: convs.len(),
        ..Default::default()
    };
    let mut out = Vec::new();
    let token_bytes = max_token_bytes(codec);
    for (i, conv) in convs.iter().enumerate() {
        let seq = fit_conversation(codec, conv.clone(), &[], max_length, token_bytes).map_err(
            |message| DataError::Row {
                path: path.to_path_buf(),
                row: i,
                message,
            },
        )?;
        let kept = seq.map(|(s, truncated)| {
            let tokens = s.ids.len();
            out.push(s);
            (tokens, truncated)
        });
        stats.count(kept);
    }
    Ok((out, stats))
}

/// `head + tail` tokenized, dropping `head`'s oldest turns until it fits; `None` when even
/// the last turn is too long. The flag says whether a turn was dropped. With a `tail` only
/// its assistant messages carry the loss; without one, every assistant message of `head`.
fn fit_conversation(
    codec: &ChatCodec,
    mut head: Vec<ChatMessage>,
    tail: &[ChatMessage],
    max_length: usize,
    token_bytes: usize,
) -> Result<Option<(TokenizedSeq, bool)>, String> {
    let floor: Vec<&ChatMessage> = if tail.is_empty() {
        never_dropped(&head).collect()
    } else {
        tail.iter().collect()
    };
    if surely_too_long(floor, max_length, token_bytes) {
        return Ok(None);
    }
    let mut truncated = false;
    loop {
        let mut conv = head.clone();
        conv.extend_from_slice(tail);
        let first = if tail.is_empty() { 0 } else { head.len() };
        let seq = tokenize_trained_from(codec, &conv, first)?;
        if seq.ids.len() <= max_length {
            return Ok(Some((seq, truncated)));
        }
        match drop_oldest_turn(&head) {
            Some(shorter) => {
                head = shorter;
                truncated = true;
            }
            None => return Ok(None),
        }
    }
}

/// With `--loss sft`, a run directory's `sft.parquet` (its best whole conversations) when it
/// has one; otherwise the pairs, as for DPO.
pub fn locate_sft_data(path: &Path) -> Result<DataFiles, DataError> {
    let sft = path.join("sft.parquet");
    if path.is_dir() && sft.is_file() {
        return Ok(DataFiles {
            train: sft,
            eval: None,
        });
    }
    locate_data(path)
}
