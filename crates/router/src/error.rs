//! The crate's errors: [`Error`] for start-up (model assets, configuration) and [`ApiError`]
//! for what a client sees. [`ApiError::status`] is the one place where an [`ErrorClass`] becomes
//! an HTTP status.

use crate::generator::GenerateError;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::Serialize;
use std::path::PathBuf;
use tandem_core::ErrorClass;

/// Start-up failures: loading a model directory, compiling its chat template, reading config.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A file could not be read.
    #[error("cannot read {path}")]
    Io {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// A JSON file of the model directory is not valid JSON.
    #[error("cannot parse {path}")]
    Json {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: serde_json::Error,
    },
    /// `tokenizer.json` could not be loaded.
    #[error("cannot load tokenizer {path}")]
    Tokenizer {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: tokenizers::Error,
    },
    /// The model directory is readable but incomplete or inconsistent.
    #[error("model directory {dir}: {message}")]
    Model {
        /// The directory.
        dir: PathBuf,
        /// What is wrong.
        message: String,
    },
    /// The chat template does not compile.
    #[error("chat template does not compile")]
    ChatTemplate(#[source] minijinja::Error),
    /// The router configuration is not valid YAML for [`crate::config::RawConfig`].
    #[error("cannot parse router configuration")]
    ConfigParse(#[source] serde_yaml::Error),
    /// The router configuration parsed but failed validation (every problem, `; `-separated).
    #[error("invalid router configuration: {0}")]
    InvalidConfig(String),
}

/// Result of this crate's fallible start-up functions.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Why a request failed, as far as HTTP is concerned.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Reason {
    /// A classified failure.
    Class(ErrorClass),
    /// The `model` field names a model this router does not serve.
    ModelNotFound,
    /// No route for the path.
    RouteNotFound,
    /// The path exists, not for this method.
    MethodNotAllowed,
    /// No API key, or one not accepted.
    Unauthorized,
    /// The request body exceeds the size limit.
    PayloadTooLarge,
    /// An admission limit: a rate limit, or the admission queue is full (429).
    Throttled,
    /// The request's wait in the admission queue ran out (503).
    QueueTimeout,
}

/// An error rendered to the client as OpenAI's `{"error": {message, type, param, code}}`.
#[derive(Clone, Debug, thiserror::Error)]
#[error("{message}")]
pub struct ApiError {
    reason: Reason,
    message: String,
    param: Option<String>,
    code: Option<String>,
    /// The body's `type` when not the class's (`requests`/`tokens` for rate limits).
    error_type: Option<&'static str>,
    /// When to try again (`Retry-After`, whole seconds rounded up); one second when absent
    /// on a 429 or 503.
    retry_after: Option<std::time::Duration>,
}

impl ApiError {
    /// A client error about request field `param` (`None` when no single field is at fault).
    pub fn invalid(message: impl Into<String>, param: Option<&str>) -> Self {
        Self {
            reason: Reason::Class(ErrorClass::InvalidRequest),
            message: message.into(),
            param: param.map(str::to_owned),
            code: None,
            error_type: None,
            retry_after: None,
        }
    }

    /// A failure of class `class`.
    pub fn from_class(class: ErrorClass, message: impl Into<String>) -> Self {
        Self {
            reason: Reason::Class(class),
            message: message.into(),
            param: None,
            code: None,
            error_type: None,
            retry_after: None,
        }
    }

    /// A bug or unexpected state on our side.
    pub fn internal(message: impl Into<String>) -> Self {
        Self::from_class(ErrorClass::Internal, message)
    }

    /// The requested model is not served here.
    pub fn model_not_found(model: &str) -> Self {
        Self {
            reason: Reason::ModelNotFound,
            message: format!("The model `{model}` does not exist."),
            param: Some("model".to_owned()),
            code: Some("model_not_found".to_owned()),
            error_type: None,
            retry_after: None,
        }
    }

    /// No route matches the path.
    pub fn route_not_found(path: &str) -> Self {
        Self {
            reason: Reason::RouteNotFound,
            message: format!("Unknown path `{path}`."),
            param: None,
            code: None,
            error_type: None,
            retry_after: None,
        }
    }

    /// The path is served, not with this method.
    pub fn method_not_allowed(method: &str, path: &str) -> Self {
        Self {
            reason: Reason::MethodNotAllowed,
            message: format!("`{method}` is not allowed on `{path}`."),
            param: None,
            code: Some("method_not_allowed".to_owned()),
            error_type: None,
            retry_after: None,
        }
    }

    /// The request carries no accepted API key.
    pub fn unauthorized(message: impl Into<String>) -> Self {
        Self {
            reason: Reason::Unauthorized,
            message: message.into(),
            param: None,
            code: Some("invalid_api_key".to_owned()),
            error_type: None,
            retry_after: None,
        }
    }

    /// The body is larger than the limit.
    pub fn payload_too_large(message: impl Into<String>) -> Self {
        Self {
            reason: Reason::PayloadTooLarge,
            message: message.into(),
            param: None,
            code: None,
            error_type: None,
            retry_after: None,
        }
    }

    /// A rate limit was reached: `limit` is `requests` or `tokens` (OpenAI's `type`), and the
    /// request would pass after `retry_after`.
    pub fn rate_limited(
        limit: &'static str,
        message: impl Into<String>,
        retry_after: std::time::Duration,
    ) -> Self {
        Self {
            reason: Reason::Throttled,
            message: message.into(),
            param: None,
            code: Some("rate_limit_exceeded".to_owned()),
            error_type: Some(limit),
            retry_after: Some(retry_after),
        }
    }

    /// The admission queue holds as many requests as it may.
    pub fn queue_full(message: impl Into<String>) -> Self {
        Self {
            reason: Reason::Throttled,
            message: message.into(),
            param: None,
            code: Some("queue_full".to_owned()),
            error_type: None,
            retry_after: None,
        }
    }

    /// The request waited in the admission queue as long as it may.
    pub fn queue_timeout(message: impl Into<String>) -> Self {
        Self {
            reason: Reason::QueueTimeout,
            message: message.into(),
            param: None,
            code: Some("queue_timeout".to_owned()),
            error_type: None,
            retry_after: None,
        }
    }

    /// The class this failure counts under in metrics.
    pub fn class(&self) -> ErrorClass {
        match self.reason {
            Reason::Class(class) => class,
            Reason::ModelNotFound
            | Reason::RouteNotFound
            | Reason::MethodNotAllowed
            | Reason::Unauthorized
            | Reason::PayloadTooLarge => ErrorClass::InvalidRequest,
            Reason::Throttled => ErrorClass::CapacityExhausted,
            Reason::QueueTimeout => ErrorClass::Unavailable,
        }
    }

    /// The HTTP status. This is the only place an [`ErrorClass`] is mapped to a status.
    pub fn status(&self) -> StatusCode {
        match self.reason {
            Reason::Class(class) => match class {
                ErrorClass::InvalidRequest => StatusCode::BAD_REQUEST,
                ErrorClass::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
                ErrorClass::CapacityExhausted => StatusCode::TOO_MANY_REQUESTS,
                ErrorClass::TransferFailed => StatusCode::BAD_GATEWAY,
                // 499 "client closed request" (nginx); from_u16 accepts any 100..=999.
                ErrorClass::Cancelled => {
                    StatusCode::from_u16(499).unwrap_or(StatusCode::BAD_REQUEST)
                }
                ErrorClass::DeadlineExceeded => StatusCode::GATEWAY_TIMEOUT,
                ErrorClass::Internal => StatusCode::INTERNAL_SERVER_ERROR,
            },
            Reason::ModelNotFound | Reason::RouteNotFound => StatusCode::NOT_FOUND,
            Reason::MethodNotAllowed => StatusCode::METHOD_NOT_ALLOWED,
            Reason::Unauthorized => StatusCode::UNAUTHORIZED,
            Reason::PayloadTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            Reason::Throttled => StatusCode::TOO_MANY_REQUESTS,
            Reason::QueueTimeout => StatusCode::SERVICE_UNAVAILABLE,
        }
    }

    /// The message shown to the client.
    pub fn message(&self) -> &str {
        &self.message
    }

    /// The JSON body, `{"error": {...}}`.
    pub fn body(&self) -> ErrorBody {
        let class = self.class();
        let error_type = match self.error_type {
            Some(t) => t,
            None if class == ErrorClass::InvalidRequest => "invalid_request_error",
            None => "server_error",
        };
        let code = match (&self.code, self.reason) {
            (Some(code), _) => Some(code.clone()),
            (None, Reason::Class(class)) if class != ErrorClass::InvalidRequest => {
                Some(class.as_str().to_owned())
            }
            (None, _) => None,
        };
        ErrorBody {
            error: ErrorDetail {
                message: self.message.clone(),
                error_type,
                param: self.param.clone(),
                code,
            },
        }
    }
}

impl From<GenerateError> for ApiError {
    fn from(err: GenerateError) -> Self {
        Self::from_class(err.class, err.message)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = self.status();
        let mut response = (status, axum::Json(self.body())).into_response();
        if matches!(
            status,
            StatusCode::SERVICE_UNAVAILABLE | StatusCode::TOO_MANY_REQUESTS
        ) {
            let seconds = self
                .retry_after
                .map_or(1, |d| d.as_secs() + u64::from(d.subsec_nanos() > 0))
                .max(1);
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(seconds));
        }
        response
    }
}

/// OpenAI's error envelope.
#[derive(Clone, Debug, Serialize)]
pub struct ErrorBody {
    /// The error.
    pub error: ErrorDetail,
}

/// OpenAI's error object.
#[derive(Clone, Debug, Serialize)]
pub struct ErrorDetail {
    /// Human-readable.
    pub message: String,
    /// `invalid_request_error` or `server_error`.
    #[serde(rename = "type")]
    pub error_type: &'static str,
    /// The offending request field, if one is.
    pub param: Option<String>,
    /// Machine-readable code (`model_not_found`, or the failure class for server errors).
    pub code: Option<String>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classes_map_to_statuses() {
        let status = |class| ApiError::from_class(class, "x").status().as_u16();
        assert_eq!(status(ErrorClass::InvalidRequest), 400);
        assert_eq!(status(ErrorClass::Unavailable), 503);
        assert_eq!(status(ErrorClass::CapacityExhausted), 429);
        assert_eq!(status(ErrorClass::TransferFailed), 502);
        assert_eq!(status(ErrorClass::Cancelled), 499);
        assert_eq!(status(ErrorClass::DeadlineExceeded), 504);
        assert_eq!(status(ErrorClass::Internal), 500);
        assert_eq!(ApiError::model_not_found("m").status().as_u16(), 404);
    }

    #[test]
    fn body_has_openai_shape() {
        let body = serde_json::to_value(ApiError::invalid("bad", Some("top_p")).body())
            .expect("serializable");
        assert_eq!(
            body,
            serde_json::json!({"error": {"message": "bad", "type": "invalid_request_error",
                "param": "top_p", "code": null}})
        );
        let body = serde_json::to_value(
            ApiError::from_class(ErrorClass::TransferFailed, "kv lost").body(),
        )
        .expect("serializable");
        assert_eq!(body["error"]["type"], "server_error");
        assert_eq!(body["error"]["code"], "transfer_failed");
    }

    #[test]
    fn admission_refusals_carry_their_retry_after_rounded_up() {
        let e = ApiError::rate_limited(
            "tokens",
            "slow down",
            std::time::Duration::from_millis(2100),
        );
        assert_eq!(
            (e.status().as_u16(), e.class()),
            (429, ErrorClass::CapacityExhausted)
        );
        let body = serde_json::to_value(e.body()).expect("serializable");
        assert_eq!(body["error"]["type"], "tokens");
        assert_eq!(body["error"]["code"], "rate_limit_exceeded");
        let response = e.into_response();
        assert_eq!(response.headers()[header::RETRY_AFTER], "3");
        let e = ApiError::queue_timeout("waited too long");
        assert_eq!(
            (e.status().as_u16(), e.class()),
            (503, ErrorClass::Unavailable)
        );
        assert_eq!(e.into_response().headers()[header::RETRY_AFTER], "1");
        assert_eq!(ApiError::queue_full("full").status().as_u16(), 429);
    }
}
