//! Load for `scripts/bench-serve.sh`: C concurrent clients, each on its own keep-alive HTTP/1.1
//! connection, POST single sentences to a LibreTranslate-style `/translate` for S seconds
//! (lines taken round robin from a file); prints one JSON line: sentences/s, p50/p99 latency
//! in ms, errors, and the server's resident memory (kB) sampled every 10 s when `--pid` is
//! given. All clients share one thread (tokio's current-thread runtime, hyper's client
//! connections): on a small machine shared with the server, the load should take as little of
//! the CPU as it can (a Python client of threads took ~7 % of two cores at 32 clients).
//!
//!     cargo run --release --example serve_load -- URL LINES --clients C --seconds S [--pid PID]

use anyhow::{anyhow, Context, Result};
use clap::Parser;
use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use serde_json::json;
use std::cell::RefCell;
use std::rc::Rc;
use std::time::{Duration, Instant};

#[derive(Parser)]
struct Args {
    /// The server, e.g. http://127.0.0.1:5000
    url: String,
    /// Sentences to send, one per line (blank lines skipped).
    lines: std::path::PathBuf,
    #[arg(long)]
    clients: usize,
    #[arg(long)]
    seconds: f64,
    #[arg(long, default_value = "de")]
    source: String,
    #[arg(long, default_value = "en")]
    target: String,
    /// The server's process: its resident memory is sampled every 10 s.
    #[arg(long)]
    pid: Option<u32>,
}

/// What the clients saw: latencies of answered requests (s), the errors, the next line.
#[derive(Default)]
struct Seen {
    latencies: Vec<f64>,
    errors: Vec<String>,
    next: usize,
}

fn rss_kb(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}

/// A keep-alive connection to `host` (host:port).
async fn connect(host: &str) -> Result<hyper::client::conn::http1::SendRequest<Full<Bytes>>> {
    let stream = tokio::net::TcpStream::connect(host).await?;
    stream.set_nodelay(true)?;
    let io = hyper_util::rt::TokioIo::new(stream);
    let (sender, conn) = hyper::client::conn::http1::handshake(io).await?;
    tokio::task::spawn_local(conn);
    Ok(sender)
}

/// One request on `sender`: Ok if the server answered 200 with a translation.
async fn request(
    sender: &mut hyper::client::conn::http1::SendRequest<Full<Bytes>>,
    host: &str,
    body: String,
) -> Result<()> {
    sender.ready().await?;
    let req = hyper::Request::post("/translate")
        .header(hyper::header::HOST, host)
        .header(hyper::header::CONTENT_TYPE, "application/json")
        .body(Full::new(Bytes::from(body)))?;
    let resp = sender.send_request(req).await?;
    let status = resp.status().as_u16();
    let text = resp.into_body().collect().await?.to_bytes();
    let answered = serde_json::from_slice::<serde_json::Value>(&text)
        .is_ok_and(|v| v.get("translatedText").is_some());
    if status == 200 && answered {
        Ok(())
    } else {
        let text = String::from_utf8_lossy(&text);
        Err(anyhow!(
            "{status}: {}",
            text.chars().take(200).collect::<String>()
        ))
    }
}

/// One client: requests one after another until `stop_at`; a failed connection is reopened.
async fn client(
    a: Rc<Args>,
    lines: Rc<Vec<String>>,
    host: Rc<str>,
    seen: Rc<RefCell<Seen>>,
    stop_at: Instant,
) {
    let mut sender = None;
    while Instant::now() < stop_at {
        let q = {
            let mut s = seen.borrow_mut();
            s.next += 1;
            &lines[(s.next - 1) % lines.len()]
        };
        let body = json!({"q": q, "source": a.source, "target": a.target}).to_string();
        let t0 = Instant::now();
        let result = async {
            let s = match &mut sender {
                Some(s) => s,
                None => sender.insert(connect(&host).await?),
            };
            request(s, &host, body).await
        }
        .await;
        let took = t0.elapsed().as_secs_f64();
        let mut s = seen.borrow_mut();
        match result {
            Ok(()) => s.latencies.push(took),
            Err(e) => {
                s.errors.push(format!("{e:#}"));
                sender = None;
            }
        }
    }
}

fn main() -> Result<()> {
    let a = Rc::new(Args::parse());
    let text = std::fs::read_to_string(&a.lines).with_context(|| a.lines.display().to_string())?;
    let lines: Rc<Vec<String>> = Rc::new(
        text.lines()
            .filter(|l| !l.trim().is_empty())
            .map(String::from)
            .collect(),
    );
    anyhow::ensure!(!lines.is_empty(), "{}: no sentences", a.lines.display());
    let host: Rc<str> = a
        .url
        .strip_prefix("http://")
        .ok_or_else(|| anyhow!("{}: only http:// URLs", a.url))?
        .trim_end_matches('/')
        .into();
    let seen = Rc::new(RefCell::new(Seen::default()));
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let start = Instant::now();
    let stop_at = start + Duration::from_secs_f64(a.seconds);
    let mut rss = Vec::new();
    tokio::task::LocalSet::new().block_on(&runtime, async {
        let clients: Vec<_> = (0..a.clients)
            .map(|_| {
                let (a, lines, host, seen) = (a.clone(), lines.clone(), host.clone(), seen.clone());
                tokio::task::spawn_local(client(a, lines, host, seen, stop_at))
            })
            .collect();
        if let Some(pid) = a.pid {
            while Instant::now() < stop_at {
                rss.push(rss_kb(pid));
                tokio::time::sleep(
                    stop_at
                        .saturating_duration_since(Instant::now())
                        .min(Duration::from_secs(10)),
                )
                .await;
            }
        }
        for c in clients {
            let _ = c.await;
        }
    });
    let elapsed = start.elapsed().as_secs_f64();
    let Seen {
        mut latencies,
        errors,
        ..
    } = Rc::try_unwrap(seen)
        .map_err(|_| anyhow!("a client outlived the run"))?
        .into_inner();
    latencies.sort_by(f64::total_cmp);
    let n = latencies.len();
    let ms = |x: f64| (1e4 * x).round() / 10.0;
    let pct = |p: f64| (n > 0).then(|| ms(latencies[((p * n as f64) as usize).min(n - 1)]));
    let mut out = json!({
        "clients": a.clients,
        "sentences": n,
        "sent_per_s": (10.0 * n as f64 / elapsed).round() / 10.0,
        "p50_ms": pct(0.50),
        "p99_ms": pct(0.99),
        "mean_ms": (n > 0).then(|| ms(latencies.iter().sum::<f64>() / n as f64)),
        "errors": errors.len(),
        "first_error": errors.first(),
    });
    if let Some(pid) = a.pid {
        rss.push(rss_kb(pid));
        out["rss_kb"] = json!(rss);
    }
    println!("{out}");
    Ok(())
}
