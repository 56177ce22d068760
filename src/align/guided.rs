//! Guided alignment (Marian's `--guided-alignment`; Garg et al., 2019): word alignments of
//! the training corpus (Pharaoh `s-t` lines, one per corpus line, e.g. from eflomal) supervise
//! one cross-attention head. A target piece whose word is aligned spreads a weight of 1
//! evenly over the source pieces of the words it aligns to (A); the cost adds
//! −w · Σ A · log P over those pieces to the training loss (summed over tokens, as the
//! cross-entropy is).

use super::{piece_words, AlignPosition, AttentionSource};
use crate::data::batch::Example;
use crate::data::corpus::LineReader;
use crate::data::tokenizer::SubwordTokenizer;
use anyhow::{bail, Result};
use candle_core::{Device, Tensor};
use std::path::{Path, PathBuf};

/// The key under which a checkpoint's config records the supervised layer and head, so that
/// `translate --alignment` reads that head by default.
pub const CONFIG_KEY: &str = "nmt_guided_alignment";

/// A corpus's word alignments and how they supervise the model.
pub struct Guide {
    /// The alignment file.
    pub path: PathBuf,
    /// (source word, target word) links of each corpus line.
    links: Vec<Vec<(u16, u16)>>,
    /// The cost's weight.
    pub weight: f64,
    /// The supervised decoder layer (0-based).
    pub layer: usize,
    /// The supervised head; `None`: the mean of the layer's heads.
    pub head: Option<usize>,
    /// The decoder position each target piece's alignment is supervised at.
    pub position: AlignPosition,
}

impl Guide {
    /// Reads `path`, one line of links per line of the corpus `src`/`tgt`, checking that the
    /// files have as many lines and that every index names a word of its line.
    pub fn read(
        path: &Path,
        src: &Path,
        tgt: &Path,
        weight: f64,
        layer: usize,
        head: Option<usize>,
        position: AlignPosition,
    ) -> Result<Self> {
        if !(weight.is_finite() && weight > 0.0) {
            bail!("--guided-alignment-weight {weight}: must be a positive number");
        }
        let mut lines = LineReader::open(path)?;
        let (mut s, mut t) = (LineReader::open(src)?, LineReader::open(tgt)?);
        let mut links = Vec::new();
        loop {
            let (a, x, y) = (lines.next_line()?, s.next_line()?, t.next_line()?);
            let (Some(a), Some(x), Some(y)) = (&a, &x, &y) else {
                if a.is_some() || x.is_some() || y.is_some() {
                    let count = |r: &mut LineReader| -> Result<usize> {
                        while r.next_line()?.is_some() {}
                        Ok(r.line_no())
                    };
                    let (na, ns) = (count(&mut lines)?, count(&mut s)?);
                    bail!(
                        "{}: {na} lines of alignments for a corpus of {ns} lines ({}); they must align line by line",
                        path.display(),
                        src.display()
                    );
                }
                break;
            };
            let (ns, nt) = (x.split_whitespace().count(), y.split_whitespace().count());
            let at = || format!("{}:{}", path.display(), lines.line_no());
            let mut row = Vec::new();
            for pair in a.split_whitespace() {
                let parsed = pair
                    .split_once('-')
                    .and_then(|(i, j)| Some((i.parse::<u16>().ok()?, j.parse::<u16>().ok()?)));
                let Some((i, j)) = parsed else {
                    bail!("{}: {pair:?} is not a source-target pair such as 3-4", at());
                };
                if i as usize >= ns {
                    bail!("{}: {pair}: source word {i} is out of range (the source line has {ns} words)", at());
                }
                if j as usize >= nt {
                    bail!("{}: {pair}: target word {j} is out of range (the target line has {nt} words)", at());
                }
                row.push((i, j));
            }
            links.push(row);
        }
        Ok(Self {
            path: path.to_path_buf(),
            links,
            weight,
            layer,
            head,
            position,
        })
    }

    /// The supervision of a batch: A as a (B, T, S) tensor for the examples (sources padded
    /// to `s_width`, targets to `t_width`, `</s>` included in both) and the number of target
    /// pieces it covers.
    pub fn targets(
        &self,
        exs: &[Example],
        tok: &SubwordTokenizer,
        s_width: usize,
        t_width: usize,
        device: &Device,
    ) -> Result<(Tensor, usize)> {
        let mut a = vec![0f32; exs.len() * t_width * s_width];
        let mut rows = 0;
        for (b, e) in exs.iter().enumerate() {
            let Some(line) = e.origin.1 else {
                bail!(
                    "--guided-alignment: the prepared corpus keeps no line numbers (prepared by an older nmt); delete its folder under DIR/data so that it is prepared again"
                );
            };
            let Some(links) = self.links.get(line as usize) else {
                bail!(
                    "{}: no alignment for corpus line {} (it has {} lines)",
                    self.path.display(),
                    line + 1,
                    self.links.len()
                );
            };
            let (src, tgt) = (&e.src[..e.src.len() - 1], &e.tgt[..e.tgt.len() - 1]);
            let (ss, ts) = (tok.word_starts(src), tok.word_starts(tgt));
            let count = |v: &[bool]| v.iter().filter(|&&x| x).count().max(1);
            let (src_of, tgt_of) = (piece_words(&ss, count(&ss)), piece_words(&ts, count(&ts)));
            for (t, &tw) in tgt_of.iter().enumerate() {
                let words: Vec<usize> = links
                    .iter()
                    .filter(|(_, j)| *j as usize == tw)
                    .map(|(i, _)| *i as usize)
                    .collect();
                let pieces: Vec<usize> = (0..src.len())
                    .filter(|&p| words.contains(&src_of[p]))
                    .collect();
                if pieces.is_empty() {
                    continue;
                }
                rows += 1;
                let row = (b * t_width + self.position.row(t)) * s_width;
                for p in &pieces {
                    a[row + p] = 1.0 / pieces.len() as f32;
                }
            }
        }
        Ok((
            Tensor::from_vec(a, (exs.len(), t_width, s_width), device)?,
            rows,
        ))
    }
}

/// −Σ A · log P for attention probabilities `probs` (B, H, T, S) of which `head` is
/// supervised (`None`: their mean over the heads), and targets A (B, T, S).
pub fn cost(probs: &Tensor, head: Option<usize>, targets: &Tensor) -> Result<Tensor> {
    let p = match head {
        Some(h) => probs.narrow(1, h, 1)?.squeeze(1)?,
        None => probs.mean(1)?,
    };
    let log_p = (p + 1e-6)?.log()?;
    Ok((targets.to_dtype(log_p.dtype())? * log_p)?
        .sum_all()?
        .neg()?)
}

/// Where the config records the supervision: `{"layer": L, "head": H}`, H a head or `"avg"`
/// for the mean of the layer's heads, and `"position": "read"` when supervised there.
pub fn config_value(g: &Guide) -> serde_json::Value {
    let mut v = match g.head {
        Some(h) => serde_json::json!({ "layer": g.layer, "head": h }),
        None => serde_json::json!({ "layer": g.layer, "head": "avg" }),
    };
    if g.position != AlignPosition::Predict {
        v["position"] = serde_json::json!(g.position);
    }
    v
}

/// The attention a checkpoint's config records as supervised, if any.
pub fn recorded(extra: &serde_json::Map<String, serde_json::Value>) -> Option<AttentionSource> {
    let v = extra.get(CONFIG_KEY)?;
    let head = match &v["head"] {
        serde_json::Value::String(s) if s == "avg" => None,
        h => Some(h.as_u64()? as usize),
    };
    let position = match v.get("position") {
        Some(p) => serde_json::from_value(p.clone()).ok()?,
        None => AlignPosition::Predict,
    };
    Some(AttentionSource {
        layer: Some(v["layer"].as_u64()? as usize),
        head,
        position,
    })
}
