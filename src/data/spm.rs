//! SentencePiece models (`*.spm`, `*.model`) read directly from their protobuf, for OPUS-MT and
//! other Marian models published with `source.spm` / `target.spm`. Owns the protobuf reader, the
//! SentencePiece normaliser (precompiled character map + whitespace rules), unigram Viterbi
//! segmentation and piece decoding, all with SentencePiece's own semantics so that our pieces
//! equal `SentencePieceProcessor.encode(text, out_type=str)`. It does not map pieces to model
//! ids: that is the vocabulary's job (see `opus.rs`).

use anyhow::{anyhow, bail, Context, Result};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use tokenizers::normalizers::Precompiled;
use tokenizers::{NormalizedString, Normalizer};

/// SentencePiece's whitespace symbol, U+2581.
pub const SPACE: char = '\u{2581}';
/// What SentencePiece subtracts from the lowest piece score to score an unknown character.
const UNK_PENALTY: f32 = 10.0;

/// The role of a piece, as SentencePiece's `ModelProto.SentencePiece.Type` says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PieceKind {
    /// An ordinary subword.
    Normal,
    /// `<unk>`.
    Unknown,
    /// `<s>`, `</s>` and the like: never produced by segmentation, invisible when decoded.
    Control,
    /// A symbol always kept whole.
    UserDefined,
    /// A byte-fallback piece `<0xAB>`.
    Byte,
    /// Kept in the vocabulary but never produced.
    Unused,
}

/// One vocabulary entry.
#[derive(Debug, Clone)]
pub struct Piece {
    /// Its text, with `▁` for spaces.
    pub text: String,
    /// Its log-probability (unigram).
    pub score: f32,
    /// Its role.
    pub kind: PieceKind,
}

/// A SentencePiece unigram model.
pub struct SpmModel {
    /// The pieces, by SentencePiece id.
    pub pieces: Vec<Piece>,
    index: HashMap<String, u32>,
    /// Longest piece text, in bytes.
    max_piece_len: usize,
    unk_id: u32,
    unk_surface: String,
    min_score: f32,
    max_score: f32,
    byte_fallback: bool,
    add_dummy_prefix: bool,
    remove_extra_whitespaces: bool,
    escape_whitespaces: bool,
    charsmap: Option<Precompiled>,
    denormalizer: Option<Precompiled>,
    /// Where it was read from.
    pub path: PathBuf,
}

/// A cursor over protobuf wire-format bytes.
struct Wire<'a> {
    buf: &'a [u8],
    pos: usize,
    /// Offset of `buf` in the file, for error messages.
    base: usize,
}

/// A field value: varint, fixed 32/64-bit, or length-delimited bytes (with their file offset).
enum Value<'a> {
    Varint(u64),
    Fixed32(u32),
    Fixed64,
    Bytes(&'a [u8], usize),
}

impl<'a> Wire<'a> {
    fn new(buf: &'a [u8], base: usize) -> Self {
        Self { buf, pos: 0, base }
    }

    fn varint(&mut self) -> Result<u64> {
        let mut v = 0u64;
        for shift in (0..64).step_by(7) {
            let b = *self
                .buf
                .get(self.pos)
                .ok_or_else(|| anyhow!("truncated varint at byte {}", self.base + self.pos))?;
            self.pos += 1;
            v |= u64::from(b & 0x7f) << shift;
            if b & 0x80 == 0 {
                return Ok(v);
            }
        }
        bail!("overlong varint at byte {}", self.base + self.pos)
    }

    fn take(&mut self, n: usize) -> Result<(&'a [u8], usize)> {
        let at = self.pos;
        let end = at
            .checked_add(n)
            .filter(|&e| e <= self.buf.len())
            .ok_or_else(|| {
                anyhow!(
                    "field of {n} bytes at byte {} runs past the end",
                    self.base + at
                )
            })?;
        self.pos = end;
        Ok((&self.buf[at..end], self.base + at))
    }

    /// The next `(field number, value)`, or `None` at the end.
    fn field(&mut self) -> Result<Option<(u64, Value<'a>)>> {
        if self.pos == self.buf.len() {
            return Ok(None);
        }
        let at = self.base + self.pos;
        let key = self.varint()?;
        let value = match key & 7 {
            0 => Value::Varint(self.varint()?),
            1 => {
                self.take(8)?;
                Value::Fixed64
            }
            2 => {
                let n = self.varint()?;
                let n = usize::try_from(n).map_err(|_| anyhow!("length {n} at byte {at}"))?;
                let (bytes, off) = self.take(n)?;
                Value::Bytes(bytes, off)
            }
            5 => {
                let (b, _) = self.take(4)?;
                Value::Fixed32(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            }
            w => bail!("unsupported protobuf wire type {w} at byte {at}"),
        };
        Ok(Some((key >> 3, value)))
    }
}

fn text(bytes: &[u8], off: usize, what: &str) -> Result<String> {
    String::from_utf8(bytes.to_vec()).map_err(|_| anyhow!("{what} at byte {off} is not UTF-8"))
}

fn flag(v: &Value) -> Option<bool> {
    match v {
        Value::Varint(x) => Some(*x != 0),
        _ => None,
    }
}

/// `NormalizerSpec` fields we use.
struct NormSpec {
    charsmap: Vec<u8>,
    add_dummy_prefix: bool,
    remove_extra_whitespaces: bool,
    escape_whitespaces: bool,
}

fn read_normalizer(bytes: &[u8], off: usize) -> Result<NormSpec> {
    let mut spec = NormSpec {
        charsmap: Vec::new(),
        add_dummy_prefix: true,
        remove_extra_whitespaces: true,
        escape_whitespaces: true,
    };
    let mut w = Wire::new(bytes, off);
    while let Some((field, v)) = w.field()? {
        match (field, &v) {
            (2, Value::Bytes(b, _)) => spec.charsmap = b.to_vec(),
            (3, _) => spec.add_dummy_prefix = flag(&v).unwrap_or(true),
            (4, _) => spec.remove_extra_whitespaces = flag(&v).unwrap_or(true),
            (5, _) => spec.escape_whitespaces = flag(&v).unwrap_or(true),
            _ => {}
        }
    }
    Ok(spec)
}

fn read_piece(bytes: &[u8], off: usize) -> Result<Piece> {
    let mut piece = Piece {
        text: String::new(),
        score: 0.0,
        kind: PieceKind::Normal,
    };
    let mut w = Wire::new(bytes, off);
    while let Some((field, v)) = w.field()? {
        match (field, v) {
            (1, Value::Bytes(b, o)) => piece.text = text(b, o, "piece text")?,
            (2, Value::Fixed32(bits)) => piece.score = f32::from_bits(bits),
            (3, Value::Varint(t)) => {
                piece.kind = match t {
                    1 => PieceKind::Normal,
                    2 => PieceKind::Unknown,
                    3 => PieceKind::Control,
                    4 => PieceKind::UserDefined,
                    5 => PieceKind::Unused,
                    6 => PieceKind::Byte,
                    t => bail!("unknown piece type {t} at byte {off}"),
                }
            }
            _ => {}
        }
    }
    Ok(piece)
}

/// Checks a precompiled character map (a darts-clone double-array trie over UTF-8 bytes, then
/// the NUL-separated replacement strings) so that no lookup can index outside it: the reader
/// we hand it to trusts the file and would panic on a corrupt one.
fn check_charsmap(bytes: &[u8]) -> Result<()> {
    let word = |at: usize| -> Option<usize> {
        let b = bytes.get(at..at + 4)?;
        Some(u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize)
    };
    let trie_bytes = word(0).ok_or_else(|| anyhow!("shorter than its header"))?;
    let units = trie_bytes / 4;
    let array: Vec<usize> = (0..units)
        .map(|i| word(4 + 4 * i))
        .collect::<Option<_>>()
        .ok_or_else(|| anyhow!("its trie runs past the end"))?;
    let strings = &bytes[(4 + 4 * units).min(bytes.len())..];
    let strings = std::str::from_utf8(strings)
        .map_err(|_| anyhow!("its replacement strings are not UTF-8"))?;
    let offset = |u: usize| (u >> 10) << ((u & (1 << 9)) >> 6);
    let root = *array.first().ok_or_else(|| anyhow!("its trie is empty"))?;
    let mut seen = vec![false; array.len()];
    let mut todo = vec![offset(root)];
    while let Some(node) = todo.pop() {
        for c in 1..=255usize {
            let at = node ^ c;
            let unit = *array
                .get(at)
                .ok_or_else(|| anyhow!("its trie points outside itself"))?;
            if unit & ((1 << 31) | 0xff) != c {
                continue;
            }
            let next = at ^ offset(unit);
            if (unit >> 8) & 1 == 1 {
                let value = array
                    .get(next)
                    .map(|v| v & ((1 << 31) - 1))
                    .ok_or_else(|| anyhow!("its trie points outside itself"))?;
                if value > strings.len() || !strings.is_char_boundary(value) {
                    bail!("its trie points outside its replacement strings");
                }
            }
            if next < seen.len() && !std::mem::replace(&mut seen[next], true) {
                todo.push(next);
            } else if next >= seen.len() {
                // A node past the end is only safe if no byte can be looked up from it.
                bail!("its trie points outside itself");
            }
        }
    }
    Ok(())
}

fn precompiled(bytes: &[u8], path: &Path, what: &str) -> Result<Option<Precompiled>> {
    if bytes.is_empty() {
        return Ok(None);
    }
    check_charsmap(bytes)
        .map_err(|e| anyhow!("{}: invalid {what} character map: {e}", path.display()))?;
    Precompiled::from(bytes)
        .map(Some)
        .map_err(|e| anyhow!("{}: invalid {what} character map: {e}", path.display()))
}

impl SpmModel {
    /// Reads a SentencePiece model file. Only unigram models are supported (OPUS-MT's kind).
    pub fn load(path: &Path) -> Result<Self> {
        let bytes = crate::io::read_input(path, "SentencePiece model")?;
        Self::from_bytes(&bytes, path)
            .with_context(|| format!("{}: not a valid SentencePiece model", path.display()))
    }

    /// Parses the bytes of a model file read from `path`.
    pub fn from_bytes(bytes: &[u8], path: &Path) -> Result<Self> {
        let mut pieces = Vec::new();
        let mut model_type = 1;
        let mut byte_fallback = false;
        let mut unk_surface = " \u{2047} ".to_string();
        let mut suffix_whitespace = false;
        let mut norm = None;
        let mut denorm = None;
        let mut w = Wire::new(bytes, 0);
        while let Some((field, v)) = w.field()? {
            let Value::Bytes(b, off) = v else { continue };
            match field {
                1 => pieces.push(read_piece(b, off)?),
                2 => {
                    let mut t = Wire::new(b, off);
                    while let Some((f, v)) = t.field()? {
                        match (f, v) {
                            (3, Value::Varint(x)) => model_type = x,
                            (24, v) => suffix_whitespace = flag(&v).unwrap_or(false),
                            (35, v) => byte_fallback = flag(&v).unwrap_or(false),
                            (44, Value::Bytes(s, o)) => unk_surface = text(s, o, "unk_surface")?,
                            _ => {}
                        }
                    }
                }
                3 => norm = Some(read_normalizer(b, off)?),
                5 => denorm = Some(read_normalizer(b, off)?),
                _ => {}
            }
        }
        if model_type != 1 {
            let name = match model_type {
                2 => "BPE",
                3 => "word",
                4 => "char",
                _ => "unknown",
            };
            bail!("a {name} model (type {model_type}); only unigram models are supported");
        }
        if suffix_whitespace {
            bail!("treat_whitespace_as_suffix models are not supported");
        }
        if pieces.is_empty() {
            bail!("no pieces");
        }
        let unk_id = pieces
            .iter()
            .position(|p| p.kind == PieceKind::Unknown)
            .ok_or_else(|| anyhow!("no <unk> piece"))? as u32;
        let norm = norm.unwrap_or(NormSpec {
            charsmap: Vec::new(),
            add_dummy_prefix: true,
            remove_extra_whitespaces: true,
            escape_whitespaces: true,
        });
        let mut index = HashMap::new();
        let (mut min_score, mut max_score) = (f32::MAX, f32::MIN_POSITIVE);
        let mut max_piece_len = 1;
        for (i, p) in pieces.iter().enumerate() {
            if matches!(
                p.kind,
                PieceKind::Normal | PieceKind::UserDefined | PieceKind::Unused
            ) && !p.text.is_empty()
            {
                max_piece_len = max_piece_len.max(p.text.len());
            }
            if p.kind == PieceKind::Normal {
                min_score = min_score.min(p.score);
                max_score = max_score.max(p.score);
            }
            index.entry(p.text.clone()).or_insert(i as u32);
        }
        Ok(Self {
            index,
            max_piece_len,
            unk_id,
            unk_surface,
            min_score,
            max_score,
            byte_fallback,
            add_dummy_prefix: norm.add_dummy_prefix,
            remove_extra_whitespaces: norm.remove_extra_whitespaces,
            escape_whitespaces: norm.escape_whitespaces,
            charsmap: precompiled(&norm.charsmap, path, "normaliser")?,
            denormalizer: match &denorm {
                Some(d) => precompiled(&d.charsmap, path, "denormaliser")?,
                None => None,
            },
            pieces,
            path: path.to_path_buf(),
        })
    }

    /// The SentencePiece id of a piece, if it is in the model.
    pub fn piece_id(&self, piece: &str) -> Option<u32> {
        self.index.get(piece).copied()
    }

    /// SentencePiece's normalisation: the character map, then (by default) leading, trailing
    /// and repeated spaces removed, a `▁` prepended, spaces written as `▁`.
    pub fn normalize(&self, text: &str) -> Result<String> {
        let mapped = match &self.charsmap {
            Some(map) => {
                let mut n = NormalizedString::from(text);
                map.normalize(&mut n)
                    .map_err(|e| anyhow!("{}: normalising: {e}", self.path.display()))?;
                n.get().to_string()
            }
            None => text.to_string(),
        };
        let mut out = String::with_capacity(mapped.len() + 3);
        let space = if self.escape_whitespaces { SPACE } else { ' ' };
        let body = if self.remove_extra_whitespaces {
            mapped.trim_matches(' ')
        } else {
            mapped.as_str()
        };
        if body.is_empty() {
            return Ok(out);
        }
        if self.add_dummy_prefix {
            out.push(space);
        }
        let mut prev_space = self.remove_extra_whitespaces && self.add_dummy_prefix;
        for c in body.chars() {
            if c == ' ' {
                if !(prev_space && self.remove_extra_whitespaces) {
                    out.push(space);
                }
                prev_space = true;
            } else {
                out.push(c);
                prev_space = false;
            }
        }
        Ok(out)
    }

    /// The pieces of `text`, as `encode(text, out_type=str)` gives them: the best unigram
    /// segmentation of the normalised text; a run of unknown characters is one piece with their
    /// text (or their UTF-8 bytes as `<0xAB>` pieces with byte fallback).
    pub fn encode(&self, text: &str) -> Result<Vec<String>> {
        let norm = self.normalize(text)?;
        let n = norm.len();
        // best[end] = (score, start, id) of the best path covering norm[..end].
        let mut best: Vec<Option<(f32, usize, u32)>> = vec![None; n + 1];
        best[0] = Some((0.0, 0, 0));
        let unk_score = self.min_score - UNK_PENALTY;
        for (start, c) in norm.char_indices() {
            let Some((here, _, _)) = best[start] else {
                continue;
            };
            let char_len = c.len_utf8();
            let mut has_single = false;
            let limit = (start + self.max_piece_len).min(n);
            for end in (start + 1..=limit).filter(|&e| norm.is_char_boundary(e)) {
                let Some(&id) = self.index.get(&norm[start..end]) else {
                    continue;
                };
                let piece = &self.pieces[id as usize];
                let score = match piece.kind {
                    PieceKind::Normal => piece.score,
                    PieceKind::UserDefined => (end - start) as f32 * self.max_score - 0.1,
                    _ => continue,
                };
                let candidate = here + score;
                if best[end].is_none_or(|(s, _, _)| candidate > s) {
                    best[end] = Some((candidate, start, id));
                }
                has_single |= end - start == char_len;
            }
            if !has_single {
                let end = start + char_len;
                let candidate = here + unk_score;
                if best[end].is_none_or(|(s, _, _)| candidate > s) {
                    best[end] = Some((candidate, start, self.unk_id));
                }
            }
        }
        let mut path = Vec::new();
        let mut end = n;
        while end > 0 {
            let (_, start, id) = best[end].expect("every character boundary is reachable");
            path.push((start, end, id));
            end = start;
        }
        path.reverse();
        let mut out: Vec<String> = Vec::with_capacity(path.len());
        let mut prev_unk = false;
        for (start, end, id) in path {
            let surface = &norm[start..end];
            let is_unk = id == self.unk_id;
            if is_unk && self.byte_fallback {
                out.extend(surface.bytes().map(|b| format!("<0x{b:02X}>")));
            } else if is_unk && prev_unk {
                out.last_mut().expect("previous piece").push_str(surface);
            } else {
                out.push(surface.to_string());
            }
            prev_unk = is_unk;
        }
        Ok(out)
    }

    /// Text of a sequence of pieces, as `decode_pieces` gives it: control pieces vanish,
    /// `<unk>` becomes ` ⁇ `, pieces not in the model are copied, byte pieces are joined into
    /// UTF-8, `▁` becomes a space and the dummy prefix is dropped.
    pub fn decode(&self, pieces: &[String]) -> String {
        let mut out = String::new();
        let mut bytes = Vec::new();
        let mut bos = true;
        for p in pieces {
            let id = self.piece_id(p).unwrap_or(self.unk_id);
            let piece = &self.pieces[id as usize];
            if piece.kind == PieceKind::Byte {
                if let Some(b) = parse_byte_piece(p) {
                    bytes.push(b);
                    continue;
                }
            }
            if !bytes.is_empty() {
                out.push_str(&String::from_utf8_lossy(&bytes));
                bytes.clear();
                bos = false;
            }
            let surface = match piece.kind {
                PieceKind::Control => String::new(),
                PieceKind::Unknown if piece.text == *p => self.unk_surface.clone(),
                PieceKind::Unknown => p.clone(),
                _ => {
                    let mut s = p.as_str();
                    if bos && (self.add_dummy_prefix || self.remove_extra_whitespaces) {
                        s = s.strip_prefix(SPACE).unwrap_or(s);
                    }
                    s.replace(SPACE, " ")
                }
            };
            if !surface.is_empty() {
                bos = false;
            }
            out.push_str(&surface);
        }
        if !bytes.is_empty() {
            out.push_str(&String::from_utf8_lossy(&bytes));
        }
        match &self.denormalizer {
            Some(d) => d.normalize_string(&out),
            None => out,
        }
    }
}

fn parse_byte_piece(p: &str) -> Option<u8> {
    let hex = p.strip_prefix("<0x")?.strip_suffix('>')?;
    u8::from_str_radix(hex, 16).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Builds a model protobuf by hand: pieces (text, score, type) and normaliser flags.
    fn proto(pieces: &[(&str, f32, u64)], add_dummy_prefix: bool) -> Vec<u8> {
        fn varint(mut v: u64, out: &mut Vec<u8>) {
            while v >= 0x80 {
                out.push((v as u8) | 0x80);
                v >>= 7;
            }
            out.push(v as u8);
        }
        fn bytes(field: u64, b: &[u8], out: &mut Vec<u8>) {
            varint(field << 3 | 2, out);
            varint(b.len() as u64, out);
            out.extend_from_slice(b);
        }
        let mut out = Vec::new();
        for (text, score, kind) in pieces {
            let mut p = Vec::new();
            bytes(1, text.as_bytes(), &mut p);
            varint(2 << 3 | 5, &mut p);
            p.extend_from_slice(&score.to_le_bytes());
            varint(3 << 3, &mut p);
            varint(*kind, &mut p);
            bytes(1, &p, &mut out);
        }
        let mut norm = Vec::new();
        varint(3 << 3, &mut norm);
        varint(u64::from(add_dummy_prefix), &mut norm);
        bytes(3, &norm, &mut out);
        out
    }

    fn model() -> SpmModel {
        let pieces = [
            ("<unk>", 0.0, 2),
            ("<s>", 0.0, 3),
            ("</s>", 0.0, 3),
            ("▁", -2.0, 1),
            ("▁a", -1.0, 1),
            ("b", -3.0, 1),
            ("▁ab", -2.5, 1),
            ("a", -4.0, 1),
            ("c", -3.5, 1),
        ];
        SpmModel::from_bytes(&proto(&pieces, true), Path::new("test.spm")).unwrap()
    }

    #[test]
    fn segments_like_sentencepiece() {
        let m = model();
        assert_eq!(m.normalize("  ab   c ").unwrap(), "▁ab▁c");
        assert_eq!(m.normalize("   ").unwrap(), "");
        assert_eq!(m.encode("ab").unwrap(), ["▁ab"]);
        assert_eq!(m.encode("abb c").unwrap(), ["▁ab", "b", "▁", "c"]);
        // Unknown characters are one piece with their text; control pieces never match.
        assert_eq!(m.encode("a xy</s>").unwrap(), ["▁a", "▁", "xy</s>"]);
        assert_eq!(m.encode("").unwrap(), Vec::<String>::new());
    }

    #[test]
    fn decodes_like_sentencepiece() {
        let m = model();
        let pieces: Vec<String> = ["</s>", "▁ab", "▁", "c", "<unk>", "zz"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        assert_eq!(m.decode(&pieces), "ab c ⁇ zz");
    }

    #[test]
    fn a_corrupt_character_map_is_an_error_not_a_panic() {
        // An empty trie; a root pointing far outside; replacement strings that are not UTF-8.
        for bad in [
            &[0u8, 0, 0, 0][..],
            &[4, 0, 0, 0, 0xff, 0xff, 0xff, 0xff],
            &[4, 0, 0, 0, 0, 0, 0, 0, 0xff],
            &[8, 0, 0, 0, 1],
        ] {
            assert!(check_charsmap(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn rejects_garbage() {
        let err = SpmModel::from_bytes(&[0x0a, 0x50, 1], Path::new("x.spm"))
            .err()
            .unwrap();
        assert!(err.to_string().contains("runs past the end"), "{err}");
        let err = SpmModel::from_bytes(&proto(&[("▁a", -1.0, 1)], true), Path::new("x.spm"))
            .err()
            .unwrap();
        assert!(err.to_string().contains("no <unk>"), "{err}");
    }
}
