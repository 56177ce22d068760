//! `nmt serve`: models behind LibreTranslate's HTTP API. Connections are served by a small
//! tokio runtime (HTTP/1.1 through hyper, routes through axum); each model has worker threads
//! of its own that batch sentences across requests (`batcher`), so a slow client never stalls
//! decoding. SIGTERM or Ctrl-C stops accepting, lets requests in progress
//! finish, and exits 0.

pub mod api;
pub mod batcher;
pub mod metrics;

use crate::checkpoint::LoadedModel;
use anyhow::{Context, Result};
use api::{Api, ApiError, Limits, Sentences};
use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use batcher::{BatchPolicy, Batcher};
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use metrics::Metrics;
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tower::ServiceExt;

/// How long requests in progress may take to finish once the server is told to stop.
const DRAIN: Duration = Duration::from_secs(60);

/// What the server runs with.
pub struct ServeOptions {
    /// Address to bind.
    pub addr: (String, u16),
    /// Request handling.
    pub api: ApiSettings,
    /// When batches are decoded.
    pub policy: BatchPolicy,
}

/// The per-request part of the options.
pub struct ApiSettings {
    /// Search settings of a request without alternatives.
    pub search: crate::translate::SearchOptions,
    /// Request limits.
    pub limits: Limits,
    /// The API key requests must carry, if any.
    pub api_key: Option<String>,
}

/// The client's address, for the request log.
#[derive(Debug, Clone, Copy)]
struct Peer(SocketAddr);

/// Serves `models` (a model per (source, target) pair) until SIGTERM or Ctrl-C.
pub fn run(models: Vec<((String, String), LoadedModel)>, opts: ServeOptions) -> Result<()> {
    let metrics = Metrics::new();
    let mut pairs = BTreeMap::new();
    let mut workers = Vec::new();
    for ((source, target), model) in models {
        let name = format!("{source}-{target}");
        let (batcher, threads) = Batcher::start(model, opts.policy, metrics.clone(), &name)
            .context("cannot start a model's worker threads")?;
        pairs.insert((source, target), batcher);
        workers.extend(threads);
    }
    let api = Arc::new(Api {
        pairs,
        search: opts.api.search,
        limits: opts.api.limits,
        api_key: opts.api.api_key.map(|k| {
            use sha2::Digest;
            sha2::Sha256::digest(k.as_bytes()).into()
        }),
        metrics: metrics.clone(),
    });
    // The models decode on their own threads (and rayon's); the connections need little.
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("nmt-http")
        .enable_all()
        .build()
        .context("cannot start the HTTP runtime")?;
    let served = runtime.block_on(serve(api, opts.addr, opts.api.limits.read_timeout));
    runtime.shutdown_timeout(Duration::from_secs(1));
    // Every batcher handle is gone with the runtime: the workers finish and stop.
    for w in workers {
        let _ = w.join();
    }
    eprintln!("stopped: {}", metrics.summary());
    served
}

/// Accepts connections until told to stop, then drains them.
async fn serve(api: Arc<Api>, addr: (String, u16), read_timeout: Duration) -> Result<()> {
    let listener = tokio::net::TcpListener::bind((addr.0.as_str(), addr.1))
        .await
        .with_context(|| format!("cannot listen on {}:{}", addr.0, addr.1))?;
    let local = listener.local_addr()?;
    let pairs: Vec<String> = api.pairs.keys().map(|(s, t)| format!("{s}-{t}")).collect();
    eprintln!("listening on http://{local} ({})", pairs.join(", "));
    let router = routes(api);
    let graceful = GracefulShutdown::new();
    let mut stop = std::pin::pin!(stop_signal());
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let (stream, peer) = match accepted {
                    Ok(a) => a,
                    Err(e) => {
                        // Out of file descriptors and the like: wait rather than spin.
                        eprintln!("warning: cannot accept a connection: {e}");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        continue;
                    }
                };
                let service = router.clone().map_request(move |mut req: Request<hyper::body::Incoming>| {
                    req.extensions_mut().insert(Peer(peer));
                    req
                });
                let mut http = hyper::server::conn::http1::Builder::new();
                http.timer(TokioTimer::new()).header_read_timeout(read_timeout);
                let conn = http.serve_connection(TokioIo::new(stream), TowerToHyperService::new(service));
                let conn = graceful.watch(conn);
                tokio::spawn(async move {
                    let _ = conn.await;
                });
            }
            () = &mut stop => break,
        }
    }
    drop(listener);
    eprintln!("stopping: no new connections; finishing the requests in progress");
    tokio::select! {
        () = graceful.shutdown() => {}
        () = tokio::time::sleep(DRAIN) => {
            eprintln!("warning: requests still in progress after {} s; closing them", DRAIN.as_secs());
        }
    }
    Ok(())
}

/// SIGTERM or Ctrl-C.
async fn stop_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = term.recv() => {}
                    _ = tokio::signal::ctrl_c() => {}
                }
            }
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}

/// The routes, each request logged and counted.
fn routes(api: Arc<Api>) -> Router {
    Router::new()
        .route(
            "/translate",
            post(|State(api): State<Arc<Api>>, headers: HeaderMap, body: Body| async move {
                api::translate(api, headers, body).await
            }),
        )
        .route(
            "/languages",
            get(|State(api): State<Arc<Api>>| async move { api::languages(&api) })
                .post(|State(api): State<Arc<Api>>| async move { api::languages(&api) }),
        )
        .route(
            "/health",
            get(|| async { api::json_response(StatusCode::OK, &serde_json::json!({ "status": "ok" })) }),
        )
        .route(
            "/metrics",
            get(|State(api): State<Arc<Api>>| async move {
                (
                    [(axum::http::header::CONTENT_TYPE, "text/plain; version=0.0.4")],
                    api.metrics.prometheus(),
                )
            }),
        )
        .fallback(|| async {
            ApiError(
                StatusCode::NOT_FOUND,
                "Not Found: the routes are POST /translate, GET /languages, GET /health, GET /metrics".into(),
            )
        })
        .method_not_allowed_fallback(|| async {
            ApiError(StatusCode::METHOD_NOT_ALLOWED, "Method Not Allowed".into())
        })
        .layer(middleware::from_fn_with_state(api.clone(), log))
        .with_state(api)
}

/// Logs one line per request (client, method, path, status, sentences, milliseconds) and
/// counts it.
async fn log(State(api): State<Arc<Api>>, req: Request, next: Next) -> Response {
    let started = Instant::now();
    let method = req.method().clone();
    let path = req.uri().path().to_string();
    let peer = req
        .extensions()
        .get::<Peer>()
        .map(|p| p.0.to_string())
        .unwrap_or_default();
    let response = next.run(req).await;
    let sentences = response.extensions().get::<Sentences>().map_or(0, |s| s.0);
    let status = response.status().as_u16();
    let route = match path.as_str() {
        "/translate" => "/translate",
        "/languages" => "/languages",
        "/health" => "/health",
        "/metrics" => "/metrics",
        _ => "other",
    };
    api.metrics.request(route, status, sentences);
    eprintln!(
        "{peer} {method} {path} {status} {sentences} sentences {:.1} ms",
        started.elapsed().as_secs_f64() * 1e3
    );
    response.into_response()
}
