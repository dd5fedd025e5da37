//! Crate-internal helpers shared by the parquet readers and writers of `task` and `dataset`:
//! atomic file replacement, tolerant column access (any string encoding, integer ids, any float
//! width) and Arrow → JSON conversion for nested columns.
//!
//! Every helper reports problems as plain strings; the callers wrap them in their own typed
//! errors, which name the file, the column and the row.

use std::sync::Arc;

use arrow::array::{Array, ArrayRef, AsArray, RecordBatch, StringArray, StructArray};
use arrow::compute::cast;
use arrow::datatypes::{self as dt, DataType, Field, Fields};

use crate::llm::ChatMessage;

/// Atomic file replacement lives with the other run-directory plumbing.
pub(crate) use crate::run::AtomicFile;

/// Snappy-compressed writer properties used by every parquet file this crate writes.
pub(crate) fn writer_properties() -> parquet::file::properties::WriterProperties {
    parquet::file::properties::WriterProperties::builder()
        .set_compression(parquet::basic::Compression::SNAPPY)
        // Lists as the Parquet spec and pyarrow name their items (`element`), so a file's
        // schema equals the one Python tools write for the same data.
        .set_coerce_types(true)
        .build()
}

/// The column named `name` of `batch`, if present.
pub(crate) fn column<'a>(batch: &'a RecordBatch, name: &str) -> Option<&'a ArrayRef> {
    batch.schema().index_of(name).ok().map(|i| batch.column(i))
}

/// Human-readable type name for error messages.
pub(crate) fn type_name(t: &DataType) -> String {
    format!("{t}")
}

/// Any string-like or integer column as a `Utf8` array (integer ids become their decimal text).
pub(crate) fn as_utf8(col: &ArrayRef) -> Result<StringArray, String> {
    let ok = match col.data_type() {
        DataType::Utf8 => return Ok(col.as_string::<i32>().clone()),
        DataType::LargeUtf8
        | DataType::Utf8View
        | DataType::Int8
        | DataType::Int16
        | DataType::Int32
        | DataType::Int64
        | DataType::UInt8
        | DataType::UInt16
        | DataType::UInt32
        | DataType::UInt64
        | DataType::Null => true,
        DataType::Dictionary(_, v) => matches!(
            v.as_ref(),
            DataType::Utf8 | DataType::LargeUtf8 | DataType::Utf8View
        ),
        _ => false,
    };
    if !ok {
        return Err(format!(
            "expected a string column, found {}",
            type_name(col.data_type())
        ));
    }
    let casted = cast(col, &DataType::Utf8).map_err(|e| e.to_string())?;
    Ok(casted.as_string::<i32>().clone())
}

/// Any string-like column (not integers) as `Utf8`.
pub(crate) fn as_text(col: &ArrayRef) -> Result<StringArray, String> {
    if col.data_type().is_integer() {
        return Err(format!(
            "expected a string column, found {}",
            type_name(col.data_type())
        ));
    }
    as_utf8(col)
}

/// Any numeric column as `Float64`.
pub(crate) fn as_f64(col: &ArrayRef) -> Result<arrow::array::Float64Array, String> {
    let t = col.data_type();
    if !(t.is_numeric() || *t == DataType::Null) {
        return Err(format!("expected a numeric column, found {}", type_name(t)));
    }
    let casted = cast(col, &DataType::Float64).map_err(|e| e.to_string())?;
    Ok(casted.as_primitive::<dt::Float64Type>().clone())
}

/// Any integer column as `Int64` (a `UInt64` value above `i64::MAX` reads as null).
pub(crate) fn as_i64(col: &ArrayRef) -> Result<arrow::array::Int64Array, String> {
    let t = col.data_type();
    if !(t.is_integer() || *t == DataType::Null) {
        return Err(format!(
            "expected an integer column, found {}",
            type_name(t)
        ));
    }
    let casted = cast(col, &DataType::Int64).map_err(|e| e.to_string())?;
    Ok(casted.as_primitive::<dt::Int64Type>().clone())
}

/// The arrow type of a message list: `List<Struct<role: Utf8, content: Utf8>>`, every level
/// nullable as in the schemas Hugging Face `datasets` (pyarrow) writes.
pub(crate) fn message_struct_fields() -> Fields {
    Fields::from(vec![
        Field::new("role", DataType::Utf8, true),
        Field::new("content", DataType::Utf8, true),
    ])
}

pub(crate) fn messages_type() -> DataType {
    DataType::List(Arc::new(Field::new_list_field(
        DataType::Struct(message_struct_fields()),
        true,
    )))
}

/// Builds a `List<Struct<role, content>>` array, one list per row.
pub(crate) fn messages_array<'a>(rows: impl Iterator<Item = &'a [ChatMessage]>) -> ArrayRef {
    let mut lengths = Vec::new();
    let mut roles: Vec<&str> = Vec::new();
    let mut contents: Vec<&str> = Vec::new();
    for msgs in rows {
        lengths.push(msgs.len());
        for m in msgs {
            roles.push(&m.role);
            contents.push(&m.content);
        }
    }
    let values = StructArray::new(
        message_struct_fields(),
        vec![
            Arc::new(StringArray::from(roles)) as ArrayRef,
            Arc::new(StringArray::from(contents)) as ArrayRef,
        ],
        None,
    );
    let field = match messages_type() {
        DataType::List(f) => f,
        _ => unreachable!(),
    };
    Arc::new(arrow::array::ListArray::new(
        field,
        arrow::buffer::OffsetBuffer::from_lengths(lengths),
        Arc::new(values),
        None,
    ))
}

/// A column of chat messages as read: the conversational form (`List`/`LargeList` of structs
/// with `role` and `content`, in any field order, extra fields ignored) or the standard string
/// form (one text per row, turned into a single message with `string_role`).
// One value per column per record batch: the size difference between variants is irrelevant.
#[allow(clippy::large_enum_variant)]
pub(crate) enum MessagesColumn {
    Lists {
        offsets: Vec<usize>,
        list_nulls: Option<arrow::buffer::NullBuffer>,
        struct_nulls: Option<arrow::buffer::NullBuffer>,
        roles: StringArray,
        contents: StringArray,
    },
    Text {
        texts: StringArray,
        role: &'static str,
    },
}

impl MessagesColumn {
    pub(crate) fn new(col: &ArrayRef, string_role: &'static str) -> Result<Self, String> {
        let (offsets, list_nulls, values): (Vec<usize>, _, ArrayRef) = match col.data_type() {
            DataType::List(_) => {
                let l = col.as_list::<i32>();
                (
                    l.offsets().iter().map(|&o| o as usize).collect(),
                    l.nulls().cloned(),
                    l.values().clone(),
                )
            }
            DataType::LargeList(_) => {
                let l = col.as_list::<i64>();
                (
                    l.offsets().iter().map(|&o| o as usize).collect(),
                    l.nulls().cloned(),
                    l.values().clone(),
                )
            }
            DataType::Utf8
            | DataType::LargeUtf8
            | DataType::Utf8View
            | DataType::Dictionary(..) => {
                return Ok(Self::Text {
                    texts: as_text(col)?,
                    role: string_role,
                })
            }
            t => {
                return Err(format!(
                    "expected list<struct<role, content>> or a string column, found {}",
                    type_name(t)
                ))
            }
        };
        let DataType::Struct(_) = values.data_type() else {
            return Err(format!(
                "expected list<struct<role, content>>, found list of {}",
                type_name(values.data_type())
            ));
        };
        let s = values.as_struct();
        let child = |name: &str| -> Result<StringArray, String> {
            let c = s.column_by_name(name).ok_or_else(|| {
                format!("message struct has no `{name}` field (expected role, content)")
            })?;
            as_text(c).map_err(|e| format!("message field `{name}`: {e}"))
        };
        Ok(Self::Lists {
            offsets,
            list_nulls,
            struct_nulls: s.nulls().cloned(),
            roles: child("role")?,
            contents: child("content")?,
        })
    }

    /// The messages of row `i`; `Ok(None)` when the row is null. A null `content` reads as
    /// empty text; a null message or `role` is an error.
    pub(crate) fn get(&self, i: usize) -> Result<Option<Vec<ChatMessage>>, String> {
        match self {
            Self::Text { texts, role } => Ok(texts
                .is_valid(i)
                .then(|| vec![ChatMessage::new(*role, texts.value(i))])),
            Self::Lists {
                offsets,
                list_nulls,
                struct_nulls,
                roles,
                contents,
            } => {
                if list_nulls.as_ref().is_some_and(|n| n.is_null(i)) {
                    return Ok(None);
                }
                let mut out = Vec::with_capacity(offsets[i + 1] - offsets[i]);
                for (k, j) in (offsets[i]..offsets[i + 1]).enumerate() {
                    if struct_nulls.as_ref().is_some_and(|n| n.is_null(j)) {
                        return Err(format!("message {k} is null"));
                    }
                    if roles.is_null(j) {
                        return Err(format!("message {k} has a null role"));
                    }
                    let content = if contents.is_null(j) {
                        ""
                    } else {
                        contents.value(j)
                    };
                    out.push(ChatMessage::new(roles.value(j), content));
                }
                Ok(Some(out))
            }
        }
    }
}

/// A column whose values are JSON: either JSON text (any string type; null → JSON null) or a
/// nested arrow value (struct, list, map, primitives) converted element by element.
pub(crate) enum JsonColumn {
    Text(StringArray),
    Nested(ArrayRef),
}

impl JsonColumn {
    pub(crate) fn new(col: &ArrayRef) -> Result<Self, String> {
        match col.data_type() {
            DataType::Utf8
            | DataType::LargeUtf8
            | DataType::Utf8View
            | DataType::Dictionary(..) => Ok(Self::Text(as_text(col)?)),
            _ => {
                check_json_convertible(col.data_type())?;
                Ok(Self::Nested(col.clone()))
            }
        }
    }

    pub(crate) fn get(&self, i: usize) -> Result<serde_json::Value, String> {
        match self {
            Self::Text(a) => {
                if a.is_null(i) {
                    Ok(serde_json::Value::Null)
                } else {
                    serde_json::from_str(a.value(i)).map_err(|e| format!("invalid JSON: {e}"))
                }
            }
            Self::Nested(a) => to_json(a.as_ref(), i),
        }
    }
}

/// Whether [`to_json`] can convert values of type `t`; the error names the first type it cannot.
pub(crate) fn check_json_convertible(t: &DataType) -> Result<(), String> {
    match t {
        DataType::Null
        | DataType::Boolean
        | DataType::Int8
        | DataType::Int16
        | DataType::Int32
        | DataType::Int64
        | DataType::UInt8
        | DataType::UInt16
        | DataType::UInt32
        | DataType::UInt64
        | DataType::Float16
        | DataType::Float32
        | DataType::Float64
        | DataType::Utf8
        | DataType::LargeUtf8
        | DataType::Utf8View => Ok(()),
        DataType::List(f) | DataType::LargeList(f) | DataType::FixedSizeList(f, _) => {
            check_json_convertible(f.data_type())
        }
        DataType::Struct(fields) => fields
            .iter()
            .try_for_each(|f| check_json_convertible(f.data_type())),
        DataType::Map(f, _) => match f.data_type() {
            DataType::Struct(kv) if kv.len() == 2 => {
                if !matches!(
                    kv[0].data_type(),
                    DataType::Utf8 | DataType::LargeUtf8 | DataType::Utf8View
                ) {
                    return Err(format!(
                        "cannot convert a map with {} keys to JSON",
                        type_name(kv[0].data_type())
                    ));
                }
                check_json_convertible(kv[1].data_type())
            }
            _ => Err(format!("cannot convert {} to JSON", type_name(t))),
        },
        other => Err(format!("cannot convert {} to JSON", type_name(other))),
    }
}

fn f64_json(x: f64) -> serde_json::Value {
    serde_json::Number::from_f64(x)
        .map(serde_json::Value::Number)
        .unwrap_or(serde_json::Value::Null)
}

/// Element `i` of `a` as JSON: structs become objects (field order kept), lists arrays, maps
/// objects, nulls `null`, non-finite floats `null`.
pub(crate) fn to_json(a: &dyn Array, i: usize) -> Result<serde_json::Value, String> {
    use serde_json::Value;
    if a.is_null(i) {
        return Ok(Value::Null);
    }
    Ok(match a.data_type() {
        DataType::Null => Value::Null,
        DataType::Boolean => Value::Bool(a.as_boolean().value(i)),
        DataType::Int8 => a.as_primitive::<dt::Int8Type>().value(i).into(),
        DataType::Int16 => a.as_primitive::<dt::Int16Type>().value(i).into(),
        DataType::Int32 => a.as_primitive::<dt::Int32Type>().value(i).into(),
        DataType::Int64 => a.as_primitive::<dt::Int64Type>().value(i).into(),
        DataType::UInt8 => a.as_primitive::<dt::UInt8Type>().value(i).into(),
        DataType::UInt16 => a.as_primitive::<dt::UInt16Type>().value(i).into(),
        DataType::UInt32 => a.as_primitive::<dt::UInt32Type>().value(i).into(),
        DataType::UInt64 => a.as_primitive::<dt::UInt64Type>().value(i).into(),
        DataType::Float16 => f64_json(a.as_primitive::<dt::Float16Type>().value(i).to_f64()),
        DataType::Float32 => f64_json(a.as_primitive::<dt::Float32Type>().value(i) as f64),
        DataType::Float64 => f64_json(a.as_primitive::<dt::Float64Type>().value(i)),
        DataType::Utf8 => Value::String(a.as_string::<i32>().value(i).to_string()),
        DataType::LargeUtf8 => Value::String(a.as_string::<i64>().value(i).to_string()),
        DataType::Utf8View => Value::String(a.as_string_view().value(i).to_string()),
        DataType::List(_) => list_json(a.as_list::<i32>().value(i).as_ref())?,
        DataType::LargeList(_) => list_json(a.as_list::<i64>().value(i).as_ref())?,
        DataType::FixedSizeList(..) => list_json(a.as_fixed_size_list().value(i).as_ref())?,
        DataType::Struct(fields) => {
            let s = a.as_struct();
            let mut obj = serde_json::Map::new();
            for (f, c) in fields.iter().zip(s.columns()) {
                obj.insert(f.name().clone(), to_json(c.as_ref(), i)?);
            }
            Value::Object(obj)
        }
        DataType::Map(..) => {
            let entries = a.as_map().value(i);
            let keys = as_text(entries.column(0))?;
            let mut obj = serde_json::Map::new();
            for k in 0..entries.len() {
                if keys.is_null(k) {
                    return Err("map with a null key".into());
                }
                obj.insert(
                    keys.value(k).to_string(),
                    to_json(entries.column(1).as_ref(), k)?,
                );
            }
            Value::Object(obj)
        }
        other => return Err(format!("cannot convert {} to JSON", type_name(other))),
    })
}

fn list_json(values: &dyn Array) -> Result<serde_json::Value, String> {
    (0..values.len())
        .map(|k| to_json(values, k))
        .collect::<Result<Vec<_>, _>>()
        .map(serde_json::Value::Array)
}

/// The arrow shape that holds a set of JSON values, found by [`JsonShape::of_values`].
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum JsonShape {
    /// Only nulls so far.
    Null,
    Bool,
    Int,
    Float,
    Str,
    List(Box<JsonShape>),
    /// An object; a key missing in some values is null there.
    Struct(Vec<(String, JsonShape)>),
    /// Values whose kinds conflict (or empty objects): stored as JSON text.
    Text,
}

impl JsonShape {
    fn of(v: &serde_json::Value) -> Self {
        use serde_json::Value;
        match v {
            Value::Null => Self::Null,
            Value::Bool(_) => Self::Bool,
            Value::Number(n) if n.is_i64() => Self::Int,
            Value::Number(_) => Self::Float,
            Value::String(_) => Self::Str,
            Value::Array(items) => Self::List(Box::new(Self::of_values(items))),
            Value::Object(m) if m.is_empty() => Self::Text,
            Value::Object(m) => {
                Self::Struct(m.iter().map(|(k, v)| (k.clone(), Self::of(v))).collect())
            }
        }
    }

    /// The narrowest shape holding every value: integers widen to floats, struct keys unite (in
    /// first-seen order), anything else that conflicts becomes JSON text.
    pub(crate) fn of_values<'a>(values: impl IntoIterator<Item = &'a serde_json::Value>) -> Self {
        values
            .into_iter()
            .fold(Self::Null, |acc, v| acc.merge(Self::of(v)))
    }

    fn merge(self, other: Self) -> Self {
        match (self, other) {
            (Self::Null, s) | (s, Self::Null) => s,
            (Self::Int, Self::Float) | (Self::Float, Self::Int) => Self::Float,
            (Self::List(a), Self::List(b)) => Self::List(Box::new(a.merge(*b))),
            (Self::Struct(mut a), Self::Struct(b)) => {
                for (k, s) in b {
                    match a.iter_mut().find(|(name, _)| *name == k) {
                        Some((_, t)) => *t = std::mem::replace(t, Self::Null).merge(s),
                        None => a.push((k, s)),
                    }
                }
                Self::Struct(a)
            }
            (a, b) if a == b => a,
            _ => Self::Text,
        }
    }

    /// Whether a column of this shape is stored nested (rather than as JSON text).
    pub(crate) fn is_nested(&self) -> bool {
        matches!(self, Self::List(_) | Self::Struct(_))
    }

    pub(crate) fn data_type(&self) -> DataType {
        match self {
            Self::Bool => DataType::Boolean,
            Self::Int => DataType::Int64,
            Self::Float => DataType::Float64,
            // An all-null leaf has no type of its own; strings are what `datasets` assumes.
            Self::Null | Self::Str | Self::Text => DataType::Utf8,
            Self::List(item) => {
                DataType::List(Arc::new(Field::new_list_field(item.data_type(), true)))
            }
            Self::Struct(fields) => DataType::Struct(
                fields
                    .iter()
                    .map(|(k, s)| Field::new(k, s.data_type(), true))
                    .collect(),
            ),
        }
    }

    /// An array of this shape's [`data_type`](Self::data_type) holding `values` (which must be
    /// among those the shape was found from); nulls, and values of another kind, are null.
    pub(crate) fn array(&self, values: &[&serde_json::Value]) -> ArrayRef {
        use arrow::array::{BooleanArray, Float64Array, Int64Array, ListArray};
        use serde_json::Value;
        // Null where a value is not of the kind this level holds.
        let valid = |is_kind: fn(&Value) -> bool| -> arrow::buffer::NullBuffer {
            values
                .iter()
                .map(|v| is_kind(v))
                .collect::<Vec<bool>>()
                .into()
        };
        match self {
            Self::Bool => Arc::new(BooleanArray::from_iter(values.iter().map(|v| v.as_bool()))),
            Self::Int => Arc::new(Int64Array::from_iter(values.iter().map(|v| v.as_i64()))),
            Self::Float => Arc::new(Float64Array::from_iter(values.iter().map(|v| v.as_f64()))),
            Self::Null | Self::Str => {
                Arc::new(StringArray::from_iter(values.iter().map(|v| v.as_str())))
            }
            Self::Text => Arc::new(StringArray::from_iter(
                values.iter().map(|v| (!v.is_null()).then(|| v.to_string())),
            )),
            Self::List(item) => {
                let empty: &[Value] = &[];
                let lists: Vec<&[Value]> = values
                    .iter()
                    .map(|v| v.as_array().map_or(empty, |a| a.as_slice()))
                    .collect();
                let children: Vec<&Value> = lists.iter().flat_map(|l| l.iter()).collect();
                let field = Arc::new(Field::new_list_field(item.data_type(), true));
                Arc::new(ListArray::new(
                    field,
                    arrow::buffer::OffsetBuffer::from_lengths(lists.iter().map(|l| l.len())),
                    item.array(&children),
                    Some(valid(Value::is_array)),
                ))
            }
            Self::Struct(fields) => {
                let columns = fields
                    .iter()
                    .map(|(k, s)| {
                        let col: Vec<&Value> = values
                            .iter()
                            .map(|v| v.get(k).unwrap_or(&Value::Null))
                            .collect();
                        s.array(&col)
                    })
                    .collect();
                Arc::new(StructArray::new(
                    match self.data_type() {
                        DataType::Struct(f) => f,
                        _ => unreachable!("a struct shape has a struct type"),
                    },
                    columns,
                    Some(valid(Value::is_object)),
                ))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn json_shapes_widen_unite_and_fall_back_to_text() {
        let values = [
            json!({"a": 1, "b": [1, 2]}),
            json!(null),
            json!({"a": 2.5, "c": "x", "b": []}),
            json!({"a": 3, "b": [0.5], "c": {"nested": true}}),
        ];
        let shape = JsonShape::of_values(&values);
        assert_eq!(
            shape,
            JsonShape::Struct(vec![
                ("a".into(), JsonShape::Float),
                ("b".into(), JsonShape::List(Box::new(JsonShape::Float))),
                ("c".into(), JsonShape::Text),
            ])
        );
        let refs: Vec<&serde_json::Value> = values.iter().collect();
        let array = shape.array(&refs);
        assert_eq!(array.data_type(), &shape.data_type());
        let back: Vec<serde_json::Value> = (0..array.len())
            .map(|i| to_json(array.as_ref(), i).unwrap())
            .collect();
        assert_eq!(
            back,
            [
                json!({"a": 1.0, "b": [1.0, 2.0], "c": null}),
                json!(null),
                json!({"a": 2.5, "b": [], "c": "\"x\""}),
                json!({"a": 3.0, "b": [0.5], "c": "{\"nested\":true}"}),
            ]
        );
        assert!(!JsonShape::of_values(&[json!("s"), json!(null)]).is_nested());
        assert_eq!(JsonShape::of_values(&[json!({})]), JsonShape::Text);
    }
}
