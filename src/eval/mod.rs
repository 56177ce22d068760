//! Evaluation metrics identical to sacreBLEU 2.6: BLEU and chrF(++) as sufficient statistics
//! plus pure scoring functions, reproducibility signatures, bootstrap confidence intervals and
//! paired bootstrap resampling. Text in, numbers out: no file or model handling here.

pub mod bleu;
pub mod chrf;
pub mod tokenizers;

use crate::rng::Rng;
use bleu::{Bleu, BleuScore};
use chrf::Chrf;
use rayon::prelude::*;
use serde::Serialize;

/// The version written into signatures.
pub const SIGNATURE_VERSION: &str = concat!("nmt-", env!("CARGO_PKG_VERSION"));

/// A corpus metric.
#[derive(Debug, Clone)]
pub enum Metric {
    /// BLEU.
    Bleu(Bleu),
    /// chrF or chrF++.
    Chrf(Chrf),
}

/// Bootstrap resampling settings (sacreBLEU: 1,000 resamples, seed 12345).
#[derive(Debug, Clone, Copy)]
pub struct Bootstrap {
    /// Number of resamples.
    pub samples: usize,
    /// RNG seed.
    pub seed: u64,
}

/// Mean and half-width of a 95 % bootstrap interval.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Confidence {
    /// Mean of the resampled scores.
    pub mean: f64,
    /// Half the distance between the 2.5th and 97.5th percentiles.
    pub ci: f64,
}

/// One metric's result on a corpus.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// `BLEU`, `chrF2` or `chrF2++`.
    pub name: String,
    /// The score, 0..100.
    pub score: f64,
    /// The reproducibility signature.
    pub signature: String,
    /// BLEU's statistics, when the metric is BLEU.
    #[serde(flatten, skip_serializing_if = "Option::is_none")]
    pub bleu: Option<BleuScore>,
    /// Bootstrap interval, when asked for.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub confidence: Option<Confidence>,
}

impl Metric {
    /// The metric's display name.
    pub fn name(&self) -> String {
        match self {
            Metric::Bleu(_) => "BLEU".into(),
            Metric::Chrf(c) => c.name(),
        }
    }

    /// Statistics of one segment against its references.
    pub fn segment_stats(&self, hyp: &str, refs: &[&str]) -> Vec<u64> {
        match self {
            Metric::Bleu(b) => b.segment_stats(hyp, refs),
            Metric::Chrf(c) => c.segment_stats(hyp, refs),
        }
    }

    /// Statistics of every segment; `refs[k][i]` is reference `k` of segment `i`.
    pub fn corpus_stats(&self, hyps: &[String], refs: &[Vec<String>]) -> Vec<Vec<u64>> {
        hyps.par_iter()
            .enumerate()
            .map(|(i, h)| {
                let r: Vec<&str> = refs.iter().map(|r| r[i].as_str()).collect();
                self.segment_stats(h, &r)
            })
            .collect()
    }

    /// The score from summed statistics.
    pub fn score(&self, stats: &[f64]) -> f64 {
        match self {
            Metric::Bleu(b) => b.score(stats).score,
            Metric::Chrf(c) => c.score(stats),
        }
    }

    /// sacreBLEU's signature, e.g. `nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:…`.
    pub fn signature(&self, nrefs: usize, bootstrap: Option<Bootstrap>) -> String {
        let mut fields = vec![("nrefs", nrefs.to_string())];
        if let Some(b) = bootstrap {
            fields.push(("bs", b.samples.to_string()));
            fields.push(("seed", b.seed.to_string()));
        }
        fields.extend(match self {
            Metric::Bleu(b) => b.signature_fields(),
            Metric::Chrf(c) => c.signature_fields(),
        });
        fields.push(("version", SIGNATURE_VERSION.into()));
        fields
            .iter()
            .map(|(k, v)| format!("{k}:{v}"))
            .collect::<Vec<_>>()
            .join("|")
    }

    /// Scores a whole corpus, with a bootstrap interval when asked.
    pub fn report(&self, stats: &[Vec<u64>], nrefs: usize, bootstrap: Option<Bootstrap>) -> Report {
        let total = sum_stats(stats, 0..stats.len());
        let (score, bleu) = match self {
            Metric::Bleu(b) => {
                let s = b.score(&total);
                (s.score, Some(s))
            }
            Metric::Chrf(c) => (c.score(&total), None),
        };
        let confidence = bootstrap.map(|b| {
            let scores = self.resample(stats, &resample_indices(stats.len(), b));
            estimate_ci(&scores)
        });
        Report {
            name: self.name(),
            score,
            signature: self.signature(nrefs, bootstrap),
            bleu,
            confidence,
        }
    }

    fn resample(&self, stats: &[Vec<u64>], indices: &[Vec<usize>]) -> Vec<f64> {
        indices
            .par_iter()
            .map(|idx| self.score(&sum_stats(stats, idx.iter().copied())))
            .collect()
    }
}

/// Element-wise sum of the statistics of the segments `idx`.
pub fn sum_stats(stats: &[Vec<u64>], idx: impl IntoIterator<Item = usize>) -> Vec<f64> {
    let width = stats.first().map_or(bleu::N_STATS, Vec::len);
    let mut total = vec![0u64; width];
    for i in idx {
        for (t, v) in total.iter_mut().zip(&stats[i]) {
            *t += v;
        }
    }
    total.into_iter().map(|v| v as f64).collect()
}

fn resample_indices(n: usize, b: Bootstrap) -> Vec<Vec<usize>> {
    let mut rng = Rng::new(b.seed);
    (0..b.samples)
        .map(|_| (0..n).map(|_| rng.below(n)).collect())
        .collect()
}

/// sacreBLEU's `estimate_ci`: mean, and half the spread between the 2.5 % and 97.5 % points.
pub fn estimate_ci(scores: &[f64]) -> Confidence {
    let mut sorted = scores.to_vec();
    sorted.sort_by(f64::total_cmp);
    let n = sorted.len();
    let lower = n / 40;
    let upper = n - lower - 1;
    Confidence {
        mean: sorted.iter().sum::<f64>() / n as f64,
        ci: 0.5 * (sorted[upper] - sorted[lower]),
    }
}

/// The result of a paired bootstrap test of a system against a baseline.
#[derive(Debug, Clone, Serialize)]
pub struct PairedResult {
    /// Metric name.
    pub name: String,
    /// Baseline score and its bootstrap interval.
    pub baseline: f64,
    /// Baseline bootstrap interval.
    pub baseline_confidence: Confidence,
    /// System score.
    pub system: f64,
    /// System bootstrap interval.
    pub system_confidence: Confidence,
    /// Probability of a difference at least this large arising by chance.
    pub p_value: f64,
}

/// Paired bootstrap resampling (Koehn 2004) as sacreBLEU's `--paired-bs` does it: the same
/// resampled segment sets for both systems; p = (c + 1) / (n + 1) where c counts resamples whose
/// centred absolute difference exceeds the observed one.
pub fn paired_bootstrap(
    metric: &Metric,
    baseline: &[Vec<u64>],
    system: &[Vec<u64>],
    b: Bootstrap,
) -> PairedResult {
    let indices = resample_indices(baseline.len(), b);
    let bl_score = metric.score(&sum_stats(baseline, 0..baseline.len()));
    let sys_score = metric.score(&sum_stats(system, 0..system.len()));
    let bl = metric.resample(baseline, &indices);
    let sys = metric.resample(system, &indices);
    let diff = (bl_score - sys_score).abs();
    let sample_diffs: Vec<f64> = sys.iter().zip(&bl).map(|(s, b)| (s - b).abs()).collect();
    let mean = sample_diffs.iter().sum::<f64>() / sample_diffs.len() as f64;
    let c = sample_diffs.iter().filter(|&&d| d - mean > diff).count();
    PairedResult {
        name: metric.name(),
        baseline: bl_score,
        baseline_confidence: estimate_ci(&bl),
        system: sys_score,
        system_confidence: estimate_ci(&sys),
        p_value: (c + 1) as f64 / (sample_diffs.len() + 1) as f64,
    }
}

impl Report {
    /// One line in sacreBLEU's style, signature last:
    /// `BLEU = 35.12 66.3/42.1/29.0/20.4 (BP = … ref_len = …) nrefs:1|…`.
    pub fn format(&self, width: usize) -> String {
        let mut line = format!("{} = {:.width$}", self.name, self.score);
        if let Some(c) = self.confidence {
            line += &format!(" (μ = {:.width$} ± {:.width$})", c.mean, c.ci);
        }
        if let Some(b) = &self.bleu {
            line += &format!(" {}", b.verbose());
        }
        line + " " + &self.signature
    }
}
