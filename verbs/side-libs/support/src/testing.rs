//! The checks every side library's tests run against Debian's installed
//! tools: what they import (`objdump -T`), what the built library exports
//! and its soname (`objdump -T`, `objdump -p`), and whether a tool starts
//! with the library in place of Debian's.
//!
//! They need `binutils`, `ibverbs-utils` and `perftest` (CI installs them,
//! `.ci/run`); without them they fail naming the package, never pass.

use std::collections::BTreeSet;
use std::fmt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// The surveyed tools (docs/libibverbs.md), all in `/usr/bin`, and
/// `ibv_devices` (which imports one `libibverbs` symbol more,
/// `ibv_get_device_guid`, and nothing from the side libraries).
pub const DEBIAN_TOOLS: [&str; 12] = [
    "ibv_devinfo",
    "ibv_devices",
    "ibv_rc_pingpong",
    "ibv_uc_pingpong",
    "ibv_ud_pingpong",
    "ibv_srq_pingpong",
    "ib_write_bw",
    "ib_read_bw",
    "ib_send_bw",
    "ib_atomic_bw",
    "ib_send_lat",
    "ib_write_lat",
];

/// A dynamic symbol with its version node (`mlx5dv_open_device@MLX5_1.7`).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct VersionedSymbol {
    pub name: String,
    pub version: String,
}

impl fmt::Display for VersionedSymbol {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}@{}", self.name, self.version)
    }
}

fn objdump(args: &[&str], file: &Path) -> String {
    let output = Command::new("objdump")
        .args(args)
        .arg(file)
        .output()
        .unwrap_or_else(|error| {
            panic!("cannot run objdump ({error}): install Debian's `binutils`")
        });
    assert!(
        output.status.success(),
        "objdump {args:?} {} failed: {}",
        file.display(),
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8(output.stdout).expect("objdump prints text")
}

/// The dynamic symbols of `file`: `(defined, symbol)` for every line of
/// `objdump -T` that names a version (`(VER)` for imports, `VER` for
/// definitions).
fn dynamic_symbols(file: &Path) -> Vec<(bool, VersionedSymbol)> {
    objdump(&["-T"], file)
        .lines()
        .filter(|line| {
            line.split_whitespace()
                .next()
                .is_some_and(|first| first.len() == 16)
        })
        .filter_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let [.., version, name] = fields.as_slice() else {
                return None;
            };
            let defined = !line.contains("*UND*");
            let version = version.trim_start_matches('(').trim_end_matches(')');
            Some((
                defined,
                VersionedSymbol {
                    name: (*name).to_string(),
                    version: version.to_string(),
                },
            ))
        })
        .collect()
}

/// A Debian tool's path; panics naming the package when it is missing.
pub fn tool_path(tool: &str) -> PathBuf {
    let path = Path::new("/usr/bin").join(tool);
    assert!(
        path.exists(),
        "{} is missing: install Debian's `ibverbs-utils` and `perftest` (apt-get install ibverbs-utils perftest)",
        path.display()
    );
    path
}

/// Every symbol the surveyed tools import whose version starts with one of
/// `version_prefixes` (`["MLX5_"]`), over all the tools.
pub fn imported_by_debian_tools(version_prefixes: &[&str]) -> BTreeSet<VersionedSymbol> {
    DEBIAN_TOOLS
        .iter()
        .flat_map(|tool| dynamic_symbols(&tool_path(tool)))
        .filter(|(defined, symbol)| {
            !defined
                && version_prefixes
                    .iter()
                    .any(|prefix| symbol.version.starts_with(prefix))
        })
        .map(|(_, symbol)| symbol)
        .collect()
}

/// Every versioned symbol `library` defines (its version-node names, which
/// `objdump -T` lists as absolute symbols, are left out).
pub fn exported_by(library: &Path) -> BTreeSet<VersionedSymbol> {
    dynamic_symbols(library)
        .into_iter()
        .filter(|(defined, symbol)| *defined && symbol.name != symbol.version)
        .map(|(_, symbol)| symbol)
        .collect()
}

/// The `SONAME` in `library`'s dynamic section.
pub fn soname_of(library: &Path) -> Option<String> {
    objdump(&["-p"], library).lines().find_map(|line| {
        let mut fields = line.split_whitespace();
        (fields.next() == Some("SONAME")).then(|| fields.next().unwrap_or_default().to_string())
    })
}

/// The cdylib `file_name` (`libmlx5.so`) cargo built for this test run: it
/// sits in the `deps` directory beside the test executable.
pub fn built_cdylib(file_name: &str) -> PathBuf {
    let test_exe = std::env::current_exe().expect("the test knows its executable");
    let deps = test_exe
        .parent()
        .expect("the test executable is in a directory");
    let path = deps.join(file_name);
    assert!(
        path.exists(),
        "cargo built no {} beside the test ({})",
        file_name,
        deps.display()
    );
    path
}

/// Runs a Debian tool with `args`, first plainly (Debian's libraries), then
/// with `library` installed under `soname` in `scratch` and that directory
/// first on `LD_LIBRARY_PATH`. Returns both outputs, after checking that the
/// loader does pick the library from `scratch` (`LD_TRACE_LOADED_OBJECTS`,
/// the mechanism of `ldd`).
pub fn run_with_and_without(
    library: &Path,
    soname: &str,
    scratch: &Path,
    tool: &str,
    args: &[&str],
) -> (Output, Output) {
    let tool = tool_path(tool);
    std::fs::create_dir_all(scratch).unwrap();
    let installed = scratch.join(soname);
    std::fs::copy(library, &installed).unwrap();

    let loaded = Command::new(&tool)
        .env("LD_TRACE_LOADED_OBJECTS", "1")
        .env("LD_LIBRARY_PATH", scratch)
        .output()
        .unwrap();
    let loaded = String::from_utf8_lossy(&loaded.stdout).into_owned();
    let expected = format!("{soname} => {}", installed.display());
    assert!(
        loaded.contains(&expected),
        "{} does not load {} from {}:\n{loaded}",
        tool.display(),
        soname,
        scratch.display()
    );

    let debian = Command::new(&tool)
        .args(args)
        .env_remove("LD_LIBRARY_PATH")
        .output()
        .unwrap();
    let ours = Command::new(&tool)
        .args(args)
        .env("LD_LIBRARY_PATH", scratch)
        .output()
        .unwrap();
    (debian, ours)
}

/// Asserts that `library` has the soname `soname` and exports exactly the
/// symbols (with their versions) the Debian tools import from the nodes
/// `version_prefixes` name: none missing, none extra.
pub fn assert_exports_exactly_the_tools_imports(
    library: &Path,
    soname: &str,
    version_prefixes: &[&str],
) {
    assert_eq!(
        soname_of(library).as_deref(),
        Some(soname),
        "{}'s soname",
        library.display()
    );
    let imported = imported_by_debian_tools(version_prefixes);
    assert!(
        !imported.is_empty(),
        "no Debian tool imports anything from {version_prefixes:?}"
    );
    let exported = exported_by(library);
    let missing: Vec<String> = imported
        .difference(&exported)
        .map(ToString::to_string)
        .collect();
    let extra: Vec<String> = exported
        .difference(&imported)
        .map(ToString::to_string)
        .collect();
    assert!(
        missing.is_empty() && extra.is_empty(),
        "{} differs from what Debian's tools import:\nmissing: {missing:?}\nextra: {extra:?}",
        library.display()
    );
}

/// Asserts that `library` has the soname `soname`, exports every symbol
/// (with its version) the Debian tools import from the nodes
/// `version_prefixes` name, and nothing else in those nodes but
/// `beyond_the_tools` (`name@version`: what the library offers on purpose
/// that no surveyed tool imports); returns what it exports outside those
/// nodes, for the caller to judge.
pub fn assert_exports_the_tools_imports_in_their_nodes(
    library: &Path,
    soname: &str,
    version_prefixes: &[&str],
    beyond_the_tools: &[&str],
) -> BTreeSet<VersionedSymbol> {
    assert_eq!(
        soname_of(library).as_deref(),
        Some(soname),
        "{}'s soname",
        library.display()
    );
    let mut imported = imported_by_debian_tools(version_prefixes);
    assert!(
        !imported.is_empty(),
        "no Debian tool imports anything from {version_prefixes:?}"
    );
    for symbol in beyond_the_tools {
        let (name, version) = symbol
            .split_once('@')
            .expect("beyond_the_tools entries are name@version");
        assert!(
            imported.insert(VersionedSymbol {
                name: name.to_string(),
                version: version.to_string(),
            }),
            "{symbol} is imported by a tool: not beyond them"
        );
    }
    let (exported, others): (BTreeSet<_>, BTreeSet<_>) =
        exported_by(library).into_iter().partition(|symbol| {
            version_prefixes
                .iter()
                .any(|prefix| symbol.version.starts_with(prefix))
        });
    let missing: Vec<String> = imported
        .difference(&exported)
        .map(ToString::to_string)
        .collect();
    let extra: Vec<String> = exported
        .difference(&imported)
        .map(ToString::to_string)
        .collect();
    assert!(
        missing.is_empty() && extra.is_empty(),
        "{} differs from what Debian's tools import:\nmissing: {missing:?}\nextra: {extra:?}",
        library.display()
    );
    others
}

/// Asserts that `tool args` behaves with `library` (as `soname`, first on
/// `LD_LIBRARY_PATH`) exactly as with Debian's libraries: same exit status,
/// same output.
pub fn assert_tool_runs_as_with_debian(
    library: &Path,
    soname: &str,
    scratch: &Path,
    tool: &str,
    args: &[&str],
) {
    let (debian, ours) = run_with_and_without(library, soname, scratch, tool, args);
    assert_eq!(
        ours.status.code(),
        debian.status.code(),
        "{tool} {args:?} exits differently with {soname} from {}:\n{}",
        scratch.display(),
        String::from_utf8_lossy(&ours.stderr)
    );
    assert_eq!(
        String::from_utf8_lossy(&ours.stdout),
        String::from_utf8_lossy(&debian.stdout)
    );
    assert_eq!(
        String::from_utf8_lossy(&ours.stderr),
        String::from_utf8_lossy(&debian.stderr)
    );
}
