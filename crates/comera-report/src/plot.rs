//! Line plots of training curves (PNG).
//!
//! [`plot_panels`] draws one line chart per [`Panel`], stacked vertically, each with a title, axis
//! labels, a light grid and a legend, and writes the picture as a PNG.
//!
//! * Text uses DejaVu Sans embedded in the binary (the `dejavu` crate), registered with plotters'
//!   `ab_glyph` text renderer, so no system fonts are needed.
//! * Non-finite points and points beyond ±1e15 are skipped (and, on a log-scale panel, points with `y <= 0`); a panel with
//!   nothing left to draw shows "no data"; a series with no drawable point still gets a legend
//!   entry marked "(no data)".
//! * The picture is rendered into memory, encoded to `<path>.tmp` in the same directory and then
//!   renamed over `<path>`, so a reader never sees a half-written file.

use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use plotters::coord::ranged1d::{AsRangedCoord, ValueFormatter};
use plotters::coord::types::RangedCoordf64;
use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

/// One line in a chart: `(x, y)` points in drawing order.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Series {
    /// Legend text (an empty name gets no legend entry).
    pub name: String,
    pub points: Vec<(f64, f64)>,
}

impl Series {
    pub fn new(name: impl Into<String>, points: Vec<(f64, f64)>) -> Self {
        Self {
            name: name.into(),
            points,
        }
    }
}

/// One chart: a title, axis labels and its lines.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Panel {
    pub title: String,
    pub x_label: String,
    pub y_label: String,
    pub series: Vec<Series>,
    /// Logarithmic y axis (points with `y <= 0` are skipped).
    pub log_y: bool,
    /// Vertical lines across the chart at these x values, each labelled at its top (e.g. the
    /// rank schedule's switch to its late stage).
    pub marks: Vec<(f64, String)>,
    /// Draw the series as filled bars instead of lines (see [`Bars`]).
    pub bars: Option<Bars>,
}

/// A bar chart: each point `(x, y)` of a series is a filled bar of `width` centred at `x`,
/// from 0 to `y`; with `x_names`, the x axis shows name i at x = i + 1 instead of numbers.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Bars {
    pub width: f64,
    pub x_names: Vec<String>,
}

/// Why a plot could not be written; every variant names the target file.
#[derive(Debug, thiserror::Error)]
pub enum PlotError {
    #[error("plot {}: invalid image size {width}x{height} pixels", .path.display())]
    BadSize {
        path: PathBuf,
        width: u64,
        height: u64,
    },
    #[error("plot {}: the embedded font could not be loaded", .path.display())]
    Font { path: PathBuf },
    #[error("plot {}: drawing failed: {message}", .path.display())]
    Draw { path: PathBuf, message: String },
    #[error("plot {}: PNG encoding failed: {message}", .path.display())]
    Encode { path: PathBuf, message: String },
    #[error("plot {}: cannot write {}: {source}", .path.display(), .file.display())]
    Io {
        /// The plot that was asked for.
        path: PathBuf,
        /// The file the failing operation was on (`<path>.tmp` or `<path>`).
        file: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// Largest accepted side of the whole image, in pixels.
const MAX_SIDE: u32 = 16_384;
/// Font family name the embedded font is registered under (also plotters' default family).
const FONT: &str = "sans-serif";
/// Series colours (the "tab10" palette).
const COLORS: [RGBColor; 10] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
    RGBColor(188, 189, 34),
    RGBColor(23, 190, 207),
];
const GRID: RGBColor = RGBColor(215, 215, 215);
const LIGHT_GRID: RGBColor = RGBColor(242, 242, 242);
const GREY: RGBColor = RGBColor(110, 110, 110);
/// Series with at most this many points also get a dot on each point.
const MARKER_MAX_POINTS: usize = 40;
/// With more named series than this, the legend goes beside the chart instead of over it.
const LEGEND_INSIDE_MAX: usize = 4;

/// Writes a PNG at `path`, `width` pixels wide and `height_per_panel` pixels per panel, with the
/// panels stacked vertically, each a line chart with a legend. An empty `panels` slice gives a
/// single "no data" panel.
pub fn plot_panels(
    path: &Path,
    panels: &[Panel],
    width: u32,
    height_per_panel: u32,
) -> Result<(), PlotError> {
    let rows = panels.len().max(1) as u64;
    let height = u64::from(height_per_panel) * rows;
    if width == 0 || height == 0 || width > MAX_SIDE || height > u64::from(MAX_SIDE) {
        return Err(PlotError::BadSize {
            path: path.to_path_buf(),
            width: u64::from(width),
            height,
        });
    }
    let height = height as u32;
    if !fonts_registered() {
        return Err(PlotError::Font {
            path: path.to_path_buf(),
        });
    }
    let mut rgb = vec![255u8; width as usize * height as usize * 3];
    render(&mut rgb, width, height, panels).map_err(|message| PlotError::Draw {
        path: path.to_path_buf(),
        message,
    })?;
    write_png_atomically(path, &rgb, width, height)
}

/// Registers DejaVu Sans (regular and bold) once per process.
fn fonts_registered() -> bool {
    static OK: OnceLock<bool> = OnceLock::new();
    *OK.get_or_init(|| {
        plotters::style::register_font(FONT, FontStyle::Normal, dejavu::sans::regular()).is_ok()
            && plotters::style::register_font(FONT, FontStyle::Bold, dejavu::sans::bold()).is_ok()
    })
}

type Area<'a> = DrawingArea<BitMapBackend<'a>, Shift>;

fn err_text<E: std::fmt::Display>(e: E) -> String {
    e.to_string()
}

fn render(rgb: &mut [u8], width: u32, height: u32, panels: &[Panel]) -> Result<(), String> {
    let root = BitMapBackend::with_buffer(rgb, (width, height)).into_drawing_area();
    root.fill(&WHITE).map_err(err_text)?;
    if panels.is_empty() {
        draw_message(&root, "", "no data")?;
    } else {
        let areas = root.split_evenly((panels.len(), 1));
        for (area, panel) in areas.iter().zip(panels) {
            draw_panel(area, panel)?;
        }
    }
    root.present().map_err(err_text)
}

/// A series reduced to its drawable points, with its style: series i gets colour i mod 10,
/// solid for the first ten, dashed for the next ten (so up to 20 lines are told apart).
struct Prepared<'a> {
    name: &'a str,
    color: RGBColor,
    dashed: bool,
    points: Vec<(f64, f64)>,
}

/// Largest magnitude drawn (see `draw_panel`).
const MAX_ABS: f64 = 1e15;

fn draw_panel(area: &Area, panel: &Panel) -> Result<(), String> {
    // Beyond ±MAX_ABS the axis span overflows and plotters' tick search never ends; no
    // training curve gets there, so such points are skipped like non-finite ones.
    let ok = |v: f64| v.is_finite() && v.abs() <= MAX_ABS;
    let drawable = |&(x, y): &(f64, f64)| ok(x) && ok(y) && (!panel.log_y || y > 0.0);
    let series: Vec<Prepared> = panel
        .series
        .iter()
        .enumerate()
        .map(|(i, s)| Prepared {
            name: &s.name,
            color: COLORS[i % COLORS.len()],
            dashed: (i / COLORS.len()) % 2 == 1,
            points: s.points.iter().copied().filter(drawable).collect(),
        })
        .collect();

    let mut x_bounds: Option<(f64, f64)> = None;
    let mut y_bounds: Option<(f64, f64)> = None;
    for &(x, y) in series.iter().flat_map(|s| &s.points) {
        x_bounds = Some(x_bounds.map_or((x, x), |(lo, hi)| (lo.min(x), hi.max(x))));
        y_bounds = Some(y_bounds.map_or((y, y), |(lo, hi)| (lo.min(y), hi.max(y))));
    }
    if let (Some(b), Some((x_lo, x_hi)), Some((y_lo, y_hi))) = (&panel.bars, x_bounds, y_bounds) {
        // Bars stand on 0 and are wholly inside the x range.
        let half = b.width.abs() / 2.0;
        let x = if b.x_names.is_empty() {
            (x_lo - half, x_hi + half)
        } else {
            (
                0.5f64.min(x_lo - half),
                (b.x_names.len() as f64 + 0.5).max(x_hi + half),
            )
        };
        x_bounds = Some(x);
        y_bounds = Some((y_lo.min(0.0), y_hi.max(0.0)));
    }
    let (Some((x_lo, x_hi)), Some((y_lo, y_hi))) = (x_bounds, y_bounds) else {
        let has_finite = panel
            .series
            .iter()
            .flat_map(|s| &s.points)
            .any(|(x, y)| x.is_finite() && y.is_finite());
        let message = if panel.log_y && has_finite {
            "no data (log scale needs y > 0)"
        } else {
            "no data"
        };
        return draw_message(area, &panel.title, message);
    };

    let x_range = match &panel.bars {
        Some(_) => x_lo..x_hi,
        None => linear_range(x_lo, x_hi),
    };
    let legend_pos = legend_position(&series, x_range.clone(), y_lo, y_hi);
    if panel.log_y {
        let y_range = log_range(y_lo, y_hi);
        let (bold, light) = log_ticks(y_range.start, y_range.end);
        let y_spec = y_range
            .log_scale()
            .with_key_points(bold)
            .with_light_points(light);
        draw_chart(area, panel, &series, x_range, y_spec, legend_pos)
    } else {
        let y_range = match &panel.bars {
            // From 0 exactly, some room above the tallest bar.
            Some(_) => y_lo..(y_hi + 0.08 * (y_hi - y_lo)).max(y_lo + 1.0),
            None => linear_range(y_lo, y_hi),
        };
        draw_chart(area, panel, &series, x_range, y_range, legend_pos)
    }
}

fn draw_chart<Y>(
    area: &Area,
    panel: &Panel,
    series: &[Prepared],
    x_range: Range<f64>,
    y_spec: Y,
    legend_pos: SeriesLabelPosition,
) -> Result<(), String>
where
    Y: AsRangedCoord<Value = f64>,
    Y::CoordDescType: ValueFormatter<f64>,
{
    let (w, h) = area.dim_in_pixel();
    let text = TextSizes::for_height(h);
    let named: Vec<&Prepared> = series.iter().filter(|s| !s.name.is_empty()).collect();
    // Many series: the legend gets its own column right of the chart, so it covers no line.
    let beside = named.len() > LEGEND_INSIDE_MAX;
    let (area, legend_area) = if beside {
        let longest = named
            .iter()
            .map(|s| s.name.chars().count())
            .max()
            .unwrap_or(0);
        let legend_w = (longest as u32 * (text.label as u32 * 6 / 10) + 60).min(w / 3);
        let (a, b) = area.split_horizontally(w.saturating_sub(legend_w));
        (a, Some(b))
    } else {
        (area.clone(), None)
    };

    let mut chart = ChartBuilder::on(&area)
        .caption(
            &panel.title,
            (FONT, text.caption).into_font().style(FontStyle::Bold),
        )
        .margin(12)
        .x_label_area_size(if text.small { 34 } else { 42 })
        .y_label_area_size(72)
        .build_cartesian_2d(x_range, y_spec)
        .map_err(err_text)?;

    let x_names = panel
        .bars
        .as_ref()
        .map(|b| b.x_names.clone())
        .unwrap_or_default();
    let x_text = |v: &f64| {
        if x_names.is_empty() {
            return tick_text(*v);
        }
        let k = v.round();
        match (k as usize).checked_sub(1).and_then(|i| x_names.get(i)) {
            Some(name) if (v - k).abs() < 1e-6 => name.clone(),
            _ => String::new(),
        }
    };
    chart
        .configure_mesh()
        .light_line_style(LIGHT_GRID)
        .bold_line_style(GRID)
        .axis_style(BLACK)
        .x_desc(panel.x_label.as_str())
        .y_desc(panel.y_label.as_str())
        .label_style((FONT, text.label))
        .axis_desc_style((FONT, text.label + 1))
        .x_label_formatter(&x_text)
        .y_label_formatter(&|v| tick_text(*v))
        .x_labels(if x_names.is_empty() {
            8
        } else {
            2 * x_names.len() + 1
        })
        .y_labels(6)
        .draw()
        .map_err(err_text)?;

    draw_marks(&mut chart, &area, &panel.marks, text.label)?;
    let any_label = draw_series(&mut chart, panel, series, beside)?;
    if any_label {
        chart
            .configure_series_labels()
            .position(legend_pos)
            .margin(10)
            .legend_area_size(28)
            .label_font((FONT, text.label))
            .background_style(WHITE.mix(0.85))
            .border_style(GREY)
            .draw()
            .map_err(err_text)?;
    }
    if let Some(legend) = legend_area {
        draw_legend_beside(&legend, &named, panel.bars.is_some(), text)?;
    }
    Ok(())
}

/// A panel's chart: x linear, y on the scale `Y` (linear or logarithmic).
type Chart<'a, 'b, Y> = ChartContext<'a, BitMapBackend<'b>, Cartesian2d<RangedCoordf64, Y>>;

/// Font sizes of a panel: smaller in a short panel.
#[derive(Clone, Copy)]
struct TextSizes {
    small: bool,
    caption: i32,
    label: i32,
}

impl TextSizes {
    fn for_height(h: u32) -> TextSizes {
        let small = h < 260;
        TextSizes {
            small,
            caption: if small { 16 } else { 20 },
            label: if small { 12 } else { 14 },
        }
    }
}

/// The panel's marks (a dashed vertical line and its label at the top) inside the x range.
fn draw_marks<Y: Ranged<ValueType = f64>>(
    chart: &mut Chart<'_, '_, Y>,
    area: &Area,
    marks: &[(f64, String)],
    label_size: i32,
) -> Result<(), String> {
    let (y_lo, y_hi) = {
        let r = chart.y_range();
        (r.start, r.end)
    };
    for (x, label) in marks {
        if !chart.x_range().contains(x) {
            continue;
        }
        chart
            .draw_series(DashedLineSeries::new(
                [(*x, y_lo), (*x, y_hi)],
                6,
                4,
                GREY.stroke_width(2),
            ))
            .map_err(err_text)?;
        let pos = chart.backend_coord(&(*x, y_hi));
        area.draw(&Text::new(
            label.clone(),
            (
                pos.0 - area.get_base_pixel().0 + 4,
                pos.1 - area.get_base_pixel().1 + 4,
            ),
            (FONT, label_size).into_font().color(&GREY),
        ))
        .map_err(err_text)?;
    }
    Ok(())
}

/// Every series as bars, or as a line with markers when it has few points; with the legend
/// inside the chart (not `beside`), each named series' entry. Whether any entry was made.
fn draw_series<Y: Ranged<ValueType = f64>>(
    chart: &mut Chart<'_, '_, Y>,
    panel: &Panel,
    series: &[Prepared],
    beside: bool,
) -> Result<bool, String> {
    let mut any_label = false;
    for s in series {
        let (color, dashed) = (s.color, s.dashed);
        let style = color.stroke_width(2);
        let drawn = match (&panel.bars, dashed) {
            (Some(b), _) => {
                let half = b.width.abs() / 2.0;
                chart.draw_series(s.points.iter().map(|&(x, y)| {
                    Rectangle::new([(x - half, 0.0), (x + half, y)], color.filled())
                }))
            }
            (None, false) => chart.draw_series(LineSeries::new(s.points.iter().copied(), style)),
            (None, true) => {
                chart.draw_series(DashedLineSeries::new(s.points.iter().copied(), 8, 5, style))
            }
        }
        .map_err(err_text)?;
        if !s.name.is_empty() && !beside {
            any_label = true;
            // Inside the chart only up to LEGEND_INSIDE_MAX series, all solid: a line sample
            // (a thick one for bars).
            let width = if panel.bars.is_some() { 10 } else { 3 };
            drawn.label(legend_label(s)).legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 22, y)], color.stroke_width(width))
            });
        }
        if panel.bars.is_none() && s.points.len() <= MARKER_MAX_POINTS {
            chart
                .draw_series(s.points.iter().map(|&p| Circle::new(p, 3, color.filled())))
                .map_err(err_text)?;
        }
    }
    Ok(any_label)
}

/// A series' name in the legend, marked when it has nothing to draw.
fn legend_label(s: &Prepared) -> String {
    if s.points.is_empty() {
        format!("{} (no data)", s.name)
    } else {
        s.name.to_string()
    }
}

/// The legend in its own column (`legend`, right of the chart): a sample and the name of each
/// named series, one a row.
fn draw_legend_beside(
    legend: &Area,
    named: &[&Prepared],
    bars: bool,
    text: TextSizes,
) -> Result<(), String> {
    let row = i32::from(text.label as u16) + 6;
    let top = 12 + text.caption + 10;
    for (k, s) in named.iter().enumerate() {
        let y = top + k as i32 * row;
        draw_legend_sample(legend, (8, y + row / 2 - 3), s.color, s.dashed, bars)?;
        legend
            .draw(&Text::new(
                legend_label(s),
                (40, y),
                (FONT, text.label).into_font().color(&BLACK),
            ))
            .map_err(err_text)?;
    }
    Ok(())
}

/// Draws the legend's sample of a series with its left end at (x, y) of `area`: a filled
/// square for bars, else a short line, dashed like the series.
fn draw_legend_sample(
    area: &Area,
    (x, y): (i32, i32),
    color: RGBColor,
    dashed: bool,
    bar: bool,
) -> Result<(), String> {
    if bar {
        return area
            .draw(&Rectangle::new(
                [(x, y - 6), (x + 12, y + 6)],
                color.filled(),
            ))
            .map_err(err_text);
    }
    let segments: &[(i32, i32)] = if dashed {
        &[(0, 8), (14, 22)]
    } else {
        &[(0, 22)]
    };
    for &(a, b) in segments {
        area.draw(&PathElement::new(
            vec![(x + a, y), (x + b, y)],
            color.stroke_width(3),
        ))
        .map_err(err_text)?;
    }
    Ok(())
}

/// A panel without drawable points: its title and a centred grey message.
fn draw_message(area: &Area, title: &str, message: &str) -> Result<(), String> {
    let inner = if title.is_empty() {
        area.clone()
    } else {
        area.titled(title, (FONT, 20).into_font().style(FontStyle::Bold))
            .map_err(err_text)?
    };
    let (w, h) = inner.dim_in_pixel();
    let style = (FONT, 20)
        .into_font()
        .color(&GREY)
        .pos(Pos::new(HPos::Center, VPos::Center));
    inner
        .draw(&Text::new(
            message.to_string(),
            ((w / 2) as i32, (h / 2) as i32),
            style,
        ))
        .map_err(err_text)
}

/// `lo..hi` widened by 5% each side (or by a unit-ish amount when `lo == hi`).
fn linear_range(lo: f64, hi: f64) -> Range<f64> {
    let span = hi - lo;
    let pad = if span > 0.0 && span.is_finite() {
        span * 0.05
    } else if lo != 0.0 {
        lo.abs() * 0.1
    } else {
        1.0
    };
    let (a, b) = (lo - pad, hi + pad);
    if a.is_finite() && b.is_finite() && a < b {
        a..b
    } else {
        // Values near f64::MAX: fall back to the unpadded (or a symmetric) range.
        let m = lo.abs().max(hi.abs()).max(1.0);
        if lo < hi {
            lo..hi
        } else {
            -m..m
        }
    }
}

/// `lo..hi` (both > 0) widened by a factor on each side, for a log axis.
fn log_range(lo: f64, hi: f64) -> Range<f64> {
    let ratio = hi / lo;
    let factor = if ratio > 1.0 && ratio.is_finite() {
        ratio.powf(0.05)
    } else {
        2.0
    };
    let (a, b) = (lo / factor, hi * factor);
    if a > 0.0 && b.is_finite() && a < b {
        a..b
    } else {
        lo..hi.max(lo * 2.0).min(f64::MAX)
    }
}

/// Tick values for a log axis over `lo..hi` (both > 0): (labelled, grid-only).
///
/// Over a decade or more: `1..9 ·10^k`, `1, 2, 5 ·10^k`, `1, 3 ·10^k` or `10^k`, the densest choice
/// with at most 8 labels (every n-th decade when even `10^k` is too dense). Within less than a
/// decade plotters would label at most one power of ten, so there the labels are evenly spaced
/// "nice" values instead.
fn log_ticks(lo: f64, hi: f64) -> (Vec<f64>, Vec<f64>) {
    const MAX_LABELS: usize = 8;
    let in_range = |v: &f64| *v >= lo && *v <= hi;
    if !(lo > 0.0 && hi > lo && lo.is_finite() && hi.is_finite()) {
        return (Vec::new(), Vec::new());
    }
    if hi / lo < 10.0 {
        return (nice_linear_ticks(lo, hi, 6), Vec::new());
    }
    let (k_lo, k_hi) = (lo.log10().floor() as i32, hi.log10().ceil() as i32);
    let decade = |k: i32, mults: &[f64]| -> Vec<f64> {
        mults
            .iter()
            .map(|&m| scaled(m, k))
            .filter(in_range)
            .collect()
    };
    let with =
        |mults: &[f64]| -> Vec<f64> { (k_lo..=k_hi).flat_map(|k| decade(k, mults)).collect() };
    let all: Vec<f64> = (1..=9).map(f64::from).collect();
    let mut labels = Vec::new();
    for mults in [&all[..], &[1.0, 2.0, 5.0], &[1.0, 3.0], &[1.0]] {
        labels = with(mults);
        if labels.len() <= MAX_LABELS {
            break;
        }
    }
    if labels.len() > MAX_LABELS {
        let every = labels.len().div_ceil(MAX_LABELS);
        labels = labels.into_iter().step_by(every).collect();
    }
    let light = if k_hi - k_lo <= 12 {
        with(&all)
    } else {
        Vec::new()
    };
    (labels, light)
}

/// About `target` evenly spaced round values (steps of 1, 2 or 5 ·10^k) inside `lo..=hi`.
fn nice_linear_ticks(lo: f64, hi: f64, target: usize) -> Vec<f64> {
    let raw = (hi - lo) / target.max(1) as f64;
    if !(raw > 0.0 && raw.is_finite()) {
        return vec![lo];
    }
    let e = raw.log10().floor() as i32;
    let m = [1.0, 2.0, 5.0, 10.0]
        .into_iter()
        .find(|&m| scaled(m, e) >= raw)
        .unwrap_or(10.0);
    let step = scaled(m, e);
    let first = (lo / step).ceil() as i64;
    let last = (hi / step).floor() as i64;
    // Computing each tick from its index keeps round values (no accumulated error).
    (first..=last)
        .take(4 * target + 1)
        .map(|i| scaled(i as f64 * m, e))
        .collect()
}

/// `m · 10^e`, rounded once (so `scaled(3.0, -1)` is the double nearest 0.3).
fn scaled(m: f64, e: i32) -> f64 {
    if e >= 0 {
        m * 10f64.powi(e)
    } else {
        m / 10f64.powi(-e)
    }
}

/// Puts the legend where the curves are not at the right-hand end: lower right when the last
/// third of the x range mostly sits high (accuracy-like curves), upper right otherwise.
fn legend_position(
    series: &[Prepared],
    x_range: Range<f64>,
    y_lo: f64,
    y_hi: f64,
) -> SeriesLabelPosition {
    let x_cut = x_range.start + (x_range.end - x_range.start) * 2.0 / 3.0;
    let y_mid = y_lo + (y_hi - y_lo) / 2.0;
    let (mut high, mut low) = (0usize, 0usize);
    for &(_, y) in series
        .iter()
        .flat_map(|s| &s.points)
        .filter(|(x, _)| *x >= x_cut)
    {
        if y > y_mid {
            high += 1;
        } else {
            low += 1;
        }
    }
    if high > low {
        SeriesLabelPosition::LowerRight
    } else {
        SeriesLabelPosition::UpperRight
    }
}

/// Short tick text: plain decimals for ordinary magnitudes, scientific otherwise.
fn tick_text(v: f64) -> String {
    if v == 0.0 {
        return "0".to_string();
    }
    let a = v.abs();
    if !(1e-3..1e6).contains(&a) {
        return format!("{v:.1e}");
    }
    // Six significant digits, trailing zeros dropped.
    let decimals = (5 - a.log10().floor() as i32).clamp(0, 8) as usize;
    let s = format!("{v:.decimals$}");
    let s = if s.contains('.') {
        s.trim_end_matches('0').trim_end_matches('.')
    } else {
        &s
    };
    if s == "-0" {
        "0".to_string()
    } else {
        s.to_string()
    }
}

/// The PNG text chunk every figure of comera's carries (`Software: comera`).
const SOFTWARE_KEY: &str = "Software";
const SOFTWARE: &str = "comera";

/// Whether `path` is a PNG that comera drew (its `Software` text chunk says so).
pub fn is_comera_png(path: &Path) -> bool {
    let Ok(file) = comera_data::open_regular(path) else {
        return false;
    };
    let Ok(reader) = png::Decoder::new(std::io::BufReader::new(file)).read_info() else {
        return false;
    };
    reader
        .info()
        .uncompressed_latin1_text
        .iter()
        .any(|t| t.keyword == SOFTWARE_KEY && t.text == SOFTWARE)
}

/// Encodes `rgb` as a PNG and writes it to `path` atomically ([`comera_run::files::write_atomic`]:
/// a temporary file renamed into place, only over an absent path or a regular file).
fn write_png_atomically(path: &Path, rgb: &[u8], width: u32, height: u32) -> Result<(), PlotError> {
    let enc_err = |e: png::EncodingError| PlotError::Encode {
        path: path.to_path_buf(),
        message: e.to_string(),
    };
    let mut png_bytes = Vec::new();
    {
        let mut encoder = png::Encoder::new(&mut png_bytes, width, height);
        encoder.set_color(png::ColorType::Rgb);
        encoder.set_depth(png::BitDepth::Eight);
        // What `plot --out --overwrite` recognises as comera's own figure (is_comera_png).
        encoder
            .add_text_chunk(SOFTWARE_KEY.into(), SOFTWARE.into())
            .map_err(enc_err)?;
        let mut writer = encoder.write_header().map_err(enc_err)?;
        writer.write_image_data(rgb).map_err(enc_err)?;
        writer.finish().map_err(enc_err)?;
    }
    comera_run::files::write_atomic_then(path, &png_bytes, || {}).map_err(|e| PlotError::Io {
        path: path.to_path_buf(),
        file: e.file,
        source: e.source,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs::{self, File};

    const PNG_SIGNATURE: [u8; 8] = [0x89, b'P', b'N', b'G', b'\r', b'\n', 0x1a, b'\n'];

    /// A fresh directory under the system temp dir, removed on drop.
    struct TempDir(PathBuf);

    impl TempDir {
        fn new(tag: &str) -> Self {
            let dir =
                std::env::temp_dir().join(format!("comera-plot-test-{}-{tag}", std::process::id()));
            let _ = fs::remove_dir_all(&dir);
            fs::create_dir_all(&dir).unwrap();
            Self(dir)
        }
    }

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = fs::remove_dir_all(&self.0);
        }
    }

    fn curve(n: usize, f: impl Fn(f64) -> f64) -> Vec<(f64, f64)> {
        (0..n).map(|i| (i as f64, f(i as f64))).collect()
    }

    fn training_panels() -> Vec<Panel> {
        vec![
            Panel {
                title: "Loss".into(),
                x_label: "step".into(),
                y_label: "cross-entropy".into(),
                series: vec![
                    Series::new("train", curve(200, |x| 2.3 * (-x / 60.0).exp() + 0.2)),
                    Series::new(
                        "valid",
                        (0..=10)
                            .map(|i| {
                                let x = i as f64 * 20.0;
                                (x, 2.3 * (-x / 70.0).exp() + 0.3)
                            })
                            .collect(),
                    ),
                ],
                log_y: true,
                ..Default::default()
            },
            Panel {
                title: "Accuracy".into(),
                x_label: "step".into(),
                y_label: "accuracy".into(),
                series: vec![Series::new(
                    "valid",
                    (0..=10)
                        .map(|i| {
                            let x = i as f64 * 20.0;
                            (x, 0.95 - 0.85 * (-x / 50.0).exp())
                        })
                        .collect(),
                )],
                log_y: false,
                ..Default::default()
            },
        ]
    }

    /// Decodes a PNG file: (width, height, RGB bytes).
    fn decode(path: &Path) -> (u32, u32, Vec<u8>) {
        let decoder = png::Decoder::new(std::io::BufReader::new(File::open(path).unwrap()));
        let mut reader = decoder.read_info().unwrap();
        let mut buf = vec![0; reader.output_buffer_size().unwrap()];
        let info = reader.next_frame(&mut buf).unwrap();
        buf.truncate(info.buffer_size());
        assert_eq!(info.color_type, png::ColorType::Rgb);
        (info.width, info.height, buf)
    }

    fn dark_pixels(rgb: &[u8]) -> usize {
        rgb.chunks_exact(3)
            .filter(|p| p.iter().all(|&c| c < 100))
            .count()
    }

    #[test]
    fn writes_png_with_two_panels_and_no_tmp_left() {
        let dir = TempDir::new("two-panels");
        let path = dir.0.join("curves.png");
        plot_panels(&path, &training_panels(), 800, 320).unwrap();

        let bytes = fs::read(&path).unwrap();
        assert!(bytes.len() > 1000);
        assert_eq!(&bytes[..8], &PNG_SIGNATURE);
        let leftovers: Vec<_> = fs::read_dir(&dir.0)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .filter(|n| n != "curves.png")
            .collect();
        assert!(leftovers.is_empty(), "unexpected files: {leftovers:?}");

        let (w, h, rgb) = decode(&path);
        assert_eq!((w, h), (800, 640));
        // Axes, ticks and text are drawn in black.
        assert!(dark_pixels(&rgb) > 2000);

        // Overwriting an existing plot works too.
        plot_panels(&path, &training_panels()[1..], 400, 300).unwrap();
        assert_eq!(decode(&path).0, 400);
        assert_eq!(
            fs::read_dir(&dir.0).unwrap().count(),
            1,
            "a temporary file was left"
        );

        // Set COMERA_PLOT_KEEP=DIR to keep a copy for looking at.
        if let Some(keep) = std::env::var_os("COMERA_PLOT_KEEP") {
            fs::copy(&path, Path::new(&keep).join("comera-plot-sample-1.png")).unwrap();
            plot_panels(
                &Path::new(&keep).join("comera-plot-sample-2.png"),
                &training_panels(),
                800,
                320,
            )
            .unwrap();
        }
    }

    /// Pixels of exactly this colour in columns `x0..x1` of an RGB image `w` pixels wide.
    fn count_colour(rgb: &[u8], w: u32, x0: u32, x1: u32, c: RGBColor) -> usize {
        rgb.chunks(3)
            .enumerate()
            .filter(|(i, p)| {
                let x = (*i as u32) % w;
                (x0..x1).contains(&x) && p[0] == c.0 && p[1] == c.1 && p[2] == c.2
            })
            .count()
    }

    #[test]
    fn many_series_get_a_legend_beside_the_chart_distinct_styles_and_marks() {
        let dir = TempDir::new("many");
        let path = dir.0.join("ranks.png");
        let series: Vec<Series> = (0..13)
            .map(|i| {
                Series::new(
                    format!("encoder.{i}.attn.q"),
                    curve(50, |x| 16.0 - (i as f64 + 1.0) * x / 10.0),
                )
            })
            .collect();
        let panel = Panel {
            title: "mean active rank per layer".into(),
            x_label: "step".into(),
            y_label: "rank".into(),
            series,
            marks: vec![(20.0, "late stage".into())],
            ..Default::default()
        };
        plot_panels(&path, &[panel], 1300, 400).unwrap();
        if let Some(keep) = std::env::var_os("COMERA_PLOT_KEEP") {
            fs::copy(&path, Path::new(&keep).join("comera-plot-many.png")).unwrap();
        }
        let (w, _, rgb) = decode(&path);
        // The legend has its own column: the chart's grid stops before it, so no line end is
        // under the legend; the column holds the legend's samples (series 0's colour). (A grid
        // running under the legend would give ~130 pixels per grid line; anti-aliased glyph
        // edges hit the grid's grey on a few.)
        let column = w - 150..w - 20;
        assert!(count_colour(&rgb, w, column.start, column.end, GRID) < 60);
        assert!(count_colour(&rgb, w, column.start - 30, column.end, COLORS[0]) > 0);
        // The mark's dashed grey line is drawn.
        assert!(count_colour(&rgb, w, 0, w, GREY) > 100);
        // Series 10.. are dashed in the first colours again: series 10 shares series 0's
        // colour but not its style, so 13 lines stay distinguishable.
        let styles: std::collections::HashSet<(u8, u8, u8, bool)> = (0..13)
            .map(|i| {
                let c = COLORS[i % COLORS.len()];
                (c.0, c.1, c.2, (i / COLORS.len()) % 2 == 1)
            })
            .collect();
        assert_eq!(styles.len(), 13);
    }

    #[test]
    fn bars_are_filled_and_stand_on_zero() {
        let dir = TempDir::new("bars");
        let path = dir.0.join("bars.png");
        let panel = Panel {
            title: "ms per step".into(),
            x_label: "arm".into(),
            y_label: "ms".into(),
            series: vec![Series::new(
                "median",
                vec![(1.0, 10.0), (2.0, 20.0), (3.0, 5.0)],
            )],
            bars: Some(Bars {
                width: 0.5,
                x_names: vec!["dense".into(), "galore".into(), "comera".into()],
            }),
            ..Default::default()
        };
        plot_panels(&path, &[panel], 600, 400).unwrap();
        let (w, _, rgb) = decode(&path);
        // Three bars of half a unit on a 3-unit axis, filled: thousands of pixels, where an
        // outline would give a few hundred.
        assert!(count_colour(&rgb, w, 0, w, COLORS[0]) > 10_000);
    }

    #[test]
    fn text_is_rendered_with_the_embedded_font() {
        // A panel with only a message: every dark pixel there comes from glyphs.
        let dir = TempDir::new("text");
        let path = dir.0.join("text.png");
        let panel = Panel {
            title: "Title text".into(),
            ..Panel::default()
        };
        plot_panels(&path, &[panel], 300, 200).unwrap();
        let (_, _, rgb) = decode(&path);
        let inked = rgb
            .chunks_exact(3)
            .filter(|p| p.iter().any(|&c| c < 200))
            .count();
        assert!(inked > 100, "only {inked} inked pixels: no text drawn?");
    }

    #[test]
    fn degenerate_data_does_not_panic() {
        let dir = TempDir::new("degenerate");
        let nan = f64::NAN;
        let inf = f64::INFINITY;
        let panels = vec![
            Panel {
                title: "NaN only".into(),
                series: vec![Series::new(
                    "train",
                    vec![(0.0, nan), (1.0, nan), (nan, 1.0)],
                )],
                ..Panel::default()
            },
            Panel {
                title: "empty series".into(),
                series: vec![Series::new("train", vec![]), Series::new("", vec![])],
                ..Panel::default()
            },
            Panel {
                title: "no series".into(),
                ..Panel::default()
            },
            Panel {
                title: "single point".into(),
                series: vec![Series::new("valid", vec![(3.0, 0.5)])],
                ..Panel::default()
            },
            Panel {
                title: "single point at zero, log".into(),
                series: vec![Series::new("valid", vec![(0.0, 0.0)])],
                log_y: true,
                ..Panel::default()
            },
            Panel {
                title: "mixed with gaps and infinities".into(),
                series: vec![
                    Series::new(
                        "train",
                        vec![(0.0, 1.0), (1.0, nan), (2.0, inf), (3.0, -inf), (4.0, 0.5)],
                    ),
                    Series::new("empty", vec![]),
                    Series::new("nan", vec![(0.0, nan)]),
                ],
                log_y: true,
                ..Panel::default()
            },
            Panel {
                title: "constant, huge and tiny".into(),
                series: vec![
                    Series::new("flat", vec![(5.0, 1e300), (5.0, 1e300)]),
                    Series::new("max", vec![(-f64::MAX, f64::MAX), (f64::MAX, -f64::MAX)]),
                ],
                ..Panel::default()
            },
            Panel {
                title: "spans of a few ulps".into(),
                series: vec![
                    Series::new("a", vec![(0.0, 1.0), (1.0, 1.0 + f64::EPSILON)]),
                    Series::new("b", vec![(1e15, 0.1), (1e15 + 0.125, 0.1)]),
                ],
                ..Panel::default()
            },
            Panel {
                title: "spans of a few ulps, log".into(),
                series: vec![Series::new("a", vec![(0.0, 0.3), (1.0, 0.3 + 1e-16)])],
                log_y: true,
                ..Panel::default()
            },
            Panel {
                title: "tiny and wide, log".into(),
                series: vec![Series::new(
                    "a",
                    vec![(0.0, 5e-324), (1.0, 1e-300), (2.0, 1e-20), (3.0, 1e15)],
                )],
                log_y: true,
                ..Panel::default()
            },
            Panel {
                title: "tiny and constant".into(),
                series: vec![Series::new("a", vec![(0.0, 1e-300), (1e-300, 1e-300)])],
                ..Panel::default()
            },
        ];
        for (i, panel) in panels.iter().enumerate() {
            let path = dir.0.join(format!("p{i}.png"));
            plot_panels(&path, std::slice::from_ref(panel), 400, 240)
                .unwrap_or_else(|e| panic!("panel {i} ({}): {e}", panel.title));
            assert_eq!(&fs::read(&path).unwrap()[..8], &PNG_SIGNATURE);
        }
        let path = dir.0.join("all.png");
        plot_panels(&path, &panels, 500, 150).unwrap();
        plot_panels(&dir.0.join("none.png"), &[], 300, 200).unwrap();
        assert_eq!(decode(&dir.0.join("none.png")).1, 200);
    }

    #[test]
    fn unwritable_path_is_an_error_naming_the_file() {
        let dir = TempDir::new("unwritable");
        // A regular file used as a directory fails even for root.
        let not_a_dir = dir.0.join("not-a-dir");
        fs::write(&not_a_dir, b"x").unwrap();
        let path = not_a_dir.join("curves.png");
        let err = plot_panels(&path, &training_panels(), 400, 200).unwrap_err();
        assert!(matches!(err, PlotError::Io { .. }), "{err:?}");
        let text = err.to_string();
        assert!(text.contains(&path.display().to_string()), "{text}");

        // A directory in the way of the final name: the rename fails, no tmp file is left.
        let blocked = dir.0.join("blocked.png");
        fs::create_dir(&blocked).unwrap();
        fs::write(blocked.join("inside"), b"x").unwrap();
        let err = plot_panels(&blocked, &training_panels(), 400, 200).unwrap_err();
        assert!(err.to_string().contains("blocked.png"), "{err}");
        let names: Vec<_> = fs::read_dir(&dir.0)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert!(
            names.iter().all(|n| !n.to_string_lossy().contains(".tmp-")),
            "a temporary file was left: {names:?}"
        );
        // A FIFO (or any other special file) in place of the plot is refused, not replaced.
        let fifo = dir.0.join("fifo.png");
        let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
        // SAFETY: a NUL-terminated path made above.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        let err = plot_panels(&fifo, &training_panels(), 400, 200).unwrap_err();
        assert!(err.to_string().contains("FIFO"), "{err}");
        use std::os::unix::fs::FileTypeExt;
        assert!(fs::symlink_metadata(&fifo).unwrap().file_type().is_fifo());
    }

    #[test]
    fn bad_sizes_are_errors() {
        let dir = TempDir::new("sizes");
        let path = dir.0.join("x.png");
        for (w, h) in [(0, 100), (100, 0), (MAX_SIDE + 1, 100), (100, MAX_SIDE)] {
            let err = plot_panels(&path, &training_panels(), w, h).unwrap_err();
            assert!(matches!(err, PlotError::BadSize { .. }), "{err:?}");
            assert!(err.to_string().contains("x.png"));
        }
        assert!(!path.exists());
    }

    #[test]
    fn tick_text_is_short() {
        assert_eq!(tick_text(0.0), "0");
        assert_eq!(tick_text(1000.0), "1000");
        assert_eq!(tick_text(0.25), "0.25");
        assert_eq!(tick_text(-1.5), "-1.5");
        assert_eq!(tick_text(2e-5), "2.0e-5");
        assert_eq!(tick_text(3e7), "3.0e7");
        assert_eq!(tick_text(1e-9), "1.0e-9");
        assert_eq!(tick_text(0.1 + 0.2), "0.3");
        assert_eq!(tick_text(0.123459), "0.123459");
        assert_eq!(tick_text(1234.5678), "1234.57");
        assert_eq!(tick_text(250000.0), "250000");
    }

    #[test]
    fn log_ticks_are_round_and_in_range() {
        // Less than a decade: evenly spaced round labels.
        let (bold, light) = log_ticks(0.25, 2.0);
        assert_eq!(bold, vec![0.5, 1.0, 1.5, 2.0]);
        assert!(light.is_empty());
        // A decade or more: 1..9 would give 10 labels, 1, 2, 5 gives 4.
        let (bold, _) = log_ticks(0.2, 2.5);
        assert_eq!(bold, vec![0.2, 0.5, 1.0, 2.0]);
        let (bold, light) = log_ticks(0.05, 30.0);
        // 1, 2, 5 would give 9 labels; 1, 3 gives 6.
        assert_eq!(bold, vec![0.1, 0.3, 1.0, 3.0, 10.0, 30.0]);
        assert!(light.len() > bold.len());
        // Many decades: powers of ten, thinned to at most 8 labels.
        let (bold, _) = log_ticks(1e-300, 1e15);
        assert!((2..=8).contains(&bold.len()), "{bold:?}");
        assert!(bold.iter().all(|v| (1e-300..=1e15).contains(v)));
    }
}
