//! What nmt's drawings (the learning curve, attention heatmaps) share: a font for plotters,
//! which draws text with ab_glyph from a font file of the system.

use plotters::style::FontStyle;
use std::sync::OnceLock;

/// Font files tried, in order, for the plot's text (plotters draws text with ab_glyph).
const FONTS: &[&str] = &[
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf",
    "/Library/Fonts/Arial.ttf",
    "C:\\Windows\\Fonts\\arial.ttf",
];

/// Registers a system font (or `$NMT_PLOT_FONT`) once as "sans-serif"; `None` when no font
/// could be found.
pub fn font() -> Option<()> {
    static FONT: OnceLock<Option<()>> = OnceLock::new();
    *FONT.get_or_init(|| {
        let custom = std::env::var("NMT_PLOT_FONT").ok();
        let bytes = custom
            .iter()
            .map(String::as_str)
            .chain(FONTS.iter().copied())
            .find_map(|p| std::fs::read(p).ok())?;
        plotters::style::register_font(
            "sans-serif",
            FontStyle::Normal,
            Box::leak(bytes.into_boxed_slice()),
        )
        .ok()
    })
}
