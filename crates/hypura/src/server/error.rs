//! `AppError`: every failure a handler returns, as a status and one message. Ollama's routes
//! answer `{"error": "..."}`; the OpenAI routes wrap the same error in OpenAI's shape
//! (`OpenAiError`). An error in the middle of a stream is not an `AppError` response but one
//! last line of the stream (see `ollama` and `openai`).
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;

use crate::engine::EngineError;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct AppError {
    pub status: StatusCode,
    pub message: String,
}

impl AppError {
    pub fn new(status: StatusCode, message: impl Into<String>) -> AppError {
        AppError { status, message: message.into() }
    }

    pub fn bad_request(message: impl Into<String>) -> AppError {
        AppError::new(StatusCode::BAD_REQUEST, message)
    }

    pub fn not_found(message: impl Into<String>) -> AppError {
        AppError::new(StatusCode::NOT_FOUND, message)
    }

    pub fn internal(message: impl Into<String>) -> AppError {
        AppError::new(StatusCode::INTERNAL_SERVER_ERROR, message)
    }

    pub fn busy() -> AppError {
        AppError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "server busy, please try again.  maximum pending requests exceeded",
        )
    }

    /// A request that came after the server began to stop.
    pub fn shutting_down() -> AppError {
        AppError::new(StatusCode::SERVICE_UNAVAILABLE, "the server is shutting down; try again later")
    }

    /// The status for an engine error: what the request asked for is a 400, the rest a 500.
    pub fn from_engine(error: &EngineError) -> AppError {
        use crate::engine::SysError;
        let status = match error {
            EngineError::PromptTooLong { .. } | EngineError::EmptyPrompt => StatusCode::BAD_REQUEST,
            EngineError::Sys(
                SysError::BadSampling { .. }
                | SysError::BadToken { .. }
                | SysError::Grammar(_)
                | SysError::TextTooLong { .. },
            ) => StatusCode::BAD_REQUEST,
            EngineError::Template { .. } | EngineError::Unsupported(_) | EngineError::Sys(SysError::Chat(_)) => {
                StatusCode::BAD_REQUEST
            }
            _ => StatusCode::INTERNAL_SERVER_ERROR,
        };
        AppError::new(status, error.to_string())
    }
}

impl IntoResponse for AppError {
    fn into_response(self) -> Response {
        (self.status, Json(json!({ "error": self.message }))).into_response()
    }
}

/// The same error in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.
#[derive(Debug)]
pub struct OpenAiError(pub AppError);

impl From<AppError> for OpenAiError {
    fn from(error: AppError) -> OpenAiError {
        OpenAiError(error)
    }
}

impl OpenAiError {
    pub fn body(error: &AppError) -> serde_json::Value {
        let kind = match error.status {
            StatusCode::BAD_REQUEST | StatusCode::PAYLOAD_TOO_LARGE => "invalid_request_error",
            StatusCode::NOT_FOUND => "not_found_error",
            _ => "api_error",
        };
        json!({ "error": { "message": error.message, "type": kind, "param": null, "code": null } })
    }
}

impl IntoResponse for OpenAiError {
    fn into_response(self) -> Response {
        (self.0.status, Json(OpenAiError::body(&self.0))).into_response()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn engine_errors_map_to_the_status_of_their_cause() {
        assert_eq!(AppError::from_engine(&EngineError::EmptyPrompt).status, StatusCode::BAD_REQUEST);
        assert_eq!(
            AppError::from_engine(&EngineError::Unsupported("does not support tools".into())).status,
            StatusCode::BAD_REQUEST
        );
        // Busy sequences mean the worker admitted past its free slots: the server's own fault.
        let busy = AppError::from_engine(&EngineError::Busy { n_sequences: 4 });
        assert_eq!(
            (busy.status, busy.message.as_str()),
            (
                StatusCode::INTERNAL_SERVER_ERROR,
                "all 4 sequences of the context are busy; admit only when free_slots() > 0"
            )
        );
    }
}
