//! Preparing a corpus: a parallel text pair streamed through the tokenizer, in parallel on
//! every core, into a store (`data::store`). Memory stays bounded whatever the corpus size: a
//! reader thread hands over chunks of lines while the previous chunk is tokenized and
//! appended. The store is written under a temporary name and renamed into place only when
//! complete, so a crash or a full disk never leaves a half-written store where one is expected.

use crate::data::corpus::{misaligned, LineReader};
use crate::data::store::{
    self, fingerprint, FileSums, Filtered, Filters, Manifest, SourceFile, Store, TokenizerInfo,
    CHUNK_BYTES, DATA_FILES, LINES_FILE, MANIFEST,
};
use crate::data::tokenizer::SubwordTokenizer;
use crate::progress::Progress;
use anyhow::{Context, Result};
use rayon::prelude::*;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::mpsc::{sync_channel, Receiver};
use std::time::Instant;

/// Pairs tokenized together; two chunks are in memory at a time.
const CHUNK_PAIRS: usize = 32 * 1024;

/// Writes a data file, computing a CRC-32 of every `CHUNK_BYTES` bytes on the way.
struct SummedWriter {
    out: BufWriter<File>,
    path: PathBuf,
    hasher: crc32fast::Hasher,
    in_chunk: u64,
    bytes: u64,
    sums: Vec<u32>,
}

impl SummedWriter {
    fn create(path: PathBuf) -> Result<Self> {
        let file =
            File::create(&path).with_context(|| format!("{}: cannot create", path.display()))?;
        Ok(Self {
            out: BufWriter::with_capacity(1 << 20, file),
            path,
            hasher: crc32fast::Hasher::new(),
            in_chunk: 0,
            bytes: 0,
            sums: Vec::new(),
        })
    }

    fn write(&mut self, mut bytes: &[u8]) -> Result<()> {
        self.out
            .write_all(bytes)
            .with_context(|| format!("{}: cannot write", self.path.display()))?;
        self.bytes += bytes.len() as u64;
        while !bytes.is_empty() {
            let take = bytes.len().min((CHUNK_BYTES - self.in_chunk) as usize);
            self.hasher.update(&bytes[..take]);
            self.in_chunk += take as u64;
            bytes = &bytes[take..];
            if self.in_chunk == CHUNK_BYTES {
                let done = std::mem::take(&mut self.hasher);
                self.sums.push(done.finalize());
                self.in_chunk = 0;
            }
        }
        Ok(())
    }

    /// Flushes and syncs the file; returns its checksums.
    fn finish(mut self, name: &str) -> Result<FileSums> {
        if self.in_chunk > 0 {
            self.sums.push(self.hasher.finalize());
        }
        let file = self
            .out
            .into_inner()
            .map_err(|e| e.into_error())
            .and_then(|f| f.sync_all().map(|()| f))
            .with_context(|| format!("{}: cannot write", self.path.display()))?;
        drop(file);
        Ok(FileSums {
            name: name.into(),
            bytes: self.bytes,
            crc32: self.sums,
        })
    }
}

/// What the reader thread hands over.
enum Lines {
    /// A chunk of source and target lines, and the bytes read from both files so far.
    Chunk(Vec<String>, Vec<String>, u64),
    /// Both files ended together after this many lines.
    End(u64),
}

/// Reads both files in step on a thread of its own; fails naming the line where one ends.
fn read_in_chunks(mut src: LineReader, mut tgt: LineReader) -> Receiver<Result<Lines>> {
    let (send, recv) = sync_channel(1);
    std::thread::spawn(move || {
        let result = (|| -> Result<()> {
            loop {
                let (mut s, mut t) = (
                    Vec::with_capacity(CHUNK_PAIRS),
                    Vec::with_capacity(CHUNK_PAIRS),
                );
                while s.len() < CHUNK_PAIRS {
                    match (src.next_line()?, tgt.next_line()?) {
                        (Some(a), Some(b)) => {
                            s.push(a);
                            t.push(b);
                        }
                        (None, None) => break,
                        (a, _) => {
                            let (long, short) = if a.is_some() {
                                (&mut src, &tgt)
                            } else {
                                (&mut tgt, &src)
                            };
                            while long.next_line()?.is_some() {}
                            let why = format!(
                                "parallel files must align line by line ({} ends after line {})",
                                short.path().display(),
                                short.line_no()
                            );
                            return Err(misaligned(
                                (src.path(), src.line_no()),
                                (tgt.path(), tgt.line_no()),
                                &why,
                            ));
                        }
                    }
                }
                let last = s.len() < CHUNK_PAIRS;
                let read = src.file_bytes_read() + tgt.file_bytes_read();
                if !s.is_empty() && send.send(Ok(Lines::Chunk(s, t, read))).is_err() {
                    return Ok(());
                }
                if last {
                    let _ = send.send(Ok(Lines::End(src.line_no() as u64)));
                    return Ok(());
                }
            }
        })();
        if let Err(e) = result {
            let _ = send.send(Err(e));
        }
    });
    recv
}

/// Why a pair is dropped, if it is.
fn filter(s: usize, t: usize, f: &Filters) -> Option<fn(&mut Filtered)> {
    if s == 0 || t == 0 {
        return Some(|c| c.empty += 1);
    }
    if s + 1 > f.max_len || t + 1 > f.max_len {
        return Some(|c| c.too_long += 1);
    }
    if f.max_len_ratio
        .is_some_and(|r| s.max(t) as f64 > r * s.min(t) as f64)
    {
        return Some(|c| c.ratio += 1);
    }
    None
}

/// Tokenizes `src` and `tgt` with `tok` into a new store at `out`, dropping pairs as
/// `filters` say. An existing store at `out` is replaced only when the new one is complete.
pub fn prepare(
    src: &Path,
    tgt: &Path,
    tok: &SubwordTokenizer,
    filters: &Filters,
    out: &Path,
) -> Result<Store> {
    filters.check()?;
    let start = Instant::now();
    let sources = [SourceFile::stat(src)?, SourceFile::stat(tgt)?];
    let chunks = read_in_chunks(LineReader::open(src)?, LineReader::open(tgt)?);
    let tokenizer = TokenizerInfo {
        fingerprint: fingerprint(tok)?,
        path: tok.path.clone(),
        vocab_size: tok.vocab_size(),
    };
    if let Some(parent) = out.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent)
            .with_context(|| format!("{}: cannot create folder", parent.display()))?;
    }
    let tmp = crate::io::temp_path(out);
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir(&tmp).with_context(|| format!("{}: cannot create", tmp.display()))?;
    let result = write_store(&tmp, chunks, tok, tokenizer, sources, filters, start)
        .and_then(|()| replace_dir(&tmp, out));
    if result.is_err() {
        let _ = std::fs::remove_dir_all(&tmp);
    }
    result.with_context(|| format!("preparing {}", out.display()))?;
    Store::open(out)
}

fn write_store(
    dir: &Path,
    chunks: Receiver<Result<Lines>>,
    tok: &SubwordTokenizer,
    tokenizer: TokenizerInfo,
    sources: [SourceFile; 2],
    filters: &Filters,
    start: Instant,
) -> Result<()> {
    let id_bytes: u8 = if tok.vocab_size() <= 1 << 16 { 2 } else { 4 };
    let [tokens, lengths, offsets] = DATA_FILES.map(|name| SummedWriter::create(dir.join(name)));
    let (mut tokens, mut lengths, mut offsets) = (tokens?, lengths?, offsets?);
    let mut line_nos = SummedWriter::create(dir.join(LINES_FILE))?;
    let total_bytes = sources[0].bytes + sources[1].bytes;
    let progress = Progress::bytes("preparing", total_bytes);
    let (mut pairs, mut n_tokens, mut filtered) = (0u64, 0u64, Filtered::default());
    let mut buf = Vec::new();
    let lines = loop {
        let (s, t, read) = match chunks.recv().expect("the reader thread always reports")? {
            Lines::Chunk(s, t, read) => (s, t, read),
            Lines::End(lines) => break lines,
        };
        let encoded: Vec<(Vec<u32>, Vec<u32>)> = s
            .par_iter()
            .zip(&t)
            .map(|(a, b)| Ok((tok.encode_ids_cached(a)?, tok.encode_target_ids(b)?)))
            .collect::<Result<_>>()?;
        buf.clear();
        let first_line = pairs + filtered.total();
        for (k, (a, b)) in encoded.iter().enumerate() {
            if let Some(count) = filter(a.len(), b.len(), filters) {
                count(&mut filtered);
                continue;
            }
            let line = u32::try_from(first_line + k as u64)
                .map_err(|_| anyhow::anyhow!("more than 2³² lines: split the corpus"))?;
            line_nos.write(&line.to_le_bytes())?;
            offsets.write(&n_tokens.to_le_bytes())?;
            lengths.write(&(a.len() as u16).to_le_bytes())?;
            lengths.write(&(b.len() as u16).to_le_bytes())?;
            for &id in a.iter().chain(b) {
                if id_bytes == 2 {
                    buf.extend_from_slice(&(id as u16).to_le_bytes());
                } else {
                    buf.extend_from_slice(&id.to_le_bytes());
                }
            }
            n_tokens += (a.len() + b.len()) as u64;
            pairs += 1;
        }
        tokens.write(&buf)?;
        let lines_done = pairs + filtered.total();
        progress.set(read, || {
            format!(
                "{lines_done} pairs, {:.0} pairs/s",
                lines_done as f64 / progress.seconds()
            )
        });
    };
    progress.finish();
    let files = vec![
        tokens.finish(DATA_FILES[0])?,
        lengths.finish(DATA_FILES[1])?,
        offsets.finish(DATA_FILES[2])?,
        line_nos.finish(LINES_FILE)?,
    ];
    for (name, bytes) in tok.model_files()? {
        crate::io::write_atomic(&dir.join(name), &bytes)?;
    }
    let manifest = Manifest {
        format: store::FORMAT.into(),
        version: store::VERSION,
        tokenizer,
        sources,
        filters: *filters,
        lines,
        pairs,
        filtered,
        id_bytes,
        tokens: n_tokens,
        seconds: start.elapsed().as_secs_f64(),
        files,
        checksum: 0,
    };
    crate::io::write_atomic(&dir.join(MANIFEST), manifest.sealed_json()?.as_bytes())
}

/// Renames the finished `tmp` to `out`, replacing an older store there.
fn replace_dir(tmp: &Path, out: &Path) -> Result<()> {
    if out.exists() {
        let old = out.with_file_name(format!(
            ".{}.old.{}",
            out.file_name().unwrap_or_default().to_string_lossy(),
            std::process::id()
        ));
        std::fs::rename(out, &old).with_context(|| format!("{}: cannot replace", out.display()))?;
        std::fs::rename(tmp, out).with_context(|| format!("{}: cannot write", out.display()))?;
        std::fs::remove_dir_all(&old)
            .with_context(|| format!("{}: cannot remove the old store", old.display()))?;
    } else {
        std::fs::rename(tmp, out).with_context(|| format!("{}: cannot write", out.display()))?;
    }
    if let Some(parent) = out.parent().filter(|p| !p.as_os_str().is_empty()) {
        if let Ok(d) = File::open(parent) {
            let _ = d.sync_all();
        }
    }
    Ok(())
}

/// Stores for the unit tests of the modules that read them.
#[cfg(test)]
pub(crate) mod testing {
    use super::*;
    use crate::data::tokenizer::{train, SubwordModel, TrainOptions};

    /// A tokenizer trained on `pairs` and a store `name` of them in `dir`.
    pub fn store_of(dir: &Path, name: &str, pairs: &[(String, String)]) -> Store {
        let (src, tgt) = (
            dir.join(format!("{name}.src")),
            dir.join(format!("{name}.tgt")),
        );
        let join = |side: fn(&(String, String)) -> &String| {
            pairs
                .iter()
                .map(|p| side(p).clone() + "\n")
                .collect::<String>()
        };
        std::fs::write(&src, join(|p| &p.0)).unwrap();
        std::fs::write(&tgt, join(|p| &p.1)).unwrap();
        let opts = TrainOptions {
            vocab_size: 500,
            model: SubwordModel::Bpe,
            min_frequency: None,
            show_progress: false,
            max_lines: 1000,
            seed: 1,
        };
        let tok = train(&[src.clone(), tgt.clone()], &opts).unwrap();
        let filters = Filters {
            max_len: 128,
            max_len_ratio: None,
        };
        prepare(&src, &tgt, &tok, &filters, &dir.join(name)).unwrap()
    }
}

#[cfg(test)]
mod tests {
    use super::testing::store_of;
    use super::*;

    fn pairs(lines: &[(&str, &str)]) -> Vec<(String, String)> {
        lines
            .iter()
            .map(|(a, b)| (a.to_string(), b.to_string()))
            .collect()
    }

    #[test]
    fn the_store_holds_exactly_what_the_tokenizer_gives_and_counts_what_it_drops() {
        let dir = tempfile::tempdir().unwrap();
        let text = pairs(&[
            ("w1 w2 w3", "w4 w5"),
            ("  leading and trailing  ", "tabs\tand  repeated   spaces "),
            ("", "an empty source"),
            ("Café crème, déjà vu — «naïve»!", "emoji 🙂 and 東京"),
            ("a literal </s> and <pad>", "x"),
            (" ", "only a space"),
            ("LONG", "long"),
        ]);
        let mut text = text;
        text[6].0 = "w1 ".repeat(150);
        let store = store_of(dir.path(), "s", &text);
        let tok = store.tokenizer().unwrap();
        let m = &store.manifest;
        assert_eq!((m.lines, m.pairs), (7, 5));
        assert_eq!((m.filtered.empty, m.filtered.too_long), (1, 1));
        assert_eq!(m.id_bytes, 2);
        let kept = [0, 1, 3, 4, 5];
        for (i, &line) in kept.iter().enumerate() {
            let (mut s, mut t) = (Vec::new(), Vec::new());
            store.read_pair(i, &mut s, &mut t);
            assert_eq!(
                s,
                tok.encode_ids(&text[line].0).unwrap(),
                "{:?}",
                text[line].0
            );
            assert_eq!(
                t,
                tok.encode_ids(&text[line].1).unwrap(),
                "{:?}",
                text[line].1
            );
            assert_eq!(store.lengths(i), (s.len(), t.len()));
        }
    }

    #[test]
    fn the_ratio_filter_drops_pairs_of_very_different_lengths() {
        let f = Filters {
            max_len: 100,
            max_len_ratio: Some(2.0),
        };
        assert!(filter(3, 6, &f).is_none());
        let mut c = Filtered::default();
        filter(3, 7, &f).unwrap()(&mut c);
        filter(0, 7, &f).unwrap()(&mut c);
        filter(100, 99, &f).unwrap()(&mut c);
        assert_eq!((c.ratio, c.empty, c.too_long), (1, 1, 1));
    }

    #[test]
    fn a_damaged_store_is_refused_naming_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let text: Vec<(String, String)> = (0..50)
            .map(|i| (format!("w{i} w{}", i + 1), format!("w{}", i * 7)))
            .collect();
        let store = store_of(dir.path(), "s", &text);
        let path = store.dir.clone();
        drop(store);
        let open_err = || Store::open(&path).err().unwrap().to_string();
        // One flipped byte in the ids.
        let tokens = path.join("tokens.bin");
        let good = std::fs::read(&tokens).unwrap();
        let mut bad = good.clone();
        bad[5] ^= 1;
        std::fs::write(&tokens, &bad).unwrap();
        let err = open_err();
        assert!(err.contains("tokens.bin: checksum mismatch"), "{err}");
        // Truncated.
        std::fs::write(&tokens, &good[..good.len() - 2]).unwrap();
        let err = open_err();
        assert!(
            err.contains("tokens.bin") && err.contains("truncated"),
            "{err}"
        );
        std::fs::write(&tokens, &good).unwrap();
        assert!(Store::open(&path).is_ok());
        // An edited manifest, and one cut short.
        let manifest = path.join(MANIFEST);
        let text = std::fs::read_to_string(&manifest).unwrap();
        std::fs::write(&manifest, text.replace("\"pairs\": 50", "\"pairs\": 49")).unwrap();
        let err = open_err();
        assert!(
            err.contains("store.json") && err.contains("checksum"),
            "{err}"
        );
        std::fs::write(&manifest, &text[..text.len() / 2]).unwrap();
        let err = open_err();
        assert!(err.contains("store.json: damaged manifest"), "{err}");
        assert!(err.contains("re-prepare"), "{err}");
    }

    #[test]
    fn files_of_different_lengths_are_an_error_naming_where_one_ends() {
        let dir = tempfile::tempdir().unwrap();
        let store = store_of(dir.path(), "s", &pairs(&[("a b", "c")]));
        let tok = store.tokenizer().unwrap();
        let (a, b) = (dir.path().join("a.de"), dir.path().join("b.en"));
        std::fs::write(&a, "1\n2\n3\n").unwrap();
        std::fs::write(&b, "1\n2\n").unwrap();
        let f = store.manifest.filters;
        let out = dir.path().join("out");
        for (x, y) in [(&a, &b), (&b, &a)] {
            let err = format!("{:#}", prepare(x, y, &tok, &f, &out).err().unwrap());
            assert!(
                err.contains("a.de has 3 lines")
                    && err.contains("b.en has 2 lines")
                    && err.contains("b.en ends after line 2"),
                "{err}"
            );
        }
        assert!(!out.exists(), "no store is left behind");
        let leftovers = std::fs::read_dir(dir.path())
            .unwrap()
            .filter(|e| {
                e.as_ref()
                    .unwrap()
                    .file_name()
                    .to_string_lossy()
                    .contains("tmp")
            })
            .count();
        assert_eq!(leftovers, 0);
    }
}
