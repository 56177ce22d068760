//! Validation during training: the loss on the validation pairs and the BLEU of their greedy
//! translations, made through the same path as `nmt translate` and scored as `nmt eval` does.

use super::data::Valid;
use super::Trainer;
use crate::data::batch::Batch;
use crate::eval::{bleu::Bleu, Metric};
use crate::model::Dropout;
use crate::translate::SearchOptions;
use anyhow::Result;
use candle_core::DType;

/// Validation results.
pub(super) struct Validation {
    /// Mean negative log-likelihood per target token.
    pub loss: f64,
    /// Corpus BLEU of greedy translations.
    pub bleu: f64,
}

impl Trainer<'_> {
    /// The validation pass: the loss per target token (teacher forcing, no dropout or label
    /// smoothing) and the BLEU of greedy translations made through `nmt translate`'s path.
    pub(super) fn validate(&self, valid: &Valid) -> Result<Validation> {
        let drop = Dropout::off();
        let (mut nll, mut n) = (0f64, 0usize);
        let plan = valid.mixture.plan(
            self.cfg.max_positions,
            self.cfg.max_tokens,
            self.cfg.seed,
            1,
        )?;
        for k in 0..plan.len() {
            let b = Batch::new(
                &valid.mixture.examples(plan.batch(k), self.tok.eos_id),
                self.tok.pad_id,
                self.model_config.decoder_start_token_id,
                self.model.device(),
            )?;
            nll += self
                .batch_loss(&b, &drop)?
                .1
                .to_dtype(DType::F32)?
                .to_scalar::<f32>()? as f64;
            n += b.n_tokens;
        }
        // Greedy, through the path `nmt translate` takes.
        let mut truncated = Vec::new();
        let sources =
            crate::translate::encode_sources(&self.model, &self.tok, &valid.sources, |i, _, _| {
                truncated.push(i + 1)
            })?;
        if let Some(first) = truncated.first() {
            if !self.truncation_said.replace(true) {
                eprintln!(
                    "validation: source line {first} ({} in all) is longer than the model's {} positions and is truncated, as `nmt translate` does",
                    truncated.len(),
                    self.model_config.max_position_embeddings
                );
            }
        }
        let hyps: Vec<String> = crate::translate::translate_sources(
            &self.model,
            &self.tok,
            &sources,
            &SearchOptions::default(),
        )?
        .into_iter()
        .map(|t| t.text().to_string())
        .collect();
        let metric = Metric::Bleu(Bleu::default());
        let stats = metric.corpus_stats(&hyps, &valid.refs);
        Ok(Validation {
            loss: nll / n.max(1) as f64,
            bleu: metric.report(&stats, 1, None).score,
        })
    }
}
