//! `nmt serve` over real HTTP on loopback: answers equal `nmt translate`'s, concurrent
//! clients get their own answers, bad requests get LibreTranslate's statuses without
//! disturbing anyone else, and SIGTERM drains requests in progress before exiting 0.

mod common;
use common::{nmt_err, nmt_ok, s};
use serde_json::{json, Value};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// A running `nmt serve`, killed when dropped; its log collected as it comes.
struct Server {
    child: Child,
    addr: String,
    log: Arc<Mutex<String>>,
}

impl Server {
    /// Starts `nmt serve` on a free port with the toy model as de→en and `extra` flags.
    fn start(extra: &[&str]) -> Server {
        let model = format!("de-en={}", s(&common::fixture("nmt-toy")));
        let mut child = Command::new(env!("CARGO_BIN_EXE_nmt"))
            .args(["serve", "--model", &model, "--port", "0"])
            .args(extra)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("nmt serve starts");
        let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
        let log = Arc::new(Mutex::new(String::new()));
        let mut addr = None;
        for line in lines.by_ref() {
            let line = line.unwrap();
            log.lock().unwrap().push_str(&format!("{line}\n"));
            if let Some(rest) = line.strip_prefix("listening on http://") {
                addr = Some(rest.split_whitespace().next().unwrap().to_string());
                break;
            }
        }
        let addr = addr.unwrap_or_else(|| panic!("no address in the log: {}", log.lock().unwrap()));
        let sink = log.clone();
        std::thread::spawn(move || {
            for line in lines.map_while(Result::ok) {
                sink.lock().unwrap().push_str(&format!("{line}\n"));
            }
        });
        Server { child, addr, log }
    }

    fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    /// POSTs `body` with `content_type`; (status, parsed JSON body).
    fn post(&self, path: &str, content_type: &str, body: &[u8]) -> (u16, Value) {
        let mut resp = agent()
            .post(self.url(path))
            .header("Content-Type", content_type)
            .send(body)
            .expect("the server answers");
        let status = resp.status().as_u16();
        let text = resp.body_mut().read_to_string().unwrap();
        (
            status,
            serde_json::from_str(&text).unwrap_or(Value::String(text)),
        )
    }

    fn post_json(&self, body: &Value) -> (u16, Value) {
        self.post(
            "/translate",
            "application/json",
            body.to_string().as_bytes(),
        )
    }

    fn get(&self, path: &str) -> (u16, String) {
        let mut resp = agent()
            .get(self.url(path))
            .call()
            .expect("the server answers");
        (
            resp.status().as_u16(),
            resp.body_mut().read_to_string().unwrap(),
        )
    }

    /// Sends SIGTERM and waits for the exit; (exit code, log).
    fn terminate(mut self) -> (Option<i32>, String) {
        let pid = self.child.id() as libc::pid_t;
        // SAFETY: kill(2) on our own child's pid.
        unsafe { libc::kill(pid, libc::SIGTERM) };
        let status = self.child.wait().unwrap();
        std::thread::sleep(Duration::from_millis(100));
        (status.code(), self.log.lock().unwrap().clone())
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A client that returns 4xx/5xx responses instead of failing on them.
fn agent() -> ureq::Agent {
    ureq::Agent::config_builder()
        .http_status_as_error(false)
        .build()
        .into()
}

fn sources() -> Vec<String> {
    std::fs::read_to_string(common::fixture("nmt-toy").join("sources.txt"))
        .unwrap()
        .lines()
        .map(str::to_string)
        .collect()
}

/// `nmt translate` of `lines` with `flags`.
fn translate(lines: &[String], flags: &[&str]) -> Vec<String> {
    let model = common::fixture("nmt-toy");
    let mut args = vec!["translate", "--model", s(&model)];
    args.extend_from_slice(flags);
    nmt_ok(&args, format!("{}\n", lines.join("\n")).as_bytes())
        .lines()
        .map(str::to_string)
        .collect()
}

#[test]
fn translations_equal_nmt_translate_for_every_client() {
    let lines = sources();
    let want = translate(&lines, &[]);
    let server = Server::start(&[]);

    // An array of texts, as JSON.
    let (status, got) = server.post_json(&json!({"q": lines, "source": "de", "target": "en"}));
    assert_eq!(status, 200, "{got}");
    assert_eq!(got["translatedText"], json!(want));

    // One sentence per request from 8 clients at once: each gets its own translation.
    let server = Arc::new(server);
    let clients: Vec<_> = (0..8)
        .map(|c| {
            let (server, lines, want) = (server.clone(), lines.clone(), want.clone());
            std::thread::spawn(move || {
                for (i, line) in lines.iter().enumerate().skip(c % 3) {
                    let (status, got) =
                        server.post_json(&json!({"q": line, "source": "de", "target": "en"}));
                    assert_eq!(status, 200, "{got}");
                    assert_eq!(
                        got["translatedText"],
                        json!(want[i]),
                        "client {c}, line {i}"
                    );
                }
            })
        })
        .collect();
    for c in clients {
        c.join().unwrap();
    }

    // A form body, as LibreTranslate's clients send it; a text of two lines is translated
    // line by line.
    let form = format!(
        "q={}%0D%0A{}&source=de&target=en",
        lines[0].replace(' ', "+"),
        lines[1].replace(' ', "+")
    );
    let (status, got) = server.post(
        "/translate",
        "application/x-www-form-urlencoded",
        form.as_bytes(),
    );
    assert_eq!(status, 200, "{got}");
    assert_eq!(
        got["translatedText"],
        json!(format!("{}\n{}", want[0], want[1]))
    );

    // Alternatives are the n-best list of a beam of k + 1 (distinct, without the best).
    let nbest = translate(&lines[..3], &["--beam", "3", "--nbest", "3"]);
    let (status, got) = server
        .post_json(&json!({"q": lines[..3], "source": "de", "target": "en", "alternatives": 2}));
    assert_eq!(status, 200, "{got}");
    for (i, alts) in got["alternatives"].as_array().unwrap().iter().enumerate() {
        let hyps: Vec<&str> = nbest
            .iter()
            .filter(|l| l.starts_with(&format!("{i} ||| ")))
            .map(|l| l.split(" ||| ").nth(1).unwrap())
            .collect();
        assert_eq!(got["translatedText"][i], json!(hyps[0]));
        let mut distinct: Vec<&str> = Vec::new();
        for h in &hyps[1..] {
            if *h != hyps[0] && !distinct.contains(h) {
                distinct.push(h);
            }
        }
        assert_eq!(alts, &json!(distinct), "line {i}");
    }

    let (status, langs) = server.get("/languages");
    assert_eq!(status, 200);
    assert_eq!(
        serde_json::from_str::<Value>(&langs).unwrap(),
        json!([{"code": "de", "name": "German", "targets": ["en"]}])
    );
    assert_eq!(
        server.get("/health"),
        (200, r#"{"status":"ok"}"#.to_string())
    );
    let (status, metrics) = server.get("/metrics");
    assert_eq!(status, 200);
    assert!(
        metrics.contains(r#"nmt_requests_total{route="/translate",status="200"}"#),
        "{metrics}"
    );
    // The single-sentence requests joined the running search (continuous batching).
    let steps: f64 = metrics
        .lines()
        .find_map(|l| l.strip_prefix("nmt_search_steps_total "))
        .and_then(|v| v.parse().ok())
        .expect("a search-step counter");
    assert!(steps > 0.0, "{metrics}");
    let log = server.log.lock().unwrap().clone();
    assert!(log.contains("POST /translate 200 "), "{log}");

    // A document of more sentences than a batch is decoded in sorted batches, as translate
    // does it: the same translations.
    let small = Server::start(&["--batch-size", "4"]);
    let (status, got) = small.post_json(&json!({"q": lines, "source": "de", "target": "en"}));
    assert_eq!(status, 200, "{got}");
    assert_eq!(got["translatedText"], json!(want));
}

#[test]
fn bad_requests_get_their_status_and_never_disturb_other_clients() {
    let server = Server::start(&[
        "--api-key",
        "sesame",
        "--max-body",
        "2000",
        "--max-sentences",
        "5",
        "--read-timeout",
        "1",
    ]);
    let good = json!({"q": "9 8 2 5", "source": "de", "target": "en", "api_key": "sesame"});
    let want = translate(&["9 8 2 5".to_string()], &[]);
    let check_good = || {
        let (status, got) = server.post_json(&good);
        assert_eq!(status, 200, "{got}");
        assert_eq!(got["translatedText"], json!(want[0]));
    };
    let error = |status: u16, body: Value, want_status: u16, want: &str| {
        assert_eq!(status, want_status, "{body}");
        let msg = body["error"]
            .as_str()
            .unwrap_or_else(|| panic!("no error field: {body}"));
        assert!(msg.contains(want), "{msg:?} should contain {want:?}");
    };
    let key = |mut v: Value| {
        v["api_key"] = json!("sesame");
        v
    };
    let (st, b) = server.post("/translate", "application/json", b"{\"q\": \"9 8");
    error(st, b, 400, "Invalid JSON format");
    check_good();
    let (st, b) = server.post_json(&key(json!({"q": 98, "source": "de", "target": "en"})));
    error(st, b, 400, "q must be a string or an array of strings");
    let (st, b) = server.post_json(&key(json!({"q": "", "source": "de", "target": "en"})));
    error(st, b, 400, "missing q parameter");
    let (st, b) = server.post(
        "/translate",
        "application/json",
        b"{\"q\": \"9 \xff 8\", \"source\": \"de\", \"target\": \"en\"}",
    );
    error(st, b, 400, "not valid UTF-8");
    let (st, b) = server.post_json(&key(json!({"q": "9 8", "source": "de", "target": "fr"})));
    error(st, b, 400, "pairs served: de-en");
    let (st, b) = server.post_json(&key(
        json!({"q": ["1", "2", "3", "4", "5", "6"], "source": "de", "target": "en"}),
    ));
    error(st, b, 400, "exceeds the limit (5)");
    let big = key(json!({"q": "9 ".repeat(1500), "source": "de", "target": "en"}));
    let (st, b) = server.post_json(&big);
    error(st, b, 413, "larger than the limit of 2000 bytes");
    let (st, b) = server.post_json(&json!({"q": "9 8", "source": "de", "target": "en"}));
    error(st, b, 400, "missing api_key");
    let (st, b) =
        server.post_json(&json!({"q": "9 8", "source": "de", "target": "en", "api_key": "sesam"}));
    error(st, b, 403, "Invalid API key");
    let (st, b) = server.get("/translations");
    assert_eq!(st, 404, "{b}");
    let (st, b) = server.get("/translate");
    assert_eq!(st, 405, "{b}");
    check_good();

    // A client that sends half a body and stalls gets 408 after the read timeout; one that
    // stalls within its headers is disconnected; meanwhile others are served at once.
    let mut half_body = TcpStream::connect(&server.addr).unwrap();
    write!(half_body, "POST /translate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{{\"q\": ").unwrap();
    let mut half_head = TcpStream::connect(&server.addr).unwrap();
    write!(half_head, "POST /translate HTTP/1.1\r\nHost: x\r\nContent-").unwrap();
    let started = Instant::now();
    check_good();
    assert!(
        started.elapsed() < Duration::from_millis(900),
        "a stalled client delayed others"
    );
    half_body
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let mut answer = String::new();
    let _ = half_body.read_to_string(&mut answer);
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert!(answer.contains("not received within 1 s"), "{answer}");
    half_head
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let mut answer = String::new();
    let _ = half_head.read_to_string(&mut answer);
    assert!(
        answer.is_empty() || answer.starts_with("HTTP/1.1 408"),
        "{answer}"
    );
    assert!(started.elapsed() < Duration::from_secs(5));
    check_good();
}

#[test]
fn a_full_queue_is_429_and_sigterm_finishes_requests_in_progress() {
    let server = Server::start(&["--max-requests", "1"]);
    // A request whose body is half sent holds the only place.
    let body = json!({"q": "7 9 1 9 0 7 4", "source": "de", "target": "en"}).to_string();
    let (head, tail) = body.split_at(10);
    let mut slow = TcpStream::connect(&server.addr).unwrap();
    write!(
        slow,
        "POST /translate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{head}",
        body.len()
    )
    .unwrap();
    std::thread::sleep(Duration::from_millis(300));
    let (status, got) = server.post_json(&json!({"q": "9 8", "source": "de", "target": "en"}));
    assert_eq!(status, 429, "{got}");
    assert!(
        got["error"].as_str().unwrap().contains("Too many requests"),
        "{got}"
    );

    // SIGTERM now: the server stops accepting, but the request in progress completes.
    let pid = server.child.id() as libc::pid_t;
    // SAFETY: kill(2) on our own child's pid.
    unsafe { libc::kill(pid, libc::SIGTERM) };
    std::thread::sleep(Duration::from_millis(300));
    assert!(
        TcpStream::connect(&server.addr).is_err(),
        "still accepting after SIGTERM"
    );
    slow.write_all(tail.as_bytes()).unwrap();
    let mut answer = String::new();
    slow.set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    let mut buf = [0u8; 4096];
    while !answer.contains(r#""translatedText""#) {
        let n = slow.read(&mut buf).unwrap();
        assert!(n > 0, "connection closed before the answer: {answer}");
        answer.push_str(&String::from_utf8_lossy(&buf[..n]));
    }
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    let want = translate(&["7 9 1 9 0 7 4".to_string()], &[]);
    assert!(answer.contains(&json!(want[0]).to_string()), "{answer}");
    let (code, log) = server.terminate();
    assert_eq!(code, Some(0), "{log}");
    assert!(log.contains("stopped: "), "{log}");
}

#[test]
fn bad_model_flags_are_clear_errors() {
    let err = nmt_err(&["serve", "--model", "de-en"], b"");
    assert!(err.contains("expected SRC-TGT=MODEL"), "{err}");
    let err = nmt_err(&["serve", "--model", "de-en=/no/such/model"], b"");
    assert!(err.contains("--model de-en=/no/such/model"), "{err}");
    let toy = format!("de-en={}", s(&common::fixture("nmt-toy")));
    let err = nmt_err(&["serve", "--model", &toy, "--model", &toy], b"");
    assert!(err.contains("given twice"), "{err}");
}
