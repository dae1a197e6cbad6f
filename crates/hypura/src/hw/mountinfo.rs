//! /proc/self/mountinfo parsing, shared by the disk probe (which volume a file lives on) and the
//! cgroup lookup (where the memory controller is mounted).

use std::path::PathBuf;

#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct MountEntry {
    pub major: u32,
    pub minor: u32,
    /// The directory of the source filesystem that is mounted (e.g. a cgroup path for bind mounts).
    pub root: String,
    pub mount_point: PathBuf,
    pub filesystem: String,
    pub source: String,
    pub super_options: String,
}

/// Parse mountinfo lines: `id parent major:minor root mount_point options [optional...] - fstype
/// source super_options`. Malformed lines are skipped, as the kernel format is append-only.
pub(crate) fn parse_mountinfo(contents: &str) -> Vec<MountEntry> {
    contents.lines().filter_map(parse_line).collect()
}

fn parse_line(line: &str) -> Option<MountEntry> {
    let (before, after) = line.split_once(" - ")?;
    let fields: Vec<&str> = before.split(' ').collect();
    let (major, minor) = fields.get(2)?.split_once(':')?;
    let mut after_fields = after.split(' ');
    Some(MountEntry {
        major: major.parse().ok()?,
        minor: minor.parse().ok()?,
        root: unescape(fields.get(3)?),
        mount_point: PathBuf::from(unescape(fields.get(4)?)),
        filesystem: after_fields.next()?.to_string(),
        source: unescape(after_fields.next().unwrap_or("")),
        super_options: after_fields.next().unwrap_or("").to_string(),
    })
}

/// The kernel writes space, tab, newline and backslash in paths as three-digit octal escapes.
fn unescape(field: &str) -> String {
    let bytes = field.as_bytes();
    let mut output = Vec::with_capacity(bytes.len());
    let mut index = 0;
    while index < bytes.len() {
        let escape = bytes
            .get(index + 1..index + 4)
            .filter(|digits| bytes[index] == b'\\' && digits.iter().all(|digit| (b'0'..=b'7').contains(digit)));
        if let Some(digits) = escape {
            let value = digits.iter().fold(0u32, |value, digit| value * 8 + u32::from(digit - b'0'));
            output.push(value as u8);
            index += 4;
            continue;
        }
        output.push(bytes[index]);
        index += 1;
    }
    String::from_utf8_lossy(&output).into_owned()
}

/// Split a Linux `st_dev` into (major, minor), as glibc's `gnu_dev_major`/`gnu_dev_minor` do.
pub(crate) fn split_device_number(device: u64) -> (u32, u32) {
    let major = ((device >> 32) & 0xffff_f000) | ((device >> 8) & 0x0000_0fff);
    let minor = ((device >> 12) & 0xffff_ff00) | (device & 0x0000_00ff);
    (major as u32, minor as u32)
}

#[cfg(test)]
mod tests {
    use super::*;

    const SAMPLE: &str = "\
27 1 254:0 / / rw,relatime - ext4 /dev/vda rw,discard
25 24 0:23 / /dev/shm rw,relatime - tmpfs tmpfs rw,size=24684100k
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime shared:9 - cgroup2 cgroup2 rw
50 27 259:1 /models /mnt/my\\040models rw master:1 - xfs /dev/nvme0n1p1 rw
garbage line
";

    #[test]
    fn parses_fields_optional_tags_and_escapes() {
        let entries = parse_mountinfo(SAMPLE);
        assert_eq!(entries.len(), 5);
        assert_eq!(entries[0].mount_point, PathBuf::from("/"));
        assert_eq!((entries[0].major, entries[0].minor), (254, 0));
        assert_eq!(entries[0].filesystem, "ext4");
        assert_eq!(entries[0].source, "/dev/vda");
        assert_eq!(entries[2].super_options, "rw,memory");
        assert_eq!(entries[3].filesystem, "cgroup2");
        assert_eq!(entries[4].mount_point, PathBuf::from("/mnt/my models"));
        assert_eq!(entries[4].root, "/models");
        assert_eq!((entries[4].major, entries[4].minor), (259, 1));
    }

    #[test]
    fn splits_device_numbers_like_glibc() {
        // makedev(254, 0) and makedev(259, 65537) computed with glibc's formula.
        assert_eq!(split_device_number(0xfe00), (254, 0));
        let (major, minor) = (259u64, 65_537u64);
        let device = ((major & 0xffff_f000) << 32)
            | ((major & 0x0000_0fff) << 8)
            | ((minor & 0xffff_ff00) << 12)
            | (minor & 0x0000_00ff);
        assert_eq!(split_device_number(device), (259, 65_537));
    }
}
