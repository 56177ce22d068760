//! Crash-safe file output: everything nmt writes for a user goes through here, so that a file
//! is either the old version or the new one, never half of each.

use anyhow::{Context, Result};
use std::fs::{self, File};
use std::io::Write;
use std::path::{Path, PathBuf};

/// The temporary sibling `path` is written as before it is renamed: `.NAME.tmp.PID`.
pub fn temp_path(path: &Path) -> PathBuf {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy())
        .unwrap_or_default();
    path.with_file_name(format!(".{name}.tmp.{}", std::process::id()))
}

/// Reads a whole input file named by the user; `what` says what it should be ("tokenizer",
/// "SentencePiece model") in the errors, which name the file.
pub fn read_input(path: &Path, what: &str) -> Result<Vec<u8>> {
    if path.is_dir() {
        anyhow::bail!("{}: is a directory, expected a {what} file", path.display());
    }
    fs::read(path).with_context(|| format!("{}: cannot read {what}", path.display()))
}

/// Writes `bytes` to `path` via a temporary file in the same folder, fsync and rename.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let tmp = temp_path(path);
    let result = (|| -> std::io::Result<()> {
        let mut f = File::create(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        fs::rename(&tmp, path)?;
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            // Make the rename itself durable; not every filesystem allows syncing a folder.
            if let Ok(d) = File::open(dir) {
                let _ = d.sync_all();
            }
        }
        Ok(())
    })();
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    result.with_context(|| format!("{}: cannot write", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replaces_the_file_and_leaves_no_temporary_behind() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("out.txt");
        write_atomic(&p, b"old").unwrap();
        write_atomic(&p, b"new").unwrap();
        assert_eq!(fs::read(&p).unwrap(), b"new");
        assert_eq!(fs::read_dir(dir.path()).unwrap().count(), 1);
    }

    #[test]
    fn a_missing_folder_is_an_error_naming_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("no/such/out.txt");
        let err = write_atomic(&p, b"x").unwrap_err().to_string();
        assert!(err.contains("out.txt: cannot write"), "{err}");
    }
}
