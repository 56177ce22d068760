//! Progress of long phases (preparing a corpus, sampling lines, checking a store): a bar with
//! rate and ETA on a terminal, and a line every ten seconds when stderr is a log file, so that
//! nothing that takes minutes is silent. Owns no work of its own.

use indicatif::{ProgressBar, ProgressStyle};
use std::io::IsTerminal;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// How often a non-terminal progress line is printed.
const LOG_EVERY: Duration = Duration::from_secs(10);

/// A phase's progress, measured in bytes of input read.
pub struct Progress {
    bar: Option<ProgressBar>,
    label: String,
    total: u64,
    start: Instant,
    last_line: Mutex<Instant>,
}

fn eta(elapsed: f64, done: u64, total: u64) -> String {
    if done == 0 || done >= total {
        return "?".into();
    }
    let s = (elapsed * (total - done) as f64 / done as f64).round() as u64;
    format!("{}m{:02}s", s / 60, s % 60)
}

impl Progress {
    /// Starts a phase named `label` over `total` bytes.
    pub fn bytes(label: &str, total: u64) -> Self {
        let bar = std::io::stderr().is_terminal().then(|| {
            let bar = ProgressBar::new(total);
            bar.set_style(
                ProgressStyle::with_template(
                    "{prefix} {bar:30} {percent:>3}% {msg} [{elapsed_precise}, ETA {eta}]",
                )
                .unwrap_or_else(|_| ProgressStyle::default_bar()),
            );
            bar.set_prefix(label.to_string());
            bar
        });
        Self {
            bar,
            label: label.into(),
            total: total.max(1),
            start: Instant::now(),
            last_line: Mutex::new(Instant::now()),
        }
    }

    /// Reports `done` bytes of the total, with `msg` (a count and a rate, say).
    pub fn set(&self, done: u64, msg: impl FnOnce() -> String) {
        match &self.bar {
            Some(bar) => {
                bar.set_position(done);
                bar.set_message(msg());
            }
            None => {
                let mut last = self.last_line.lock().unwrap();
                if last.elapsed() >= LOG_EVERY {
                    *last = Instant::now();
                    eprintln!(
                        "{}: {:.0} % {} (ETA {})",
                        self.label,
                        100.0 * done as f64 / self.total as f64,
                        msg(),
                        eta(self.start.elapsed().as_secs_f64(), done, self.total)
                    );
                }
            }
        }
    }

    /// Seconds since the phase started.
    pub fn seconds(&self) -> f64 {
        self.start.elapsed().as_secs_f64()
    }

    /// Ends the phase, clearing the bar.
    pub fn finish(&self) {
        if let Some(bar) = &self.bar {
            bar.finish_and_clear();
        }
    }
}
