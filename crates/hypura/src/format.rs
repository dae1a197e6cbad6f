//! Human-readable numbers for reports (a pure leaf module: the planner, `hw` and the CLI use it): sizes in binary units (GiB, MiB), because memory and
//! tensor sizes are powers of two, and bandwidth in decimal GB/s (10^9 bytes per second), as disk
//! vendors and `dd` quote it.

const UNITS: [&str; 6] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];

/// Bytes as lower-case hexadecimal (digests, in names and manifests).
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|byte| format!("{byte:02x}")).collect()
}

/// "512 B", "4.00 KiB", "236.0 MiB", "1.50 GiB": two decimals below 10, one above.
pub fn format_bytes(bytes: u64) -> String {
    if bytes < 1024 {
        return format!("{bytes} B");
    }
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit < UNITS.len() - 1 {
        value /= 1024.0;
        unit += 1;
    }
    if value < 10.0 {
        format!("{value:.2} {}", UNITS[unit])
    } else {
        format!("{value:.1} {}", UNITS[unit])
    }
}

/// "2.35 GB/s"; rates below 0.1 GB/s in MB/s ("85.3 MB/s") so they keep their digits.
pub fn format_bytes_per_sec(bytes_per_sec: f64) -> String {
    if bytes_per_sec >= 1e8 {
        format!("{:.2} GB/s", bytes_per_sec / 1e9)
    } else {
        format!("{:.1} MB/s", bytes_per_sec / 1e6)
    }
}

/// Seconds since the Unix epoch as "2025-01-31 14:05:09 UTC" (no time-zone database needed).
pub fn format_unix_time_utc(unix_secs: u64) -> String {
    let days = (unix_secs / 86_400) as i64;
    let seconds_of_day = unix_secs % 86_400;
    let (year, month, day) = civil_from_days(days);
    format!(
        "{year:04}-{month:02}-{day:02} {:02}:{:02}:{:02} UTC",
        seconds_of_day / 3600,
        seconds_of_day / 60 % 60,
        seconds_of_day % 60
    )
}

/// Howard Hinnant's days-since-1970 to proleptic Gregorian (year, month, day).
pub fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let shifted = days + 719_468;
    let era = shifted.div_euclid(146_097);
    let day_of_era = shifted.rem_euclid(146_097);
    let year_of_era = (day_of_era - day_of_era / 1460 + day_of_era / 36_524 - day_of_era / 146_096) / 365;
    let day_of_year = day_of_era - (365 * year_of_era + year_of_era / 4 - year_of_era / 100);
    let month_index = (5 * day_of_year + 2) / 153;
    let day = (day_of_year - (153 * month_index + 2) / 5 + 1) as u32;
    let month = if month_index < 10 { month_index + 3 } else { month_index - 9 } as u32;
    let year = year_of_era + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_use_binary_units() {
        assert_eq!(format_bytes(0), "0 B");
        assert_eq!(format_bytes(512), "512 B");
        assert_eq!(format_bytes(1023), "1023 B");
        assert_eq!(format_bytes(4096), "4.00 KiB");
        assert_eq!(format_bytes(236 << 20), "236.0 MiB");
        assert_eq!(format_bytes(3 << 29), "1.50 GiB");
        assert_eq!(format_bytes(24_684_100 * 1024), "23.5 GiB");
        assert_eq!(format_bytes(u64::MAX), "16384.0 PiB");
    }

    #[test]
    fn bandwidth_uses_decimal_units() {
        assert_eq!(format_bytes_per_sec(2.345e9), "2.35 GB/s");
        assert_eq!(format_bytes_per_sec(1e8), "0.10 GB/s");
        assert_eq!(format_bytes_per_sec(85.3e6), "85.3 MB/s");
    }

    #[test]
    fn unix_time_formats_as_utc_dates() {
        assert_eq!(format_unix_time_utc(0), "1970-01-01 00:00:00 UTC");
        assert_eq!(format_unix_time_utc(951_782_400), "2000-02-29 00:00:00 UTC");
        assert_eq!(format_unix_time_utc(1_738_332_309), "2025-01-31 14:05:09 UTC");
    }
}
