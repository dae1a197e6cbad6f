//! `bench --svg FILE`: the run's results as one picture, a panel per test (prompt processing and
//! generation have their own scales). In each, Hypura and llama.cpp side by side: a bar to the
//! mean, a whisker of one standard deviation, and every sample as a dot, with the ratio in the
//! panel's caption. `summary_svg` draws `scripts/bench/bench-limited`'s table: each run's decode speed
//! beside the physical limit, and its peak memory beside the memory limit. `budget_svg` draws
//! `inspect --svg`: the predicted decode speed and the mode the planner picks at each memory
//! budget, this machine's marked. Drawn with plotters into SVG.
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

use super::{BenchReport, Rate, TestResult};

const WIDTH: u32 = 480;
const HEIGHT: u32 = 420;
const HYPURA: RGBColor = RGBColor(0x1f, 0x6f, 0xb4);
const LLAMA_CPP: RGBColor = RGBColor(0xe0, 0x7b, 0x1a);
const LIMIT: RGBColor = RGBColor(0xb0, 0x20, 0x20);

/// The SVG text of the report's picture.
pub fn svg(report: &BenchReport) -> Result<String, String> {
    let panels = report.results.len().max(1) as u32;
    let mut text = String::new();
    {
        let root = SVGBackend::with_string(&mut text, (WIDTH * panels, HEIGHT)).into_drawing_area();
        root.fill(&WHITE).map_err(|error| error.to_string())?;
        let (title, body) = root.split_vertically(56);
        let heading = format!(
            "{} ({}), {}, {} threads",
            report.model_description,
            crate::format::format_bytes(report.file_bytes),
            report.mode,
            report.threads
        );
        title
            .draw_text(&heading, &("sans-serif", 18).into_font().color(&BLACK), (16, 10))
            .map_err(|error| error.to_string())?;
        title
            .draw_text(
                "bar: the mean · whisker: one standard deviation · dots: every run",
                &("sans-serif", 13).into_font().color(&BLACK.mix(0.7)),
                (16, 34),
            )
            .map_err(|error| error.to_string())?;
        for (area, result) in body.split_evenly((1, panels as usize)).iter().zip(&report.results) {
            panel(area, result)?;
        }
        root.present().map_err(|error| error.to_string())?;
    }
    Ok(text)
}

fn panel<DB: DrawingBackend>(
    area: &DrawingArea<DB, plotters::coord::Shift>,
    result: &TestResult,
) -> Result<(), String> {
    let error = |error: DrawingAreaErrorKind<DB::ErrorType>| error.to_string();
    let sides: Vec<(&str, &Rate, RGBColor)> =
        [("Hypura", &result.hypura, HYPURA), ("llama.cpp", &result.llama_cpp, LLAMA_CPP)]
            .into_iter()
            .filter_map(|(name, rate, color)| rate.as_ref().map(|rate| (name, rate, color)))
            .collect();
    let top = sides
        .iter()
        .flat_map(|(_, rate, _)| rate.samples.iter().copied().chain([rate.mean + rate.sd]))
        .fold(0.0_f64, f64::max)
        .max(1e-9)
        * 1.15;
    let caption = match result.ratio {
        Some(ratio) => format!("{}: Hypura {ratio:.2}× llama.cpp", result.test),
        None => result.test.clone(),
    };
    let names: Vec<&str> = sides.iter().map(|(name, _, _)| *name).collect();
    let mut chart = ChartBuilder::on(area)
        .caption(caption, ("sans-serif", 16))
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(64)
        .build_cartesian_2d(0.0..sides.len() as f64, 0.0..top)
        .map_err(error)?;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .max_light_lines(0)
        .x_labels(sides.len() * 2 + 1)
        .x_label_formatter(&|x| {
            let index = x.floor() as usize;
            if (x - index as f64 - 0.5).abs() < 1e-6 {
                names.get(index).map_or_else(String::new, |name| name.to_string())
            } else {
                String::new()
            }
        })
        .y_desc("tokens per second")
        .y_label_formatter(&|y| format!("{y:.0}"))
        .label_style(("sans-serif", 13))
        .axis_desc_style(("sans-serif", 14))
        .draw()
        .map_err(error)?;
    for (index, (_, rate, color)) in sides.iter().enumerate() {
        let left = index as f64 + 0.2;
        let right = index as f64 + 0.8;
        let middle = index as f64 + 0.5;
        chart
            .draw_series([Rectangle::new([(left, 0.0), (right, rate.mean)], color.mix(0.35).filled())])
            .map_err(error)?;
        chart
            .draw_series([PathElement::new(
                vec![(middle, (rate.mean - rate.sd).max(0.0)), (middle, rate.mean + rate.sd)],
                color.stroke_width(2),
            )])
            .map_err(error)?;
        chart
            .draw_series([PathElement::new(vec![(left, rate.mean), (right, rate.mean)], color.stroke_width(3))])
            .map_err(error)?;
        // The samples, spread across the bar so that equal ones stay visible.
        let count = rate.samples.len().max(1) as f64;
        chart
            .draw_series(rate.samples.iter().enumerate().map(|(at, sample)| {
                let x = left + 0.1 + 0.4 * (at as f64 + 0.5) / count;
                Circle::new((x, *sample), 4, color.filled())
            }))
            .map_err(error)?;
        let highest = rate.samples.iter().copied().fold(rate.mean + rate.sd, f64::max);
        chart
            .draw_series([Text::new(
                format!("{:.2} ± {:.2}", rate.mean, rate.sd),
                (left, highest + top * 0.1),
                ("sans-serif", 13).into_font().color(&BLACK),
            )])
            .map_err(error)?;
    }
    Ok(())
}

/// One run of a `scripts/bench/bench-limited` summary (`summary.json`, written by
/// `scripts/bench/bench-summary.py`).
#[derive(Debug, Clone, serde::Deserialize)]
pub struct SummaryRun {
    pub label: String,
    /// Decode tokens per second; None where the run did not finish.
    pub tokens_per_sec: Option<f64>,
    /// The process's exit status (137: killed by the OOM killer; 124: over the time limit).
    pub status: Option<i64>,
    pub peak_bytes: Option<u64>,
}

/// A `scripts/bench/bench-limited` run as its summary states it.
#[derive(Debug, Clone, serde::Deserialize)]
pub struct Summary {
    pub title: String,
    pub memory_limit_bytes: u64,
    /// Hypura's physical limit, and how it was taken.
    pub limit_tokens_per_sec: Option<f64>,
    pub limit_note: Option<String>,
    pub runs: Vec<SummaryRun>,
}

const SUMMARY_PANEL_WIDTH: u32 = 560;
const ROW_HEIGHT: u32 = 44;

/// The SVG text of a `scripts/bench/bench-limited` summary: two panels of a bar per run, decode speed
/// with the physical limit marked, and peak memory with the memory limit marked.
pub fn summary_svg(summary: &Summary) -> Result<String, String> {
    let rows = summary.runs.len().max(1) as u32;
    let height = 120 + ROW_HEIGHT * (rows + 1);
    let mut text = String::new();
    {
        let root = SVGBackend::with_string(&mut text, (2 * SUMMARY_PANEL_WIDTH, height)).into_drawing_area();
        root.fill(&WHITE).map_err(|error| error.to_string())?;
        let (title, body) = root.split_vertically(56);
        title
            .draw_text(&summary.title, &("sans-serif", 18).into_font().color(&BLACK), (16, 10))
            .map_err(|error| error.to_string())?;
        let legend = "blue: Hypura · orange: llama.cpp · red line: the limit";
        title
            .draw_text(legend, &("sans-serif", 13).into_font().color(&BLACK.mix(0.7)), (16, 34))
            .map_err(|error| error.to_string())?;
        let (left, right) = body.split_horizontally(SUMMARY_PANEL_WIDTH);
        let speed = |run: &SummaryRun| run.tokens_per_sec;
        let limit_label = summary.limit_tokens_per_sec.map(|limit| {
            let note = summary.limit_note.as_deref().map(|note| format!(" ({note})")).unwrap_or_default();
            (limit, format!("physical limit {limit:.1} tok/s{note}"))
        });
        bars(&left, &summary.runs, "decode speed", "tokens per second", &speed, limit_label, &|rate| {
            format!("{rate:.2}")
        })?;
        let gib = |bytes: u64| bytes as f64 / f64::from(1u32 << 30);
        let memory = |run: &SummaryRun| run.peak_bytes.map(gib);
        let memory_limit = gib(summary.memory_limit_bytes);
        let limit = Some((memory_limit, format!("memory limit {memory_limit:.2} GiB")));
        bars(&right, &summary.runs, "peak memory", "GiB", &memory, limit, &|value| format!("{value:.2} GiB"))?;
        root.present().map_err(|error| error.to_string())?;
    }
    Ok(text)
}

/// A panel of horizontal bars, a run a row (Hypura's blue, llama.cpp's orange), each labelled
/// with its value or why it has none, and the limit as a vertical line.
fn bars<DB: DrawingBackend>(
    area: &DrawingArea<DB, plotters::coord::Shift>,
    runs: &[SummaryRun],
    caption: &str,
    unit: &str,
    value: &dyn Fn(&SummaryRun) -> Option<f64>,
    limit: Option<(f64, String)>,
    show: &dyn Fn(f64) -> String,
) -> Result<(), String> {
    let error = |error: DrawingAreaErrorKind<DB::ErrorType>| error.to_string();
    let highest = runs.iter().filter_map(value).chain(limit.as_ref().map(|(at, _)| *at)).fold(0.0_f64, f64::max);
    // Room right of the longest bar for its label.
    let right = highest.max(1e-9) * 1.35;
    let count = runs.len().max(1);
    let labels: Vec<&str> = runs.iter().map(|run| run.label.as_str()).collect();
    let mut chart = ChartBuilder::on(area)
        .caption(caption, ("sans-serif", 16))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(150)
        // A row above the runs for the limit's label.
        .build_cartesian_2d(0.0..right, 0.0..count as f64 + 1.0)
        .map_err(error)?;
    chart
        .configure_mesh()
        .disable_y_mesh()
        .max_light_lines(0)
        .y_labels(count * 2 + 3)
        .y_label_formatter(&|y| {
            // The first run on the top row; the label row above them has none.
            let index = y.floor() as usize;
            if (y - index as f64 - 0.5).abs() < 1e-6 && index < count {
                labels.get(count - 1 - index).map_or_else(String::new, |label| label.to_string())
            } else {
                String::new()
            }
        })
        .x_desc(unit)
        .x_label_formatter(&|x| format!("{x:.0}"))
        .label_style(("sans-serif", 13))
        .axis_desc_style(("sans-serif", 14))
        .draw()
        .map_err(error)?;
    for (row, run) in runs.iter().enumerate() {
        let bottom = (count - 1 - row) as f64 + 0.2;
        let top = bottom + 0.6;
        let color = if run.label.starts_with("llama") { LLAMA_CPP } else { HYPURA };
        let label = match value(run) {
            Some(amount) => {
                chart
                    .draw_series([Rectangle::new([(0.0, bottom), (amount, top)], color.mix(0.6).filled())])
                    .map_err(error)?;
                (show(amount), amount)
            }
            None => {
                let why = match run.status {
                    Some(137) => "killed (out of memory)".to_string(),
                    Some(124) => "over the time limit".to_string(),
                    Some(status) => format!("no result (exit {status})"),
                    None => "no result".to_string(),
                };
                (why, 0.0)
            }
        };
        chart
            .draw_series([Text::new(
                label.0,
                (label.1 + right * 0.01, bottom + 0.45),
                ("sans-serif", 13).into_font().color(&BLACK),
            )])
            .map_err(error)?;
    }
    if let Some((at, text)) = limit {
        chart
            .draw_series([PathElement::new(vec![(at, 0.0), (at, count as f64 + 0.5)], LIMIT.stroke_width(2))])
            .map_err(error)?;
        // The label on the side of the line with more room, in the strip above the rows.
        let side = if at > right / 2.0 { HPos::Right } else { HPos::Left };
        let style = ("sans-serif", 12).into_font().color(&LIMIT).pos(Pos::new(side, VPos::Bottom));
        chart.draw_series([Text::new(text, (at, count as f64 + 0.55), style)]).map_err(error)?;
    }
    Ok(())
}

/// The plan at one memory budget, for `inspect --svg`.
#[derive(Debug, Clone, serde::Serialize)]
pub struct BudgetPoint {
    pub budget_bytes: u64,
    /// The mode the planner picks; None where no plan fits.
    pub mode: Option<&'static str>,
    /// Predicted decode tokens per second; None where the plan cannot predict it (no compute
    /// measured for a plan that streams nothing, or no plan).
    pub tokens_per_sec: Option<f64>,
}

const MODE_COLORS: [(&str, RGBColor); 3] =
    [("resident", RGBColor(0x2a, 0x9d, 0x55)), ("dense-stream", HYPURA), ("expert-stream", RGBColor(0x8e, 0x44, 0xad))];

fn mode_color(mode: &str) -> RGBColor {
    MODE_COLORS.iter().find(|(name, _)| *name == mode).map_or(LLAMA_CPP, |(_, color)| *color)
}

/// One panel of `inspect --svg`: the plans along one budget (the host's memory, or the GPU's
/// with the host's as it is), and this machine's value of it.
pub struct BudgetPanel<'a> {
    /// The axis: "memory budget", "GPU budget".
    pub axis: &'a str,
    pub points: &'a [BudgetPoint],
    pub this_machine: u64,
}

/// Height of one panel of `inspect --svg`.
const PANEL_HEIGHT: u32 = 520;

/// The SVG text of `inspect --svg`: per panel, predicted decode speed against a budget, each
/// point in the color of the mode picked there, a strip of those modes along the budget axis
/// (where a point has no prediction too), and this machine's budget as a line.
pub fn budget_svg(title: &str, note: &str, panels: &[BudgetPanel<'_>]) -> Result<String, String> {
    let mut text = String::new();
    {
        let height = PANEL_HEIGHT * panels.len().max(1) as u32 + 40;
        let canvas = SVGBackend::with_string(&mut text, (900, height)).into_drawing_area();
        canvas.fill(&WHITE).map_err(|error| error.to_string())?;
        let (root, footer) = canvas.split_vertically(height - 40);
        let error = |error: DrawingAreaErrorKind<std::io::Error>| error.to_string();
        let areas = root.split_evenly((panels.len().max(1), 1));
        for (index, (panel, area)) in panels.iter().zip(&areas).enumerate() {
            let caption = if index == 0 { title.to_string() } else { format!("the same by {}", panel.axis) };
            budget_panel(area, &caption, panel)?;
        }
        footer.draw_text(note, &("sans-serif", 12).into_font().color(&BLACK.mix(0.7)), (16, 12)).map_err(error)?;
        canvas.present().map_err(|error| error.to_string())?;
    }
    Ok(text)
}

fn budget_panel(
    root: &DrawingArea<SVGBackend<'_>, plotters::coord::Shift>,
    caption: &str,
    panel: &BudgetPanel<'_>,
) -> Result<(), String> {
    let points = panel.points;
    let gib = |bytes: u64| bytes as f64 / f64::from(1u32 << 30);
    let widest = points.iter().map(|point| gib(point.budget_bytes)).fold(0.0_f64, f64::max).max(1e-3) * 1.05;
    // Room above the fastest point for the legend, which sits at the upper left.
    let fastest = points.iter().filter_map(|point| point.tokens_per_sec).fold(0.0_f64, f64::max).max(1.0) * 1.45;
    let mut chart = ChartBuilder::on(root)
        .caption(caption, ("sans-serif", 18))
        .margin(16)
        .x_label_area_size(48)
        .y_label_area_size(64)
        .build_cartesian_2d(0.0..widest, -fastest * 0.08..fastest)
        .map_err(|error| error.to_string())?;
    chart
        .configure_mesh()
        .max_light_lines(0)
        .x_desc(format!("{} (GiB)", panel.axis))
        .y_desc("predicted decode tokens per second")
        .x_label_formatter(&|x| format!("{x:.1}"))
        .y_label_formatter(&|y| if *y < 0.0 { String::new() } else { format!("{y:.0}") })
        .label_style(("sans-serif", 13))
        .axis_desc_style(("sans-serif", 14))
        .draw()
        .map_err(|error| error.to_string())?;
    // The modes along the axis: a strip below zero, each budget's mode up to the next.
    for (at, point) in points.iter().enumerate() {
        let Some(mode) = point.mode else { continue };
        let left = gib(point.budget_bytes);
        let right = points.get(at + 1).map_or(widest, |next| gib(next.budget_bytes));
        chart
            .draw_series([Rectangle::new(
                [(left, -fastest * 0.07), (right, -fastest * 0.02)],
                mode_color(mode).filled(),
            )])
            .map_err(|error| error.to_string())?;
    }
    let predicted: Vec<(f64, f64)> =
        points.iter().filter_map(|point| point.tokens_per_sec.map(|rate| (gib(point.budget_bytes), rate))).collect();
    chart
        .draw_series([PathElement::new(predicted, BLACK.mix(0.3).stroke_width(1))])
        .map_err(|error| error.to_string())?;
    for (name, color) in MODE_COLORS {
        let dots: Vec<(f64, f64)> = points
            .iter()
            .filter(|point| point.mode == Some(name))
            .filter_map(|point| point.tokens_per_sec.map(|rate| (gib(point.budget_bytes), rate)))
            .collect();
        chart
            .draw_series(dots.into_iter().map(|at| Circle::new(at, 5, color.filled())))
            .map_err(|error| error.to_string())?
            .label(name)
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 14, y + 5)], color.filled()));
    }
    // This machine's budget: a line where it falls, or at the right edge when it is larger
    // than every budget drawn.
    let machine = gib(panel.this_machine);
    let (at, label) = if machine <= widest {
        (machine, format!("this machine's {}: {machine:.2} GiB", panel.axis))
    } else {
        (widest * 0.995, format!("this machine's {}: {machine:.2} GiB, right of the axis →", panel.axis))
    };
    chart
        .draw_series([PathElement::new(vec![(at, 0.0), (at, fastest * 0.95)], LIMIT.stroke_width(2))])
        .map_err(|error| error.to_string())?;
    let side = if at > widest / 2.0 { HPos::Right } else { HPos::Left };
    let style = ("sans-serif", 13).into_font().color(&LIMIT).pos(Pos::new(side, VPos::Bottom));
    chart.draw_series([Text::new(label, (at, fastest * 0.96), style)]).map_err(|error| error.to_string())?;
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK.mix(0.3))
        .label_font(("sans-serif", 13))
        .draw()
        .map_err(|error| error.to_string())?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_gpu_gets_a_panel_of_its_own() {
        let point =
            |gib: u64, mode, rate| BudgetPoint { budget_bytes: gib << 30, mode: Some(mode), tokens_per_sec: rate };
        let memory = [point(1, "expert-stream", Some(3.0)), point(8, "resident", Some(30.0))];
        let gpu = [point(0, "expert-stream", Some(3.0)), point(4, "expert-stream", Some(12.5))];
        let panels = [
            BudgetPanel { axis: "memory budget", points: &memory, this_machine: 6 << 30 },
            BudgetPanel { axis: "GPU budget", points: &gpu, this_machine: 2 << 30 },
        ];
        let svg = budget_svg("a model", "a note", &panels).unwrap();
        for words in [
            "memory budget (GiB)",
            "GPU budget (GiB)",
            "the same by GPU budget",
            "this machine&apos;s GPU budget: 2.00 GiB",
            "a note",
        ] {
            assert!(svg.contains(words), "{words:?} is not in the picture");
        }
        let one = budget_svg("a model", "a note", &panels[..1]).unwrap();
        assert!(!one.contains("GPU budget"));
    }

    #[test]
    fn a_report_draws_both_sides_of_every_test() {
        let rate = |samples: Vec<f64>| Some(Rate::from_samples(samples));
        let report = BenchReport {
            results: vec![
                TestResult {
                    test: "pp512".into(),
                    hypura: rate(vec![310.0, 320.0]),
                    llama_cpp: rate(vec![300.0, 305.0]),
                    ratio: Some(1.04),
                },
                TestResult {
                    test: "tg128".into(),
                    hypura: rate(vec![40.0, 42.0, 41.0]),
                    llama_cpp: rate(vec![12.0, 13.0, 12.5]),
                    ratio: Some(3.28),
                },
            ],
            ..BenchReport::default()
        };
        let svg = svg(&report).unwrap();
        assert!(svg.starts_with("<svg") && svg.contains("tokens per second"), "{svg}");
        assert!(svg.contains("tg128: Hypura 3.28× llama.cpp") && svg.contains("pp512: Hypura 1.04× llama.cpp"));
        let texts: Vec<&str> = svg.split("</text>").filter_map(|part| Some(part.rsplit_once('>')?.1.trim())).collect();
        for text in ["41.00 ± 1.00", "Hypura", "llama.cpp", "tokens per second"] {
            assert!(texts.contains(&text), "{text:?} is not among {texts:?}");
        }
        // Every sample is a dot: 2 + 2 + 3 + 3.
        assert_eq!(svg.matches("<circle").count(), 10);
    }

    #[test]
    fn a_limited_run_draws_every_run_and_both_limits() {
        let run = |label: &str, tokens_per_sec: Option<f64>, status: i64, peak: u64| SummaryRun {
            label: label.into(),
            tokens_per_sec,
            status: Some(status),
            peak_bytes: Some(peak),
        };
        let summary = Summary {
            title: "qwen3.6-35b-a3b in 11.15 GiB, cold".into(),
            memory_limit_bytes: 11 << 30,
            limit_tokens_per_sec: Some(37.4),
            limit_note: Some("the disk at 1.39 GB/s".into()),
            runs: vec![
                run("hypura", Some(35.77), 0, 3 << 30),
                run("llama-fit", Some(52.17), 0, 11 << 30),
                run("llama-exps-cpu", None, 137, 11 << 30),
            ],
        };
        let svg = summary_svg(&summary).unwrap();
        let texts: Vec<&str> = svg.split("</text>").filter_map(|part| Some(part.rsplit_once('>')?.1.trim())).collect();
        for text in [
            "35.77",
            "52.17",
            "killed (out of memory)",
            "3.00 GiB",
            "11.00 GiB",
            "physical limit 37.4 tok/s (the disk at 1.39 GB/s)",
            "memory limit 11.00 GiB",
            "hypura",
            "llama-fit",
            "llama-exps-cpu",
            "tokens per second",
            "GiB",
        ] {
            assert!(texts.contains(&text), "{text:?} is not among {texts:?}");
        }
        // Two bars a finished run, one for the killed run's memory: 2 + 2 + 1.
        assert_eq!(svg.matches("<rect").count() - 1, 5, "{svg}");
    }
}
