//! Corpus reading shared by every command: plain or gzip files (detected by magic bytes), one
//! sentence per line, CRLF stripped, a leading UTF-8 byte-order mark skipped, strict UTF-8 with
//! errors that name the file, line and byte offset. This module reads text; it knows nothing
//! about tokenizers or tensors.

use anyhow::{bail, Context, Result};
use flate2::read::MultiGzDecoder;
use std::fs::File;
use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// Streams the lines of one corpus file, plain or gzip.
pub struct LineReader {
    path: PathBuf,
    reader: Box<dyn BufRead + Send>,
    line_no: usize,
    empty: usize,
    offset: u64,
    buf: Vec<u8>,
    file_bytes: Arc<AtomicU64>,
    keep_bom: bool,
}

/// The UTF-8 byte-order mark (U+FEFF) that Windows editors put at the start of a file.
const BOM: &[u8] = b"\xef\xbb\xbf";

/// A reader that counts the bytes read through it.
struct Counted<R> {
    inner: R,
    count: Arc<AtomicU64>,
}

impl<R: Read> Read for Counted<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.count.fetch_add(n as u64, Ordering::Relaxed);
        Ok(n)
    }
}

/// Opens `path` for reading, checking that it is a readable regular file; gzip is detected
/// from its first two bytes (0x1f 0x8b), not its name.
pub fn open(path: &Path) -> Result<Box<dyn BufRead + Send>> {
    Ok(open_counted(path)?.0)
}

/// [`open`], with a counter of the bytes read from the file itself (compressed bytes for
/// gzip): progress against the file's size.
fn open_counted(path: &Path) -> Result<(Box<dyn BufRead + Send>, Arc<AtomicU64>)> {
    let meta =
        std::fs::metadata(path).with_context(|| format!("{}: cannot open", path.display()))?;
    if meta.is_dir() {
        bail!("{}: is a directory, expected a text file", path.display());
    }
    let file = File::open(path).with_context(|| format!("{}: cannot open", path.display()))?;
    let count = Arc::new(AtomicU64::new(0));
    let file = Counted {
        inner: file,
        count: count.clone(),
    };
    let mut reader = BufReader::with_capacity(1 << 16, file);
    let magic = reader
        .fill_buf()
        .with_context(|| format!("{}: cannot read", path.display()))?;
    let reader: Box<dyn BufRead + Send> = if magic.starts_with(&[0x1f, 0x8b]) {
        Box::new(BufReader::with_capacity(
            1 << 16,
            MultiGzDecoder::new(reader),
        ))
    } else {
        Box::new(reader)
    };
    Ok((reader, count))
}

impl LineReader {
    /// Opens a corpus file; see [`open`].
    pub fn open(path: &Path) -> Result<Self> {
        let (reader, count) = open_counted(path)?;
        Ok(Self {
            file_bytes: count,
            ..Self::from_reader(path, reader)
        })
    }

    /// Reads lines from any buffered reader (stdin, say); `path` names it in errors.
    pub fn from_reader(path: &Path, reader: Box<dyn BufRead + Send>) -> Self {
        Self {
            path: path.to_path_buf(),
            reader,
            line_no: 0,
            empty: 0,
            offset: 0,
            buf: Vec::new(),
            file_bytes: Arc::default(),
            keep_bom: false,
        }
    }

    /// Keeps a byte-order mark at the start of the input as the first line's first character
    /// (U+FEFF), as sacreBLEU reads files: for the files `eval` scores. Every other reader
    /// skips it: it marks the encoding, and left in a line to translate or train on it would
    /// be tokenized as text and change the first line's translation.
    pub fn keeping_bom(self) -> Self {
        Self {
            keep_bom: true,
            ..self
        }
    }

    /// Bytes read so far from the file itself (compressed bytes for gzip; 0 for a reader
    /// that is not a file): progress against the file's size.
    pub fn file_bytes_read(&self) -> u64 {
        self.file_bytes.load(Ordering::Relaxed)
    }

    /// The number of lines returned so far.
    pub fn line_no(&self) -> usize {
        self.line_no
    }

    /// How many of them were empty (or only whitespace).
    pub fn empty_lines(&self) -> usize {
        self.empty
    }

    /// The file this reader reads.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The next line without its `\n` or `\r\n`, or `None` at the end of the file.
    pub fn next_line(&mut self) -> Result<Option<String>> {
        self.buf.clear();
        let n = self
            .reader
            .read_until(b'\n', &mut self.buf)
            .with_context(|| {
                format!(
                    "{}: read error after line {} (corrupt or truncated gzip?)",
                    self.path.display(),
                    self.line_no
                )
            })?;
        if n == 0 {
            return Ok(None);
        }
        self.line_no += 1;
        let mut start = self.offset;
        self.offset += n as u64;
        if self.line_no == 1 && !self.keep_bom && self.buf.starts_with(BOM) {
            self.buf.drain(..BOM.len());
            start += BOM.len() as u64;
        }
        if self.buf.last() == Some(&b'\n') {
            self.buf.pop();
            if self.buf.last() == Some(&b'\r') {
                self.buf.pop();
            }
        }
        match std::str::from_utf8(&self.buf) {
            Ok(s) => {
                if s.trim().is_empty() {
                    self.empty += 1;
                }
                Ok(Some(s.to_owned()))
            }
            Err(e) => bail!(
                "{}:{}: invalid UTF-8 at byte offset {} (byte {} of the line)",
                self.path.display(),
                self.line_no,
                start + e.valid_up_to() as u64,
                e.valid_up_to() + 1
            ),
        }
    }
}

impl Iterator for LineReader {
    type Item = Result<String>;
    fn next(&mut self) -> Option<Self::Item> {
        self.next_line().transpose()
    }
}

/// A whole corpus file in memory, with its empty-line count.
#[derive(Debug, Clone)]
pub struct Corpus {
    /// Where the lines came from.
    pub path: PathBuf,
    /// The lines, without line terminators.
    pub lines: Vec<String>,
    /// How many of them are empty (or only whitespace).
    pub empty: usize,
}

/// Reads a whole corpus file.
pub fn read_corpus(path: &Path) -> Result<Corpus> {
    Corpus::read(LineReader::open(path)?)
}

/// Reads two sides of a parallel corpus and checks they have the same number of lines.
pub fn read_parallel(src: &Path, tgt: &Path) -> Result<(Corpus, Corpus)> {
    let s = read_corpus(src)?;
    let t = read_corpus(tgt)?;
    s.check_aligned(&t, "parallel files must align line by line")?;
    Ok((s, t))
}

/// The error for two files that should align line by line but have `a.1` and `b.1` lines.
pub fn misaligned(a: (&Path, usize), b: (&Path, usize), why: &str) -> anyhow::Error {
    anyhow::anyhow!(
        "{} has {} lines but {} has {} lines: {why}",
        a.0.display(),
        a.1,
        b.0.display(),
        b.1
    )
}

impl Corpus {
    /// Every line of `reader`.
    pub fn read(mut reader: LineReader) -> Result<Self> {
        let mut lines = Vec::new();
        while let Some(line) = reader.next_line()? {
            lines.push(line);
        }
        Ok(Corpus {
            path: reader.path.clone(),
            lines,
            empty: reader.empty_lines(),
        })
    }

    /// Fails, naming both files and their line counts, unless `other` has as many lines.
    pub fn check_aligned(&self, other: &Corpus, why: &str) -> Result<()> {
        if self.lines.len() != other.lines.len() {
            return Err(misaligned(
                (&self.path, self.lines.len()),
                (&other.path, other.lines.len()),
                why,
            ));
        }
        Ok(())
    }

    /// A one-line note for stderr when the corpus has empty lines, `None` otherwise.
    pub fn empty_note(&self) -> Option<String> {
        (self.empty > 0).then(|| {
            format!(
                "note: {}: {} of {} lines are empty",
                self.path.display(),
                self.empty,
                self.lines.len()
            )
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn write(dir: &Path, name: &str, bytes: &[u8]) -> PathBuf {
        let p = dir.join(name);
        std::fs::write(&p, bytes).unwrap();
        p
    }

    #[test]
    fn reads_plain_and_gzip_alike_and_strips_crlf() {
        let dir = tempfile::tempdir().unwrap();
        let plain = write(dir.path(), "a.txt", b"one\r\ntwo\n\nthree");
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
        gz.write_all(b"one\r\ntwo\n\nthree").unwrap();
        // A name without .gz: the magic bytes decide.
        let zipped = write(dir.path(), "b.txt", &gz.finish().unwrap());
        for p in [plain, zipped] {
            let c = read_corpus(&p).unwrap();
            assert_eq!(c.lines, vec!["one", "two", "", "three"]);
            assert_eq!(c.empty, 1);
        }
    }

    #[test]
    fn invalid_utf8_names_file_line_and_offset() {
        let dir = tempfile::tempdir().unwrap();
        let p = write(dir.path(), "bad.txt", b"fine\nab\xffc\n");
        let err = read_corpus(&p).unwrap_err().to_string();
        assert!(
            err.contains("bad.txt:2: invalid UTF-8 at byte offset 7"),
            "{err}"
        );
    }

    #[test]
    fn a_leading_byte_order_mark_is_skipped_unless_kept() {
        let dir = tempfile::tempdir().unwrap();
        let p = write(dir.path(), "bom.txt", b"\xef\xbb\xbfone\n\xef\xbb\xbftwo\n");
        assert_eq!(read_corpus(&p).unwrap().lines, vec!["one", "\u{feff}two"]);
        let kept = Corpus::read(LineReader::open(&p).unwrap().keeping_bom()).unwrap();
        assert_eq!(kept.lines, vec!["\u{feff}one", "\u{feff}two"]);
        // Offsets still count the file's bytes.
        let p = write(dir.path(), "bad.txt", b"\xef\xbb\xbfab\xffc\n");
        let err = read_corpus(&p).unwrap_err().to_string();
        assert!(
            err.contains("bad.txt:1: invalid UTF-8 at byte offset 5 (byte 3 of the line)"),
            "{err}"
        );
    }

    #[test]
    fn parallel_length_mismatch_names_both_files_and_counts() {
        let dir = tempfile::tempdir().unwrap();
        let a = write(dir.path(), "a.de", b"1\n2\n3\n");
        let b = write(dir.path(), "b.en", b"1\n2\n");
        let err = read_parallel(&a, &b).unwrap_err().to_string();
        assert!(
            err.contains("a.de has 3 lines") && err.contains("b.en has 2 lines"),
            "{err}"
        );
    }

    #[test]
    fn a_directory_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let err = read_corpus(dir.path()).unwrap_err().to_string();
        assert!(err.contains("is a directory"), "{err}");
    }
}
