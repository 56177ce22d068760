//! An attention heatmap: a word alignment's weights drawn as a grid, source words across the
//! top, target words down the left, darker for more attention, with a colour scale.

use super::WordAlignment;
use crate::plot::font;
use anyhow::{anyhow, bail, Result};
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};
use std::path::Path;

/// White for 0, through light to dark blue for 1 (ColorBrewer's "Blues").
fn colour(w: f32) -> RGBColor {
    const STOPS: [(f32, [f32; 3]); 4] = [
        (0.0, [255.0, 255.0, 255.0]),
        (0.25, [198.0, 219.0, 239.0]),
        (0.6, [66.0, 146.0, 198.0]),
        (1.0, [8.0, 48.0, 107.0]),
    ];
    let w = w.clamp(0.0, 1.0);
    let i = STOPS
        .iter()
        .rposition(|(x, _)| *x <= w)
        .unwrap_or(0)
        .min(STOPS.len() - 2);
    let ((x0, c0), (x1, c1)) = (STOPS[i], STOPS[i + 1]);
    let f = (w - x0) / (x1 - x0);
    let mix = |k: usize| (c0[k] + (c1[k] - c0[k]) * f).round() as u8;
    RGBColor(mix(0), mix(1), mix(2))
}

/// The size in pixels of the heatmap of `a` (the file `draw` writes).
pub fn size(a: &WordAlignment) -> (u32, u32) {
    let l = layout(a);
    (l.width, l.height)
}

struct Layout {
    cell: u32,
    left: u32,
    top: u32,
    width: u32,
    height: u32,
}

/// Label space from the longest words (a rough 8 px per character at 15 px), cells of 20–40
/// px so that long sentences stay within about 1,200 px.
fn layout(a: &WordAlignment) -> Layout {
    let longest = |w: &[String]| w.iter().map(|s| s.chars().count()).max().unwrap_or(1) as u32;
    let n = a.source_words.len().max(a.target_words.len()).max(1) as u32;
    let cell = (1200 / n).clamp(20, 40);
    let (left, top) = (
        16 + 8 * longest(&a.target_words),
        16 + 8 * longest(&a.source_words),
    );
    let width = left + cell * a.source_words.len() as u32 + 90;
    let height = (top + cell * a.target_words.len() as u32 + 20).max(top + 180);
    Layout {
        cell,
        left,
        top,
        width,
        height,
    }
}

/// Draws `a` into the PNG `path` (via a temporary file and a rename).
pub fn draw(a: &WordAlignment, path: &Path) -> Result<()> {
    if font().is_none() {
        bail!(
            "cannot draw {}: no font found (set NMT_PLOT_FONT to a .ttf file)",
            path.display()
        );
    }
    let l = layout(a);
    let err = |e: DrawingAreaErrorKind<_>| anyhow!("{}: cannot draw: {e}", path.display());
    crate::io::write_atomic_with(path, |tmp| {
        let root = BitMapBackend::new(tmp, (l.width, l.height)).into_drawing_area();
        root.fill(&WHITE).map_err(err)?;
        let label = ("sans-serif", 15).into_font().color(&BLACK);
        let small = ("sans-serif", 12).into_font().color(&BLACK);
        let (cell, left, top) = (l.cell as i32, l.left as i32, l.top as i32);
        for (t, row) in a.weights.iter().enumerate() {
            let y = top + t as i32 * cell;
            for (s, &w) in row.iter().enumerate() {
                let x = left + s as i32 * cell;
                root.draw(&Rectangle::new(
                    [(x, y), (x + cell, y + cell)],
                    colour(w).filled(),
                ))
                .map_err(err)?;
                if cell >= 32 && w >= 0.1 {
                    let ink = if w > 0.5 { &WHITE } else { &BLACK };
                    let style = small
                        .clone()
                        .color(ink)
                        .pos(Pos::new(HPos::Center, VPos::Center));
                    root.draw_text(
                        &format!("{w:.2}").replacen("0.", ".", 1),
                        &style,
                        (x + cell / 2, y + cell / 2),
                    )
                    .map_err(err)?;
                }
            }
            let style = label.clone().pos(Pos::new(HPos::Right, VPos::Center));
            root.draw_text(&a.target_words[t], &style, (left - 6, y + cell / 2))
                .map_err(err)?;
        }
        // Source words read upwards above their columns.
        let vertical = ("sans-serif", 15)
            .into_font()
            .transform(FontTransform::Rotate270)
            .color(&BLACK)
            .pos(Pos::new(HPos::Left, VPos::Center));
        for (s, word) in a.source_words.iter().enumerate() {
            let x = left + s as i32 * cell + cell / 2;
            root.draw_text(word, &vertical, (x, top - 6)).map_err(err)?;
        }
        let grid = left + cell * a.source_words.len() as i32;
        let rows = cell * a.target_words.len() as i32;
        root.draw(&Rectangle::new(
            [(left, top), (grid, top + rows)],
            BLACK.stroke_width(1),
        ))
        .map_err(err)?;
        // The colour scale: 1 at the top, 0 at the bottom.
        let (bx, bh) = (grid + 24, 150);
        for i in 0..bh {
            let w = 1.0 - i as f32 / (bh - 1) as f32;
            root.draw(&Rectangle::new(
                [(bx, top + i), (bx + 16, top + i + 1)],
                colour(w).filled(),
            ))
            .map_err(err)?;
        }
        root.draw(&Rectangle::new(
            [(bx, top), (bx + 16, top + bh)],
            BLACK.stroke_width(1),
        ))
        .map_err(err)?;
        let scale = small.pos(Pos::new(HPos::Left, VPos::Center));
        for (v, y) in [("1", top), ("0.5", top + bh / 2), ("0", top + bh)] {
            root.draw_text(v, &scale, (bx + 22, y)).map_err(err)?;
        }
        root.present().map_err(err)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_colour_scale_runs_from_white_to_dark_blue() {
        assert_eq!(colour(0.0), RGBColor(255, 255, 255));
        assert_eq!(colour(1.0), RGBColor(8, 48, 107));
        let (a, b) = (colour(0.3), colour(0.7));
        assert!(a.0 > b.0 && a.1 > b.1);
    }
}
