//! LibreTranslate's API: `POST /translate` (a JSON or form body; `q` a text or an array of
//! texts; `source`, `target`, `format`, `alternatives`, `api_key`), `GET /languages`,
//! `GET /health`; errors as `{"error": "..."}` with LibreTranslate's status codes. A text
//! is translated line by line; its lines are the sentences the batcher sees.

use super::batcher::Batcher;
use super::metrics::Metrics;
use crate::translate::{SearchOptions, Translation};
use axum::body::Body;
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use http_body_util::BodyExt;
use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;
use subtle::ConstantTimeEq;

/// What requests may ask for.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Largest body in bytes.
    pub body_bytes: usize,
    /// Most sentences (lines) in one request.
    pub sentences: usize,
    /// Most characters in one text.
    pub chars: usize,
    /// Most alternatives.
    pub alternatives: usize,
    /// Translation requests in progress at once.
    pub requests: usize,
    /// Time allowed for receiving a body.
    pub read_timeout: Duration,
}

/// Everything a request handler needs, shared by all connections.
pub struct Api {
    /// A model's batcher per (source, target) language.
    pub pairs: BTreeMap<(String, String), Batcher>,
    /// Search settings of a request without alternatives.
    pub search: SearchOptions,
    /// Request limits.
    pub limits: Limits,
    /// SHA-256 of the API key requests must carry, if one is required.
    pub api_key: Option<[u8; 32]>,
    /// Counters.
    pub metrics: Arc<Metrics>,
}

/// The number of sentences a response carried, for the request log.
#[derive(Debug, Clone, Copy)]
pub struct Sentences(pub usize);

/// An error answered as LibreTranslate does: `{"error": message}` with a status.
#[derive(Debug)]
pub struct ApiError(pub StatusCode, pub String);

impl ApiError {
    fn bad(message: impl Into<String>) -> Self {
        ApiError(StatusCode::BAD_REQUEST, message.into())
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        json_response(self.0, &json!({ "error": self.1 }))
    }
}

/// A JSON body with a status.
pub fn json_response(status: StatusCode, value: &Value) -> Response {
    (
        status,
        [(header::CONTENT_TYPE, "application/json")],
        value.to_string(),
    )
        .into_response()
}

/// A translation request as parsed from its body.
#[derive(Debug, PartialEq)]
pub struct TranslateRequest {
    /// The texts.
    pub q: Vec<String>,
    /// Whether `q` was an array (the response then holds arrays too).
    pub batch: bool,
    /// Source language code.
    pub source: String,
    /// Target language code.
    pub target: String,
    /// Alternative translations asked for, beside the best one.
    pub alternatives: usize,
    /// The key sent, if any.
    pub api_key: Option<String>,
}

/// Parses a body by its Content-Type: JSON, or a form (`application/x-www-form-urlencoded`);
/// without a Content-Type, a body starting with `{` is taken for JSON.
pub fn parse_request(
    content_type: Option<&str>,
    body: &[u8],
) -> Result<TranslateRequest, ApiError> {
    let kind = content_type.map(|c| {
        c.split(';')
            .next()
            .unwrap_or("")
            .trim()
            .to_ascii_lowercase()
    });
    let text = std::str::from_utf8(body).map_err(|e| {
        ApiError::bad(format!(
            "Invalid request: the body is not valid UTF-8 (byte {})",
            e.valid_up_to()
        ))
    })?;
    let fields = match kind.as_deref() {
        Some("application/json") => json_fields(text)?,
        Some("application/x-www-form-urlencoded") => form_fields(text)?,
        None if text.trim_start().starts_with('{') => json_fields(text)?,
        None => form_fields(text)?,
        Some(other) => {
            return Err(ApiError(
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                format!("Content-Type {other} is not supported: send application/json or application/x-www-form-urlencoded"),
            ))
        }
    };
    let string = |name: &str| -> Result<Option<String>, ApiError> {
        match fields.get(name) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.clone())),
            Some(_) => Err(ApiError::bad(format!(
                "Invalid request: {name} must be a string"
            ))),
        }
    };
    let (q, batch) = match fields.get("q") {
        None | Some(Value::Null) => (Vec::new(), false),
        Some(Value::String(s)) => (vec![s.clone()], false),
        Some(Value::Array(items)) => (
            items
                .iter()
                .map(|v| v.as_str().map(str::to_string))
                .collect::<Option<Vec<_>>>()
                .ok_or_else(|| {
                    ApiError::bad("Invalid request: q must be a string or an array of strings")
                })?,
            true,
        ),
        Some(_) => {
            return Err(ApiError::bad(
                "Invalid request: q must be a string or an array of strings",
            ))
        }
    };
    if q.is_empty() || (!batch && q[0].is_empty()) {
        return Err(ApiError::bad("Invalid request: missing q parameter"));
    }
    let source = string("source")?.filter(|s| !s.is_empty());
    let source =
        source.ok_or_else(|| ApiError::bad("Invalid request: missing source parameter"))?;
    let target = string("target")?.filter(|s| !s.is_empty());
    let target =
        target.ok_or_else(|| ApiError::bad("Invalid request: missing target parameter"))?;
    match string("format")?.as_deref() {
        None | Some("text") => {}
        Some("html") => {
            return Err(ApiError::bad(
                "html format is not supported: nmt serve translates plain text (format: text)",
            ))
        }
        Some(other) => return Err(ApiError::bad(format!("{other} format is not supported"))),
    }
    let not_a_number = || ApiError::bad("Invalid request: alternatives parameter is not a number");
    let alternatives = match fields.get("alternatives") {
        None | Some(Value::Null) => 0,
        Some(Value::Number(n)) => n.as_i64().ok_or_else(not_a_number)?.max(0) as usize,
        Some(Value::String(s)) => {
            s.trim().parse::<i64>().map_err(|_| not_a_number())?.max(0) as usize
        }
        Some(_) => return Err(not_a_number()),
    };
    Ok(TranslateRequest {
        q,
        batch,
        source,
        target,
        alternatives,
        api_key: string("api_key")?,
    })
}

fn json_fields(text: &str) -> Result<serde_json::Map<String, Value>, ApiError> {
    match serde_json::from_str::<Value>(text) {
        Ok(Value::Object(fields)) => Ok(fields),
        Ok(_) => Err(ApiError::bad(
            "Invalid JSON format: the body must be a JSON object",
        )),
        Err(e) => Err(ApiError::bad(format!("Invalid JSON format: {e}"))),
    }
}

/// A form's fields, percent-decoded; the first of repeated names counts.
fn form_fields(text: &str) -> Result<serde_json::Map<String, Value>, ApiError> {
    let mut fields = serde_json::Map::new();
    for pair in text.split('&').filter(|p| !p.is_empty()) {
        let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
        let decode = |s: &str| {
            percent_encoding::percent_decode_str(&s.replace('+', " "))
                .decode_utf8()
                .map(|c| c.into_owned())
                .map_err(|_| {
                    ApiError::bad("Invalid request: a form field is not valid UTF-8 once decoded")
                })
        };
        let (name, value) = (decode(name)?, decode(value)?);
        fields.entry(name).or_insert(Value::String(value));
    }
    Ok(fields)
}

/// `POST /translate`.
pub async fn translate(
    api: Arc<Api>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, ApiError> {
    let _admitted = api.metrics.admit(api.limits.requests).ok_or_else(|| {
        ApiError(
            StatusCode::TOO_MANY_REQUESTS,
            format!(
                "Too many requests in progress ({}); try again shortly",
                api.limits.requests
            ),
        )
    })?;
    let body = read_body(body, &headers, &api.limits).await?;
    let content_type = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok());
    let req = parse_request(content_type, &body)?;
    if let Some(want) = &api.api_key {
        let Some(key) = &req.api_key else {
            return Err(ApiError::bad(
                "Invalid request: missing api_key parameter (this server requires an API key)",
            ));
        };
        let got: [u8; 32] = Sha256::digest(key.as_bytes()).into();
        if !bool::from(got.ct_eq(want)) {
            return Err(ApiError(StatusCode::FORBIDDEN, "Invalid API key".into()));
        }
    }
    let pair = (req.source.clone(), req.target.clone());
    let Some(batcher) = api.pairs.get(&pair) else {
        let served: Vec<String> = api.pairs.keys().map(|(s, t)| format!("{s}-{t}")).collect();
        let what = if req.source == "auto" {
            "source auto (language detection) is not supported: name the source language"
                .to_string()
        } else {
            format!("{}-{} is not served", req.source, req.target)
        };
        return Err(ApiError::bad(format!(
            "{what}; pairs served: {}",
            served.join(", ")
        )));
    };
    if req.alternatives > api.limits.alternatives {
        return Err(ApiError::bad(format!(
            "Invalid request: alternatives parameter must be <= {}",
            api.limits.alternatives
        )));
    }
    if let Some(long) = req
        .q
        .iter()
        .map(|t| t.chars().count())
        .find(|&n| n > api.limits.chars)
    {
        return Err(ApiError::bad(format!(
            "Invalid request: request ({long}) exceeds text limit ({})",
            api.limits.chars
        )));
    }
    let texts: Vec<Vec<String>> = req
        .q
        .iter()
        .map(|t| {
            t.split('\n')
                .map(|l| l.strip_suffix('\r').unwrap_or(l).to_string())
                .collect()
        })
        .collect();
    let sentences: usize = texts.iter().map(Vec::len).sum();
    if sentences > api.limits.sentences {
        return Err(ApiError::bad(format!(
            "Invalid request: request ({sentences} sentences) exceeds the limit ({})",
            api.limits.sentences
        )));
    }
    let opts = SearchOptions {
        beam: api.search.beam.max(req.alternatives + 1),
        nbest: req.alternatives + 1,
        ..api.search
    };
    let translations = batcher
        .submit(texts.concat(), opts)
        .await
        .map_err(|_| "the model's worker has stopped".to_string())
        .and_then(|r| r)
        .map_err(|e| {
            ApiError(
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("Cannot translate text: {e}"),
            )
        })?;
    let mut rest = translations.as_slice();
    let mut best = Vec::new();
    let mut alternatives = Vec::new();
    for lines in &texts {
        let (own, tail) = rest.split_at(lines.len());
        rest = tail;
        let (text, alts) = join_lines(own, req.alternatives);
        best.push(Value::String(text));
        alternatives.push(json!(alts));
    }
    let mut answer = serde_json::Map::new();
    if req.batch {
        answer.insert("translatedText".into(), Value::Array(best));
        if req.alternatives > 0 {
            answer.insert("alternatives".into(), Value::Array(alternatives));
        }
    } else {
        answer.insert("translatedText".into(), best.swap_remove(0));
        if req.alternatives > 0 {
            answer.insert("alternatives".into(), alternatives.swap_remove(0));
        }
    }
    let mut response = json_response(StatusCode::OK, &Value::Object(answer));
    response.extensions_mut().insert(Sentences(sentences));
    Ok(response)
}

/// A text's translation, its lines' best hypotheses joined, and up to `k` alternatives: the
/// k-th alternative joins each line's (k+1)-th hypothesis (its best where it has fewer);
/// alternatives equal to the translation or to an earlier one are left out, as LibreTranslate
/// does.
fn join_lines(lines: &[Translation], k: usize) -> (String, Vec<String>) {
    let nth = |n: usize| -> String {
        lines
            .iter()
            .map(|t| {
                t.hypotheses
                    .get(n)
                    .unwrap_or(&t.hypotheses[0])
                    .text
                    .as_str()
            })
            .collect::<Vec<_>>()
            .join("\n")
    };
    let best = nth(0);
    let mut alternatives: Vec<String> = Vec::new();
    for n in 1..=k {
        let alt = nth(n);
        if alt != best && !alternatives.contains(&alt) {
            alternatives.push(alt);
        }
    }
    (best, alternatives)
}

/// Reads a body up to the size limit (413 beyond it) within the read timeout (408 after).
async fn read_body(
    mut body: Body,
    headers: &HeaderMap,
    limits: &Limits,
) -> Result<Vec<u8>, ApiError> {
    let too_large = || {
        ApiError(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!(
                "Request body larger than the limit of {} bytes",
                limits.body_bytes
            ),
        )
    };
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limits.body_bytes as u64) {
        return Err(too_large());
    }
    let read = async {
        let mut bytes = Vec::new();
        while let Some(frame) = body.frame().await {
            let frame = frame
                .map_err(|e| ApiError::bad(format!("Could not read the request body: {e}")))?;
            if let Some(data) = frame.data_ref() {
                if bytes.len() + data.len() > limits.body_bytes {
                    return Err(too_large());
                }
                bytes.extend_from_slice(data);
            }
        }
        Ok(bytes)
    };
    tokio::time::timeout(limits.read_timeout, read)
        .await
        .map_err(|_| {
            ApiError(
                StatusCode::REQUEST_TIMEOUT,
                format!(
                    "Request body not received within {} s",
                    limits.read_timeout.as_secs()
                ),
            )
        })?
}

/// `GET /languages`: each source language with the targets served from it.
pub fn languages(api: &Api) -> Response {
    let mut targets: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    for (s, t) in api.pairs.keys() {
        targets.entry(s).or_default().push(t);
    }
    let list: Vec<Value> = targets
        .into_iter()
        .map(|(code, targets)| json!({ "code": code, "name": language_name(code), "targets": targets }))
        .collect();
    json_response(StatusCode::OK, &Value::Array(list))
}

/// The English name of an ISO 639-1 code, the code itself for others.
fn language_name(code: &str) -> &str {
    const NAMES: &[(&str, &str)] = &[
        ("ar", "Arabic"),
        ("bg", "Bulgarian"),
        ("ca", "Catalan"),
        ("cs", "Czech"),
        ("da", "Danish"),
        ("de", "German"),
        ("el", "Greek"),
        ("en", "English"),
        ("es", "Spanish"),
        ("et", "Estonian"),
        ("fa", "Persian"),
        ("fi", "Finnish"),
        ("fr", "French"),
        ("ga", "Irish"),
        ("he", "Hebrew"),
        ("hi", "Hindi"),
        ("hr", "Croatian"),
        ("hu", "Hungarian"),
        ("id", "Indonesian"),
        ("it", "Italian"),
        ("ja", "Japanese"),
        ("ko", "Korean"),
        ("lt", "Lithuanian"),
        ("lv", "Latvian"),
        ("nb", "Norwegian Bokmål"),
        ("nl", "Dutch"),
        ("pl", "Polish"),
        ("pt", "Portuguese"),
        ("ro", "Romanian"),
        ("ru", "Russian"),
        ("sk", "Slovak"),
        ("sl", "Slovenian"),
        ("sv", "Swedish"),
        ("th", "Thai"),
        ("tr", "Turkish"),
        ("uk", "Ukrainian"),
        ("vi", "Vietnamese"),
        ("zh", "Chinese"),
    ];
    NAMES
        .iter()
        .find(|(c, _)| *c == code)
        .map_or(code, |(_, n)| n)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::translate::Hypothesis;

    fn translation(hyps: &[&str]) -> Translation {
        Translation {
            hypotheses: hyps
                .iter()
                .map(|h| Hypothesis {
                    text: h.to_string(),
                    ..Default::default()
                })
                .collect(),
        }
    }

    #[test]
    fn json_and_form_bodies_parse_to_the_same_request() {
        let j = parse_request(
            Some("application/json; charset=utf-8"),
            br#"{"q": "Guten Tag", "source": "de", "target": "en", "alternatives": 2, "api_key": "k"}"#,
        )
        .unwrap();
        let f = parse_request(
            Some("application/x-www-form-urlencoded"),
            b"q=Guten+Tag&source=de&target=en&alternatives=2&api_key=k",
        )
        .unwrap();
        assert_eq!(j, f);
        assert_eq!(j.q, ["Guten Tag"]);
        assert!(!j.batch);
        let b = parse_request(
            None,
            br#"{"q": ["a", "b"], "source": "de", "target": "en"}"#,
        )
        .unwrap();
        assert!(b.batch);
        assert_eq!(b.q, ["a", "b"]);
    }

    #[test]
    fn bad_bodies_are_400_with_the_reason() {
        let cases: &[(&[u8], &str)] = &[
            (b"{\"q\": ", "Invalid JSON format"),
            (b"[1, 2]", "must be a JSON object"),
            (
                br#"{"q": 5, "source": "de", "target": "en"}"#,
                "q must be a string or an array",
            ),
            (
                br#"{"q": ["a", 1], "source": "de", "target": "en"}"#,
                "q must be a string or an array",
            ),
            (
                br#"{"q": "", "source": "de", "target": "en"}"#,
                "missing q parameter",
            ),
            (
                br#"{"q": [], "source": "de", "target": "en"}"#,
                "missing q parameter",
            ),
            (br#"{"q": "a", "target": "en"}"#, "missing source parameter"),
            (
                br#"{"q": "a", "source": 1, "target": "en"}"#,
                "source must be a string",
            ),
            (
                br#"{"q": "a", "source": "de", "target": "en", "alternatives": "x"}"#,
                "not a number",
            ),
            (
                br#"{"q": "a", "source": "de", "target": "en", "format": "html"}"#,
                "html format is not supported",
            ),
            (b"{\"q\": \"\xff\"}", "not valid UTF-8 (byte 7)"),
        ];
        for (body, want) in cases {
            let e = parse_request(Some("application/json"), body).unwrap_err();
            assert_eq!(
                e.0,
                StatusCode::BAD_REQUEST,
                "{}",
                String::from_utf8_lossy(body)
            );
            assert!(
                e.1.contains(want),
                "{:?}: {}",
                String::from_utf8_lossy(body),
                e.1
            );
        }
        let e = parse_request(
            Some("application/x-www-form-urlencoded"),
            b"q=%FF&source=de&target=en",
        )
        .unwrap_err();
        assert!(e.1.contains("not valid UTF-8"), "{}", e.1);
        let e = parse_request(Some("text/xml"), b"<q/>").unwrap_err();
        assert_eq!(e.0, StatusCode::UNSUPPORTED_MEDIA_TYPE);
    }

    #[test]
    fn lines_join_into_texts_and_alternatives_are_distinct() {
        let lines = [translation(&["a", "b", "a"]), translation(&["c"])];
        let (best, alts) = join_lines(&lines, 2);
        assert_eq!(best, "a\nc");
        // The second alternative, "a\nc", equals the translation and is left out.
        assert_eq!(alts, ["b\nc"]);
    }
}
