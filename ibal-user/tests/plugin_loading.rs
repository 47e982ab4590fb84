//! Loading the UVP the kernel names: only from the verified directory, by
//! absolute path, its table taken from `uvp_get_interface` and checked
//! (`UvpInterface::check`). The plugins are real shared libraries compiled
//! for the test with `rustc` (a few hundred milliseconds each), whose
//! entry point fills the table's bytes at the offsets `ib_types::uvp`
//! asserts.
#![cfg(unix)]

use std::path::{Path, PathBuf};
use std::process::Command;

use ib_types::interface::{InterfaceVersion, UvpName};
use ibal_user::plugin::{LoadedPlugin, PluginError, file_name};

/// A fresh directory for one test.
fn scratch(test: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("ibal-user-{test}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Compiles `source` as the shared library of plugin `name` in `dir`.
fn build_plugin(dir: &Path, name: &str, source: &str) -> PathBuf {
    let src = dir.join(format!("{name}.rs"));
    std::fs::write(&src, source).unwrap();
    let out = dir.join(file_name(&UvpName::new(name).unwrap()));
    let status = Command::new(std::env::var("RUSTC").unwrap_or_else(|_| "rustc".into()))
        .args(["--crate-type", "cdylib", "--edition", "2021", "-o"])
        .arg(&out)
        .arg(&src)
        .status()
        .expect("rustc runs");
    assert!(status.success());
    out
}

/// A plugin whose `uvp_get_interface` answers `status`; on success it
/// fills a table of interface version `packed` (whatever the library asked
/// for), with every entry point but those in `missing` (table offsets).
fn entry(packed: u16, status: u32, missing: &[usize]) -> String {
    format!(
        r#"
extern "system" fn release(_: *mut u8) {{}}
extern "system" fn unused() -> u32 {{ 0xC000_0002 }}

#[no_mangle]
pub unsafe extern "system" fn uvp_get_interface(_version: u16, table: *mut u8) -> u32 {{
    let status: u32 = {status};
    if status != 0 {{
        return status;
    }}
    let entries: [(usize, usize); 6] = [
        (16, release as *const () as usize),
        (616, unused as *const () as usize),
        (624, unused as *const () as usize),
        (632, unused as *const () as usize),
        (640, unused as *const () as usize),
        (648, unused as *const () as usize),
    ];
    let missing: &[usize] = &{missing:?};
    unsafe {{
        table.cast::<u32>().write_unaligned(656);
        table.add(4).cast::<u16>().write_unaligned({packed});
        for (offset, address) in entries {{
            if !missing.contains(&offset) {{
                table.add(offset).cast::<usize>().write_unaligned(address);
            }}
        }}
    }}
    0
}}
"#
    )
}

fn version_entry(packed: u16) -> String {
    entry(packed, 0, &[])
}

fn name(s: &str) -> UvpName {
    UvpName::new(s).unwrap()
}

#[test]
fn a_plugin_in_the_verified_directory_loads_by_absolute_path_with_its_version_checked() {
    let dir = scratch("load");
    let good = InterfaceVersion::new(1, 2);
    let built = build_plugin(&dir, "good_uvp", &version_entry(good.packed()));
    let plugin = LoadedPlugin::load(&dir, &name("good_uvp"), None).unwrap();
    assert!(plugin.path().is_absolute());
    assert_eq!(plugin.path(), built.canonicalize().unwrap());
    assert_eq!(plugin.version(), good, "a newer minor is accepted");
    drop(plugin);

    // Another major version is refused.
    build_plugin(
        &dir,
        "v2_uvp",
        &version_entry(InterfaceVersion::new(2, 0).packed()),
    );
    assert_eq!(
        LoadedPlugin::load(&dir, &name("v2_uvp"), None).unwrap_err(),
        PluginError::Version {
            found: InterfaceVersion::new(2, 0),
            required: ibal_user::plugin::UVP_INTERFACE_VERSION,
        }
    );
    // An entry point refusing the library's version is refused.
    build_plugin(&dir, "no_uvp", &entry(0x0100, 0xC000_00BB, &[]));
    assert!(matches!(
        LoadedPlugin::load(&dir, &name("no_uvp"), None),
        Err(PluginError::Refused { .. })
    ));
    // A table without its arm entry point (offset 648) is refused.
    build_plugin(&dir, "partial_uvp", &entry(0x0100, 0, &[648]));
    assert!(matches!(
        LoadedPlugin::load(&dir, &name("partial_uvp"), None),
        Err(PluginError::Table { .. })
    ));
    // A library without the entry point is refused.
    build_plugin(
        &dir,
        "bare_uvp",
        "#[no_mangle]\npub extern \"C\" fn other() {}\n",
    );
    assert!(matches!(
        LoadedPlugin::load(&dir, &name("bare_uvp"), None),
        Err(PluginError::NoEntryPoint(_))
    ));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn nothing_outside_the_verified_directory_and_nothing_that_is_not_a_library_loads() {
    let dir = scratch("refuse");
    let outside = scratch("outside");
    // Absent.
    assert!(matches!(
        LoadedPlugin::load(&dir, &name("missing_uvp"), None),
        Err(PluginError::Absent { .. })
    ));
    // A link in the directory to a plugin outside it.
    let real = build_plugin(&outside, "escape_uvp", &version_entry(0x0100));
    std::os::unix::fs::symlink(&real, dir.join(file_name(&name("escape_uvp")))).unwrap();
    assert!(matches!(
        LoadedPlugin::load(&dir, &name("escape_uvp"), None),
        Err(PluginError::Unverified(_))
    ));
    // A directory of the plugin's name.
    std::fs::create_dir(dir.join(file_name(&name("dir_uvp")))).unwrap();
    assert!(matches!(
        LoadedPlugin::load(&dir, &name("dir_uvp"), None),
        Err(PluginError::Unverified(_))
    ));
    // A file that is no library.
    std::fs::write(
        dir.join(file_name(&name("junk_uvp"))),
        b"not a shared object",
    )
    .unwrap();
    assert!(matches!(
        LoadedPlugin::load(&dir, &name("junk_uvp"), None),
        Err(PluginError::Load { .. })
    ));
    // A name with a directory or an extension cannot even be spelled.
    for hostile in ["../evil", "evil.dll", "C:\\evil", ""] {
        assert!(UvpName::new(hostile).is_err(), "{hostile}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
    std::fs::remove_dir_all(&outside).unwrap();
}

/// Process memory that has none.
struct NoMemory;

impl uvp_plugin::UserMemory for NoMemory {
    fn alloc(&self, _: usize) -> Option<u64> {
        None
    }

    fn free(&self, _: u64) {}
}

#[test]
fn a_platform_goes_only_to_a_plugin_exporting_uvp_set_platform_and_a_refused_one_is_released() {
    let dir = scratch("platform");
    let memory: std::sync::Arc<dyn uvp_plugin::UserMemory> = std::sync::Arc::new(NoMemory);
    let platform = || uvp_plugin::Platform {
        memory: std::sync::Arc::clone(&memory),
        mmio: std::sync::Arc::new(|_, _| {}),
    };
    // Without the export, a platform cannot be handed over.
    build_plugin(&dir, "plain_uvp", &version_entry(0x0100));
    assert!(matches!(
        LoadedPlugin::load(&dir, &name("plain_uvp"), Some(platform())),
        Err(PluginError::NoPlatformEntryPoint(_))
    ));
    // A plugin refusing the record: the load fails with its status and
    // the record is released (nothing holds the platform any more).
    let refusing = format!(
        "{}\n#[no_mangle]\npub extern \"system\" fn uvp_set_platform(_: *const u8) -> u32 {{ 0xC000_000D }}\n",
        version_entry(0x0100)
    );
    build_plugin(&dir, "refusing_uvp", &refusing);
    assert!(matches!(
        LoadedPlugin::load(&dir, &name("refusing_uvp"), Some(platform())),
        Err(PluginError::Refused { .. })
    ));
    assert_eq!(std::sync::Arc::strong_count(&memory), 1);
    std::fs::remove_dir_all(&dir).unwrap();
}
