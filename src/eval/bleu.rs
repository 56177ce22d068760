//! Corpus BLEU exactly as sacreBLEU 2.6 computes it: sufficient statistics per segment
//! (`[hyp_len, ref_len, correct₁..₄, total₁..₄]`), summed, then a pure scoring function.

use super::tokenizers::{py_rstrip, py_split, MetricTokenizer};
use serde::Serialize;
use std::collections::HashMap;

/// Highest n-gram order.
pub const MAX_ORDER: usize = 4;
/// Number of statistics per segment.
pub const N_STATS: usize = 2 + 2 * MAX_ORDER;

/// BLEU smoothing (Chen & Cherry 2014), as sacreBLEU names them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize)]
pub enum Smooth {
    /// NIST geometric smoothing (mteval-v13a): default.
    Exp,
    /// Zero precisions become `smooth_value / total` (default 0.1).
    Floor,
    /// Add `smooth_value` (default 1) to counts and totals of orders above 1.
    #[value(name = "add-k")]
    AddK,
    /// No smoothing.
    None,
}

impl Smooth {
    fn default_value(self) -> Option<f64> {
        match self {
            Smooth::Floor => Some(0.1),
            Smooth::AddK => Some(1.0),
            Smooth::Exp | Smooth::None => None,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Smooth::Exp => "exp",
            Smooth::Floor => "floor",
            Smooth::AddK => "add-k",
            Smooth::None => "none",
        }
    }
}

/// BLEU's settings.
#[derive(Debug, Clone)]
pub struct Bleu {
    /// Metric tokenizer.
    pub tokenizer: MetricTokenizer,
    /// Lowercase hypotheses and references first.
    pub lowercase: bool,
    /// Smoothing method.
    pub smooth: Smooth,
    /// Smoothing value for `floor` and `add-k`; `None` takes the method's default.
    pub smooth_value: Option<f64>,
    /// Leave out n-gram orders with no hypothesis n-grams (sentence BLEU).
    pub effective_order: bool,
}

impl Default for Bleu {
    fn default() -> Self {
        Self {
            tokenizer: MetricTokenizer::Tok13a,
            lowercase: false,
            smooth: Smooth::Exp,
            smooth_value: None,
            effective_order: false,
        }
    }
}

/// A BLEU score with everything sacreBLEU reports.
#[derive(Debug, Clone, Serialize)]
pub struct BleuScore {
    /// BLEU, 0..100 (serialized once, as the report's `score`, which it is flattened into).
    #[serde(skip)]
    pub score: f64,
    /// Matching n-grams per order (after add-k smoothing, as sacreBLEU reports them).
    pub counts: Vec<f64>,
    /// Hypothesis n-grams per order (likewise).
    pub totals: Vec<f64>,
    /// Precisions per order, 0..100.
    pub precisions: Vec<f64>,
    /// Brevity penalty.
    pub bp: f64,
    /// Hypothesis length in tokens.
    pub sys_len: u64,
    /// Closest reference length in tokens.
    pub ref_len: u64,
}

impl BleuScore {
    /// sacreBLEU's verbose part: `66.3/42.1/29.0/20.4 (BP = 0.981 ratio = 0.981 hyp_len = … ref_len = …)`.
    pub fn verbose(&self) -> String {
        let precisions: Vec<String> = self.precisions.iter().map(|p| format!("{p:.1}")).collect();
        let ratio = if self.ref_len > 0 {
            self.sys_len as f64 / self.ref_len as f64
        } else {
            0.0
        };
        format!(
            "{} (BP = {:.3} ratio = {:.3} hyp_len = {} ref_len = {})",
            precisions.join("/"),
            self.bp,
            ratio,
            self.sys_len,
            self.ref_len
        )
    }
}

fn ngrams<'a>(tokens: &'a [&'a str]) -> HashMap<&'a [&'a str], u64> {
    let mut counts = HashMap::with_capacity(tokens.len() * MAX_ORDER);
    for n in 1..=MAX_ORDER {
        for gram in tokens.windows(n) {
            *counts.entry(gram).or_insert(0) += 1;
        }
    }
    counts
}

impl Bleu {
    /// Lowercasing, trailing-space removal and tokenization, in sacreBLEU's order.
    pub fn preprocess(&self, line: &str) -> String {
        if self.lowercase {
            self.tokenizer.tokenize(py_rstrip(&line.to_lowercase()))
        } else {
            self.tokenizer.tokenize(py_rstrip(line))
        }
    }

    /// The statistics of one segment against one or more references.
    pub fn segment_stats(&self, hyp: &str, refs: &[&str]) -> Vec<u64> {
        let refs: Vec<String> = refs.iter().map(|r| self.preprocess(r)).collect();
        let ref_tokens: Vec<Vec<&str>> = refs.iter().map(|r| py_split(r).collect()).collect();
        let mut ref_ngrams: HashMap<&[&str], u64> = HashMap::new();
        for tokens in &ref_tokens {
            for (gram, count) in ngrams(tokens) {
                let c = ref_ngrams.entry(gram).or_insert(0);
                *c = (*c).max(count);
            }
        }
        let hyp = self.preprocess(hyp);
        let hyp_tokens: Vec<&str> = py_split(&hyp).collect();
        let hyp_len = hyp_tokens.len() as u64;
        // The closest reference length; ties go to the shorter reference.
        let mut closest: Option<(u64, u64)> = None;
        for tokens in &ref_tokens {
            let len = tokens.len() as u64;
            let diff = hyp_len.abs_diff(len);
            closest = match closest {
                Some((d, l)) if d < diff || (d == diff && l <= len) => Some((d, l)),
                _ => Some((diff, len)),
            };
        }
        let ref_len = closest.map_or(0, |(_, l)| l);
        let mut stats = vec![0u64; N_STATS];
        stats[0] = hyp_len;
        stats[1] = ref_len;
        for (gram, count) in ngrams(&hyp_tokens) {
            let n = gram.len() - 1;
            stats[2 + MAX_ORDER + n] += count;
            if let Some(&r) = ref_ngrams.get(gram) {
                stats[2 + n] += count.min(r);
            }
        }
        stats
    }

    /// BLEU from summed statistics (sacreBLEU's `compute_bleu`, operation for operation).
    pub fn score(&self, stats: &[f64]) -> BleuScore {
        let (sys_len, ref_len) = (stats[0], stats[1]);
        let mut correct = stats[2..2 + MAX_ORDER].to_vec();
        let mut total = stats[2 + MAX_ORDER..N_STATS].to_vec();
        let smooth_value = self
            .smooth_value
            .or(self.smooth.default_value())
            .unwrap_or(0.0);
        let bp = if sys_len < ref_len {
            if sys_len > 0.0 {
                (1.0 - ref_len / sys_len).exp()
            } else {
                0.0
            }
        } else {
            1.0
        };
        let mut precisions = vec![0.0; MAX_ORDER];
        let mut result = BleuScore {
            score: 0.0,
            counts: correct.clone(),
            totals: total.clone(),
            precisions: precisions.clone(),
            bp,
            sys_len: sys_len as u64,
            ref_len: ref_len as u64,
        };
        if correct.iter().all(|&c| c == 0.0) {
            return result;
        }
        let mut smooth_mteval = 1.0;
        let mut eff_order = MAX_ORDER;
        for n in 1..=MAX_ORDER {
            if self.smooth == Smooth::AddK && n > 1 {
                correct[n - 1] += smooth_value;
                total[n - 1] += smooth_value;
            }
            if total[n - 1] == 0.0 {
                break;
            }
            if self.effective_order {
                eff_order = n;
            }
            if correct[n - 1] == 0.0 {
                match self.smooth {
                    Smooth::Exp => {
                        smooth_mteval *= 2.0;
                        precisions[n - 1] = 100.0 / (smooth_mteval * total[n - 1]);
                    }
                    Smooth::Floor => precisions[n - 1] = 100.0 * smooth_value / total[n - 1],
                    Smooth::AddK | Smooth::None => {}
                }
            } else {
                precisions[n - 1] = 100.0 * correct[n - 1] / total[n - 1];
            }
        }
        let log_sum: f64 = precisions[..eff_order]
            .iter()
            .map(|&p| if p == 0.0 { -9999999999.0 } else { p.ln() })
            .sum();
        result.score = bp * (log_sum / eff_order as f64).exp();
        result.counts = correct;
        result.totals = total;
        result.precisions = precisions;
        result
    }

    /// The settings part of the signature: `case:…|eff:…|tok:…|smooth:…`.
    pub fn signature_fields(&self) -> Vec<(&'static str, String)> {
        let mut smooth = self.smooth.name().to_string();
        if let Some(default) = self.smooth.default_value() {
            smooth += &format!("[{:.2}]", self.smooth_value.unwrap_or(default));
        }
        vec![
            ("case", if self.lowercase { "lc" } else { "mixed" }.into()),
            (
                "eff",
                if self.effective_order { "yes" } else { "no" }.into(),
            ),
            ("tok", self.tokenizer.signature().into()),
            ("smooth", smooth),
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn corpus(bleu: &Bleu, hyps: &[&str], refs: &[&str]) -> BleuScore {
        let mut sum = vec![0.0; N_STATS];
        for (h, r) in hyps.iter().zip(refs) {
            for (s, v) in sum.iter_mut().zip(bleu.segment_stats(h, &[r])) {
                *s += v as f64;
            }
        }
        bleu.score(&sum)
    }

    #[test]
    fn identical_text_scores_100_and_disjoint_text_0() {
        let b = Bleu::default();
        let s = corpus(
            &b,
            &["the cat sat on the mat ."],
            &["the cat sat on the mat ."],
        );
        assert!((s.score - 100.0).abs() < 1e-9, "{s:?}");
        let s = corpus(&b, &["a b c d"], &["e f g h"]);
        assert_eq!(s.score, 0.0);
    }

    #[test]
    fn brevity_penalty_and_verbose_line() {
        let b = Bleu::default();
        let s = corpus(&b, &["the cat sat on"], &["the cat sat on the mat"]);
        assert!((s.bp - (1.0f64 - 6.0 / 4.0).exp()).abs() < 1e-12);
        assert_eq!(
            s.verbose(),
            "100.0/100.0/100.0/100.0 (BP = 0.607 ratio = 0.667 hyp_len = 4 ref_len = 6)"
        );
    }
}
