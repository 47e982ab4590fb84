//! `cargo xtask wdk-check`: type-checks and lints every KMDF shell
//! (`hca-miniport`, `ibal-bus`) and the code they share (`kmdf-platform`)
//! for `x86_64-pc-windows-msvc` on Linux.
//!
//! The real windows-drivers-rs build runs — `wdk-sys`'s build script
//! (bindgen over the kernel and KMDF headers, its C shim), the shells'
//! `build.rs` (the WDK link configuration, the miniport's SEH shim compiled
//! with clang in cl mode at `-W4 -WX`) — then `cargo check` and
//! `cargo clippy -- -D warnings` on the shells. Linux has no WDK, so:
//!
//! - a **stand-in WDK** is built once under `target/wdk-check/wdk`: Debian's
//!   mingw-w64 DDK headers (package `mingw-w64-x86-64-dev`) in the WDK's
//!   layout, with Microsoft's open-source KMDF 1.33 headers and five
//!   documented substitutions ([`build_stand_in`]);
//! - `wdk-build`, which refuses a non-Windows host, is copied from cargo's
//!   registry and patched for a Linux host ([`patch_wdk_build`]); cargo uses
//!   the copy through `--config patch…` in a scratch copy of the workspace
//!   manifest and lock file (`target/wdk-check/workspace`), never through
//!   the workspace's own `Cargo.toml` or `Cargo.lock`.
//!
//! What it proves and what not (README, "What is type-checked"): every WDF
//! call against Microsoft's real KMDF 1.33 declarations; the rest of the
//! kernel API against mingw-w64's community headers (a missing declaration
//! can be a false error, a looser type can hide a real one; struct layouts
//! are not verified). Nothing is linked, MSVC's own warnings are not
//! produced, and no INF tool runs.
//!
//! Prerequisites (each missing one is reported with its fix): the rustup
//! target `x86_64-pc-windows-msvc`; the Debian packages
//! `mingw-w64-x86-64-dev clang-14 libclang1-14 llvm-14`; the KMDF 1.33
//! headers (`--kmdf-headers DIR`, `WDK_CHECK_KMDF_HEADERS`, or the project
//! machines' copy in [`DEFAULT_KMDF_HEADERS`]); network access to crates.io
//! the first time (`cargo fetch` of the Windows-only crates).

use std::collections::BTreeMap;
use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};

/// The target the KMDF shells are built for.
pub(crate) const TARGET: &str = "x86_64-pc-windows-msvc";
/// Every KMDF crate: the code the shells share, then the shells.
const SHELLS: [&str; 3] = ["kmdf-platform", "hca-miniport", "ibal-bus"];
/// The Windows SDK version directory of the stand-in WDK (any valid one).
const WDK_VERSION: &str = "10.0.99999.0";
/// The KMDF version windows-drivers-rs supports from crates.io.
const KMDF_VERSION: &str = "1.33";
/// Where the project's machines keep Microsoft's KMDF 1.33 headers
/// (`src/publicinc/wdf/kmdf/1.33` of microsoft/Windows-Driver-Frameworks,
/// MIT). Third-party: read from there, never copied into the repository.
pub(crate) const DEFAULT_KMDF_HEADERS: &str = "/work/shared/windows-check/kmdf/1.33";
/// The environment variable naming another KMDF headers directory.
const KMDF_HEADERS_ENV: &str = "WDK_CHECK_KMDF_HEADERS";
/// The mingw-w64 headers (Debian `mingw-w64-x86-64-dev`).
const MINGW_INCLUDE: &str = "/usr/share/mingw-w64/include";
/// LLVM 14 (Debian `llvm-14`, `libclang1-14`): bindgen's libclang, the
/// clang resource directory, `llvm-lib`.
const LLVM_ROOT: &str = "/usr/lib/llvm-14";
/// The `wdk-build` version the Linux-host edits were made for.
const WDK_BUILD_VERSION: &str = "0.6.0";
/// Bump when the stand-in recipe or the `wdk-build` edits change, so the
/// cached copies under `target/wdk-check` are rebuilt.
const RECIPE_REVISION: u32 = 3;

/// Runs the check. `kmdf_headers` overrides where the KMDF headers are.
pub(crate) fn run(kmdf_headers: Option<PathBuf>) -> ExitCode {
    match check(kmdf_headers) {
        Ok(()) => {
            println!("\nwdk-check: the KMDF shells type-check and lint clean for {TARGET}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("\nwdk-check failed: {e}");
            ExitCode::FAILURE
        }
    }
}

fn check(kmdf_headers: Option<PathBuf>) -> Result<(), String> {
    let root = workspace_root();
    let tools = prerequisites(kmdf_headers)?;
    let cache = root.join("target").join("wdk-check");
    fs::create_dir_all(&cache).map_err(|e| format!("cannot create {}: {e}", cache.display()))?;

    println!("== wdk-check: stand-in WDK ==");
    let stand_in = cached(&cache.join("wdk"), &tools.stamp(), |out| {
        build_stand_in(out, &tools.kmdf_headers)
    })?;
    println!("   {}", stand_in.display());

    println!("== wdk-check: wdk-build {WDK_BUILD_VERSION} patched for a Linux host ==");
    let original = registry_source(&root, "wdk-build", WDK_BUILD_VERSION)?;
    let patched = cached(
        &cache.join(format!("wdk-build-{WDK_BUILD_VERSION}")),
        &format!("revision {RECIPE_REVISION}\nfrom {}\n", original.display()),
        |out| patch_wdk_build(&original, out),
    )?;
    println!("   {}", patched.display());

    let workspace = scratch_workspace(&root, &cache.join("workspace"))?;
    let patch = format!(
        "patch.crates-io.wdk-build.path={}",
        toml_string(&patched.to_string_lossy())
    );
    let target_dir = cache.join("cargo-target");
    let mut packages = Vec::new();
    for shell in SHELLS {
        packages.extend(["-p", shell]);
    }
    let common = |subcommand: &str| {
        let mut command = Command::new(cargo());
        command
            .current_dir(&workspace)
            .arg(subcommand)
            .args(["--target", TARGET, "--config", &patch])
            .args(&packages)
            .args([
                "--features",
                "hca-miniport/wdk-cross-check,ibal-bus/wdk-cross-check",
            ])
            .envs(tools.environment(&stand_in, &root))
            .env("CARGO_TARGET_DIR", &target_dir);
        command
    };

    println!("== wdk-check: cargo check --target {TARGET} ==");
    run_cargo(common("check").arg("--keep-going"))?;
    println!("== wdk-check: cargo clippy --target {TARGET} -- -D warnings ==");
    run_cargo(common("clippy").args(["--keep-going", "--", "-D", "warnings"]))?;
    Ok(())
}

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask lives inside the workspace")
        .to_path_buf()
}

fn cargo() -> String {
    std::env::var("CARGO").unwrap_or_else(|_| "cargo".into())
}

fn run_cargo(command: &mut Command) -> Result<(), String> {
    let status = command
        .status()
        .map_err(|e| format!("cannot run cargo: {e}"))?;
    if status.success() {
        Ok(())
    } else {
        Err(format!("`cargo {}` failed ({status})", describe(command)))
    }
}

fn describe(command: &Command) -> String {
    command
        .get_args()
        .map(|a| a.to_string_lossy().into_owned())
        .collect::<Vec<_>>()
        .join(" ")
}

/// A TOML basic string for `--config`.
fn toml_string(text: &str) -> String {
    format!("\"{}\"", text.replace('\\', "\\\\").replace('"', "\\\""))
}

// ---------------------------------------------------------------------------
// Prerequisites

/// What the check runs with, every path verified.
#[derive(Debug)]
struct Tools {
    kmdf_headers: PathBuf,
    clang_resource_dir: PathBuf,
}

impl Tools {
    /// What the cached stand-in was built from.
    fn stamp(&self) -> String {
        format!(
            "revision {RECIPE_REVISION}\nmingw {MINGW_INCLUDE}\nkmdf {}\n",
            self.kmdf_headers.display()
        )
    }

    /// The environment windows-drivers-rs's build scripts and cc-rs read.
    fn environment(&self, stand_in: &Path, root: &Path) -> Vec<(String, String)> {
        let clang_cl = root.join("xtask").join("wdk-check").join("clang-cl");
        let text = |p: &Path| p.to_string_lossy().into_owned();
        vec![
            // wdk-build: the WDK to use and its SDK version directory.
            ("WDKContentRoot".into(), text(stand_in)),
            ("Version_Number".into(), WDK_VERSION.into()),
            // The clang-cl wrapper: which include directories are the WDK's.
            ("WDK_STAND_IN_ROOT".into(), text(stand_in)),
            // bindgen: libclang 14; mingw's headers need __GNUC__, which
            // clang drops under MS compatibility (about 350 errors without).
            ("LIBCLANG_PATH".into(), format!("{LLVM_ROOT}/lib")),
            (
                "BINDGEN_EXTRA_CLANG_ARGS".into(),
                format!(
                    "-fgnuc-version=4.2.1 -resource-dir={}",
                    self.clang_resource_dir.display()
                ),
            ),
            // cc-rs: the C compiler and archiver for the msvc target.
            ("CC_x86_64_pc_windows_msvc".into(), text(&clang_cl)),
            ("AR_x86_64_pc_windows_msvc".into(), "llvm-lib-14".into()),
            // Kernel drivers do not unwind. The profile setting applies to
            // the Windows-target crates only here (build scripts and proc
            // macros always unwind); Linux builds keep unwinding. The
            // static CRT comes from `.cargo/config.toml`'s Windows target
            // section, which this check thereby verifies.
            ("CARGO_PROFILE_DEV_PANIC".into(), "abort".into()),
            ("CARGO_PROFILE_RELEASE_PANIC".into(), "abort".into()),
        ]
    }
}

/// Checks every prerequisite and reports all that are missing at once.
fn prerequisites(kmdf_headers: Option<PathBuf>) -> Result<Tools, String> {
    let mut missing = Vec::new();
    let apt = "apt-get install mingw-w64-x86-64-dev clang-14 libclang1-14 llvm-14";
    if !Path::new(MINGW_INCLUDE).join("ddk").join("wdm.h").is_file() {
        missing.push(format!(
            "mingw-w64's DDK headers ({MINGW_INCLUDE}/ddk): {apt}"
        ));
    }
    for tool in ["clang-14", "llvm-lib-14"] {
        if find_on_path(tool).is_none() {
            missing.push(format!("`{tool}` on PATH: {apt}"));
        }
    }
    let llvm_lib = Path::new(LLVM_ROOT).join("lib");
    let has_libclang = fs::read_dir(&llvm_lib).is_ok_and(|entries| {
        entries
            .filter_map(Result::ok)
            .any(|e| e.file_name().to_string_lossy().starts_with("libclang"))
    });
    if !has_libclang {
        missing.push(format!("libclang in {}: {apt}", llvm_lib.display()));
    }
    let clang_resource_dir = fs::read_dir(llvm_lib.join("clang"))
        .ok()
        .and_then(|entries| entries.filter_map(Result::ok).map(|e| e.path()).max());
    if clang_resource_dir.is_none() {
        missing.push(format!(
            "clang's resource directory ({LLVM_ROOT}/lib/clang/<version>): {apt}"
        ));
    }
    if !rust_target_installed() {
        missing.push(format!(
            "the Rust standard library for {TARGET}: rustup target add {TARGET}"
        ));
    }
    let kmdf_headers = kmdf_headers
        .or_else(|| std::env::var_os(KMDF_HEADERS_ENV).map(PathBuf::from))
        .unwrap_or_else(|| PathBuf::from(DEFAULT_KMDF_HEADERS));
    if !kmdf_headers.join("wdf.h").is_file() {
        missing.push(format!(
            "the KMDF {KMDF_VERSION} headers (no wdf.h in {}): pass --kmdf-headers DIR or set \
             {KMDF_HEADERS_ENV} to the src/publicinc/wdf/kmdf/{KMDF_VERSION} directory of a \
             clone of https://github.com/microsoft/Windows-Driver-Frameworks (MIT)",
            kmdf_headers.display()
        ));
    }
    match (missing.is_empty(), clang_resource_dir) {
        (true, Some(clang_resource_dir)) => Ok(Tools {
            kmdf_headers,
            clang_resource_dir,
        }),
        _ => Err(format!(
            "prerequisites missing:\n  - {}",
            missing.join("\n  - ")
        )),
    }
}

fn find_on_path(tool: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|dir| dir.join(tool))
        .find(|candidate| candidate.is_file())
}

fn rust_target_installed() -> bool {
    let rustc = std::env::var("RUSTC").unwrap_or_else(|_| "rustc".into());
    Command::new(rustc)
        .args(["--print", "target-libdir", "--target", TARGET])
        .output()
        .ok()
        .filter(|out| out.status.success())
        .map(|out| PathBuf::from(String::from_utf8_lossy(&out.stdout).trim()))
        .is_some_and(|dir| {
            fs::read_dir(dir).is_ok_and(|entries| {
                entries
                    .filter_map(Result::ok)
                    .any(|e| e.file_name().to_string_lossy().starts_with("libcore-"))
            })
        })
}

// ---------------------------------------------------------------------------
// Cache

/// Returns `dir`, building it with `build` unless it holds a finished
/// build of the same `stamp`. Builds into a sibling directory and renames
/// it into place, so an interrupted build is never mistaken for a finished
/// one.
fn cached(
    dir: &Path,
    stamp: &str,
    build: impl FnOnce(&Path) -> Result<(), String>,
) -> Result<PathBuf, String> {
    let stamp_file = dir.join(".wdk-check-stamp");
    if fs::read_to_string(&stamp_file).is_ok_and(|s| s == stamp) {
        return Ok(dir.to_path_buf());
    }
    let partial = dir.with_extension("partial");
    remove_dir(&partial)?;
    build(&partial)?;
    write(&partial.join(".wdk-check-stamp"), stamp)?;
    remove_dir(dir)?;
    fs::rename(&partial, dir).map_err(|e| format!("cannot move {}: {e}", partial.display()))?;
    Ok(dir.to_path_buf())
}

fn remove_dir(dir: &Path) -> Result<(), String> {
    match fs::remove_dir_all(dir) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => {
            Err(format!("cannot remove {}: {e}", dir.display()))
        }
        _ => Ok(()),
    }
}

fn write(path: &Path, text: &str) -> Result<(), String> {
    fs::write(path, text).map_err(|e| format!("cannot write {}: {e}", path.display()))
}

fn read(path: &Path) -> Result<String, String> {
    let bytes = fs::read(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    Ok(String::from_utf8_lossy(&bytes).into_owned())
}

/// Copies the tree at `from` into `to` (created), keeping symbolic links.
fn copy_tree(from: &Path, to: &Path) -> Result<(), String> {
    let context = |e: io::Error| format!("copying {} to {}: {e}", from.display(), to.display());
    fs::create_dir_all(to).map_err(context)?;
    for entry in fs::read_dir(from).map_err(context)? {
        let entry = entry.map_err(context)?;
        let (source, dest) = (entry.path(), to.join(entry.file_name()));
        let kind = entry.file_type().map_err(context)?;
        if kind.is_symlink() {
            let link = fs::read_link(&source).map_err(context)?;
            std::os::unix::fs::symlink(link, &dest).map_err(context)?;
        } else if kind.is_dir() {
            copy_tree(&source, &dest)?;
        } else {
            fs::copy(&source, &dest).map_err(context)?;
        }
    }
    Ok(())
}

/// Replaces `old` by `new` in `text`, which must hold `old` exactly
/// `count` times (an edit that no longer applies is an error, not a no-op).
fn replace_exactly(
    text: &str,
    old: &str,
    new: &str,
    count: usize,
    file: &Path,
) -> Result<String, String> {
    let found = text.matches(old).count();
    if found != count {
        return Err(format!(
            "{}: expected {count} occurrence(s) of {old:?}, found {found}; the recipe in \
             xtask/src/wdk_check.rs needs updating",
            file.display()
        ));
    }
    Ok(text.replace(old, new))
}

// ---------------------------------------------------------------------------
// The stand-in WDK

/// Builds a `WDKContentRoot` layout in `out`: the kernel headers from
/// mingw-w64 in `Include/<ver>/{km,shared}`, the KMDF headers in
/// `Include/wdf/kmdf/1.33`, the (empty) library directories wdk-build
/// expects, and five substitutions, each a known difference between
/// mingw-w64 and the WDK.
fn build_stand_in(out: &Path, kmdf_headers: &Path) -> Result<(), String> {
    let include = out.join("Include").join(WDK_VERSION);
    let km = include.join("km");
    for dir in [
        km.join("crt"),
        km.join("ufx").join("1.1"),
        include.join("shared"),
        out.join("Include").join("wdf").join("kmdf"),
        out.join("Lib").join(WDK_VERSION).join("km").join("x64"),
        out.join("Lib")
            .join("wdf")
            .join("kmdf")
            .join("x64")
            .join(KMDF_VERSION),
    ] {
        fs::create_dir_all(&dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    }
    let mingw = Path::new(MINGW_INCLUDE);
    copy_tree(&mingw.join("ddk"), &km)?;
    copy_tree(mingw, &include.join("shared"))?;
    remove_dir(&include.join("shared").join("ddk"))?;
    copy_tree(
        kmdf_headers,
        &out.join("Include")
            .join("wdf")
            .join("kmdf")
            .join(KMDF_VERSION),
    )?;

    let wdm_h = km.join("wdm.h");
    let mut wdm = read(&wdm_h)?;
    // 1. The WDK declares SCATTER_GATHER_LIST.Elements[] (a flexible array,
    //    bindgen's __IncompleteArrayField); mingw-w64 declares [1].
    let old = "\n  SCATTER_GATHER_ELEMENT Elements[1];";
    if !wdm.contains(old) {
        return Err(format!("{}: no {old:?} to substitute", wdm_h.display()));
    }
    wdm = wdm.replace(old, "\n  SCATTER_GATHER_ELEMENT Elements[];");
    // 2. The x64 WDK declares KeGetCurrentIrql as an exported routine
    //    (wdk-sys binds it; its PAGED_CODE calls it); mingw-w64 inlines it.
    wdm = replace_exactly(
        &wdm,
        "FORCEINLINE\nKIRQL\nKeGetCurrentIrql(VOID)\n{\n  return (KIRQL)__readcr8();\n}\n",
        "NTHALAPI\nKIRQL\nNTAPI\nKeGetCurrentIrql(VOID);\n",
        1,
        &wdm_h,
    )?;
    write(&wdm_h, &wdm)?;

    // 3. Kernel-mode WDK headers define STRICT (so a WDFDEVICE is a pointer
    //    to its own struct, not a void pointer), and 4. declarations newer
    //    than mingw-w64 10's DDK (extras.h): both through an ntifs.h in
    //    km/crt, which wdk-sys searches first, wrapping mingw's.
    write(
        &km.join("crt").join("wdk_stand_in_extras.h"),
        include_str!("../wdk-check/extras.h"),
    )?;
    write(
        &km.join("crt").join("ntifs.h"),
        "/* stand-in WDK: mingw-w64's ntifs.h with STRICT, then what newer WDKs add. */\n\
         #ifndef STRICT\n#define STRICT 1\n#endif\n\
         #include_next <ntifs.h>\n#include \"wdk_stand_in_extras.h\"\n",
    )?;

    // 5. Windows sources include header names in any case; Linux file
    //    names are case-sensitive.
    let links = case_links(out)?;
    println!("   built ({links} case-variant header links)");
    Ok(())
}

/// Adds a symbolic link for every header name some header includes under
/// a spelling that differs in case from the file's; returns how many.
fn case_links(root: &Path) -> Result<usize, String> {
    let mut files = Vec::new();
    collect_files(root, &mut files)?;
    let mut by_lower_name: BTreeMap<String, Vec<PathBuf>> = BTreeMap::new();
    let mut wanted = std::collections::BTreeSet::new();
    for file in &files {
        let name = file_name(file);
        by_lower_name
            .entry(name.to_lowercase())
            .or_default()
            .push(file.clone());
        let lower = name.to_lowercase();
        if [".h", ".hpp", ".inl", ".c"]
            .iter()
            .any(|ext| lower.ends_with(ext))
        {
            wanted.extend(included_names(&read(file)?));
        }
    }
    let mut made = 0;
    for name in wanted {
        let base = name.rsplit(['/', '\\']).next().unwrap_or(&name).to_string();
        for target in by_lower_name
            .get(&base.to_lowercase())
            .into_iter()
            .flatten()
        {
            let link = target.with_file_name(&base);
            if fs::symlink_metadata(&link).is_err() {
                std::os::unix::fs::symlink(file_name(target), &link)
                    .map_err(|e| format!("cannot link {}: {e}", link.display()))?;
                made += 1;
            }
        }
    }
    Ok(made)
}

fn file_name(path: &Path) -> String {
    path.file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default()
}

fn collect_files(dir: &Path, out: &mut Vec<PathBuf>) -> Result<(), String> {
    let context = |e: io::Error| format!("cannot list {}: {e}", dir.display());
    for entry in fs::read_dir(dir).map_err(context)? {
        let entry = entry.map_err(context)?;
        let kind = entry.file_type().map_err(context)?;
        if kind.is_dir() {
            collect_files(&entry.path(), out)?;
        } else if kind.is_file() {
            out.push(entry.path());
        }
    }
    Ok(())
}

/// The names of `#include <…>` and `#include "…"` lines.
fn included_names(source: &str) -> Vec<String> {
    source
        .lines()
        .filter_map(|line| {
            let rest = line.trim_start().strip_prefix('#')?;
            let rest = rest.trim_start().strip_prefix("include")?.trim_start();
            let close = match rest.chars().next()? {
                '<' => '>',
                '"' => '"',
                _ => return None,
            };
            let name = &rest[1..];
            let end = name.find(close)?;
            Some(name[..end].replace('\\', "/"))
        })
        .collect()
}

// ---------------------------------------------------------------------------
// wdk-build for a Linux host

/// The source of `name` `version` in cargo's registry cache, fetched
/// first (with the Windows target, so the Windows-only crates come too).
fn registry_source(root: &Path, name: &str, version: &str) -> Result<PathBuf, String> {
    let lock = read(&root.join("Cargo.lock"))?;
    let entry = format!("name = \"{name}\"\nversion = \"{version}\"\n");
    if !lock.contains(&entry) {
        return Err(format!(
            "Cargo.lock does not pin {name} {version}, for which the Linux-host edits in \
             xtask/src/wdk_check.rs were made: update the edits and WDK_BUILD_VERSION"
        ));
    }
    run_cargo(
        Command::new(cargo())
            .current_dir(root)
            .args(["fetch", "--locked", "--target", TARGET]),
    )?;
    let cargo_home = std::env::var_os("CARGO_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|home| Path::new(&home).join(".cargo")))
        .ok_or("neither CARGO_HOME nor HOME is set")?;
    let registry = cargo_home.join("registry").join("src");
    let dirs =
        fs::read_dir(&registry).map_err(|e| format!("cannot list {}: {e}", registry.display()))?;
    dirs.filter_map(Result::ok)
        .map(|index| index.path().join(format!("{name}-{version}")))
        .find(|dir| dir.join("Cargo.toml").is_file())
        .ok_or_else(|| format!("{name} {version} is not in {}", registry.display()))
}

/// Copies `wdk-build` into `out` with the edits that let it build and run
/// on a Linux host, and nothing else changed: its `windows` crate
/// dependency made `cfg(windows)`, the registry lookup of the WDK gated
/// (the environment names the WDK here), the `compile_error!` in
/// `set_var`/`remove_var` (used only by cargo-make flows) turned into a
/// runtime error, and the Windows-only symlink call aliased.
fn patch_wdk_build(original: &Path, out: &Path) -> Result<(), String> {
    copy_tree(original, out)?;
    let edit = |relative: &str, edits: &[(&str, &str, usize)]| -> Result<(), String> {
        let path = out.join(relative);
        // The crate's sources have CRLF line ends; the edits are LF.
        let mut text = read(&path)?.replace("\r\n", "\n");
        for (old, new, count) in edits {
            text = replace_exactly(&text, old, new, *count, &path)?;
        }
        write(&path, &text)
    };
    edit(
        "Cargo.toml",
        &[
            (
                "\n[dependencies.windows]\n",
                "\n[target.'cfg(windows)'.dependencies.windows]\n",
                1,
            ),
            (
                "\n[dev-dependencies.windows]\n",
                "\n[target.'cfg(windows)'.dev-dependencies.windows]\n",
                1,
            ),
        ],
    )?;
    edit(
        "src/cargo_make.rs",
        &[("std::os::windows::fs::symlink_file(", "symlink_file(", 2)],
    )?;
    let cargo_make = out.join("src/cargo_make.rs");
    let mut text = read(&cargo_make)?;
    text.push_str(
        "\n#[cfg(windows)]\nuse std::os::windows::fs::symlink_file;\n\
         #[cfg(not(windows))]\nuse std::os::unix::fs::symlink as symlink_file;\n",
    );
    write(&cargo_make, &text)?;
    let refuse = "    compile_error!(\n        \"windows-drivers-rs is designed to be run on a \
                  Windows host machine in a WDK environment. \\\n         Please build using a \
                  Windows target.\"\n    );\n";
    edit(
        "src/utils.rs",
        &[
            ("    ffi::{CStr, OsStr},\n", "    ffi::OsStr,\n", 1),
            (
                "\nuse windows::{\n",
                "\n#[cfg(windows)]\nuse std::ffi::CStr;\n#[cfg(windows)]\nuse windows::{\n",
                1,
            ),
            (
                "\nuse crate::{ConfigError, CpuArchitecture, IoError, TwoPartVersion};\n",
                "\n#[allow(unused_imports)]\n\
                 use crate::{ConfigError, CpuArchitecture, IoError, TwoPartVersion};\n",
                1,
            ),
            (
                "    // Check HKEY_LOCAL_MACHINE\\SOFTWARE\\Microsoft\\Windows Kits\\Installed\n",
                "    registry_kits_root()\n}\n\n\
                 #[cfg(not(windows))]\nfn registry_kits_root() -> Option<PathBuf> {\n    None\n}\n\n\
                 #[cfg(windows)]\nfn registry_kits_root() -> Option<PathBuf> {\n\
                 \x20   // Check HKEY_LOCAL_MACHINE\\SOFTWARE\\Microsoft\\Windows Kits\\Installed\n",
                1,
            ),
            (
                "\nfn read_registry_key_string_value(",
                "\n#[cfg(windows)]\nfn read_registry_key_string_value(",
                1,
            ),
            (
                refuse,
                "    panic!(\"set_var/remove_var: Windows hosts only (cargo xtask wdk-check)\")\n",
                2,
            ),
            (
                "    mod read_registry_key_string_value {",
                "    #[cfg(windows)]\n    mod read_registry_key_string_value {",
                1,
            ),
        ],
    )
}

/// A scratch workspace at `dir` that cargo may rewrite the lock file of:
/// copies of the manifest and lock file, and links to everything else at
/// the root of the workspace (the `--config patch` of `wdk-build` changes
/// its lock entry, which the real `Cargo.lock` must never see).
fn scratch_workspace(root: &Path, dir: &Path) -> Result<PathBuf, String> {
    remove_dir(dir)?;
    fs::create_dir_all(dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    let entries = fs::read_dir(root).map_err(|e| format!("cannot list {}: {e}", root.display()))?;
    for entry in entries.filter_map(Result::ok) {
        let name = entry.file_name();
        let dest = dir.join(&name);
        match name.to_string_lossy().as_ref() {
            "target" | ".git" => {}
            "Cargo.toml" | "Cargo.lock" => {
                fs::copy(entry.path(), &dest)
                    .map_err(|e| format!("cannot copy {}: {e}", entry.path().display()))?;
            }
            _ => std::os::unix::fs::symlink(entry.path(), &dest)
                .map_err(|e| format!("cannot link {}: {e}", dest.display()))?,
        }
    }
    Ok(dir.to_path_buf())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn included_names_reads_both_forms_and_ignores_the_rest() {
        let source = "#include <Wdm.h>\n  #  include \"sub\\\\Foo.H\"\n// #include <no.h>\n\
                      #define X 1\n#include_next <ntifs.h>\n";
        assert_eq!(included_names(source), vec!["Wdm.h", "sub//Foo.H"]);
    }

    #[test]
    fn an_edit_that_no_longer_applies_is_an_error() {
        let file = Path::new("f.rs");
        assert_eq!(
            replace_exactly("a b a", "a", "c", 2, file).as_deref(),
            Ok("c b c")
        );
        assert!(replace_exactly("a b", "a", "c", 2, file).is_err());
        assert!(replace_exactly("b", "a", "c", 1, file).is_err());
    }
}
