//! The prepared corpus: a parallel corpus tokenized once (by `data::prepare`) into a folder
//! that training reads by memory mapping, so that neither the text nor all the token ids are
//! ever resident at once.
//!
//! A store folder holds:
//! - `store.json`, the manifest: what the store was made from (the tokenizer's fingerprint,
//!   both source files' paths, sizes and modification times, the filters), what was filtered,
//!   the counts, and a CRC-32 of every 64 MiB chunk of the data files. It carries a CRC-32 of
//!   itself, so an edited or damaged manifest is refused too.
//! - a copy of the tokenizer it was made with (`tokenizer.json`, or OPUS-MT's SentencePiece
//!   models and vocabulary): a store is self-contained.
//! - `tokens.bin`: each kept pair's source ids then its target ids, `</s>` left out, as
//!   little-endian u16 when the vocabulary fits in 16 bits, else u32.
//! - `lengths.bin`: per pair, the source and target lengths as two little-endian u16.
//! - `offsets.bin`: per pair, the little-endian u64 position of its first id in `tokens.bin`.
//! - `lines.bin`: per pair, the little-endian u32 number (0-based) of the line it came from,
//!   which guided alignment needs to find a pair's alignment (stores written before it
//!   existed lack it, and serve everything else as before).
//!
//! This module reads and checks stores; it does not tokenize or batch.

use crate::data::tokenizer::SubwordTokenizer;
use anyhow::{anyhow, bail, Context, Result};
use memmap2::Mmap;
use rayon::prelude::*;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::fs::File;
use std::path::{Path, PathBuf};
use std::time::UNIX_EPOCH;

/// The manifest's `format` value.
pub const FORMAT: &str = "nmt-corpus-store";
/// The layout version this build reads and writes.
pub const VERSION: u32 = 1;
/// The manifest file.
pub const MANIFEST: &str = "store.json";
/// Data files are checksummed in chunks of this many bytes, verified in parallel.
pub const CHUNK_BYTES: u64 = 64 << 20;
/// The data files, in the order the manifest lists them.
pub const DATA_FILES: [&str; 3] = ["tokens.bin", "lengths.bin", "offsets.bin"];
/// The optional data file of source line numbers, listed after [`DATA_FILES`].
pub const LINES_FILE: &str = "lines.bin";

/// Which pairs preparation drops. Pairs with an empty side are always dropped.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Filters {
    /// Longest side in tokens, `</s>` included; longer pairs are dropped.
    pub max_len: usize,
    /// Drop pairs whose longer side has more than this many times the tokens of the shorter
    /// (`</s>` not counted); `None`: no ratio filter.
    pub max_len_ratio: Option<f64>,
}

impl Filters {
    /// Checks the values: `max_len` from 2 to 65535, a ratio of at least 1.
    pub fn check(&self) -> Result<()> {
        if self.max_len < 2 || self.max_len > u16::MAX as usize {
            bail!(
                "max_len {} must be between 2 and {}",
                self.max_len,
                u16::MAX
            );
        }
        if self.max_len_ratio.is_some_and(|r| r.is_nan() || r < 1.0) {
            bail!("max_len_ratio must be at least 1 (or absent: no ratio filter)");
        }
        Ok(())
    }
}

/// How many pairs each filter dropped.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct Filtered {
    /// A side empty (or only spaces).
    pub empty: u64,
    /// A side longer than `max_len`.
    pub too_long: u64,
    /// Sides' lengths too far apart (`max_len_ratio`).
    pub ratio: u64,
}

impl Filtered {
    /// All dropped pairs.
    pub fn total(&self) -> u64 {
        self.empty + self.too_long + self.ratio
    }
}

/// A source file as it was when the store was made.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct SourceFile {
    /// Its absolute path.
    pub path: PathBuf,
    /// Size in bytes.
    pub bytes: u64,
    /// Modification time, nanoseconds since the Unix epoch.
    pub modified_ns: u64,
}

impl SourceFile {
    /// The file as it is now.
    pub fn stat(path: &Path) -> Result<Self> {
        let meta =
            std::fs::metadata(path).with_context(|| format!("{}: cannot open", path.display()))?;
        let modified_ns = meta
            .modified()
            .ok()
            .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
            .map_or(0, |d| d.as_nanos() as u64);
        Ok(Self {
            path: std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf()),
            bytes: meta.len(),
            modified_ns,
        })
    }

    /// "606.1 MB, modified 1763890000.123 s", for messages.
    fn describe(&self) -> String {
        format!(
            "{} bytes, modified at {:.3} s since 1970",
            self.bytes,
            self.modified_ns as f64 / 1e9
        )
    }
}

/// The tokenizer a store was made with.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct TokenizerInfo {
    /// SHA-256 of the tokenizer's canonical JSON.
    pub fingerprint: String,
    /// Where it was loaded from when the store was made.
    pub path: PathBuf,
    /// Its vocabulary size.
    pub vocab_size: usize,
}

/// CRC-32s of one data file, one per `CHUNK_BYTES` chunk.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct FileSums {
    /// File name inside the store.
    pub name: String,
    /// Its size in bytes.
    pub bytes: u64,
    /// CRC-32 of each chunk.
    pub crc32: Vec<u32>,
}

/// `store.json`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Manifest {
    /// Always [`FORMAT`].
    pub format: String,
    /// Layout version, [`VERSION`].
    pub version: u32,
    /// The tokenizer the ids come from.
    pub tokenizer: TokenizerInfo,
    /// Source and target files.
    pub sources: [SourceFile; 2],
    /// The filters applied.
    pub filters: Filters,
    /// Lines read from each side.
    pub lines: u64,
    /// Pairs kept.
    pub pairs: u64,
    /// Pairs dropped, by filter.
    pub filtered: Filtered,
    /// Bytes per id in `tokens.bin`: 2 or 4.
    pub id_bytes: u8,
    /// Ids in `tokens.bin` (both sides, `</s>` not stored).
    pub tokens: u64,
    /// Seconds preparation took.
    pub seconds: f64,
    /// Checksums of the data files.
    pub files: Vec<FileSums>,
    /// CRC-32 of this manifest serialised with `checksum` set to 0.
    pub checksum: u32,
}

impl Manifest {
    fn self_checksum(&self) -> Result<u32> {
        let mut copy = self.clone();
        copy.checksum = 0;
        Ok(crc32fast::hash(serde_json::to_string(&copy)?.as_bytes()))
    }

    /// Sets `checksum` and serialises the manifest for writing.
    pub fn sealed_json(mut self) -> Result<String> {
        self.checksum = self.self_checksum()?;
        Ok(serde_json::to_string_pretty(&self)? + "\n")
    }
}

/// The fingerprint of a tokenizer: SHA-256 over its files (canonical `tokenizer.json`, or
/// OPUS-MT's SentencePiece models and vocabulary), names and lengths included.
pub fn fingerprint(tok: &SubwordTokenizer) -> Result<String> {
    let mut h = Sha256::new();
    for (name, bytes) in tok.model_files()? {
        h.update((name.len() as u64).to_le_bytes());
        h.update(name.as_bytes());
        h.update((bytes.len() as u64).to_le_bytes());
        h.update(&bytes);
    }
    Ok(h.finalize().iter().map(|b| format!("{b:02x}")).collect())
}

/// An opened, verified store.
pub struct Store {
    /// Its folder.
    pub dir: PathBuf,
    /// Its manifest.
    pub manifest: Manifest,
    tokens: Mmap,
    lengths: Mmap,
    offsets: Mmap,
    lines: Option<Mmap>,
}

fn map(path: &Path) -> Result<Mmap> {
    let file = File::open(path).with_context(|| format!("{}: cannot open", path.display()))?;
    // SAFETY: the store's files are written once, under a temporary name, and renamed into
    // place; nmt never modifies them afterwards. Their contents are checksummed before use.
    unsafe { Mmap::map(&file) }.with_context(|| format!("{}: cannot map", path.display()))
}

/// How to make a store again, for error messages.
fn re_prepare_hint(dir: &Path) -> String {
    format!(
        "re-prepare it (`nmt prepare ... --out {} --force`, or delete it and nmt train prepares it again)",
        dir.display()
    )
}

impl Store {
    /// Opens a store, checking its manifest and every data file's size and checksums. A
    /// damaged or truncated store is an error naming the file; nothing is read unchecked.
    pub fn open(dir: &Path) -> Result<Self> {
        let path = dir.join(MANIFEST);
        if !dir.is_dir() {
            bail!("{}: not a prepared corpus (no such folder)", dir.display());
        }
        let text = std::fs::read_to_string(&path)
            .with_context(|| format!("{}: cannot read (not a prepared corpus?)", path.display()))?;
        let manifest: Manifest = serde_json::from_str(&text).map_err(|e| {
            anyhow!(
                "{}: damaged manifest ({e}); {}",
                path.display(),
                re_prepare_hint(dir)
            )
        })?;
        if manifest.format != FORMAT || manifest.version != VERSION {
            bail!(
                "{}: a {} version {} store; this nmt reads {FORMAT} version {VERSION}: {}",
                path.display(),
                manifest.format,
                manifest.version,
                re_prepare_hint(dir)
            );
        }
        if manifest.self_checksum()? != manifest.checksum {
            bail!(
                "{}: the manifest's checksum does not match its contents (edited or damaged); {}",
                path.display(),
                re_prepare_hint(dir)
            );
        }
        let names: Vec<&str> = manifest.files.iter().map(|f| f.name.as_str()).collect();
        if !matches!(manifest.id_bytes, 2 | 4)
            || (names[..] != DATA_FILES[..]
                && names[..] != [&DATA_FILES[..], &[LINES_FILE]].concat()[..])
        {
            bail!("{}: inconsistent manifest", path.display());
        }
        let mut maps = Vec::with_capacity(names.len());
        for sums in &manifest.files {
            let want = match sums.name.as_str() {
                "tokens.bin" => manifest.tokens * manifest.id_bytes as u64,
                "lengths.bin" | LINES_FILE => manifest.pairs * 4,
                _ => manifest.pairs * 8,
            };
            let p = dir.join(&sums.name);
            let m = map(&p)?;
            if sums.bytes != want || m.len() as u64 != want {
                bail!(
                    "{}: {} bytes, expected {want} (truncated or damaged); {}",
                    p.display(),
                    m.len(),
                    re_prepare_hint(dir)
                );
            }
            let bad = m
                .par_chunks(CHUNK_BYTES as usize)
                .zip(sums.crc32.par_iter())
                .position_any(|(chunk, &crc)| crc32fast::hash(chunk) != crc);
            let chunks = m.len().div_ceil(CHUNK_BYTES as usize);
            if let Some(i) = bad.or((sums.crc32.len() != chunks).then_some(0)) {
                bail!(
                    "{}: checksum mismatch in bytes {}..{} (damaged); {}",
                    p.display(),
                    i as u64 * CHUNK_BYTES,
                    ((i as u64 + 1) * CHUNK_BYTES).min(want),
                    re_prepare_hint(dir)
                );
            }
            maps.push(m);
        }
        let lines = (maps.len() > DATA_FILES.len())
            .then(|| maps.pop())
            .flatten();
        let [tokens, lengths, offsets] =
            maps.try_into().map_err(|_| anyhow!("three data files"))?;
        Ok(Self {
            dir: dir.to_path_buf(),
            manifest,
            tokens,
            lengths,
            offsets,
            lines,
        })
    }

    /// The line (0-based, of both source files) pair `i` came from; `None` for a store
    /// written before line numbers were kept.
    pub fn line(&self, i: usize) -> Option<u64> {
        let l = self.lines.as_ref()?;
        Some(u32::from_le_bytes(l[i * 4..i * 4 + 4].try_into().unwrap()) as u64)
    }

    /// Number of pairs.
    pub fn len(&self) -> usize {
        self.manifest.pairs as usize
    }

    /// Whether the store holds no pair.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Source and target lengths of pair `i`, `</s>` not counted.
    pub fn lengths(&self, i: usize) -> (usize, usize) {
        let b = &self.lengths[i * 4..i * 4 + 4];
        (
            u16::from_le_bytes([b[0], b[1]]) as usize,
            u16::from_le_bytes([b[2], b[3]]) as usize,
        )
    }

    /// Appends the ids of pair `i`'s source to `src` and its target to `tgt` (no `</s>`).
    pub fn read_pair(&self, i: usize, src: &mut Vec<u32>, tgt: &mut Vec<u32>) {
        let at = u64::from_le_bytes(self.offsets[i * 8..i * 8 + 8].try_into().unwrap()) as usize;
        let (s, t) = self.lengths(i);
        let w = self.manifest.id_bytes as usize;
        let bytes = &self.tokens[at * w..(at + s + t) * w];
        let mut ids = bytes.chunks_exact(w).map(|c| match c {
            [a, b] => u16::from_le_bytes([*a, *b]) as u32,
            _ => u32::from_le_bytes(c.try_into().unwrap()),
        });
        src.extend(ids.by_ref().take(s));
        tgt.extend(ids);
    }

    /// The tokenizer stored with the corpus.
    pub fn tokenizer(&self) -> Result<SubwordTokenizer> {
        SubwordTokenizer::load_dir(&self.dir)
    }

    /// Fails, saying why and how to re-prepare, unless the store was made with `tok`.
    pub fn check_tokenizer(&self, tok: &SubwordTokenizer) -> Result<()> {
        if fingerprint(tok)? != self.manifest.tokenizer.fingerprint {
            bail!(
                "{}: prepared with another tokenizer ({}) than this run's ({}); {}",
                self.dir.display(),
                self.manifest.tokenizer.path.display(),
                tok.path.display(),
                re_prepare_hint(&self.dir)
            );
        }
        Ok(())
    }

    /// Fails unless each source file that still exists is as it was when the store was
    /// made; a source that no longer exists is fine (the store stands on its own).
    pub fn check_sources_unchanged(&self) -> Result<()> {
        for was in &self.manifest.sources {
            if !was.path.exists() {
                continue;
            }
            let now = SourceFile::stat(&was.path)?;
            if now.bytes != was.bytes || now.modified_ns != was.modified_ns {
                bail!(
                    "{}: {} changed since it was prepared (then {}, now {}); {}",
                    self.dir.display(),
                    was.path.display(),
                    was.describe(),
                    now.describe(),
                    re_prepare_hint(&self.dir)
                );
            }
        }
        Ok(())
    }

    /// Whether the store was made from exactly these files (as they are now), with these
    /// filters and this tokenizer: the test for reusing a store that training made itself.
    pub fn made_from(
        &self,
        src: &Path,
        tgt: &Path,
        tok: &SubwordTokenizer,
        filters: &Filters,
    ) -> Result<Option<String>> {
        let now = [SourceFile::stat(src)?, SourceFile::stat(tgt)?];
        for (was, now) in self.manifest.sources.iter().zip(&now) {
            if was != now {
                return Ok(Some(if was.path != now.path {
                    format!(
                        "it was made from {}, not {}",
                        was.path.display(),
                        now.path.display()
                    )
                } else {
                    format!(
                        "{} changed since (then {}, now {})",
                        was.path.display(),
                        was.describe(),
                        now.describe()
                    )
                }));
            }
        }
        if self.manifest.filters != *filters {
            return Ok(Some(format!(
                "it was filtered with {:?}, this run asks for {filters:?}",
                self.manifest.filters
            )));
        }
        if fingerprint(tok)? != self.manifest.tokenizer.fingerprint {
            return Ok(Some("it was made with another tokenizer".into()));
        }
        Ok(None)
    }

    /// A one-line summary: pairs, filtered, size.
    pub fn summary(&self) -> String {
        let m = &self.manifest;
        let bytes: u64 = m.files.iter().map(|f| f.bytes).sum();
        format!(
            "{}: {} pairs of {} lines ({} dropped: {} empty, {} longer than {} tokens, {} over length ratio{}), {} ids, {:.1} MB",
            self.dir.display(),
            m.pairs,
            m.lines,
            m.filtered.total(),
            m.filtered.empty,
            m.filtered.too_long,
            m.filters.max_len,
            m.filtered.ratio,
            m.filters
                .max_len_ratio
                .map(|r| format!(" {r}"))
                .unwrap_or_else(|| " (off)".into()),
            m.tokens,
            bytes as f64 / 1e6
        )
    }
}
