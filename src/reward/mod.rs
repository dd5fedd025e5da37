//! Reward primitives: pure, tested building blocks the metrics of DESIGN §2 are computed from.
//!
//! * [`bleu`] — token-level sentence BLEU-4 (sacrebleu-exact), for document editing;
//! * [`math`] — final-answer extraction and numeric comparison, for math accuracy;
//! * [`sandbox`] — running generated Python against unit tests in a confined process, for
//!   `pass_rate`;
//! * [`parse`] — lenient parsing of judge / extractor output (JSON objects, fenced code,
//!   documents).
//!
//! Nothing here calls a model; the metric layer combines these with the LLM judges.

pub mod bleu;
pub mod math;
pub mod parse;
pub mod sandbox;
