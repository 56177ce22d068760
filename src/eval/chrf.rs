//! chrF and chrF++ exactly as sacreBLEU 2.6 computes them: character n-grams (1..=6) and
//! optionally word n-grams, best reference per segment by F-score, corpus statistics summed.

use super::tokenizers::py_split;
use std::borrow::Cow;
use std::collections::HashMap;

const PUNCTS: &str = "!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~";

/// chrF's settings.
#[derive(Debug, Clone)]
pub struct Chrf {
    /// Character n-gram order (6).
    pub char_order: usize,
    /// Word n-gram order: 0 for chrF, 2 for chrF++.
    pub word_order: usize,
    /// Recall weight β (2).
    pub beta: u32,
    /// Lowercase first.
    pub lowercase: bool,
    /// Keep whitespace inside character n-grams.
    pub whitespace: bool,
    /// chrF++.py's epsilon smoothing instead of effective order.
    pub eps_smoothing: bool,
}

impl Default for Chrf {
    fn default() -> Self {
        Self {
            char_order: 6,
            word_order: 0,
            beta: 2,
            lowercase: false,
            whitespace: false,
            eps_smoothing: false,
        }
    }
}

/// Character n-gram counts of `line` (already stripped of whitespace unless it counts),
/// keyed by slices of it.
fn char_ngrams(line: &str, max_order: usize) -> Vec<HashMap<Cow<'_, str>, u64>> {
    let bounds: Vec<usize> = line
        .char_indices()
        .map(|(i, _)| i)
        .chain([line.len()])
        .collect();
    let n_chars = bounds.len() - 1;
    (1..=max_order)
        .map(|n| {
            let mut counts = HashMap::new();
            for i in 0..(n_chars + 1).saturating_sub(n) {
                *counts
                    .entry(Cow::Borrowed(&line[bounds[i]..bounds[i + n]]))
                    .or_insert(0) += 1;
            }
            counts
        })
        .collect()
}

/// A segment prepared for n-gram counting: the character stream and the word list.
struct Prepared {
    chars: String,
    words: Vec<String>,
}

impl Chrf {
    /// The metric's name: `chrF2` or `chrF2++`.
    pub fn name(&self) -> String {
        format!("chrF{}{}", self.beta, "+".repeat(self.word_order))
    }

    fn remove_punctuation(sent: &str) -> Vec<String> {
        let mut out = Vec::new();
        for w in py_split(sent) {
            let mut chars = w.chars();
            let first = chars.next().unwrap();
            let last = w.chars().next_back().unwrap();
            if w.chars().count() == 1 {
                out.push(w.to_string());
            } else if PUNCTS.contains(last) {
                out.push(w[..w.len() - last.len_utf8()].to_string());
                out.push(last.to_string());
            } else if PUNCTS.contains(first) {
                out.push(first.to_string());
                out.push(chars.as_str().to_string());
            } else {
                out.push(w.to_string());
            }
        }
        out
    }

    fn prepare(&self, line: &str) -> Prepared {
        let lowered;
        let line = if self.lowercase {
            lowered = line.to_lowercase();
            lowered.as_str()
        } else {
            line
        };
        Prepared {
            chars: if self.whitespace {
                line.to_string()
            } else {
                py_split(line).collect()
            },
            words: if self.word_order > 0 {
                Self::remove_punctuation(line)
            } else {
                Vec::new()
            },
        }
    }

    fn all_ngrams<'a>(&self, p: &'a Prepared) -> Vec<HashMap<Cow<'a, str>, u64>> {
        let mut all = char_ngrams(&p.chars, self.char_order);
        for n in 1..=self.word_order {
            let mut counts = HashMap::new();
            for gram in p.words.windows(n) {
                let key = if n == 1 {
                    Cow::Borrowed(gram[0].as_str())
                } else {
                    Cow::Owned(gram.join(" "))
                };
                *counts.entry(key).or_insert(0) += 1;
            }
            all.push(counts);
        }
        all
    }

    /// `[hyp, ref, match]` counts for each order, against the best-scoring reference.
    pub fn segment_stats(&self, hyp: &str, refs: &[&str]) -> Vec<u64> {
        let hyp = self.prepare(hyp);
        let hyp_ngrams = self.all_ngrams(&hyp);
        let mut best: Vec<u64> = Vec::new();
        let mut best_f = -1.0;
        for r in refs {
            let r = self.prepare(r);
            let ref_ngrams = self.all_ngrams(&r);
            let mut stats = Vec::with_capacity(3 * hyp_ngrams.len());
            for (h, r) in hyp_ngrams.iter().zip(&ref_ngrams) {
                let mut matches = 0;
                let mut hyp_count = 0;
                for (gram, &count) in h {
                    hyp_count += count;
                    if let Some(&rc) = r.get(gram) {
                        matches += count.min(rc);
                    }
                }
                stats.push(if r.is_empty() { 0 } else { hyp_count });
                stats.push(r.values().sum());
                stats.push(matches);
            }
            let as_f: Vec<f64> = stats.iter().map(|&v| v as f64).collect();
            let f = self.score(&as_f);
            if f > best_f {
                best_f = f;
                best = stats;
            }
        }
        best
    }

    /// chrF from summed statistics (sacreBLEU's `_compute_f_score`, operation for operation).
    pub fn score(&self, stats: &[f64]) -> f64 {
        let eps = 1e-16;
        let order = self.char_order + self.word_order;
        let factor = (self.beta * self.beta) as f64;
        let mut score = 0.0;
        let mut effective_order = 0;
        let (mut avg_prec, mut avg_rec) = (0.0, 0.0);
        for i in 0..order {
            let (n_hyp, n_ref, n_match) = (stats[3 * i], stats[3 * i + 1], stats[3 * i + 2]);
            let prec = if n_hyp > 0.0 { n_match / n_hyp } else { eps };
            let rec = if n_ref > 0.0 { n_match / n_ref } else { eps };
            let denom = factor * prec + rec;
            score += if denom > 0.0 {
                (1.0 + factor) * prec * rec / denom
            } else {
                eps
            };
            if n_hyp > 0.0 && n_ref > 0.0 {
                avg_prec += prec;
                avg_rec += rec;
                effective_order += 1;
            }
        }
        if self.eps_smoothing {
            return 100.0 * score / order as f64;
        }
        if effective_order == 0 {
            avg_prec = 0.0;
            avg_rec = 0.0;
        } else {
            avg_prec /= effective_order as f64;
            avg_rec /= effective_order as f64;
        }
        if avg_prec + avg_rec != 0.0 {
            let mut s = (1.0 + factor) * avg_prec * avg_rec;
            s /= (factor * avg_prec) + avg_rec;
            100.0 * s
        } else {
            0.0
        }
    }

    /// The settings part of the signature: `case:…|eff:…|nc:…|nw:…|space:…`.
    pub fn signature_fields(&self) -> Vec<(&'static str, String)> {
        vec![
            ("case", if self.lowercase { "lc" } else { "mixed" }.into()),
            ("eff", if self.eps_smoothing { "no" } else { "yes" }.into()),
            ("nc", self.char_order.to_string()),
            ("nw", self.word_order.to_string()),
            ("space", if self.whitespace { "yes" } else { "no" }.into()),
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identical_is_100_and_punctuation_is_split_for_words() {
        let c = Chrf {
            word_order: 2,
            ..Chrf::default()
        };
        let stats: Vec<f64> = c
            .segment_stats("Hello, world!", &["Hello, world!"])
            .into_iter()
            .map(|v| v as f64)
            .collect();
        assert!((c.score(&stats) - 100.0).abs() < 1e-9);
        assert_eq!(
            Chrf::remove_punctuation("Hello, (world) x!"),
            ["Hello", ",", "(world", ")", "x", "!"]
        );
    }
}
