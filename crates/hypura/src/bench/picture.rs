//! `bench --svg FILE`: the run's results as one picture, a panel per test (prompt processing and
//! generation have their own scales). In each, Hypura and llama.cpp side by side: a bar to the
//! mean, a whisker of one standard deviation, and every sample as a dot, with the ratio in the
//! panel's caption. Drawn with plotters into SVG.
use plotters::prelude::*;

use super::{BenchReport, Rate, TestResult};

const WIDTH: u32 = 480;
const HEIGHT: u32 = 420;
const HYPURA: RGBColor = RGBColor(0x1f, 0x6f, 0xb4);
const LLAMA_CPP: RGBColor = RGBColor(0xe0, 0x7b, 0x1a);

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

#[cfg(test)]
mod tests {
    use super::*;

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
}
