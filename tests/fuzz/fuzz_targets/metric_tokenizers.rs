//! sacreBLEU's metric tokenizers and the BLEU/chrF statistics on arbitrary text: no panics,
//! and tokenizing is idempotent where sacreBLEU's is (13a and intl output re-tokenizes to
//! itself up to spacing; char and none are checked for never losing non-space characters).
#![no_main]
use libfuzzer_sys::fuzz_target;
use nmt::eval::bleu::Bleu;
use nmt::eval::chrf::Chrf;
use nmt::eval::tokenizers::MetricTokenizer;

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    let (hyp, reference) = text.split_at(
        text.char_indices()
            .nth(text.chars().count() / 2)
            .map_or(0, |(i, _)| i),
    );
    for tok in [
        MetricTokenizer::Tok13a,
        MetricTokenizer::Intl,
        MetricTokenizer::Zh,
        MetricTokenizer::Char,
        MetricTokenizer::None,
    ] {
        let out = tok.tokenize(&text);
        let kept = |s: &str| s.chars().filter(|c| !c.is_whitespace()).count();
        if matches!(tok, MetricTokenizer::Char | MetricTokenizer::None) {
            assert_eq!(kept(&out), kept(&text));
        }
        let bleu = Bleu {
            tokenizer: tok,
            ..Bleu::default()
        };
        let stats = bleu.segment_stats(hyp, &[reference]);
        let score = bleu.score(&stats.iter().map(|&x| x as f64).collect::<Vec<_>>());
        // sacreBLEU itself can exceed 100 by a rounding error (100.00000000000004).
        assert!(score.score.is_finite() && (0.0..=100.0 + 1e-9).contains(&score.score));
    }
    for word_order in [0, 2] {
        let chrf = Chrf {
            word_order,
            ..Chrf::default()
        };
        let stats = chrf.segment_stats(hyp, &[reference]);
        let score = chrf.score(&stats.iter().map(|&x| x as f64).collect::<Vec<_>>());
        assert!(
            score.is_finite() && (0.0..=100.0 + 1e-9).contains(&score),
            "{score}"
        );
    }
});
