//! The property of the INF parser and binder (`sim_host::inf`) under
//! hostile files. Shared by the bounded property test
//! (`tests/fuzz_inf.rs`) and the `inf` cargo-fuzz target, which includes
//! this file by path.
//!
//! - The parse does not depend on the encoding or the line ends: text that
//!   is UTF-8 parses exactly as the same text in UTF-16LE with a BOM, and
//!   as the same text with CRLF line ends.
//! - Added to the set loaded from the workspace's `inf/`, a file the
//!   parser refuses changes nothing: the usable INFs and the bindings of
//!   our devices stay what they were, and the file is named as rejected.
//!   A file it accepts binds or refuses our devices (and a device of its
//!   own IDs) without panicking, and a binding applies to a registry.

use std::sync::OnceLock;

use sim_host::inf::{BindError, Binding, Inf, InfError, InfSet, workspace_inf_dir};
use sim_host::registry::RegistryStore;

/// The name the fuzzed file is added under (last in load order).
const NAME: &str = "zz-fuzz.inf";

/// Our devices: the HCA's PCI IDs and a port client's bus IDs.
const DEVICES: [(&[&str], &[&str]); 3] = [
    (
        &[
            "PCI\\VEN_F1B0&DEV_0001&SUBSYS_0001F1B0&REV_01",
            "PCI\\VEN_F1B0&DEV_0001&SUBSYS_0001F1B0",
            "PCI\\VEN_F1B0&DEV_0001&REV_01",
            "PCI\\VEN_F1B0&DEV_0001",
        ],
        &["PCI\\VEN_F1B0&CC_020700", "PCI\\CC_0207"],
    ),
    (&["IBA\\IPOIB"], &["IBA\\PORT_CLIENT"]),
    (&["X\\Y"], &["C\\D"]),
];

/// What a parse produced, comparable.
type Parsed = Result<(Vec<(String, Vec<sim_host::inf::InfLine>)>, Vec<String>), InfError>;

fn parsed(bytes: &[u8]) -> Parsed {
    let inf = Inf::parse(NAME, bytes)?;
    let sections = inf
        .section_names()
        .map(|name| {
            let lines = inf.section(name).unwrap_or_default().to_vec();
            (name.to_owned(), lines)
        })
        .collect();
    let mut facts = inf.warnings().to_vec();
    facts.push(format!("{:?}", inf.driver_ver()));
    Ok((sections, facts))
}

/// The workspace's INFs, loaded once.
fn workspace() -> &'static InfSet {
    static SET: OnceLock<InfSet> = OnceLock::new();
    SET.get_or_init(|| InfSet::load_dir(workspace_inf_dir()).expect("inf/ is readable"))
}

fn bindings(set: &InfSet) -> Vec<Result<Binding, BindError>> {
    DEVICES
        .iter()
        .map(|(hw, compat)| set.bind(hw, compat, "NTamd64"))
        .collect()
}

fn names(set: &InfSet) -> Vec<String> {
    set.infs().iter().map(|i| i.name().to_owned()).collect()
}

/// Checks the property on one input; panics on a violation. Returns
/// whether the file parsed.
pub(crate) fn check(bytes: &[u8]) -> bool {
    let first = parsed(bytes);
    let no_bom = !bytes.starts_with(&[0xFF, 0xFE])
        && !bytes.starts_with(&[0xFE, 0xFF])
        && !bytes.starts_with(&[0xEF, 0xBB, 0xBF]);
    if let (true, Ok(text)) = (no_bom, std::str::from_utf8(bytes)) {
        let mut utf16 = vec![0xFF, 0xFE];
        utf16.extend(text.encode_utf16().flat_map(u16::to_le_bytes));
        assert_eq!(parsed(&utf16), first, "UTF-16LE parses as UTF-8");
        if !text.contains('\r') {
            let crlf = text.replace('\n', "\r\n");
            assert_eq!(parsed(crlf.as_bytes()), first, "CRLF parses as LF");
        }
    }

    let base = workspace();
    let mut set = base.clone();
    let added = set.add(NAME, bytes);
    assert_eq!(added.is_ok(), first.is_ok(), "the set parses as the parser");
    match added {
        Err(e) => {
            assert_eq!(names(&set), names(base), "a refused INF adds nothing");
            for (now, before) in bindings(&set).into_iter().zip(bindings(base)) {
                match (now, before) {
                    (
                        Err(BindError::NoMatch { problems, .. }),
                        Err(BindError::NoMatch {
                            problems: before, ..
                        }),
                    ) => {
                        // A search that finds nothing names the rejected
                        // file among its problems, and nothing else new.
                        let (named, rest): (Vec<_>, Vec<_>) =
                            problems.into_iter().partition(|p| p.contains(NAME));
                        assert!(!named.is_empty(), "a NoMatch names the rejected INF");
                        assert_eq!(rest, before, "a refused INF adds no other problem");
                    }
                    (now, before) => assert_eq!(now, before, "a refused INF binds nothing"),
                }
            }
            assert!(
                set.rejected().iter().any(|(n, why)| n == NAME && *why == e),
                "a refused INF is named as rejected"
            );
            false
        }
        Ok(()) => {
            assert_eq!(names(&set).last().map(String::as_str), Some(NAME));
            for (n, binding) in bindings(&set).into_iter().enumerate() {
                if let Ok(binding) = binding {
                    let registry = RegistryStore::new();
                    let _ = binding.apply(&registry, &format!("ROOT\\FUZZ\\{n:04}"));
                }
            }
            true
        }
    }
}

/// The workspace's INF files, in UTF-8 and UTF-16LE: seeds for the
/// fuzzer's corpus and the property test's mutations.
pub(crate) fn seeds() -> Vec<Vec<u8>> {
    let mut paths: Vec<_> = std::fs::read_dir(workspace_inf_dir())
        .expect("inf/ is readable")
        .map(|e| e.expect("a directory entry").path())
        .filter(|p| p.extension().is_some_and(|e| e.eq_ignore_ascii_case("inf")))
        .collect();
    paths.sort();
    let mut seeds = Vec::new();
    for path in paths {
        let bytes = std::fs::read(&path).expect("an INF is readable");
        if let Ok(text) = std::str::from_utf8(&bytes) {
            let mut utf16 = vec![0xFF, 0xFE];
            utf16.extend(text.encode_utf16().flat_map(u16::to_le_bytes));
            seeds.push(utf16);
        }
        seeds.push(bytes);
    }
    seeds
}
