//! OpenAI-shaped errors (`{"error": {message, type, param, code}}`) for malformed input,
//! refused parameters, unknown routes and backend failures.

use axum::http::{Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;

use super::response_format::{self, ResponseFormat};
use super::ErrorNote;
use crate::llm::LlmError;

/// An OpenAI-shaped error response.
#[derive(Debug)]
pub struct ApiError {
    pub(super) status: StatusCode,
    pub(super) message: String,
    pub(super) kind: &'static str,
    pub(super) param: Option<String>,
    pub(super) code: Option<&'static str>,
}

impl ApiError {
    pub(super) fn invalid(message: impl Into<String>, param: Option<&str>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            kind: "invalid_request_error",
            param: param.map(str::to_string),
            code: None,
        }
    }

    pub(super) fn from_llm(e: &LlmError) -> Self {
        let message = e.to_string();
        let (status, kind, code) = match e {
            LlmError::InvalidRequest(msg) => {
                let mut err = Self::invalid(message, backticked(msg).as_deref());
                err.code = Some("invalid_value");
                return err;
            }
            LlmError::ContextExceeded { param, .. } => {
                return Self::context_exceeded(message, param);
            }
            LlmError::Unsupported { .. } => (
                StatusCode::BAD_REQUEST,
                "invalid_request_error",
                Some("unsupported"),
            ),
            LlmError::RateLimited { .. } => (
                StatusCode::TOO_MANY_REQUESTS,
                "rate_limit_error",
                Some("rate_limit_exceeded"),
            ),
            LlmError::Timeout { .. } | LlmError::Connection { .. } | LlmError::Server { .. } => (
                StatusCode::SERVICE_UNAVAILABLE,
                "server_error",
                Some("service_unavailable"),
            ),
            _ => (StatusCode::INTERNAL_SERVER_ERROR, "server_error", None),
        };
        Self {
            status,
            message,
            kind,
            param: None,
            code,
        }
    }

    /// [`ApiError::from_llm`] for `/v1/completions`, whose prompt is the field `prompt`:
    /// a prompt too long for the context names it, not chat's `messages`.
    pub(super) fn from_completion_llm(e: &LlmError) -> Self {
        let mut err = Self::from_llm(e);
        if err.param.as_deref() == Some("messages") {
            err.param = Some("prompt".into());
        }
        err
    }

    pub(super) fn context_exceeded(message: String, param: &str) -> Self {
        let mut err = Self::invalid(message, Some(param));
        err.code = Some("context_length_exceeded");
        err
    }

    pub(super) fn from_format(e: response_format::FormatError) -> Self {
        let mut err = Self::invalid(e.message, Some(&e.param));
        err.code = Some(if e.unsupported {
            "unsupported_parameter"
        } else {
            "invalid_value"
        });
        err
    }

    /// A reply that does not satisfy `response_format`: the model's failure, not the client's.
    pub(super) fn format_not_met(index: usize, format: &ResponseFormat, why: &str) -> Self {
        let wanted = match format {
            ResponseFormat::JsonSchema { name, .. } => format!("json_schema `{name}`"),
            _ => "json_object".into(),
        };
        Self {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            message: format!(
                "choice {index} does not satisfy response_format {wanted}: {why} (this server \
                 checks the finished reply; it does not constrain decoding)"
            ),
            kind: "server_error",
            param: Some("response_format".into()),
            code: Some("response_format_not_met"),
        }
    }

    pub(super) fn model_not_found(name: &str) -> Self {
        Self {
            status: StatusCode::NOT_FOUND,
            message: format!("The model `{name}` does not exist or you do not have access to it."),
            kind: "invalid_request_error",
            param: Some("model".into()),
            code: Some("model_not_found"),
        }
    }

    pub fn status(&self) -> StatusCode {
        self.status
    }
}

/// The first `name` quoted in backticks in a validation message (our messages name the
/// offending parameter that way).
pub(super) fn backticked(msg: &str) -> Option<String> {
    let start = msg.find('`')? + 1;
    let len = msg[start..].find('`')?;
    Some(msg[start..start + len].to_string())
}

/// Bytes of an error's message at most, as a client and the log see it: a client's string
/// quoted in it (a 1 MB key, `model`, `role`, `$ref`) is cut, never echoed whole.
pub(super) const MAX_ERROR_MESSAGE_BYTES: usize = 1_000;
/// Bytes of an error's `param` at most (a path of client-chosen keys).
pub(super) const MAX_ERROR_PARAM_BYTES: usize = 200;

impl ApiError {
    /// The error as it leaves the server: message and param cut to their bounds.
    pub(super) fn capped(mut self) -> Self {
        if self.message.len() > MAX_ERROR_MESSAGE_BYTES {
            self.message = crate::check::clip(&self.message, MAX_ERROR_MESSAGE_BYTES);
        }
        if let Some(p) = self.param.as_mut() {
            if p.len() > MAX_ERROR_PARAM_BYTES {
                *p = crate::check::clip(p, MAX_ERROR_PARAM_BYTES);
            }
        }
        self
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let this = self.capped();
        let body = json!({
            "error": {
                "message": this.message,
                "type": this.kind,
                "param": this.param,
                "code": this.code,
            }
        });
        let mut resp = (this.status, Json(body)).into_response();
        resp.extensions_mut().insert(ErrorNote(this.message));
        resp
    }
}

pub(super) async fn not_found(method: Method, uri: Uri) -> ApiError {
    ApiError {
        status: StatusCode::NOT_FOUND,
        message: format!("no route for {method} {}", uri.path()),
        kind: "invalid_request_error",
        param: None,
        code: Some("not_found"),
    }
}

pub(super) async fn method_not_allowed(method: Method, uri: Uri) -> ApiError {
    ApiError {
        status: StatusCode::METHOD_NOT_ALLOWED,
        message: format!("method {method} is not allowed on {}", uri.path()),
        kind: "invalid_request_error",
        param: None,
        code: Some("method_not_allowed"),
    }
}
