//! The server's counters: requests by route and status, sentences, decoded batches and their
//! time, requests in progress; shown at `GET /metrics` in Prometheus' text format and
//! summed up in the log when the server stops.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Counters shared by the connections and the model workers.
pub struct Metrics {
    started: Instant,
    requests: Mutex<BTreeMap<(&'static str, u16), u64>>,
    sentences: AtomicU64,
    batches: AtomicU64,
    batch_sentences: AtomicU64,
    steps: AtomicU64,
    step_sentences: AtomicU64,
    decode_micros: AtomicU64,
    in_flight: AtomicUsize,
}

/// A translation request admitted under the in-progress limit; dropping it leaves room.
pub struct Admitted(Arc<Metrics>);

impl Drop for Admitted {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Metrics {
    /// Zeroed counters, the clock started now.
    pub fn new() -> Arc<Self> {
        Arc::new(Self {
            started: Instant::now(),
            requests: Mutex::new(BTreeMap::new()),
            sentences: AtomicU64::new(0),
            batches: AtomicU64::new(0),
            batch_sentences: AtomicU64::new(0),
            steps: AtomicU64::new(0),
            step_sentences: AtomicU64::new(0),
            decode_micros: AtomicU64::new(0),
            in_flight: AtomicUsize::new(0),
        })
    }

    /// Admits one more translation request unless `max` are in progress.
    pub fn admit(self: &Arc<Self>, max: usize) -> Option<Admitted> {
        self.in_flight
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| {
                (n < max).then_some(n + 1)
            })
            .ok()
            .map(|_| Admitted(self.clone()))
    }

    /// Counts one answered request.
    pub fn request(&self, route: &'static str, status: u16, sentences: usize) {
        *self
            .requests
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry((route, status))
            .or_default() += 1;
        self.sentences
            .fetch_add(sentences as u64, Ordering::Relaxed);
    }

    /// Counts one decoded batch.
    pub fn batch(&self, sentences: usize, took: Duration) {
        self.batches.fetch_add(1, Ordering::Relaxed);
        self.batch_sentences
            .fetch_add(sentences as u64, Ordering::Relaxed);
        self.decode_micros
            .fetch_add(took.as_micros() as u64, Ordering::Relaxed);
    }

    /// Counts one step of the continuous greedy search over `sentences` sentences.
    pub fn step(&self, sentences: usize, took: Duration) {
        self.steps.fetch_add(1, Ordering::Relaxed);
        self.step_sentences
            .fetch_add(sentences as u64, Ordering::Relaxed);
        self.decode_micros
            .fetch_add(took.as_micros() as u64, Ordering::Relaxed);
    }

    /// The counters in Prometheus' text exposition format.
    pub fn prometheus(&self) -> String {
        let mut s = String::new();
        s.push_str("# HELP nmt_requests_total HTTP requests answered, by route and status.\n");
        s.push_str("# TYPE nmt_requests_total counter\n");
        for ((route, status), n) in self
            .requests
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
        {
            let _ = writeln!(
                s,
                "nmt_requests_total{{route=\"{route}\",status=\"{status}\"}} {n}"
            );
        }
        let counters = [
            (
                "nmt_sentences_total",
                "Sentences translated.",
                self.sentences.load(Ordering::Relaxed) as f64,
            ),
            (
                "nmt_batches_total",
                "Batches decoded.",
                self.batches.load(Ordering::Relaxed) as f64,
            ),
            (
                "nmt_batch_sentences_total",
                "Sentences in decoded batches.",
                self.batch_sentences.load(Ordering::Relaxed) as f64,
            ),
            (
                "nmt_search_steps_total",
                "Steps of the continuous greedy search.",
                self.steps.load(Ordering::Relaxed) as f64,
            ),
            (
                "nmt_search_step_sentences_total",
                "Sentences decoded in the continuous search's steps, summed over steps.",
                self.step_sentences.load(Ordering::Relaxed) as f64,
            ),
            (
                "nmt_decode_seconds_total",
                "Time spent decoding.",
                self.decode_micros.load(Ordering::Relaxed) as f64 / 1e6,
            ),
        ];
        for (name, help, value) in counters {
            let _ = writeln!(
                s,
                "# HELP {name} {help}\n# TYPE {name} counter\n{name} {value}"
            );
        }
        let _ = writeln!(
            s,
            "# HELP nmt_requests_in_flight Translation requests in progress.\n# TYPE nmt_requests_in_flight gauge\nnmt_requests_in_flight {}",
            self.in_flight.load(Ordering::SeqCst)
        );
        let _ = writeln!(
            s,
            "# HELP nmt_uptime_seconds Seconds since the server started.\n# TYPE nmt_uptime_seconds gauge\nnmt_uptime_seconds {:.3}",
            self.started.elapsed().as_secs_f64()
        );
        s
    }

    /// One line for the log: requests, sentences, greedy search steps and gathered batches
    /// (those that ran) with their mean sentences, decoding time.
    pub fn summary(&self) -> String {
        let requests: u64 = self
            .requests
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .values()
            .sum();
        let mut line = format!(
            "{requests} requests, {} sentences",
            self.sentences.load(Ordering::Relaxed)
        );
        let mean =
            |sentences: &AtomicU64, n: u64| sentences.load(Ordering::Relaxed) as f64 / n as f64;
        let steps = self.steps.load(Ordering::Relaxed);
        if steps > 0 {
            let m = mean(&self.step_sentences, steps);
            line += &format!("; {steps} greedy search steps (mean {m:.1} sentences)");
        }
        let batches = self.batches.load(Ordering::Relaxed);
        if batches > 0 {
            let m = mean(&self.batch_sentences, batches);
            line += &format!(
                "; {batches} gathered batches (beam search, alignments; mean {m:.1} sentences)"
            );
        }
        line + &format!(
            "; {:.1} s decoding, {:.0} s up",
            self.decode_micros.load(Ordering::Relaxed) as f64 / 1e6,
            self.started.elapsed().as_secs_f64()
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_summary_names_only_the_kinds_of_decoding_that_ran() {
        let m = Metrics::new();
        m.request("/translate", 200, 3);
        m.step(2, Duration::from_millis(1));
        m.step(4, Duration::from_millis(1));
        let s = m.summary();
        assert!(
            s.starts_with("1 requests, 3 sentences; 2 greedy search steps (mean 3.0 sentences); "),
            "{s}"
        );
        assert!(!s.contains("batches"), "{s}");
        m.batch(5, Duration::from_millis(1));
        assert!(m
            .summary()
            .contains("; 1 gathered batches (beam search, alignments; mean 5.0 sentences); "));
    }
}
