//! Cross-request batching. A model's worker runs one greedy search that the sentences of
//! every pending request join between its steps (up to a budget of source tokens) and leave as
//! soon as they end: a request is answered when its last sentence ends, never waiting for
//! the longest sentence of a batch, and new requests never wait for a batch to finish
//! (continuous batching; each sentence's arithmetic does not depend on its company, so the
//! translations are `nmt translate`'s, bit for bit). On a device where sentences cannot join a
//! running search (a GPU's decoder cache), the requests that arrive meanwhile start the next
//! search together. Requests for beam search (alternatives), and documents of more sentences
//! than `--batch-size`, are gathered, sorted by length into batches and decoded between the
//! steps, through the one translation path.
//!
//! With several workers, each runs its own search on one of the process's worker pools
//! ([`crate::runtime::worker_pools`]), a share of the cores; worker i of every model served
//! uses pool i, so several models do not start more threads than there are cores. A worker
//! that is alone uses all of them.

use super::metrics::Metrics;
use crate::checkpoint::LoadedModel;
use crate::translate::{
    continuous, encode_sources, translate_sources, GreedyTranslator, SearchOptions, Translation,
};
use std::collections::VecDeque;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::{Arc, Mutex, TryLockError};
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
    /// Workers with sentences to decode (in their search or waiting to join it).
    busy: AtomicUsize,
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
            busy: AtomicUsize::new(0),
        });
        let pools = crate::runtime::worker_pools(workers)?;
        let handles = (0..workers)
            .map(|i| {
                let (shared, pools) = (shared.clone(), pools.clone());
                std::thread::Builder::new()
                    .name(format!("nmt-model-{name}-{i}"))
                    .spawn(move || work(&shared, &pools[i]))
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

impl Shared {
    /// Counts a worker in `busy` or not, as `now` says; `counted` is whether it is.
    fn mark_busy(&self, counted: &mut bool, now: bool) {
        if *counted != now {
            *counted = now;
            if now {
                self.busy.fetch_add(1, Ordering::SeqCst);
            } else {
                self.busy.fetch_sub(1, Ordering::SeqCst);
            }
        }
    }
}

/// A worker's loop: gather, decode, answer; returns when every handle is gone and the queue
/// is empty. Greedy requests join one running search between its steps and are answered as
/// soon as their last sentence ends (continuous batching: a short sentence does not wait for
/// a long one, and a new request does not wait for a batch to finish); other requests
/// (beam search, alignments) are decoded as gathered batches between the steps.
fn work(shared: &Shared, pool: &rayon::ThreadPool) {
    let (model, policy) = (&shared.model, shared.policy);
    let mut search: Option<GreedyTranslator> = None;
    // Requests in the search: their translations so far, by the search's sentence numbers.
    let mut open: Vec<Open> = Vec::new();
    // Jobs taken from the queue that wait for room in the search.
    let mut waiting: VecDeque<Encoded> = VecDeque::new();
    // Waiting for company pays only when requests come together: after a batch of one
    // request, the next is decoded as soon as it arrives (with whatever is queued by then).
    let mut together = false;
    // Whether this worker counts in `shared.busy`.
    let mut busy = false;
    loop {
        let running = search.as_ref().is_some_and(|s| !s.is_empty());
        let mut batch: Vec<Encoded> = Vec::new();
        if running || !waiting.is_empty() {
            // Take what has come, without waiting; if another worker, idle, holds the queue,
            // what comes is its.
            let queue = match shared.queue.try_lock() {
                Ok(queue) => Some(queue),
                Err(TryLockError::Poisoned(e)) => Some(e.into_inner()),
                Err(TryLockError::WouldBlock) => None,
            };
            while let Some(Ok(job)) = queue.as_ref().map(|q| q.try_recv()) {
                batch.extend(encode(model, job));
            }
        } else {
            shared.mark_busy(&mut busy, false);
            let queue = shared.queue.lock().unwrap_or_else(|e| e.into_inner());
            let Ok(first) = queue.recv() else { return };
            let wait = if together {
                policy.wait
            } else {
                Duration::ZERO
            };
            let deadline = first.arrived + wait;
            batch.extend(encode(model, first));
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
            together = batch.len() > 1;
        }
        // A client that went away (timeout, closed connection) needs no translation.
        waiting.extend(batch.into_iter().filter(|e| !e.job.reply.is_closed()));
        // Greedy requests join the search while its source tokens stay within the budget.
        let mut gathered = Vec::new();
        let mut joining: Vec<Encoded> = Vec::new();
        let mut tokens: usize = open.iter().map(|o| o.tokens).sum();
        while let Some(e) = waiting.pop_front() {
            // A document (more sentences than a batch) decodes best sorted by length into
            // batches, as `nmt translate` does it.
            if !continuous(&e.job.opts) || e.sources.len() > e.job.opts.batch_size {
                gathered.push(e);
                continue;
            }
            let fits = search
                .as_ref()
                .is_none_or(|s| s.is_empty() || (s.can_add() && *s.options() == e.job.opts))
                && joining.iter().all(|j| j.job.opts == e.job.opts);
            let room = tokens == 0 || tokens + token_count(&e) <= policy.tokens;
            if !fits || !room {
                waiting.push_front(e);
                break;
            }
            tokens += token_count(&e);
            joining.push(e);
        }
        // A worker is busy from its first sentence until its search and its waiting jobs
        // are empty; one that is alone in that decodes on all the cores.
        let has_work = !gathered.is_empty()
            || !joining.is_empty()
            || !waiting.is_empty()
            || search.as_ref().is_some_and(|s| !s.is_empty());
        shared.mark_busy(&mut busy, has_work);
        let alone = shared.busy.load(Ordering::SeqCst) <= 1;
        let run = |f: &mut (dyn FnMut() + Send)| {
            let awake = || crate::runtime::with_partners_awake(model.model.device(), f);
            if alone {
                crate::runtime::on_worker(awake);
            } else {
                pool.install(awake);
            }
        };
        if !gathered.is_empty() {
            run(&mut || decode(model, std::mem::take(&mut gathered), &shared.metrics));
        }
        if !joining.is_empty() {
            let opts = joining[0].job.opts;
            let s = match &mut search {
                Some(s) if !s.is_empty() => s,
                s => s.insert(GreedyTranslator::new(&model.model, &model.tokenizer, opts)),
            };
            run(&mut || join(s, std::mem::take(&mut joining), &mut open));
        }
        if let Some(s) = search.as_mut().filter(|s| !s.is_empty()) {
            run(&mut || step(s, &mut open, &shared.metrics));
        }
    }
}

/// A request in the continuous search.
struct Open {
    job: Job,
    /// Its source tokens.
    tokens: usize,
    /// Its translations, by sentence; empty sentences are done from the start.
    translations: Vec<Option<Translation>>,
    /// The search's number of its first non-empty sentence: the others follow in order.
    first: usize,
    /// The sentence (index into `translations`) of each search number from `first` on.
    slots: Vec<usize>,
    /// Sentences still being decoded.
    left: usize,
}

/// Adds the sentences of `jobs` to the search (answering a job whose sentences are all empty
/// at once); a failure answers those jobs with it.
fn join(search: &mut GreedyTranslator, jobs: Vec<Encoded>, open: &mut Vec<Open>) {
    let sources: Vec<Vec<u32>> = jobs
        .iter()
        .flat_map(|e| e.sources.iter().flatten().cloned())
        .collect();
    let mut next_id = match catch_unwind(AssertUnwindSafe(|| search.add(&sources))) {
        Ok(Ok(first)) => first,
        other => {
            let why = failure(other).unwrap_or_default();
            for e in jobs {
                let _ = e.job.reply.send(Err(why.clone()));
            }
            return;
        }
    };
    for e in jobs {
        let slots: Vec<usize> = (0..e.sources.len())
            .filter(|&i| e.sources[i].is_some())
            .collect();
        let o = Open {
            tokens: token_count(&e),
            translations: e
                .sources
                .iter()
                .map(|s| s.is_none().then(Translation::default))
                .collect(),
            first: next_id,
            left: slots.len(),
            slots,
            job: e.job,
        };
        next_id += o.slots.len();
        if o.left == 0 {
            answer(o);
        } else {
            open.push(o);
        }
    }
}

/// One step of the search; requests whose sentences have all ended are answered. A failure
/// answers every request in the search with it and empties the search.
fn step(search: &mut GreedyTranslator, open: &mut Vec<Open>, metrics: &Metrics) {
    let (started, rows) = (Instant::now(), search.len());
    let done = match catch_unwind(AssertUnwindSafe(|| search.step())) {
        Ok(Ok(done)) => done,
        other => {
            let why = failure(other).unwrap_or_default();
            eprintln!("error: {why}");
            for o in open.drain(..) {
                let _ = o.job.reply.send(Err(why.clone()));
            }
            search.clear();
            return;
        }
    };
    metrics.step(rows, started.elapsed());
    for (id, translation) in done {
        // Requests hold consecutive numbers, in the order they joined.
        let at = open.partition_point(|o| o.first + o.slots.len() <= id);
        let o = &mut open[at];
        o.translations[o.slots[id - o.first]] = Some(translation);
        o.left -= 1;
    }
    let (finished, running): (Vec<Open>, Vec<Open>) = open.drain(..).partition(|o| o.left == 0);
    *open = running;
    finished.into_iter().for_each(answer);
}

/// Sends a finished request its translations.
fn answer(o: Open) {
    let translations = o
        .translations
        .into_iter()
        .map(Option::unwrap_or_default)
        .collect();
    let _ = o.job.reply.send(Ok(translations));
}

/// What went wrong, if anything, in a call made under `catch_unwind`.
fn failure<T>(result: std::thread::Result<anyhow::Result<T>>) -> Option<String> {
    match result {
        Ok(Ok(_)) => None,
        Ok(Err(e)) => Some(format!("{e:#}")),
        Err(_) => Some("translation failed unexpectedly (a bug: please report it)".into()),
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
        match result {
            Ok(Ok(mut translations)) => {
                for e in group.into_iter().rev() {
                    let own = translations.split_off(translations.len() - e.sources.len());
                    let _ = e.job.reply.send(Ok(own));
                }
            }
            other => {
                let why = failure(other).unwrap_or_default();
                eprintln!("error: {why}");
                for e in group {
                    let _ = e.job.reply.send(Err(why.clone()));
                }
            }
        }
    }
}
