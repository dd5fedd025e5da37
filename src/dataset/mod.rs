//! Parquet datasets this toolkit writes and reads:
//!
//! - [`pairs`] — DPO preference pairs in TRL's conversational format, and the split by
//!   conversation into train/test.
//! - [`flat`] — the upstream CollabLLM flat rows (`collabllm/collabllm-multiturn-*`), so that
//!   upstream tools read what we write and we read what they published.
//!
//! Writers replace the destination atomically (temporary file in the same directory + rename)
//! and compress with snappy. Readers are tolerant about encodings (any string type, integer or
//! string ids, any float width) and strict about meaning: every error is a [`DatasetError`] that
//! names the file and, where it applies, the column and the 0-based row.

use std::fs::File;
use std::path::{Path, PathBuf};

use arrow::array::RecordBatch;
use parquet::arrow::arrow_reader::{ParquetRecordBatchReader, ParquetRecordBatchReaderBuilder};
use parquet::arrow::ArrowWriter;

use columnar::AtomicFile;

pub(crate) mod columnar;
pub mod flat;
pub mod pairs;
pub mod sft;
pub mod verl;

pub use flat::{read_flat_parquet, write_flat_parquet, FlatRow};
pub use pairs::{read_pairs_parquet, split_by_conversation, write_pairs_parquet, PairRow};

/// Errors of the dataset readers and writers; every variant names the file.
#[derive(Debug, thiserror::Error)]
pub enum DatasetError {
    #[error("{}: cannot read: {source}", path.display())]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{}: cannot write: {source}", path.display())]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
    /// The parquet/arrow layer failed (not a parquet file, corrupt page, encoder error).
    #[error("{}: parquet: {message}", path.display())]
    Parquet { path: PathBuf, message: String },
    #[error("{}: missing required column `{column}`", path.display())]
    MissingColumn { path: PathBuf, column: &'static str },
    /// A column has a type this reader cannot interpret.
    #[error("{}: column `{column}`: {message}", path.display())]
    ColumnType {
        path: PathBuf,
        column: &'static str,
        message: String,
    },
    /// The input holds nothing to write (an export of a run whose every task failed).
    #[error("{}: nothing to write: {message}", path.display())]
    Empty { path: PathBuf, message: String },
    /// One value is unusable (null where a value is required, invalid JSON, out of range).
    #[error("{}: column `{column}`, row {row}: {message}", path.display())]
    InvalidValue {
        path: PathBuf,
        column: &'static str,
        row: usize,
        message: String,
    },
}

/// Error constructors bound to one file.
pub(crate) struct Ctx<'a> {
    pub path: &'a Path,
}

impl Ctx<'_> {
    pub fn parquet(&self, e: impl std::fmt::Display) -> DatasetError {
        DatasetError::Parquet {
            path: self.path.to_path_buf(),
            message: e.to_string(),
        }
    }
    pub fn missing(&self, column: &'static str) -> DatasetError {
        DatasetError::MissingColumn {
            path: self.path.to_path_buf(),
            column,
        }
    }
    pub fn coltype(&self, column: &'static str, message: String) -> DatasetError {
        DatasetError::ColumnType {
            path: self.path.to_path_buf(),
            column,
            message,
        }
    }
    pub fn invalid(
        &self,
        column: &'static str,
        row: usize,
        message: impl Into<String>,
    ) -> DatasetError {
        DatasetError::InvalidValue {
            path: self.path.to_path_buf(),
            column,
            row,
            message: message.into(),
        }
    }
    pub fn write(&self, source: std::io::Error) -> DatasetError {
        DatasetError::Write {
            path: self.path.to_path_buf(),
            source,
        }
    }

    /// A required column of `batch`.
    pub fn required<'b>(
        &self,
        batch: &'b RecordBatch,
        column: &'static str,
    ) -> Result<&'b arrow::array::ArrayRef, DatasetError> {
        columnar::column(batch, column).ok_or_else(|| self.missing(column))
    }

    /// `turn_id`-style value: a non-null integer in `u32` range.
    pub fn turn_id(
        &self,
        a: &arrow::array::Int64Array,
        column: &'static str,
        row: usize,
        i: usize,
    ) -> Result<u32, DatasetError> {
        use arrow::array::Array as _;
        if a.is_null(i) {
            return Err(self.invalid(column, row, "null"));
        }
        u32::try_from(a.value(i))
            .map_err(|_| self.invalid(column, row, format!("{} is out of range", a.value(i))))
    }
}

/// Opens a parquet file for batch-wise reading.
pub(crate) fn open(path: &Path) -> Result<ParquetRecordBatchReader, DatasetError> {
    let ctx = Ctx { path };
    let file = File::open(path).map_err(|source| DatasetError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    ParquetRecordBatchReaderBuilder::try_new(file)
        .map_err(|e| ctx.parquet(e))?
        .build()
        .map_err(|e| ctx.parquet(e))
}

/// Writes one batch as a snappy-compressed parquet file, atomically.
pub(crate) fn write_batch(path: &Path, batch: &RecordBatch) -> Result<(), DatasetError> {
    let ctx = Ctx { path };
    let (guard, file) = AtomicFile::create(path).map_err(|e| ctx.write(e))?;
    let mut w = ArrowWriter::try_new(file, batch.schema(), Some(columnar::writer_properties()))
        .map_err(|e| ctx.parquet(e))?;
    w.write(batch).map_err(|e| ctx.parquet(e))?;
    let file = w.into_inner().map_err(|e| ctx.parquet(e))?;
    guard.commit(file).map_err(|e| ctx.write(e))
}
