//! The learning curve: training loss, validation loss and validation BLEU against the step,
//! drawn from metrics.jsonl into a PNG after each validation.

use crate::plot::font;
use anyhow::{anyhow, Context, Result};
use plotters::prelude::*;
use std::path::Path;

struct Series {
    loss: Vec<(f64, f64)>,
    val_loss: Vec<(f64, f64)>,
    val_bleu: Vec<(f64, f64)>,
}

fn read(metrics: &Path) -> Result<Series> {
    let text = std::fs::read_to_string(metrics)
        .with_context(|| format!("{}: cannot read", metrics.display()))?;
    let mut s = Series {
        loss: Vec::new(),
        val_loss: Vec::new(),
        val_bleu: Vec::new(),
    };
    for v in text
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
    {
        let Some(step) = v["step"].as_f64() else {
            continue;
        };
        let push = |key: &str, to: &mut Vec<(f64, f64)>| {
            if let Some(y) = v[key].as_f64().filter(|y| y.is_finite()) {
                to.push((step, y));
            }
        };
        push("loss", &mut s.loss);
        push("val_loss", &mut s.val_loss);
        push("val_bleu", &mut s.val_bleu);
    }
    Ok(s)
}

fn range(points: &[&[(f64, f64)]], f: impl Fn(&(f64, f64)) -> f64) -> (f64, f64) {
    let all = points.iter().flat_map(|p| p.iter()).map(f);
    let (lo, hi) = all.fold((f64::MAX, f64::MIN), |(a, b), v| (a.min(v), b.max(v)));
    if lo > hi {
        (0.0, 1.0)
    } else if hi - lo < 1e-9 {
        (lo - 0.5, hi + 0.5)
    } else {
        (lo, hi)
    }
}

/// Draws metrics.jsonl into `png` (written via a temporary file and a rename). Returns
/// `Ok(false)` when no font is available on this system, so no plot can be labelled.
pub fn learning_curve(metrics: &Path, png: &Path) -> Result<bool> {
    if font().is_none() {
        return Ok(false);
    }
    let s = read(metrics)?;
    crate::io::write_atomic_with(png, |tmp| {
        let root = BitMapBackend::new(tmp, (1000, 420)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| anyhow!("plot: {e}"))?;
        let (left, right) = root.split_horizontally(500);
        let (x0, x1) = range(&[&s.loss, &s.val_loss, &s.val_bleu], |p| p.0);
        let (y0, y1) = range(&[&s.loss, &s.val_loss], |p| p.1);
        let mut chart = ChartBuilder::on(&left)
            .caption("loss", ("sans-serif", 20))
            .margin(10)
            .x_label_area_size(30)
            .y_label_area_size(45)
            .build_cartesian_2d(x0..x1, y0.min(0.0)..y1 * 1.05)
            .map_err(|e| anyhow!("plot: {e}"))?;
        chart
            .configure_mesh()
            .x_desc("step")
            .draw()
            .map_err(|e| anyhow!("plot: {e}"))?;
        chart
            .draw_series(LineSeries::new(s.loss.iter().copied(), &BLUE))
            .map_err(|e| anyhow!("plot: {e}"))?
            .label("train (label-smoothed)")
            .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 15, y)], BLUE));
        chart
            .draw_series(LineSeries::new(s.val_loss.iter().copied(), &RED))
            .map_err(|e| anyhow!("plot: {e}"))?
            .label("validation")
            .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 15, y)], RED));
        chart
            .configure_series_labels()
            .border_style(BLACK)
            .background_style(WHITE)
            .draw()
            .map_err(|e| anyhow!("plot: {e}"))?;
        let (_, b1) = range(&[&s.val_bleu], |p| p.1);
        let mut chart = ChartBuilder::on(&right)
            .caption("validation BLEU (greedy)", ("sans-serif", 20))
            .margin(10)
            .x_label_area_size(30)
            .y_label_area_size(45)
            .build_cartesian_2d(x0..x1, 0.0..(b1 * 1.1).max(1.0))
            .map_err(|e| anyhow!("plot: {e}"))?;
        chart
            .configure_mesh()
            .x_desc("step")
            .draw()
            .map_err(|e| anyhow!("plot: {e}"))?;
        chart
            .draw_series(LineSeries::new(s.val_bleu.iter().copied(), &GREEN).point_size(3))
            .map_err(|e| anyhow!("plot: {e}"))?;
        root.present().map_err(|e| anyhow!("plot: {e}"))
    })?;
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn draws_a_png_from_metrics() {
        let dir = tempfile::tempdir().unwrap();
        let m = dir.path().join("metrics.jsonl");
        std::fs::write(&m, "{\"step\":1,\"loss\":9.0}\n{\"step\":2,\"loss\":7.5}\n{\"step\":2,\"val_loss\":7.0,\"val_bleu\":3.5}\n{\"step\":3,\"lo").unwrap();
        let png = dir.path().join("curve.png");
        if !learning_curve(&m, &png).unwrap() {
            eprintln!("skipped: no font on this system");
            return;
        }
        assert_eq!(&std::fs::read(&png).unwrap()[..4], b"\x89PNG");
    }
}
