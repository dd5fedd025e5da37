//! API keys: which keys a client can send at all, and the middleware that requires one
//! (`Authorization: Bearer <key>`, the scheme matched in any case; a 401 is logged).

use axum::extract::Request;
use axum::middleware::{self, Next};
use std::sync::Arc;

use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::Router;

use super::ApiError;

/// An API key no client could send: HTTP header values carry printable ASCII only, so a key
/// with other characters would start a server that refuses every request. The key itself is
/// never part of the message.
#[derive(Debug, thiserror::Error)]
#[error(
    "the API key holds {0}; clients send it in an HTTP header, which carries printable ASCII \
     without spaces only: choose a key of letters, digits and punctuation"
)]
pub struct InvalidApiKey(&'static str);

/// Refuses a key that no `Authorization` header can carry (see [`InvalidApiKey`]).
pub fn check_api_key(key: &str) -> Result<(), InvalidApiKey> {
    if key.is_empty() {
        return Err(InvalidApiKey("nothing"));
    }
    if !key.is_ascii() {
        return Err(InvalidApiKey("non-ASCII characters"));
    }
    if !key.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(InvalidApiKey("spaces or control characters"));
    }
    Ok(())
}

/// `router` answering only requests that carry `Authorization: Bearer <key>` (OpenAI
/// clients send their API key so; the scheme's case does not matter, RFC 7235); `/health`
/// stays open for load balancers and probes. A refused request is logged (method, path,
/// status; never the header), so guessing shows in the log.
pub fn require_api_key(router: Router, key: String) -> Result<Router, InvalidApiKey> {
    check_api_key(&key)?;
    let key: Arc<str> = key.into();
    Ok(
        router.layer(middleware::from_fn(move |req: Request, next: Next| {
            let key = key.clone();
            async move {
                let path = req.uri().path();
                if path == "/health" || path == "/v1/health" || bearer_matches(&req, &key) {
                    return next.run(req).await;
                }
                tracing::warn!(
                    method = %req.method(),
                    path,
                    status = 401,
                    "request rejected: missing or wrong API key"
                );
                ApiError {
                    status: StatusCode::UNAUTHORIZED,
                    message: "missing or wrong API key: send `Authorization: Bearer <key>`".into(),
                    kind: "invalid_request_error",
                    param: None,
                    code: Some("invalid_api_key"),
                }
                .into_response()
            }
        })),
    )
}

/// Whether the request's bearer token is `key`, compared in time independent of where the
/// two first differ.
pub(super) fn bearer_matches(req: &Request, key: &str) -> bool {
    let Some(token) = req
        .headers()
        .get(axum::http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split_once(' '))
        .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
        .map(|(_, token)| token.trim_start_matches(' '))
    else {
        return false;
    };
    token.len() == key.len()
        && token
            .bytes()
            .zip(key.bytes())
            .fold(0u8, |acc, (a, b)| acc | (a ^ b))
            == 0
}
