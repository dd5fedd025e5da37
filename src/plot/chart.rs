//! Figure descriptions and their rendering to PNG and SVG with plotters.
//!
//! A [`Figure`] is plain data (panels of layers); [`render_png`] and [`render_svg`] draw the
//! same description on the two backends, so both files always show the same picture. Text
//! goes through plotters' `ab_glyph` with DejaVu Sans embedded in the binary: no
//! system fonts, the same pixels on every machine.

use std::sync::OnceLock;

use plotters::chart::SeriesAnno;
use plotters::coord::types::RangedCoordf64;
use plotters::coord::Shift;
use plotters::element::{DashedPathElement, PathElement};
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};
use plotters::style::{FontStyle, RGBColor};

/// The embedded font (DejaVu Sans, Bitstream Vera licence: assets/fonts/LICENSE-DejaVu.txt).
static FONT: &[u8] = include_bytes!("../../assets/fonts/DejaVuSans.ttf");

/// The family every text element names. The SVG keeps it as a CSS font list, so a viewer
/// without DejaVu Sans falls back to its own sans-serif.
pub const FAMILY: &str = "DejaVu Sans, sans-serif";

/// Reference width: font sizes and strokes are given for 1200 px (8 in at 150 dpi).
pub const BASE_WIDTH: u32 = 1200;

/// Registers the embedded font once per process (under our family and plotters' default).
pub fn register_fonts() -> Result<(), String> {
    static DONE: OnceLock<Result<(), String>> = OnceLock::new();
    DONE.get_or_init(|| {
        for name in [FAMILY, "sans-serif"] {
            plotters::style::register_font(name, FontStyle::Normal, FONT)
                .map_err(|_| "the embedded font DejaVuSans.ttf is not a valid font".to_string())?;
        }
        Ok(())
    })
    .clone()
}

/// Okabe–Ito colours, ordered so that the first few are the most distinct on white (yellow,
/// hard to see on white, and black come last).
pub const OKABE_ITO: [RGBColor; 8] = [
    RGBColor(0, 114, 178),   // blue
    RGBColor(230, 159, 0),   // orange
    RGBColor(0, 158, 115),   // bluish green
    RGBColor(213, 94, 0),    // vermillion
    RGBColor(204, 121, 167), // reddish purple
    RGBColor(86, 180, 233),  // sky blue
    RGBColor(0, 0, 0),       // black
    RGBColor(240, 228, 66),  // yellow
];

/// A marker drawn at each point of a [`Shape::Markers`] layer.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Marker {
    Circle { filled: bool },
    Triangle,
}

/// One thing drawn in an x/y panel.
#[derive(Clone, Debug)]
pub enum Shape {
    /// A polyline; `faint` draws it light (the raw curve behind a smoothed one).
    Line {
        points: Vec<(f64, f64)>,
        dashed: bool,
        faint: bool,
        markers: bool,
    },
    /// The area under a polyline down to y = 0, lightly filled.
    Area { points: Vec<(f64, f64)> },
    Markers {
        points: Vec<(f64, f64)>,
        marker: Marker,
    },
    /// (x, y, half-height) vertical error bars.
    ErrorBars { points: Vec<(f64, f64, f64)> },
    /// A dashed vertical line across the panel.
    VLine { x: f64 },
    /// Text at a data point (left-aligned, slightly to the right of it).
    Label { x: f64, y: f64, text: String },
}

#[derive(Clone, Debug)]
pub struct Layer {
    /// Legend entry; `None` draws without one.
    pub label: Option<String>,
    pub color: RGBColor,
    pub shape: Shape,
}

/// Bars of several groups (models/runs) at each category, with optional error bars.
#[derive(Clone, Debug)]
pub struct Bars {
    pub categories: Vec<String>,
    pub groups: Vec<BarGroup>,
    /// Groups side by side within a category; `false`: every bar takes the whole slot (each
    /// group then has values at its own categories only, e.g. one bar per model).
    pub dodge: bool,
}

#[derive(Clone, Debug)]
pub struct BarGroup {
    pub label: String,
    pub color: RGBColor,
    /// One per category: (height, standard error); `None` = no bar.
    pub values: Vec<Option<(f64, f64)>>,
}

#[derive(Clone, Debug)]
pub enum PanelKind {
    Xy(Vec<Layer>),
    Bars(Bars),
    /// No axes, a sentence in their place (e.g. "0 for every model": an empty chart would
    /// read as missing data).
    Note(String),
}

#[derive(Clone, Debug)]
pub struct Panel {
    pub title: Option<String>,
    pub x_label: String,
    pub y_label: String,
    pub kind: PanelKind,
    /// The y axis includes 0 (counts, rates).
    pub y_from_zero: bool,
    /// Draw the legend in this panel.
    pub legend: bool,
    /// Where the legend goes (inside the plotting area).
    pub legend_at: LegendAt,
    /// A categorical y axis: these names, top to bottom, at y = k, …, 1 (forest plots).
    /// Empty: a numeric axis.
    pub y_categories: Vec<String>,
    /// A fixed x range (e.g. [0, 1] for rates) that the data widens only if it must.
    pub x_range: Option<(f64, f64)>,
}

/// Legend corner, chosen per figure where the data usually is not.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum LegendAt {
    #[default]
    UpperRight,
    LowerRight,
    MiddleRight,
    UpperLeft,
}

impl Panel {
    pub fn xy(x_label: &str, y_label: &str, layers: Vec<Layer>) -> Panel {
        Panel {
            title: None,
            x_label: x_label.to_string(),
            y_label: y_label.to_string(),
            kind: PanelKind::Xy(layers),
            y_from_zero: false,
            legend: true,
            legend_at: LegendAt::UpperRight,
            y_categories: Vec::new(),
            x_range: None,
        }
    }

    /// A panel that shows `note` instead of axes.
    pub fn note(title: &str, note: &str) -> Panel {
        Panel {
            title: Some(title.to_string()),
            kind: PanelKind::Note(note.to_string()),
            ..Panel::xy("", "", Vec::new())
        }
    }
}

/// A figure: a title over a grid of panels. `name` is the file stem.
#[derive(Clone, Debug)]
pub struct Figure {
    pub name: String,
    pub title: String,
    pub panels: Vec<Panel>,
}

impl Figure {
    /// Grid (rows, cols) of the panels.
    fn grid(&self) -> (usize, usize) {
        let n = self.panels.len().max(1);
        let cols = match n {
            1 => 1,
            2..=4 => 2,
            _ => 3,
        };
        (n.div_ceil(cols), cols)
    }

    /// Pixel size at `width`: 8 × 5 in for one panel row, taller for more rows.
    pub fn size(&self, width: u32) -> (u32, u32) {
        let (rows, _) = self.grid();
        let h = if rows == 1 {
            width as f64 * 0.625
        } else {
            width as f64 * (0.05 + 0.42 * rows as f64)
        };
        (width, h.round() as u32)
    }
}

/// Renders to SVG text.
pub fn render_svg(fig: &Figure, width: u32) -> Result<String, String> {
    register_fonts()?;
    let size = fig.size(width);
    let mut out = String::new();
    {
        let root = SVGBackend::with_string(&mut out, size).into_drawing_area();
        draw_figure(&root, fig, width)?;
        root.present().map_err(|e| e.to_string())?;
    }
    Ok(out)
}

/// Renders to PNG bytes (RGB, 150 dpi recorded in the pHYs chunk, deterministic encoder).
pub fn render_png(fig: &Figure, width: u32) -> Result<Vec<u8>, String> {
    register_fonts()?;
    let (w, h) = fig.size(width);
    let mut pixels = vec![0u8; w as usize * h as usize * 3];
    {
        let root = BitMapBackend::with_buffer(&mut pixels, (w, h)).into_drawing_area();
        draw_figure(&root, fig, width)?;
        root.present().map_err(|e| e.to_string())?;
    }
    encode_png(&pixels, w, h).map_err(|e| e.to_string())
}

fn encode_png(pixels: &[u8], w: u32, h: u32) -> Result<Vec<u8>, png::EncodingError> {
    // 150 dots per inch = 5906 per metre.
    const PPM_150_DPI: u32 = 5906;
    let mut out = Vec::new();
    {
        let mut enc = png::Encoder::new(&mut out, w, h);
        enc.set_color(png::ColorType::Rgb);
        enc.set_depth(png::BitDepth::Eight);
        enc.set_compression(png::Compression::Best);
        enc.set_adaptive_filter(png::AdaptiveFilterType::Adaptive);
        enc.set_pixel_dims(Some(png::PixelDimensions {
            xppu: PPM_150_DPI,
            yppu: PPM_150_DPI,
            unit: png::Unit::Meter,
        }));
        let mut writer = enc.write_header()?;
        writer.write_image_data(pixels)?;
        writer.finish()?;
    }
    Ok(out)
}

/// Sizes at a given output width.
#[derive(Clone, Copy)]
struct Scale(f64);

impl Scale {
    fn px(self, base: f64) -> f64 {
        base * self.0
    }
    fn font(self, base: f64) -> FontDesc<'static> {
        (FAMILY, self.px(base)).into_font()
    }
    fn stroke(self) -> u32 {
        (2.0 * self.0).round().max(1.0) as u32
    }
    fn int(self, base: f64) -> i32 {
        self.px(base).round().max(1.0) as i32
    }
}

fn draw_figure<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    fig: &Figure,
    width: u32,
) -> Result<(), String> {
    let s = Scale(width as f64 / BASE_WIDTH as f64);
    let err = |e: DrawingAreaErrorKind<DB::ErrorType>| e.to_string();
    root.fill(&WHITE).map_err(err)?;
    // A white border: no title, label or legend may touch the canvas edge.
    let m = s.int(CANVAS_MARGIN);
    let inner = root.margin(m, m, m, m);
    let size = title_size(&fig.title);
    let lines = wrap_title(&fig.title, size, BASE_WIDTH as f64 - 2.0 * CANVAS_MARGIN);
    let line_height = s.px(size * 1.25);
    let title_height = (line_height * lines.len() as f64 + s.px(size * 0.4)).round() as u32;
    let (head, body) = inner.split_vertically(title_height);
    let centre = head.dim_in_pixel().0 as i32 / 2;
    let style = s
        .font(size)
        .color(&BLACK)
        .pos(Pos::new(HPos::Center, VPos::Top));
    for (i, line) in lines.iter().enumerate() {
        let top = (line_height * i as f64).round() as i32;
        head.draw_text(line, &style, (centre, top)).map_err(err)?;
    }
    let (rows, cols) = fig.grid();
    let areas = body.split_evenly((rows, cols));
    for (panel, area) in fig.panels.iter().zip(areas.iter()) {
        draw_panel(area, panel, s)?;
    }
    Ok(())
}

/// Blank pixels (at the reference width) between the canvas edge and anything drawn.
pub const CANVAS_MARGIN: f64 = 12.0;

/// Approximate width of `text` in DejaVu Sans at `size` px (0.6 em per character: wide
/// enough for its widest common letters, so an estimate errs toward more room).
pub fn text_width(text: &str, size: f64) -> f64 {
    text.chars().count() as f64 * size * 0.6
}

/// The title's font size: 30 px, smaller (down to 20) when a long title would not fit.
fn title_size(title: &str) -> f64 {
    let room = BASE_WIDTH as f64 - 2.0 * CANVAS_MARGIN;
    (room / (title.chars().count().max(1) as f64 * 0.6)).clamp(20.0, 30.0)
}

/// The title's lines at `size` px within `room` px: one line when it fits, else broken
/// between words into two (the second cut with an ellipsis only if even two do not hold it).
fn wrap_title(text: &str, size: f64, room: f64) -> Vec<String> {
    let max = (room / (size * 0.6)).floor() as usize;
    if text.chars().count() <= max {
        return vec![text.to_string()];
    }
    let mut first = String::new();
    let mut words = text.split(' ').peekable();
    while let Some(w) = words.peek() {
        let next = if first.is_empty() {
            w.chars().count()
        } else {
            first.chars().count() + 1 + w.chars().count()
        };
        if next > max {
            break;
        }
        if !first.is_empty() {
            first.push(' ');
        }
        first.push_str(w);
        words.next();
    }
    if first.is_empty() {
        // One word longer than the line: cut it.
        return vec![fit_to(text, size, room)];
    }
    let rest: Vec<&str> = words.collect();
    vec![first, fit_to(&rest.join(" "), size, room)]
}

/// `text` at `size` px, cut with an ellipsis where it would not fit `room` px.
fn fit_to(text: &str, size: f64, room: f64) -> String {
    let max = (room / (size * 0.6)).floor() as usize;
    if text.chars().count() <= max {
        text.to_string()
    } else {
        let kept: String = text.chars().take(max.saturating_sub(1)).collect();
        format!("{}…", kept.trim_end())
    }
}

/// Largest magnitude a figure plots. Axis ticks need the range and its width to be finite
/// after padding (plotters loops forever on an infinite range); far beyond any real loss,
/// reward or score.
pub const PLOT_LIMIT: f64 = 1e100;

/// Whether `v` can be placed on an axis (finite, within [`PLOT_LIMIT`]).
pub fn plottable(v: f64) -> bool {
    v.is_finite() && v.abs() <= PLOT_LIMIT
}

/// Data ranges of a panel with padding; never degenerate (a single point still gets a box).
/// Points outside [`plottable`] are ignored.
fn bounds(points: impl Iterator<Item = (f64, f64)>, y_from_zero: bool) -> ((f64, f64), (f64, f64)) {
    let (mut x0, mut x1, mut y0, mut y1) = (f64::MAX, f64::MIN, f64::MAX, f64::MIN);
    for (x, y) in points.filter(|(x, y)| plottable(*x) && plottable(*y)) {
        x0 = x0.min(x);
        x1 = x1.max(x);
        y0 = y0.min(y);
        y1 = y1.max(y);
    }
    if x0 > x1 {
        (x0, x1, y0, y1) = (0.0, 1.0, 0.0, 1.0);
    }
    if y_from_zero {
        y0 = y0.min(0.0);
        y1 = y1.max(0.0);
    }
    let pad = |lo: f64, hi: f64, frac: f64| {
        let span = hi - lo;
        let p = if span > 0.0 {
            span * frac
        } else if lo != 0.0 {
            lo.abs() * 0.1
        } else {
            1.0
        };
        (lo - p, hi + p)
    };
    let (x0, x1) = pad(x0, x1, 0.03);
    let (lo, hi) = (y0, y1);
    let (mut y0, mut y1) = pad(y0, y1, 0.06);
    // Counts and rates start at the axis: no padding below 0 for data that is never negative
    // (all zeros gives 0..1), none above 0 for data that is never positive.
    if y_from_zero && lo >= 0.0 {
        y0 = 0.0;
    }
    if y_from_zero && hi <= 0.0 && lo < 0.0 {
        y1 = 0.0;
    }
    ((x0, x1), (y0, y1))
}

/// Tick labels: short decimals, scientific notation for very small or large values.
pub fn fmt_tick(v: f64) -> String {
    // Tick positions computed as sums can land a rounding error away from zero.
    if v.abs() < 1e-12 || !v.is_finite() {
        return "0".to_string();
    }
    let a = v.abs();
    if !(1e-3..1e5).contains(&a) {
        return format!("{v:.1e}");
    }
    let s = format!("{v:.4}");
    let s = s.trim_end_matches('0').trim_end_matches('.');
    if s == "-0" {
        "0".to_string()
    } else {
        s.to_string()
    }
}

fn layer_points(layer: &Layer) -> Vec<(f64, f64)> {
    match &layer.shape {
        Shape::Line { points, .. } | Shape::Markers { points, .. } => points.clone(),
        Shape::Area { points } => points.iter().copied().chain([(points[0].0, 0.0)]).collect(),
        Shape::ErrorBars { points } => points
            .iter()
            .flat_map(|&(x, y, e)| [(x, y - e), (x, y + e)])
            .collect(),
        // A vertical line only needs its x inside the range; its y comes from the others.
        Shape::VLine { .. } => Vec::new(),
        Shape::Label { x, y, .. } => vec![(*x, *y)],
    }
}

fn draw_panel<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    panel: &Panel,
    s: Scale,
) -> Result<(), String> {
    match &panel.kind {
        PanelKind::Xy(layers) => draw_xy(area, panel, layers, s),
        PanelKind::Bars(bars) => draw_bars(area, panel, bars, s),
        PanelKind::Note(text) => draw_note(area, panel, text, s),
    }
}

fn draw_note<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    panel: &Panel,
    text: &str,
    s: Scale,
) -> Result<(), String> {
    let err = |e: DrawingAreaErrorKind<DB::ErrorType>| e.to_string();
    let area = match &panel.title {
        Some(t) => area.titled(t, s.font(24.0)).map_err(err)?,
        None => area.clone(),
    };
    let (w, h) = area.dim_in_pixel();
    let style =
        s.font(20.0)
            .color(&RGBColor(90, 90, 90))
            .pos(plotters::style::text_anchor::Pos::new(
                plotters::style::text_anchor::HPos::Center,
                plotters::style::text_anchor::VPos::Center,
            ));
    area.draw_text(text, &style, (w as i32 / 2, h as i32 / 2))
        .map_err(err)
}

type Chart<'a, DB> = ChartContext<'a, DB, Cartesian2d<RangedCoordf64, RangedCoordf64>>;

fn build_chart<'a, DB: DrawingBackend>(
    area: &'a DrawingArea<DB, Shift>,
    panel: &Panel,
    (xr, yr): ((f64, f64), (f64, f64)),
    s: Scale,
) -> Result<Chart<'a, DB>, String> {
    let mut builder = ChartBuilder::on(area);
    // Category names need room for the longest one (tick text at 18 px, plus the tick and
    // a gap); numbers fit the usual 105 px.
    let longest = panel
        .y_categories
        .iter()
        .map(|c| text_width(c, 18.0))
        .fold(0.0, f64::max);
    let y_area = (longest + 40.0).max(105.0);
    builder
        .margin(s.int(14.0))
        .x_label_area_size(s.int(70.0))
        .y_label_area_size(s.int(y_area));
    if let Some(t) = &panel.title {
        builder.caption(t, s.font(24.0));
    }
    builder
        .build_cartesian_2d(xr.0..xr.1, yr.0..yr.1)
        .map_err(|e| e.to_string())
}

fn draw_mesh<DB: DrawingBackend>(
    chart: &mut Chart<'_, DB>,
    panel: &Panel,
    x_fmt: &dyn Fn(&f64) -> String,
    y_fmt: &dyn Fn(&f64) -> String,
    x_labels: usize,
    y_labels: usize,
    s: Scale,
) -> Result<(), String> {
    // Axis titles shrink (down to 14 px) and then shorten to fit their side of the panel:
    // text that does not fit would cross into the next panel or off the canvas.
    let (w, h) = chart.plotting_area().dim_in_pixel();
    let fit = |text: &str, room: u32| {
        let room = room as f64 / s.0;
        let size = (room / (text.chars().count().max(1) as f64 * 0.6)).clamp(14.0, 22.0);
        (fit_to(text, size, room), size)
    };
    let (x_desc, x_size) = fit(&panel.x_label, w);
    let (y_desc, y_size) = fit(&panel.y_label, h);
    let desc_size = x_size.min(y_size);
    chart
        .configure_mesh()
        .x_desc(x_desc)
        .y_desc(y_desc)
        .x_labels(x_labels)
        .y_labels(y_labels)
        .x_label_formatter(x_fmt)
        .y_label_formatter(y_fmt)
        .label_style(s.font(18.0))
        .axis_desc_style(s.font(desc_size))
        .light_line_style(TRANSPARENT)
        .bold_line_style(RGBColor(225, 225, 225))
        .draw()
        .map_err(|e| e.to_string())
}

fn draw_legend<'a, DB: DrawingBackend + 'a>(
    chart: &mut Chart<'a, DB>,
    at: LegendAt,
    s: Scale,
) -> Result<(), String> {
    let pos = match at {
        LegendAt::UpperRight => SeriesLabelPosition::UpperRight,
        LegendAt::LowerRight => SeriesLabelPosition::LowerRight,
        LegendAt::MiddleRight => SeriesLabelPosition::MiddleRight,
        LegendAt::UpperLeft => SeriesLabelPosition::UpperLeft,
    };
    chart
        .configure_series_labels()
        .position(pos)
        .margin(s.int(10.0))
        .legend_area_size(s.int(30.0))
        .label_font(s.font(18.0))
        .background_style(WHITE.mix(0.85))
        .border_style(RGBColor(160, 160, 160))
        .draw()
        .map_err(|e| e.to_string())
}

fn draw_xy<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    panel: &Panel,
    layers: &[Layer],
    s: Scale,
) -> Result<(), String> {
    let mut range = bounds(layers.iter().flat_map(layer_points), panel.y_from_zero);
    if let Some((lo, hi)) = panel.x_range {
        let data = layers.iter().flat_map(layer_points).map(|p| p.0);
        let inside = data
            .filter(|x| plottable(*x))
            .all(|x| (lo..=hi).contains(&x));
        // Just beyond the fixed range, so a dot at its end is not cut in half.
        let pad = (hi - lo) * 0.02;
        range.0 = if inside {
            (lo - pad, hi + pad)
        } else {
            (range.0 .0.min(lo), range.0 .1.max(hi))
        };
    }
    if !panel.y_categories.is_empty() {
        range.1 = (0.5, panel.y_categories.len() as f64 + 0.5);
    }
    // Keep vertical reference lines inside the box.
    for l in layers {
        if let Shape::VLine { x } = l.shape {
            if !plottable(x) {
                continue;
            }
            let (x0, x1) = range.0;
            let pad = ((x1 - x0) * 0.03).max(1e-9);
            range.0 = (x0.min(x - pad), x1.max(x + pad));
        }
    }
    // Point labels are written to the right of their points: leave room for them.
    if layers
        .iter()
        .any(|l| matches!(l.shape, Shape::Label { .. }))
    {
        let (x0, x1) = range.0;
        let pad = (x1 - x0) * 0.12;
        range.0 = (x0 - pad, x1 + 2.0 * pad);
    }
    let mut chart = build_chart(area, panel, range, s)?;
    if panel.y_categories.is_empty() {
        draw_mesh(
            &mut chart,
            panel,
            &|v| fmt_tick(*v),
            &|v| fmt_tick(*v),
            8,
            8,
            s,
        )?;
    } else {
        let cats = panel.y_categories.clone();
        let k = cats.len();
        // Row i (top to bottom) sits at y = k − i.
        let name = move |v: &f64| {
            let r = v.round();
            if (v - r).abs() < 1e-6 && r >= 1.0 && (r as usize) <= k {
                cats[k - r as usize].clone()
            } else {
                String::new()
            }
        };
        // One tick per row: exactly k + 1 labels over a range of width k.
        draw_mesh(&mut chart, panel, &|v| fmt_tick(*v), &name, 8, k + 1, s)?;
    }
    let mut any_label = false;
    for layer in layers {
        any_label |= layer.label.is_some();
        draw_layer(&mut chart, layer, range.1, s)?;
    }
    if panel.legend && any_label {
        draw_legend(&mut chart, panel.legend_at, s)?;
    }
    Ok(())
}

/// The points of a series that [`plottable`] allows (the others would be drawn off the chart).
fn on_axes(points: &[(f64, f64)]) -> Vec<(f64, f64)> {
    points
        .iter()
        .copied()
        .filter(|(x, y)| plottable(*x) && plottable(*y))
        .collect()
}

fn draw_layer<'a, DB: DrawingBackend + 'a>(
    chart: &mut Chart<'a, DB>,
    layer: &Layer,
    (y0, y1): (f64, f64),
    s: Scale,
) -> Result<(), String> {
    let err = |e: DrawingAreaErrorKind<DB::ErrorType>| e.to_string();
    let c = layer.color;
    let w = s.stroke();
    let dash = (s.px(12.0), s.px(7.0));
    let r = s.int(5.0);
    let off_axes = match layer.shape {
        Shape::VLine { x } => !plottable(x),
        Shape::Label { x, y, .. } => !(plottable(x) && plottable(y)),
        _ => false,
    };
    if off_axes {
        return Ok(());
    }
    // Every series returns an annotation handle; only labelled ones get a legend entry.
    let anno = match &layer.shape {
        Shape::Line {
            points,
            dashed,
            faint,
            markers,
        } => {
            let points = &on_axes(points);
            let style = if *faint {
                c.mix(0.25).stroke_width(w)
            } else {
                c.stroke_width(w)
            };
            let a = if *dashed {
                chart
                    .draw_series(std::iter::once(DashedPathElement::new(
                        points.clone(),
                        dash.0 as i32,
                        dash.1 as i32,
                        style,
                    )))
                    .map_err(err)?
            } else {
                chart
                    .draw_series(LineSeries::new(points.clone(), style))
                    .map_err(err)?
            };
            let dashed = *dashed;
            let legend_w = s.int(24.0);
            if let Some(l) = &layer.label {
                a.label(l)
                    .legend(move |(x, y)| -> DynElement<'static, DB, (i32, i32)> {
                        let seg = vec![(x, y), (x + legend_w, y)];
                        if dashed {
                            DashedPathElement::new(seg, legend_w / 3, legend_w / 6, style)
                                .into_dyn()
                        } else {
                            PathElement::new(seg, style).into_dyn()
                        }
                    });
            }
            if *markers {
                chart
                    .draw_series(points.iter().map(|&p| Circle::new(p, r, c.filled())))
                    .map_err(err)?;
            }
            return Ok(());
        }
        Shape::Area { points } => chart
            .draw_series(AreaSeries::new(on_axes(points), 0.0, c.mix(0.18)))
            .map_err(err)?,
        Shape::Markers { points, marker } => match (&on_axes(points), marker) {
            (points, Marker::Circle { filled }) => {
                let style = if *filled {
                    c.filled()
                } else {
                    c.stroke_width(w)
                };
                chart
                    .draw_series(points.iter().map(|&p| Circle::new(p, r + 1, style)))
                    .map_err(err)?
            }
            (points, Marker::Triangle) => chart
                .draw_series(
                    points
                        .iter()
                        .map(|&p| TriangleMarker::new(p, r + 3, c.filled())),
                )
                .map_err(err)?,
        },
        Shape::ErrorBars { points } => chart
            .draw_series(
                points
                    .iter()
                    .filter(|p| plottable(p.1 - p.2) && plottable(p.1 + p.2) && plottable(p.0))
                    .map(|&(x, y, e)| {
                        ErrorBar::new_vertical(
                            x,
                            y - e,
                            y,
                            y + e,
                            c.stroke_width(w),
                            s.int(10.0) as u32,
                        )
                    }),
            )
            .map_err(err)?,
        Shape::VLine { x } => chart
            .draw_series(std::iter::once(DashedPathElement::new(
                vec![(*x, y0), (*x, y1)],
                dash.0 as i32,
                dash.1 as i32,
                c.stroke_width(w),
            )))
            .map_err(err)?,
        Shape::Label { x, y, text } => {
            // Annotations have no legend entry: draw straight onto the plotting area.
            let font = s.font(16.0).color(&c);
            let elem = EmptyElement::at((*x, *y))
                + Text::new(text.clone(), (s.int(9.0), -s.int(20.0)), font);
            chart.plotting_area().draw(&elem).map_err(err)?;
            return Ok(());
        }
    };
    if let Some(l) = &layer.label {
        let (glyph, style) = match &layer.shape {
            Shape::Area { .. } => (Glyph::Box, c.mix(0.3).filled()),
            Shape::VLine { .. } => (Glyph::Dash, c.stroke_width(w)),
            Shape::Markers {
                marker: Marker::Triangle,
                ..
            } => (Glyph::Triangle, c.filled()),
            Shape::Markers {
                marker: Marker::Circle { filled: false },
                ..
            } => (Glyph::Circle, c.stroke_width(w)),
            _ => (Glyph::Circle, c.filled()),
        };
        set_legend(anno, l, glyph, style, s);
    }
    Ok(())
}

#[derive(Clone, Copy)]
enum Glyph {
    Box,
    Dash,
    Triangle,
    Circle,
}

fn set_legend<'a, DB: DrawingBackend + 'a>(
    anno: &mut SeriesAnno<'a, DB>,
    label: &str,
    glyph: Glyph,
    style: ShapeStyle,
    s: Scale,
) {
    let (w, r) = (s.int(24.0), s.int(6.0));
    anno.label(label)
        .legend(move |(x, y)| -> DynElement<'static, DB, (i32, i32)> {
            match glyph {
                Glyph::Box => Rectangle::new([(x, y - r), (x + w, y + r)], style).into_dyn(),
                Glyph::Dash => {
                    DashedPathElement::new(vec![(x, y), (x + w, y)], w / 3, w / 6, style).into_dyn()
                }
                Glyph::Triangle => TriangleMarker::new((x + w / 2, y), r + 2, style).into_dyn(),
                Glyph::Circle => Circle::new((x + w / 2, y), r, style).into_dyn(),
            }
        });
}

fn draw_bars<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    panel: &Panel,
    bars: &Bars,
    s: Scale,
) -> Result<(), String> {
    let err = |e: DrawingAreaErrorKind<DB::ErrorType>| e.to_string();
    let n = bars.categories.len().max(1);
    let tops = bars.groups.iter().flat_map(|g| {
        g.values
            .iter()
            .flatten()
            .flat_map(|&(v, e)| [(0.0, v - e), (0.0, v + e)])
    });
    let (_, yr) = bounds(tops, true);
    let xr = (-0.5, n as f64 - 0.5);
    let mut chart = build_chart(area, panel, (xr, yr), s)?;
    let cats = bars.categories.clone();
    let fmt = move |v: &f64| {
        let i = v.round();
        if (v - i).abs() < 1e-6 && i >= 0.0 && (i as usize) < cats.len() {
            cats[i as usize].clone()
        } else {
            String::new()
        }
    };
    // One tick per category: ask for exactly n + 1 labels over a range of width n.
    draw_mesh(&mut chart, panel, &fmt, &|v| fmt_tick(*v), n + 1, 8, s)?;
    let k = if bars.dodge {
        bars.groups.len().max(1)
    } else {
        1
    };
    let slot = 0.8 / k as f64;
    for (gi, g) in bars.groups.iter().enumerate() {
        let gi = if bars.dodge { gi } else { 0 };
        let left = |ci: usize| ci as f64 - 0.4 + slot * gi as f64;
        let rects = g.values.iter().enumerate().filter_map(|(ci, v)| {
            v.map(|(h, _)| {
                Rectangle::new(
                    [(left(ci) + slot * 0.06, 0.0), (left(ci) + slot * 0.94, h)],
                    g.color.filled(),
                )
            })
        });
        let color = g.color;
        let r = s.int(8.0);
        chart
            .draw_series(rects)
            .map_err(err)?
            .label(g.label.as_str())
            .legend(move |(x, y)| Rectangle::new([(x, y - r), (x + 2 * r, y + r)], color.filled()));
        let errs = g.values.iter().enumerate().filter_map(|(ci, v)| {
            v.filter(|&(_, e)| e > 0.0).map(|(h, e)| {
                ErrorBar::new_vertical(
                    left(ci) + slot * 0.5,
                    h - e,
                    h,
                    h + e,
                    BLACK.stroke_width(s.stroke()),
                    s.int(8.0) as u32,
                )
            })
        });
        chart.draw_series(errs).map_err(err)?;
    }
    if panel.legend && !bars.groups.is_empty() {
        draw_legend(&mut chart, panel.legend_at, s)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn single_point_gets_a_box() {
        let ((x0, x1), (y0, y1)) = bounds(std::iter::once((3.0, 2e-6)), false);
        assert!(x0 < 3.0 && x1 > 3.0);
        assert!(y0 < 2e-6 && y1 > 2e-6);
        let ((x0, x1), (y0, y1)) = bounds(std::iter::once((0.0, 0.0)), false);
        assert!(x1 - x0 > 0.0 && y1 - y0 > 0.0);
    }

    /// A title too long for one line breaks between words into two, all of it kept; only a
    /// title longer than two lines loses its end.
    #[test]
    fn long_titles_wrap_between_words() {
        let room = 400.0;
        let size = 20.0; // 33 characters a line
        assert_eq!(wrap_title("Short title", size, room), ["Short title"]);
        let long = "Clarify-or-answer ablation: ask rates during GRPO";
        let lines = wrap_title(long, size, room);
        assert_eq!(lines.len(), 2, "{lines:?}");
        assert!(lines.iter().all(|l| l.chars().count() <= 33), "{lines:?}");
        assert!(!lines[1].ends_with('…'), "{lines:?}");
        let mut words: Vec<&str> = lines[0].split(' ').collect();
        words.extend(lines[1].split(' '));
        assert_eq!(words.join(" "), long);
        let huge = "word ".repeat(40);
        assert!(wrap_title(huge.trim(), size, room)[1].ends_with('…'));
    }

    #[test]
    fn ticks_are_short() {
        assert_eq!(fmt_tick(0.5), "0.5");
        assert_eq!(fmt_tick(10.0), "10");
        assert_eq!(fmt_tick(2e-6), "2.0e-6");
        assert_eq!(fmt_tick(-0.00001), "-1.0e-5");
        assert_eq!(fmt_tick(0.0), "0");
    }
}
