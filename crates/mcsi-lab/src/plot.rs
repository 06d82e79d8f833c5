//! Figures as PNG (plotters): one metric against one swept parameter, a line per series with
//! the median of the repetitions and bars from min to max, the published points as markers and
//! the model's curve where one exists.

use crate::model;
use crate::results::Aggregate;
use crate::spec::{Experiment, Figure};
use plotters::element::DashedPathElement;
use plotters::prelude::*;
use plotters::style::FontStyle;
use std::path::Path;
use std::sync::Once;

const W: u32 = 1100;
const H: u32 = 680;

const COLORS: [RGBColor; 7] = [
    RGBColor(31, 119, 180),
    RGBColor(214, 39, 40),
    RGBColor(44, 160, 44),
    RGBColor(255, 127, 14),
    RGBColor(148, 103, 189),
    RGBColor(23, 190, 207),
    RGBColor(140, 86, 75),
];
const INK: RGBColor = RGBColor(30, 30, 30);
const MODEL: RGBColor = RGBColor(110, 110, 110);

/// The fonts are compiled in, so figures look the same on a machine without fonts.
fn fonts() -> Result<(), String> {
    static ONCE: Once = Once::new();
    let mut r = Ok(());
    ONCE.call_once(|| {
        r = plotters::style::register_font(
            "sans-serif",
            FontStyle::Normal,
            dejavu::sans::regular(),
        )
        .and_then(|()| {
            plotters::style::register_font("sans-serif", FontStyle::Bold, dejavu::sans::bold())
        })
        .map_err(|_| "cannot load the embedded DejaVu font".to_string());
    });
    r
}

/// A model's curve: label, points, colour and dash pattern (dash, gap).
type Curve = (String, Vec<(f64, f64)>, RGBColor, (u32, u32));

/// A line of the figure: (x, median, min, max), sorted by x.
struct Line {
    series: String,
    label: String,
    points: Vec<(f64, f64, f64, f64)>,
}

fn fmt_tick(v: f64) -> String {
    if (v - v.round()).abs() < 1e-9 {
        format!("{}", v.round() as i64)
    } else {
        format!("{v:.2}")
            .trim_end_matches('0')
            .trim_end_matches('.')
            .to_string()
    }
}

/// Whether two series lie on top of each other in a figure whose y axis spans `span` once
/// drawn (`ty`: a value's place on the axis): the same x values, medians within 1.5 % of it.
fn coincide(a: &Line, b: &Line, span: f64, ty: impl Fn(f64) -> f64) -> bool {
    a.points.len() == b.points.len()
        && a.points
            .iter()
            .zip(&b.points)
            .all(|(p, q)| p.0 == q.0 && (ty(p.1) - ty(q.1)).abs() <= 0.015 * span)
}

/// `note` as one line, or as two split at the "; " nearest `max` characters from the start.
fn wrap_note(note: &str, max: usize) -> Vec<String> {
    if note.chars().count() <= max {
        return vec![note.to_string()];
    }
    let cut = note
        .char_indices()
        .take_while(|(i, _)| *i <= max)
        .filter(|(i, _)| note[*i..].starts_with("; "))
        .map(|(i, _)| i)
        .last();
    match cut {
        Some(i) => vec![note[..i + 1].to_string(), note[i + 2..].to_string()],
        None => vec![note.to_string()],
    }
}

/// Draws `fig` from `aggs` into `path`. `note` goes under the figure (runs, link, congestion).
pub fn draw(
    exp: &Experiment,
    fig: &Figure,
    aggs: &[Aggregate],
    note: &str,
    path: &Path,
) -> Result<bool, String> {
    fonts()?;
    let tx = |x: f64| if fig.x_log { x.log2() } else { x };
    // On a log y axis a value is drawn at its log10; zero and below at the axis's foot.
    let ty = |y: f64| if fig.y_log { y.max(1e-9).log10() } else { y };
    let mut lines = Vec::new();
    for s in &fig.series {
        let mut pts: Vec<(f64, f64, f64, f64)> = aggs
            .iter()
            .filter(|a| &a.point.series == s && fig.filter.matches(&a.point))
            .filter_map(|a| {
                let x = a.point.num(fig.x.name)?;
                let m = a.metrics.get(&fig.y)?;
                Some((x, m.median, m.min, m.max))
            })
            .collect();
        pts.sort_by(|a, b| a.0.total_cmp(&b.0));
        if !pts.is_empty() {
            lines.push(Line {
                series: s.clone(),
                label: exp.series_label(s).to_string(),
                points: pts,
            });
        }
    }
    // Model curves: one per distinct curve over the series (a model that depends on the
    // number of connections gives one per connection count).
    let mut curves: Vec<Curve> = Vec::new();
    for (mi, m) in fig.models.iter().enumerate() {
        let dash = [(10, 6), (3, 5), (18, 6), (6, 3)][mi % 4];
        let mut mine: Vec<Vec<(f64, f64)>> = Vec::new();
        let mut labels = Vec::new();
        for s in &fig.series {
            let mut pts: Vec<(f64, f64)> = aggs
                .iter()
                .filter(|a| &a.point.series == s && fig.filter.matches(&a.point))
                .filter_map(|a| {
                    Some((
                        a.point.num(fig.x.name)?,
                        model::value(m, &a.point, fig.y).ok()?,
                    ))
                })
                .collect();
            pts.sort_by(|a, b| a.0.total_cmp(&b.0));
            pts.dedup_by(|a, b| a.0 == b.0);
            if pts.is_empty()
                || mine.iter().any(|c| {
                    c.len() == pts.len()
                        && c.iter().zip(&pts).all(|(a, b)| (a.1 - b.1).abs() < 1e-9)
                })
            {
                continue;
            }
            let conns = aggs
                .iter()
                .find(|a| &a.point.series == s)
                .and_then(|a| a.point.num("connections"))
                .unwrap_or(1.0);
            let line = lines.iter().position(|l| &l.series == s).unwrap_or(0);
            labels.push((conns, COLORS[line % COLORS.len()]));
            mine.push(pts);
        }
        let several = mine.len() > 1;
        // One curve: grey. Several (one per connection count): each in the colour of the
        // first series it belongs to.
        for (pts, (conns, colour)) in mine.into_iter().zip(labels) {
            if several {
                curves.push((format!("{}, {} conn.", m.label, conns), pts, colour, dash));
            } else {
                curves.push((m.label.clone(), pts, MODEL, dash));
            }
        }
    }
    let all_x: Vec<f64> = lines
        .iter()
        .flat_map(|l| l.points.iter().map(|p| p.0))
        .chain(
            fig.published
                .iter()
                .flat_map(|p| p.points.iter().map(|q| q[0])),
        )
        .filter(|x| !fig.x_log || *x > 0.0)
        .collect();
    if all_x.is_empty() {
        // None of its series ran (a quick run keeps fewer series): nothing to draw.
        let _ = std::fs::remove_file(path);
        return Ok(false);
    }
    let (xmin, xmax) = all_x
        .iter()
        .fold((f64::MAX, f64::MIN), |(a, b), &x| (a.min(x), b.max(x)));
    let (mut x0, mut x1) = (tx(xmin), tx(xmax));
    let pad = ((x1 - x0) * 0.05).max(0.1);
    x0 -= pad;
    x1 += pad;
    let ymax = lines
        .iter()
        .flat_map(|l| l.points.iter().map(|p| p.3))
        .chain(
            fig.published
                .iter()
                .flat_map(|p| p.points.iter().map(|q| q[1])),
        )
        .chain(curves.iter().flat_map(|c| c.1.iter().map(|p| p.1)))
        .fold(0.0f64, f64::max);
    // A legend at the top gets room of its own above the data.
    let head = if fig.legend.starts_with("upper") {
        1.6
    } else {
        1.15
    };
    let (y0, y1) = if fig.y_log {
        let ymin = lines
            .iter()
            .flat_map(|l| l.points.iter().map(|p| p.2))
            .filter(|y| *y > 0.0)
            .fold(f64::MAX, f64::min);
        let lo = if ymin < f64::MAX {
            ymin.log10().floor()
        } else {
            0.0
        };
        let hi = ty(ymax.max(1e-9)) + if head > 1.5 { 1.0 } else { 0.2 };
        (lo, hi.max(lo + 1.0))
    } else {
        (0.0, if ymax > 0.0 { ymax * head } else { 1.0 })
    };

    let root = BitMapBackend::new(path, (W, H)).into_drawing_area();
    let err = |e: DrawingAreaErrorKind<_>| format!("{}: {e}", path.display());
    root.fill(&WHITE).map_err(err)?;
    // A note too long for one line goes on two, split at a "; ".
    let note_lines = wrap_note(note, 150);
    let (chart_area, foot) = root.split_vertically(H - 16 - 18 * note_lines.len() as u32);
    for (i, l) in note_lines.iter().enumerate() {
        foot.draw(&Text::new(
            l.clone(),
            (14, 8 + 18 * i as i32),
            ("sans-serif", 15).into_font().color(&MODEL),
        ))
        .map_err(err)?;
    }
    let mut chart = ChartBuilder::on(&chart_area)
        .caption(
            &fig.title,
            ("sans-serif", 24).into_font().style(FontStyle::Bold),
        )
        .margin(16)
        .x_label_area_size(52)
        .y_label_area_size(74)
        .build_cartesian_2d(x0..x1, y0..y1)
        .map_err(err)?;
    let x_ticks: Vec<f64> = if fig.x_log {
        let mut v: Vec<f64> = all_x.iter().map(|x| tx(*x)).collect();
        v.sort_by(f64::total_cmp);
        v.dedup();
        v
    } else {
        Vec::new()
    };
    let log = fig.x_log;
    // On a log axis, a label at every power of two the axis spans.
    let mut distinct: Vec<f64> = all_x.clone();
    distinct.sort_by(f64::total_cmp);
    distinct.dedup();
    let n_ticks = if log {
        ((x1 - x0).floor() as usize + 1).max(x_ticks.len()).max(2)
    } else if distinct.len() <= 12
        && distinct.iter().all(|x| x.fract() == 0.0)
        && distinct.windows(2).all(|w| w[1] - w[0] == 1.0)
    {
        // Consecutive whole numbers (a requirement's number): a label at each.
        distinct.len().max(2)
    } else {
        10
    };
    // On a log y axis, a label at each power of ten.
    let n_y_ticks = if fig.y_log {
        ((y1 - y0).floor() as usize + 1).max(2)
    } else {
        10
    };
    chart
        .configure_mesh()
        .x_desc(if log {
            format!("{} (log scale)", fig.x.axis)
        } else {
            fig.x.axis.to_string()
        })
        .y_desc(if fig.y_log {
            format!("{} (log scale)", fig.y.axis())
        } else {
            fig.y.axis().to_string()
        })
        .axis_desc_style(("sans-serif", 18))
        .label_style(("sans-serif", 15))
        .x_labels(n_ticks)
        .y_labels(n_y_ticks)
        .x_label_formatter(&|v| {
            if log {
                fmt_tick(2f64.powf(*v))
            } else {
                fmt_tick(*v)
            }
        })
        .y_label_formatter(&|v| {
            if fig.y_log {
                fmt_tick(10f64.powf(*v))
            } else {
                fmt_tick(*v)
            }
        })
        .light_line_style(WHITE.mix(0.0))
        .bold_line_style(BLACK.mix(0.08))
        .draw()
        .map_err(err)?;

    for (i, l) in lines.iter().enumerate() {
        let c = COLORS[i % COLORS.len()];
        let pts: Vec<(f64, f64)> = l.points.iter().map(|p| (tx(p.0), ty(p.1))).collect();
        // A series that later ones cover is drawn wider, so that it shows around them.
        let under = lines[i + 1..]
            .iter()
            .filter(|o| coincide(l, o, y1 - y0, ty))
            .count() as u32;
        let (width, radius) = (2 + 3 * under, 4 + 3 * under);
        chart
            .draw_series(LineSeries::new(pts.clone(), c.stroke_width(width)))
            .map_err(err)?
            .label(l.label.clone())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 22, y)], c.stroke_width(2)));
        chart
            .draw_series(
                pts.iter()
                    .map(|&(x, y)| Circle::new((x, y), radius, c.filled())),
            )
            .map_err(err)?;
        chart
            .draw_series(l.points.iter().filter(|p| p.3 > p.2).map(|p| {
                ErrorBar::new_vertical(tx(p.0), ty(p.2), ty(p.1), ty(p.3), c.stroke_width(1), 8)
            }))
            .map_err(err)?;
    }
    for (label, pts, colour, (dash, gap)) in &curves {
        let pts: Vec<(f64, f64)> = pts.iter().map(|p| (tx(p.0), ty(p.1))).collect();
        let style = colour.stroke_width(2);
        let (dash, gap) = (*dash, *gap);
        chart
            .draw_series(DashedLineSeries::new(pts, dash, gap, style))
            .map_err(err)?
            .label(label.clone())
            .legend(move |(x, y)| {
                DashedPathElement::new(vec![(x, y), (x + 26, y)], dash, gap, style)
            });
    }
    for (i, p) in fig.published.iter().enumerate() {
        let pts: Vec<(f64, f64)> = p
            .points
            .iter()
            .filter(|q| !log || q[0] > 0.0)
            .map(|q| (tx(q[0]), ty(q[1])))
            .collect();
        if i % 2 == 0 {
            chart
                .draw_series(
                    pts.iter()
                        .map(|&(x, y)| TriangleMarker::new((x, y), 9, INK.filled())),
                )
                .map_err(err)?
                .label(p.label.clone())
                .legend(|(x, y)| TriangleMarker::new((x + 11, y), 7, INK.filled()));
        } else {
            chart
                .draw_series(
                    pts.iter()
                        .map(|&(x, y)| Cross::new((x, y), 7, INK.stroke_width(3))),
                )
                .map_err(err)?
                .label(p.label.clone())
                .legend(|(x, y)| Cross::new((x + 11, y), 6, INK.stroke_width(3)));
        }
    }
    chart
        .configure_series_labels()
        .position(match fig.legend.as_str() {
            "upper-left" => SeriesLabelPosition::UpperLeft,
            "upper-right" => SeriesLabelPosition::UpperRight,
            "lower-left" => SeriesLabelPosition::LowerLeft,
            "middle-right" => SeriesLabelPosition::MiddleRight,
            _ => SeriesLabelPosition::LowerRight,
        })
        .background_style(WHITE.mix(0.9))
        .border_style(BLACK.mix(0.3))
        .label_font(("sans-serif", 15))
        .draw()
        .map_err(err)?;
    root.present().map_err(err)?;
    Ok(true)
}

/// One line of a time trace: a label, (seconds, value) samples, and the times of events to mark
/// on it (congestion-window reductions).
#[derive(Debug, Clone, Default)]
pub struct Trace {
    pub label: String,
    pub points: Vec<(f64, f64)>,
    pub events: Vec<f64>,
}

/// A value over time, a line per trace, with each trace's events marked by a cross on its line
/// (the congestion-window traces of `mcsi monitor --plot`).
pub fn traces(path: &Path, title: &str, y_label: &str, traces: &[Trace]) -> Result<(), String> {
    fonts()?;
    let t_max = traces
        .iter()
        .flat_map(|t| t.points.iter().map(|p| p.0))
        .fold(0.0f64, f64::max)
        .max(1e-3);
    let y_max = traces
        .iter()
        .flat_map(|t| t.points.iter().map(|p| p.1))
        .fold(0.0f64, f64::max)
        .max(1.0)
        * 1.15;
    let root = BitMapBackend::new(path, (W, H)).into_drawing_area();
    let e = |e: &dyn std::fmt::Display| format!("{}: {e}", path.display());
    root.fill(&WHITE).map_err(|x| e(&x))?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 22).into_font().color(&INK))
        .margin(16)
        .x_label_area_size(48)
        .y_label_area_size(72)
        .build_cartesian_2d(0.0..t_max, 0.0..y_max)
        .map_err(|x| e(&x))?;
    chart
        .configure_mesh()
        .x_desc("time (s)")
        .y_desc(y_label)
        .label_style(("sans-serif", 15))
        .axis_desc_style(("sans-serif", 17))
        .light_line_style(RGBColor(235, 235, 235))
        .draw()
        .map_err(|x| e(&x))?;
    for (i, t) in traces.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        chart
            .draw_series(LineSeries::new(
                t.points.iter().copied(),
                color.stroke_width(2),
            ))
            .map_err(|x| e(&x))?
            .label(format!("{} ({} reductions)", t.label, t.events.len()))
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(3))
            });
        // An event sits on the line at the last sample at or before it.
        let marks: Vec<(f64, f64)> = t
            .events
            .iter()
            .filter_map(|&at| {
                t.points
                    .iter()
                    .take_while(|p| p.0 <= at + 1e-9)
                    .last()
                    .map(|p| (at, p.1))
            })
            .collect();
        chart
            .draw_series(
                marks
                    .into_iter()
                    .map(|p| Cross::new(p, 7, color.stroke_width(2))),
            )
            .map_err(|x| e(&x))?;
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .background_style(WHITE.mix(0.85))
        .border_style(RGBColor(200, 200, 200))
        .label_font(("sans-serif", 15))
        .draw()
        .map_err(|x| e(&x))?;
    root.present().map_err(|x| e(&x))?;
    Ok(())
}
