//! Small pieces of the wire format shared by both APIs: request bodies parsed into typed structs
//! (every failure a 400 with the parser's message), RFC 3339 timestamps, durations in
//! nanoseconds, Ollama's `keep_alive`, and framed streams.
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::body::{Body, Bytes};
use axum::extract::rejection::BytesRejection;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use futures_util::Stream;
use serde::de::DeserializeOwned;

use super::error::AppError;

/// Parse a JSON request body. An empty body, malformed JSON and wrong types are all 400s (a
/// body over the size limit is a 413), each with a message saying what was wrong.
pub fn parse_body<T: DeserializeOwned>(body: Result<Bytes, BytesRejection>) -> Result<T, AppError> {
    let bytes = body.map_err(|rejection| AppError::new(rejection.status(), rejection.body_text()))?;
    if bytes.iter().all(u8::is_ascii_whitespace) {
        return Err(AppError::bad_request("missing request body"));
    }
    serde_json::from_slice(&bytes).map_err(|error| AppError::bad_request(error.to_string()))
}

/// Go's `time.Time` JSON form in UTC: RFC 3339 with the fraction's trailing zeros trimmed.
pub fn rfc3339(time: SystemTime) -> String {
    let since = time.duration_since(UNIX_EPOCH).unwrap_or_default();
    let seconds = since.as_secs();
    let (year, month, day) = crate::format::civil_from_days((seconds / 86_400) as i64);
    let of_day = seconds % 86_400;
    let mut text =
        format!("{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}", of_day / 3600, of_day / 60 % 60, of_day % 60);
    let nanos = since.subsec_nanos();
    if nanos > 0 {
        let fraction = format!("{nanos:09}");
        text.push('.');
        text.push_str(fraction.trim_end_matches('0'));
    }
    text.push('Z');
    text
}

pub fn unix_seconds(time: SystemTime) -> u64 {
    time.duration_since(UNIX_EPOCH).unwrap_or_default().as_secs()
}

pub fn nanos(duration: Duration) -> u64 {
    u64::try_from(duration.as_nanos()).unwrap_or(u64::MAX)
}

/// How long a model stays loaded after a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KeepAlive {
    For(Duration),
    Forever,
}

impl KeepAlive {
    /// Ollama's forms: a Go duration string (`"5m"`, `"1h30m"`, `"-1m"`), a number of seconds
    /// (the Python client sends floats), or a plain number in a string. Negative means forever.
    pub fn parse(value: &serde_json::Value) -> Result<KeepAlive, AppError> {
        let seconds = match value {
            serde_json::Value::Number(number) => {
                number.as_f64().ok_or_else(|| AppError::bad_request("keep_alive is not a number"))?
            }
            serde_json::Value::String(text) => match text.trim().parse::<f64>() {
                Ok(seconds) => seconds,
                Err(_) => parse_go_duration(text.trim())
                    .ok_or_else(|| AppError::bad_request(format!("time: invalid duration \"{text}\"")))?,
            },
            _ => return Err(AppError::bad_request("keep_alive must be a duration string or a number of seconds")),
        };
        if !seconds.is_finite() {
            return Err(AppError::bad_request("keep_alive is not finite"));
        }
        if seconds < 0.0 {
            return Ok(KeepAlive::Forever);
        }
        Ok(KeepAlive::For(Duration::from_secs_f64(seconds.min(1e12))))
    }
}

/// Seconds in a Go duration string such as `300ms`, `1.5h`, `1h30m`, `-1m`.
fn parse_go_duration(text: &str) -> Option<f64> {
    let (sign, mut rest) = match text.strip_prefix('-') {
        Some(rest) => (-1.0, rest),
        None => (1.0, text.strip_prefix('+').unwrap_or(text)),
    };
    if rest == "0" {
        return Some(0.0);
    }
    if rest.is_empty() {
        return None;
    }
    let mut total = 0.0;
    while !rest.is_empty() {
        let number_end =
            rest.find(|character: char| !(character.is_ascii_digit() || character == '.')).unwrap_or(rest.len());
        let value: f64 = rest[..number_end].parse().ok()?;
        rest = &rest[number_end..];
        let unit_end =
            rest.find(|character: char| character.is_ascii_digit() || character == '.').unwrap_or(rest.len());
        let scale = match &rest[..unit_end] {
            "ns" => 1e-9,
            "us" | "µs" | "μs" => 1e-6,
            "ms" => 1e-3,
            "s" => 1.0,
            "m" => 60.0,
            "h" => 3600.0,
            _ => return None,
        };
        total += value * scale;
        rest = &rest[unit_end..];
    }
    Some(sign * total)
}

/// A streamed response body with its content type.
pub fn stream_response<S>(content_type: &'static str, stream: S) -> Response
where
    S: Stream<Item = Result<Bytes, std::convert::Infallible>> + Send + 'static,
{
    let mut response = Body::from_stream(stream).into_response();
    response.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    response.headers_mut().insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    *response.status_mut() = StatusCode::OK;
    response
}

/// One NDJSON line: compact JSON and a newline, never a blank line.
pub fn ndjson_line(value: &serde_json::Value) -> Bytes {
    let mut line = serde_json::to_vec(value).unwrap_or_else(|_| b"{\"error\":\"serialisation failed\"}".to_vec());
    line.push(b'\n');
    Bytes::from(line)
}

/// One server-sent event carrying JSON.
pub fn sse_event(value: &serde_json::Value) -> Bytes {
    let mut event = b"data: ".to_vec();
    event.extend(serde_json::to_vec(value).unwrap_or_default());
    event.extend_from_slice(b"\n\n");
    Bytes::from(event)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timestamps_are_rfc3339_utc() {
        assert_eq!(rfc3339(UNIX_EPOCH), "1970-01-01T00:00:00Z");
        let time = UNIX_EPOCH + Duration::new(1_691_139_139, 385_406_455);
        assert_eq!(rfc3339(time), "2023-08-04T08:52:19.385406455Z");
        let time = UNIX_EPOCH + Duration::new(951_782_400, 500_000_000);
        assert_eq!(rfc3339(time), "2000-02-29T00:00:00.5Z");
    }

    #[test]
    fn keep_alive_forms() {
        let parse = |value: serde_json::Value| KeepAlive::parse(&value);
        assert_eq!(parse(serde_json::json!("5m")).unwrap(), KeepAlive::For(Duration::from_secs(300)));
        assert_eq!(parse(serde_json::json!("1h30m")).unwrap(), KeepAlive::For(Duration::from_secs(5400)));
        assert_eq!(parse(serde_json::json!("300ms")).unwrap(), KeepAlive::For(Duration::from_millis(300)));
        assert_eq!(parse(serde_json::json!("-1m")).unwrap(), KeepAlive::Forever);
        assert_eq!(parse(serde_json::json!(0.0)).unwrap(), KeepAlive::For(Duration::ZERO));
        assert_eq!(parse(serde_json::json!("0")).unwrap(), KeepAlive::For(Duration::ZERO));
        assert_eq!(parse(serde_json::json!(-1)).unwrap(), KeepAlive::Forever);
        assert_eq!(parse(serde_json::json!("10")).unwrap(), KeepAlive::For(Duration::from_secs(10)));
        for bad in [serde_json::json!("soon"), serde_json::json!("5x"), serde_json::json!(true), serde_json::json!("")]
        {
            assert!(parse(bad.clone()).is_err(), "{bad}");
        }
    }
}
