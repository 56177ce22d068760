//! Cross-request batching: a model's worker threads take the sentences of every pending
//! request, wait a few milliseconds after the first for company while requests are coming
//! together (or until a token budget is reached), and decode them together through the one
//! translation path, sorted by length into batches; each request gets exactly its own
//! translations back, in order.
//!
//! Small batches decode with poor parallel efficiency (a search step is too little work to
//! split across cores), so under load each worker decodes its batch on a thread pool of its
//! own with a share of the cores, several batches at once; a worker that is alone uses all
//! of them (one client's latency).

use super::metrics::Metrics;
use crate::checkpoint::LoadedModel;
use crate::translate::{encode_sources, translate_sources, SearchOptions, Translation};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};
use tokio::sync::oneshot;

/// When a batch is decoded.
#[derive(Debug, Clone, Copy)]
pub struct BatchPolicy {
    /// Decode once pending requests hold this many source tokens.
    pub tokens: usize,
    /// ... or once the first pending request has waited this long.
    pub wait: Duration,
    /// Batches of one model decoded at once, each on its share of the cores.
    pub workers: usize,
}

/// What a request gets back: its translations in order, or why there are none.
pub type Reply = Result<Vec<Translation>, String>;

/// Sentences of one request, searched with one setting.
struct Job {
    lines: Vec<String>,
    opts: SearchOptions,
    arrived: Instant,
    reply: oneshot::Sender<Reply>,
}

/// The handle of a model's worker: submit sentences, await the reply. Dropping every handle
/// lets the worker finish what is queued and stop.
#[derive(Clone)]
pub struct Batcher {
    jobs: mpsc::Sender<Job>,
}

/// What a model's workers share.
struct Shared {
    model: LoadedModel,
    queue: Mutex<mpsc::Receiver<Job>>,
    policy: BatchPolicy,
    metrics: Arc<Metrics>,
    /// Workers decoding now.
    decoding: AtomicUsize,
}

impl Batcher {
    /// Starts `policy.workers` worker threads sharing `model`.
    pub fn start(
        model: LoadedModel,
        policy: BatchPolicy,
        metrics: Arc<Metrics>,
        name: &str,
    ) -> std::io::Result<(Batcher, Vec<JoinHandle<()>>)> {
        let (jobs, queue) = mpsc::channel();
        let workers = policy.workers.max(1);
        let shared = Arc::new(Shared {
            model,
            queue: Mutex::new(queue),
            policy,
            metrics,
            decoding: AtomicUsize::new(0),
        });
        let threads = (rayon::current_num_threads() / workers).max(1);
        let handles = (0..workers)
            .map(|i| {
                let pool = rayon::ThreadPoolBuilder::new()
                    .num_threads(threads)
                    .stack_size(64 << 20)
                    .thread_name(move |t| format!("nmt-decode-{i}-{t}"))
                    .build()
                    .map_err(std::io::Error::other)?;
                let shared = shared.clone();
                std::thread::Builder::new()
                    .name(format!("nmt-model-{name}-{i}"))
                    .spawn(move || work(&shared, &pool))
            })
            .collect::<std::io::Result<_>>()?;
        Ok((Batcher { jobs }, handles))
    }

    /// Queues `lines` for translation with `opts`; the receiver yields their translations.
    pub fn submit(&self, lines: Vec<String>, opts: SearchOptions) -> oneshot::Receiver<Reply> {
        let (reply, answer) = oneshot::channel();
        let job = Job {
            lines,
            opts,
            arrived: Instant::now(),
            reply,
        };
        if let Err(mpsc::SendError(job)) = self.jobs.send(job) {
            let _ = job.reply.send(Err("the model's worker has stopped".into()));
        }
        answer
    }
}

/// A job with its sentences tokenized.
struct Encoded {
    job: Job,
    sources: Vec<Option<Vec<u32>>>,
}

/// A worker's loop: gather, decode, answer; returns when every handle is gone and the queue
/// is empty.
fn work(shared: &Shared, pool: &rayon::ThreadPool) {
    let (model, policy) = (&shared.model, shared.policy);
    // Waiting for company pays only when requests come together: after a batch of one
    // request, the next is decoded as soon as it arrives (with whatever is queued by then).
    let mut together = false;
    loop {
        let batch = {
            let queue = shared.queue.lock().unwrap_or_else(|e| e.into_inner());
            let Ok(first) = queue.recv() else { return };
            let wait = if together {
                policy.wait
            } else {
                Duration::ZERO
            };
            let deadline = first.arrived + wait;
            let mut batch: Vec<Encoded> = encode(model, first).into_iter().collect();
            let mut tokens: usize = batch.iter().map(token_count).sum();
            while tokens < policy.tokens {
                let next = match deadline.checked_duration_since(Instant::now()) {
                    Some(left) => queue.recv_timeout(left),
                    None => queue.try_recv().map_err(|_| RecvTimeoutError::Timeout),
                };
                let Ok(job) = next else { break };
                if let Some(e) = encode(model, job) {
                    tokens += token_count(&e);
                    batch.push(e);
                }
            }
            batch
        };
        together = batch.len() > 1;
        // A client that went away (timeout, closed connection) needs no translation.
        let batch: Vec<Encoded> = batch
            .into_iter()
            .filter(|e| !e.job.reply.is_closed())
            .collect();
        let alone = shared.decoding.fetch_add(1, Ordering::SeqCst) == 0;
        if alone {
            crate::runtime::on_worker(|| decode(model, batch, &shared.metrics));
        } else {
            pool.install(|| decode(model, batch, &shared.metrics));
        }
        shared.decoding.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Tokenizes a job's sentences; `None` (the job answered with the error) if that fails.
fn encode(model: &LoadedModel, job: Job) -> Option<Encoded> {
    let sources = encode_sources(&model.model, &model.tokenizer, &job.lines, |i, n, keep| {
        eprintln!(
            "warning: request sentence {}: {n} tokens, truncated to the model's {keep} positions",
            i + 1
        )
    });
    match sources {
        Ok(sources) => Some(Encoded { job, sources }),
        Err(e) => {
            let _ = job.reply.send(Err(format!("{e:#}")));
            None
        }
    }
}

fn token_count(e: &Encoded) -> usize {
    e.sources.iter().flatten().map(Vec::len).sum()
}

/// Decodes a gathered batch: requests with the same search settings together, each
/// request's results sent back in its own order.
fn decode(model: &LoadedModel, mut batch: Vec<Encoded>, metrics: &Metrics) {
    while !batch.is_empty() {
        let opts = batch[0].job.opts;
        let (group, rest): (Vec<Encoded>, Vec<Encoded>) = batch
            .into_iter()
            .partition(|e| (e.job.opts.beam, e.job.opts.nbest) == (opts.beam, opts.nbest));
        batch = rest;
        let sources: Vec<Option<Vec<u32>>> = group
            .iter()
            .flat_map(|e| e.sources.iter().cloned())
            .collect();
        let started = Instant::now();
        let result = catch_unwind(AssertUnwindSafe(|| {
            translate_sources(&model.model, &model.tokenizer, &sources, &opts)
        }));
        metrics.batch(sources.len(), started.elapsed());
        let result = match result {
            Ok(Ok(t)) => Ok(t),
            Ok(Err(e)) => Err(format!("{e:#}")),
            Err(_) => Err("translation failed unexpectedly (a bug: please report it)".into()),
        };
        match result {
            Ok(mut translations) => {
                for e in group.into_iter().rev() {
                    let own = translations.split_off(translations.len() - e.sources.len());
                    let _ = e.job.reply.send(Ok(own));
                }
            }
            Err(why) => {
                eprintln!("error: {why}");
                for e in group {
                    let _ = e.job.reply.send(Err(why.clone()));
                }
            }
        }
    }
}
