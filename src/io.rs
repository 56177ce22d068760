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

/// Whether `path` is `place` or lies inside it, links resolved: writing or replacing `place`
/// would destroy it. False where either does not exist.
pub fn lies_within(path: &Path, place: &Path) -> bool {
    match (path.canonicalize(), place.canonicalize()) {
        (Ok(path), Ok(place)) => path.starts_with(place),
        _ => false,
    }
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
    write_atomic_with(path, |tmp| {
        File::create(tmp)?.write_all(bytes)?;
        Ok(())
    })
}

/// Has `write` make the new version of `path` in a temporary file of the same extension (an
/// image library picks the format by it), then puts it in place: fsync and rename, so that
/// `path` is the old file or the new one, never half of each. A symbolic link is followed
/// (the file it names is replaced, the link stays); a device or pipe such as `/dev/null`
/// is written in place, as a rename would replace it or fail.
pub fn write_atomic_with(path: &Path, write: impl FnOnce(&Path) -> Result<()>) -> Result<()> {
    // `metadata` follows links: what `path` names in the end.
    let (in_place, real) = match fs::metadata(path) {
        Ok(m) if m.is_file() => (false, fs::canonicalize(path).unwrap_or(path.to_path_buf())),
        Ok(m) => (!m.is_dir(), path.to_path_buf()),
        Err(_) => (false, path.to_path_buf()),
    };
    let mut tmp = if in_place {
        std::env::temp_dir().join(temp_path(path).file_name().unwrap_or_default())
    } else {
        temp_path(&real)
    };
    if let Some(ext) = real.extension() {
        tmp.as_mut_os_string().push(".");
        tmp.as_mut_os_string().push(ext);
    }
    let result = write(&tmp).and_then(|()| {
        if in_place {
            let bytes = fs::read(&tmp)?;
            fs::OpenOptions::new()
                .write(true)
                .open(path)?
                .write_all(&bytes)?;
            fs::remove_file(&tmp)?;
            return Ok(());
        }
        File::open(&tmp)?.sync_all()?;
        fs::rename(&tmp, &real)?;
        if let Some(dir) = real.parent().filter(|d| !d.as_os_str().is_empty()) {
            // Make the rename itself durable; not every filesystem allows syncing a folder.
            if let Ok(d) = File::open(dir) {
                let _ = d.sync_all();
            }
        }
        Ok(())
    });
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

    #[test]
    fn a_link_is_followed_and_a_device_written_in_place() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("file.json");
        write_atomic(&file, b"old").unwrap();
        let link = dir.path().join("link.json");
        std::os::unix::fs::symlink(&file, &link).unwrap();
        write_atomic(&link, b"new").unwrap();
        assert!(fs::symlink_metadata(&link).unwrap().is_symlink());
        assert_eq!(fs::read(&file).unwrap(), b"new");
        assert_eq!(fs::read_dir(dir.path()).unwrap().count(), 2);
        // /dev/null stays the device (a rename run as root would replace it with a file).
        let null = Path::new("/dev/null");
        write_atomic(null, b"gone").unwrap();
        use std::os::unix::fs::FileTypeExt;
        assert!(fs::metadata(null).unwrap().file_type().is_char_device());
    }
}
