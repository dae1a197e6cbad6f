//! Progress bars that show on a terminal and stay quiet in pipes.
use std::io::IsTerminal;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// A byte-count bar on stderr, hidden when stderr is not a terminal.
pub fn bytes_bar(message: &'static str) -> ProgressBar {
    let bar = ProgressBar::new(0);
    if !std::io::stderr().is_terminal() {
        bar.set_draw_target(ProgressDrawTarget::hidden());
    }
    if let Ok(style) =
        ProgressStyle::with_template("{msg} {bytes}/{total_bytes} {binary_bytes_per_sec} eta {eta} {wide_bar}")
    {
        bar.set_style(style);
    }
    bar.set_message(message);
    bar
}
