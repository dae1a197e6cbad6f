//! The floors of the main crate (ARCHITECTURE.md, "Floors"): each module names only modules on
//! floors below its own, `format` is a leaf any floor may use, and `hypura-sys` is named only
//! where the map says; and within each module folder (`server/`, `store/experts/`, ...) the
//! files name one another in one direction, without a cycle. Read from the source text, so a
//! new import upwards fails here before it is a habit.
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use crate::common;

/// The floor of each top-level module of `crates/hypura/src`.
const FLOORS: [(&str, u32); 14] = [
    ("io", 0),
    ("format", 0),
    ("sync", 0),
    ("model", 1),
    ("plan", 2),
    ("store", 3),
    ("remote", 3),
    ("hw", 3),
    ("hub", 3),
    ("engine", 4),
    ("setup", 5),
    ("server", 6),
    ("bench", 6),
    ("cli", 7),
];

fn source_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

/// The Rust files of a top-level module: `src/NAME.rs` or every file under `src/NAME/`.
fn files_of(module: &str) -> Vec<PathBuf> {
    let single = source_dir().join(format!("{module}.rs"));
    if single.exists() {
        return vec![single];
    }
    let files = files_under(&source_dir().join(module));
    assert!(!files.is_empty(), "no source files for module {module}");
    files
}

/// Every Rust file under a folder, its subfolders' included.
fn files_under(folder: &Path) -> Vec<PathBuf> {
    let mut files = Vec::new();
    let mut folders = vec![folder.to_path_buf()];
    while let Some(folder) = folders.pop() {
        for entry in std::fs::read_dir(&folder).unwrap_or_else(|error| panic!("{}: {error}", folder.display())) {
            let path = entry.unwrap().path();
            if path.is_dir() {
                folders.push(path);
            } else if path.extension().is_some_and(|extension| extension == "rs") {
                files.push(path);
            }
        }
    }
    files
}

/// The code of a file without its comments (line comments, doc comments).
fn code_of(path: &Path) -> String {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|line| line.split("//").next().unwrap_or_default())
        .collect::<Vec<_>>()
        .join("\n")
}

/// The top-level modules a file names through `crate::` (paths and `use crate::{a, b::c}`).
fn modules_named(code: &str) -> BTreeSet<String> {
    let mut named = BTreeSet::new();
    for (at, _) in code.match_indices("crate::") {
        // `hypura_crate::` or `$crate::` are not this crate's root.
        if code[..at]
            .chars()
            .next_back()
            .is_some_and(|before| before.is_alphanumeric() || before == '_' || before == '$')
        {
            continue;
        }
        let rest = &code[at + "crate::".len()..];
        if let Some(group) = rest.strip_prefix('{') {
            let group = &group[..group.find('}').unwrap_or(group.len())];
            named.extend(
                group
                    .split(',')
                    .map(|item| item.trim().split("::").next().unwrap_or_default().to_string())
                    .filter(|name| !name.is_empty()),
            );
        } else {
            named.insert(rest.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect());
        }
    }
    named
}

fn floor_of(module: &str) -> Option<u32> {
    FLOORS.iter().find(|(name, _)| *name == module).map(|(_, floor)| *floor)
}

#[test]
fn every_module_imports_only_from_the_floors_below_it() {
    let _turn = common::shared_machine();
    let mut wrong = Vec::new();
    for (module, floor) in FLOORS {
        for file in files_of(module) {
            for named in modules_named(&code_of(&file)) {
                if named == module || named == "format" || named == "sync" {
                    continue;
                }
                match floor_of(&named) {
                    Some(other) if other < floor => {}
                    Some(other) => {
                        wrong.push(format!("{} (floor {floor}) names crate::{named} (floor {other})", file.display()))
                    }
                    None => wrong.push(format!("{} names crate::{named}, which has no floor", file.display())),
                }
            }
        }
    }
    assert!(wrong.is_empty(), "imports that run sideways or up:\n{}", wrong.join("\n"));
}

/// The three the map names: the planner reads only the inventory and the format helpers, the
/// engine never reads the machine, the server never reaches into the CLI.
#[test]
fn plan_reads_only_model_engine_not_hw_server_not_cli() {
    let _turn = common::shared_machine();
    let named_by =
        |module: &str| files_of(module).iter().flat_map(|file| modules_named(&code_of(file))).collect::<BTreeSet<_>>();
    let plan: BTreeSet<String> = named_by("plan").into_iter().filter(|name| name != "plan").collect();
    assert!(plan.iter().all(|name| name == "model" || name == "format"), "plan names {plan:?}");
    assert!(!named_by("engine").contains("hw"), "the engine names crate::hw");
    assert!(!named_by("server").contains("cli"), "the server names crate::cli");
}

/// `hypura-sys` is named only by the modules the map lists: never by the planner, the
/// inventory, the machine profile, raw I/O or the server.
#[test]
fn the_fence_is_named_only_where_the_map_says() {
    let _turn = common::shared_machine();
    for module in ["io", "format", "model", "hw", "plan", "server"] {
        for file in files_of(module) {
            assert!(!code_of(&file).contains("hypura_sys"), "{} names hypura_sys", file.display());
        }
    }
}

/// The parser above sees what it must: a grouped import, a path, and not a comment.
#[test]
fn the_import_reader_sees_groups_and_paths_but_not_comments() {
    let _turn = common::shared_machine();
    let code = "use crate::{engine::Batcher, hw};\nlet x = crate::plan::plan(a);\n// crate::cli\nmacro $crate::server";
    let named = modules_named(
        &code.lines().map(|line| line.split("//").next().unwrap_or_default()).collect::<Vec<_>>().join("\n"),
    );
    assert_eq!(named, ["engine", "hw", "plan"].into_iter().map(String::from).collect());
}

/// Every module folder under `src/` (`server`, `store/experts`, ...), relative to it.
fn module_folders() -> Vec<String> {
    let source = source_dir();
    let found: BTreeSet<String> = files_under(&source)
        .iter()
        .filter_map(|file| file.parent()?.strip_prefix(&source).ok())
        .filter(|folder| !folder.as_os_str().is_empty())
        .map(|folder| folder.to_string_lossy().into_owned())
        .collect();
    found.into_iter().collect()
}

/// The rooms of a module folder: each file beside its `mod.rs` (by stem) and each folder inside
/// it (by name, all its files together), every file with the number of `super::` that reach the
/// folder from it (1 beside `mod.rs` and in a child's `mod.rs`, 2 one folder down, ...).
/// `mod.rs` is the folder's root, not a room: what it names and what names it are left out.
fn rooms_of(folder: &str) -> Vec<(String, Vec<(PathBuf, usize)>)> {
    let root = source_dir().join(folder);
    let mut rooms: Vec<(String, Vec<(PathBuf, usize)>)> = Vec::new();
    for file in files_under(&root) {
        let relative = file.strip_prefix(&root).unwrap().with_extension("");
        let mut parts: Vec<String> =
            relative.components().map(|part| part.as_os_str().to_string_lossy().into_owned()).collect();
        if parts.last().is_some_and(|last| last == "mod") {
            parts.pop();
        }
        let Some(room) = parts.first().cloned() else { continue };
        let depth = parts.len();
        match rooms.iter_mut().find(|(name, _)| *name == room) {
            Some((_, files)) => files.push((file, depth)),
            None => rooms.push((room, vec![(file, depth)])),
        }
    }
    rooms
}

/// The rooms of a module folder (`src/server/`) that a file `depth` modules below it names:
/// `super::X` (`super::super::X` from a child folder's file, ...) and `crate::server::X`, paths
/// or grouped imports, where `X` is a room.
fn siblings_named(code: &str, folder: &str, depth: usize, siblings: &BTreeSet<String>) -> BTreeSet<String> {
    let mut named = BTreeSet::new();
    let relative = "super::".repeat(depth);
    let absolute = format!("crate::{}::", folder.replace('/', "::"));
    for prefix in [relative.as_str(), absolute.as_str()] {
        for (at, _) in code.match_indices(prefix) {
            // Not the tail of a longer path (`super::super::X` is not `super::X`).
            if code[..at]
                .chars()
                .next_back()
                .is_some_and(|before| before.is_alphanumeric() || before == '_' || before == ':')
            {
                continue;
            }
            let rest = &code[at + prefix.len()..];
            let names: Vec<String> = match rest.strip_prefix('{') {
                Some(group) => group[..group.find('}').unwrap_or(group.len())]
                    .split(',')
                    .map(|item| item.trim().split("::").next().unwrap_or_default().to_string())
                    .collect(),
                None => vec![rest.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect()],
            };
            named.extend(names.into_iter().filter(|name| siblings.contains(name)));
        }
    }
    named
}

/// The room-level graph of a module folder: each room to the rooms its files name.
fn file_graph(folder: &str) -> Vec<(String, BTreeSet<String>)> {
    let rooms = rooms_of(folder);
    let siblings: BTreeSet<String> = rooms.iter().map(|(room, _)| room.clone()).collect();
    let mut graph: Vec<(String, BTreeSet<String>)> = rooms
        .iter()
        .map(|(room, files)| {
            let mut named: BTreeSet<String> = files
                .iter()
                .flat_map(|(file, depth)| siblings_named(&code_of(file), folder, *depth, &siblings))
                .collect();
            named.remove(room);
            (room.clone(), named)
        })
        .collect();
    graph.sort();
    graph
}

/// A cycle of the graph, as the files around it (the first one again at the end), if any.
fn a_cycle(graph: &[(String, BTreeSet<String>)]) -> Option<Vec<String>> {
    fn visit(
        node: &str,
        graph: &[(String, BTreeSet<String>)],
        path: &mut Vec<String>,
        done: &mut BTreeSet<String>,
    ) -> Option<Vec<String>> {
        if let Some(at) = path.iter().position(|on_path| on_path == node) {
            let mut cycle = path[at..].to_vec();
            cycle.push(node.to_string());
            return Some(cycle);
        }
        if done.contains(node) {
            return None;
        }
        path.push(node.to_string());
        let named = graph.iter().find(|(name, _)| name == node).map(|(_, named)| named.clone()).unwrap_or_default();
        for next in &named {
            if let Some(cycle) = visit(next, graph, path, done) {
                return Some(cycle);
            }
        }
        path.pop();
        done.insert(node.to_string());
        None
    }
    let mut done = BTreeSet::new();
    graph.iter().find_map(|(node, _)| visit(node, graph, &mut Vec::new(), &mut done))
}

/// Module folders whose files already name one another both ways, left out of the check below:
/// in `plan`, `types` (the plan, which holds each tier's layout) and the placement files
/// (`gpu`, `dense`, `experts`, which build those layouts from the plan's options).
const FOLDERS_WITH_CYCLES: [&str; 1] = ["plan"];

/// The files of every module folder name one another without a circle: in the server the
/// scheduler starts workers, a worker and the scheduler share the registry's types
/// (`model.rs`), and none names back up; a folder split into files (`store/experts/`,
/// `engine/batch/`, `remote/protocol/`, ...) keeps one direction between its files the same way.
#[test]
fn the_files_of_each_module_folder_name_one_another_without_a_cycle() {
    let _turn = common::shared_machine();
    let folders = module_folders();
    for expected in [
        "server",
        "store/experts",
        "store/residency",
        "engine/batch",
        "engine/chat",
        "engine/prompt_cache",
        "remote/protocol",
        "cli",
    ]
    .into_iter()
    .chain(FOLDERS_WITH_CYCLES)
    {
        assert!(folders.iter().any(|folder| folder == expected), "no folder src/{expected} in {folders:?}");
    }
    let server = file_graph("server");
    assert!(server.iter().any(|(name, _)| name == "scheduler"), "no scheduler.rs in {server:?}");
    let mut cycles = Vec::new();
    for folder in folders.iter().filter(|folder| !FOLDERS_WITH_CYCLES.contains(&folder.as_str())) {
        if let Some(cycle) = a_cycle(&file_graph(folder)) {
            cycles.push(format!("src/{folder}: {}", cycle.join(" -> ")));
        }
    }
    assert!(cycles.is_empty(), "files that name one another in a cycle:\n{}", cycles.join("\n"));
}

/// The graph reader sees `super::` paths and groups and `crate::server::` paths, not comments,
/// the folder's root or a longer `super::super::` path; from a child folder's file it reads
/// `super::super::`; and the cycle finder names the files around a cycle.
#[test]
fn the_file_graph_sees_siblings_and_finds_a_cycle() {
    let _turn = common::shared_machine();
    let strip = |code: &str| {
        code.lines().map(|line| line.split("//").next().unwrap_or_default()).collect::<Vec<_>>().join("\n")
    };
    let siblings: BTreeSet<String> = ["model", "worker", "scheduler"].into_iter().map(String::from).collect();
    let code = strip(
        "use super::{model::Lease, AppState};\nlet w = crate::server::worker::Worker;\n// super::scheduler\nsuper::show_model();\nsuper::super::scheduler::x()",
    );
    let named = siblings_named(&code, "server", 1, &siblings);
    assert_eq!(named, ["model", "worker"].into_iter().map(String::from).collect());
    let siblings: BTreeSet<String> = ["pool", "split", "cache"].into_iter().map(String::from).collect();
    let code =
        strip("use super::cache::Cache;\nuse super::super::pool::Slots;\nlet s = crate::store::experts::split::run();");
    assert_eq!(
        siblings_named(&code, "store/experts", 2, &siblings),
        ["pool", "split"].into_iter().map(String::from).collect()
    );
    let edges = |pairs: &[(&str, &[&str])]| -> Vec<(String, BTreeSet<String>)> {
        pairs.iter().map(|(from, to)| (from.to_string(), to.iter().map(|name| name.to_string()).collect())).collect()
    };
    assert_eq!(a_cycle(&edges(&[("model", &[]), ("scheduler", &["model", "worker"]), ("worker", &["model"])])), None);
    let cycle = a_cycle(&edges(&[("model", &[]), ("scheduler", &["worker"]), ("worker", &["model", "scheduler"])]));
    assert_eq!(cycle, Some(["scheduler", "worker", "scheduler"].into_iter().map(String::from).collect()));
}
