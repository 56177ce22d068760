//! `nmt serve`'s `POST /translate` body parser on arbitrary bytes, as JSON, as a form and
//! without a Content-Type: a request or a client error (4xx) with a message; nothing panics.
#![no_main]
use libfuzzer_sys::fuzz_target;
use nmt::serve::api::parse_request;

fuzz_target!(|data: &[u8]| {
    let Some((&kind, body)) = data.split_first() else {
        return;
    };
    let content_type = match kind % 4 {
        0 => Some("application/json"),
        1 => Some("application/x-www-form-urlencoded; charset=utf-8"),
        2 => None,
        _ => Some("text/plain"),
    };
    match parse_request(content_type, body) {
        Ok(req) => {
            assert!(!req.q.is_empty() && !req.source.is_empty() && !req.target.is_empty());
        }
        Err(e) => assert!(e.0.is_client_error() && !e.1.is_empty(), "{e:?}"),
    }
});
