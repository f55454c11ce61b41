//! Pictures of a run's figures, as SVG (feature `plot`): rates against a setting on a
//! logarithmic axis, one line per consumer through the medians, with bars from the
//! smallest to the largest round.
//!
//! Only plotters' SVG backend is compiled in: no bitmap encoders and no font loading. Text
//! goes into the SVG as `<text>` elements that the viewer renders with its own fonts;
//! plotters only estimates their size to lay the chart out.

use std::path::Path;

use plotters::prelude::*;

/// One consumer's figures: at each setting `x`, the smallest, the median and the largest of
/// its rounds.
#[derive(Clone, Debug)]
pub struct Series {
    /// The consumer, as the legend names it.
    pub label: String,
    /// `(x, min, median, max)`, in any order.
    pub points: Vec<(f64, f64, f64, f64)>,
}

/// One chart of the picture: a caption and its consumers.
#[derive(Clone, Debug)]
pub struct Panel {
    /// Shown above the chart.
    pub caption: String,
    /// One line each; a series without points is left out.
    pub series: Vec<Series>,
}

/// The colours of the lines, in series order (then again from the start): distinct for
/// the few consumers a chart has, and readable on white.
const COLORS: [RGBColor; 8] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
];

/// Draws `panels` side by side as one SVG at `path` (its folder is made if missing): x on a
/// logarithmic axis labelled at the settings measured, y from 0; per series a line through
/// the medians and a bar from min to max at each x.
///
/// ```no_run
/// use bench_support::plot::{Panel, Series, log_x_panels};
///
/// let ours = Series {
///     label: "ours".into(),
///     points: vec![(20.0, 9e3, 1e4, 11e3), (1000.0, 2e4, 22e3, 23e3)],
/// };
/// let panel = Panel { caption: "retry path".into(), series: vec![ours] };
/// log_x_panels("rates.svg".as_ref(), "msg/s by prefetch", "prefetch", "msg/s", &[panel])?;
/// # Ok::<(), String>(())
/// ```
pub fn log_x_panels(
    path: &Path,
    title: &str,
    x_desc: &str,
    y_desc: &str,
    panels: &[Panel],
) -> Result<(), String> {
    if let Some(folder) = path.parent().filter(|f| !f.as_os_str().is_empty()) {
        std::fs::create_dir_all(folder).map_err(|e| format!("{}: {e}", folder.display()))?;
    }
    let width = 560 * u32::try_from(panels.len().max(1)).unwrap_or(1);
    let root = SVGBackend::new(path, (width, 520)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| e.to_string())?;
    let root = root
        .titled(title, ("sans-serif", 20))
        .map_err(|e| e.to_string())?;
    for (area, panel) in root
        .split_evenly((1, panels.len().max(1)))
        .iter()
        .zip(panels)
    {
        let points = || panel.series.iter().flat_map(|s| s.points.iter());
        // The settings measured are the axis's labels; a log axis needs them above 0.
        let mut xs: Vec<f64> = points().map(|p| p.0).filter(|x| *x > 0.0).collect();
        xs.sort_by(f64::total_cmp);
        xs.dedup();
        let (Some(&lo), Some(&hi)) = (xs.first(), xs.last()) else {
            continue;
        };
        let top = points().map(|p| p.3).fold(1.0, f64::max) * 1.1;
        let mut chart = ChartBuilder::on(area)
            .margin(14)
            .x_label_area_size(40)
            .y_label_area_size(64)
            .caption(&panel.caption, ("sans-serif", 16))
            .build_cartesian_2d(
                (lo / 1.5..hi * 1.5).log_scale().with_key_points(xs.clone()),
                0.0..top,
            )
            .map_err(|e| e.to_string())?;
        chart
            .configure_mesh()
            .x_desc(x_desc)
            .y_desc(y_desc)
            .x_label_formatter(&|x| format!("{x:.0}"))
            .y_label_formatter(&|y| format!("{:.0}k", y / 1000.0))
            .light_line_style(WHITE)
            .draw()
            .map_err(|e| e.to_string())?;
        for (i, series) in panel.series.iter().enumerate() {
            if series.points.is_empty() {
                continue;
            }
            let color = COLORS[i % COLORS.len()];
            let mut sorted = series.points.clone();
            sorted.sort_by(|a, b| a.0.total_cmp(&b.0));
            chart
                .draw_series(LineSeries::new(
                    sorted.iter().map(|p| (p.0, p.2)),
                    color.stroke_width(2),
                ))
                .map_err(|e| e.to_string())?
                .label(&series.label)
                .legend(move |(x, y)| {
                    PathElement::new([(x, y), (x + 18, y)], color.stroke_width(2))
                });
            chart
                .draw_series(sorted.iter().map(|&(x, min, median, max)| {
                    ErrorBar::new_vertical(x, min, median, max, color.stroke_width(1), 8)
                }))
                .map_err(|e| e.to_string())?;
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperLeft)
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK.mix(0.3))
            .label_font(("sans-serif", 13))
            .draw()
            .map_err(|e| e.to_string())?;
    }
    root.present().map_err(|e| e.to_string())
}
