//! metrics.jsonl: one JSON record per logged step and per validation, which the learning
//! curve and `--resume` read back.

use anyhow::{Context, Result};
use std::io::Write;
use std::path::{Path, PathBuf};

/// Appends JSON lines to metrics.jsonl, one whole line per write, synced.
pub(super) struct MetricsLog {
    file: std::fs::File,
    path: PathBuf,
}

impl MetricsLog {
    /// Opens the log; on resume drops records after `step` and any half-written last line.
    pub(super) fn open(path: &Path, resume_step: Option<usize>) -> Result<Self> {
        let kept: String = match (resume_step, std::fs::read_to_string(path)) {
            (Some(step), Ok(text)) => text
                .lines()
                .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
                .filter(|v| v["step"].as_u64().is_some_and(|s| s as usize <= step))
                .map(|v| v.to_string() + "\n")
                .collect(),
            _ => String::new(),
        };
        crate::io::write_atomic(path, kept.as_bytes())?;
        let file = std::fs::OpenOptions::new()
            .append(true)
            .open(path)
            .with_context(|| format!("{}: cannot open", path.display()))?;
        Ok(Self {
            file,
            path: path.to_path_buf(),
        })
    }

    pub(super) fn write(&mut self, record: serde_json::Value) -> Result<()> {
        self.file
            .write_all((record.to_string() + "\n").as_bytes())
            .and_then(|()| self.file.sync_data())
            .with_context(|| format!("{}: cannot write", self.path.display()))
    }
}
