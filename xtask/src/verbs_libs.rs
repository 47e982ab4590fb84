//! `cargo xtask verbs-libs [--out DIR] [--release]`: builds our
//! `libibverbs.so.1` (`verbs/sim-lib`) and the side libraries perftest
//! links (`verbs/side-libs/*`, docs/libibverbs.md) and lays them out in one
//! directory under their sonames (default `target/verbs-libs`), ready for
//! `LD_LIBRARY_PATH`. Then, if Debian's `ib_send_bw` is installed (it links
//! all five), checks that it loads every one of them from there and prints
//! its usage exactly as with Debian's libraries; and, if Debian's
//! `ibv_devinfo` is installed, that it runs on our library (exit 0, our
//! HCA listed).

use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};

/// Each library: its package, the file cargo builds, its soname.
const LIBRARIES: [(&str, &str, &str); 5] = [
    ("sim-libibverbs", "libibverbs.so", "libibverbs.so.1"),
    ("verbs-side-mlx5", "libmlx5.so", "libmlx5.so.1"),
    ("verbs-side-efa", "libefa.so", "libefa.so.1"),
    ("verbs-side-rdmacm", "librdmacm.so", "librdmacm.so.1"),
    ("verbs-side-ibumad", "libibumad.so", "libibumad.so.3"),
];

/// The perftest binary that links all five libraries.
const CHECK_TOOL: &str = "/usr/bin/ib_send_bw";

/// The tool that shows our HCA through our libibverbs.
const DEVINFO: &str = "/usr/bin/ibv_devinfo";

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask sits in the workspace")
        .to_path_buf()
}

/// Builds, lays out and checks; success when all three steps pass.
pub(crate) fn run(out: Option<PathBuf>, release: bool) -> ExitCode {
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace().join("target"));
    let out = out.unwrap_or_else(|| target.join("verbs-libs"));

    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_string());
    let mut build = Command::new(cargo);
    build.current_dir(workspace()).args(["build", "--locked"]);
    if release {
        build.arg("--release");
    }
    for (package, _, _) in LIBRARIES {
        build.args(["-p", package]);
    }
    match build.status() {
        Ok(status) if status.success() => {}
        Ok(status) => {
            eprintln!("verbs-libs: cargo build failed ({status})");
            return ExitCode::FAILURE;
        }
        Err(error) => {
            eprintln!("verbs-libs: cannot run cargo: {error}");
            return ExitCode::FAILURE;
        }
    }

    let built = target.join(if release { "release" } else { "debug" });
    if let Err(error) = std::fs::create_dir_all(&out) {
        eprintln!("verbs-libs: cannot create {}: {error}", out.display());
        return ExitCode::FAILURE;
    }
    for (_, file, soname) in LIBRARIES {
        let from = built.join(file);
        let to = out.join(soname);
        // Copied, not linked: the directory stays valid while cargo rebuilds.
        if let Err(error) = std::fs::copy(&from, &to) {
            eprintln!(
                "verbs-libs: cannot copy {} to {}: {error}",
                from.display(),
                to.display()
            );
            return ExitCode::FAILURE;
        }
        println!("verbs-libs: {}", to.display());
    }

    if !Path::new(CHECK_TOOL).exists() {
        println!("verbs-libs: {CHECK_TOOL} not installed (Debian's perftest): load check skipped");
    } else if check_loading(&out) != ExitCode::SUCCESS {
        return ExitCode::FAILURE;
    }
    if !Path::new(DEVINFO).exists() {
        println!("verbs-libs: {DEVINFO} not installed (Debian's ibverbs-utils): run check skipped");
        return ExitCode::SUCCESS;
    }
    check_devinfo(&out)
}

/// `ibv_devinfo` must run on our library from `dir` and list our HCA.
fn check_devinfo(dir: &Path) -> ExitCode {
    match Command::new(DEVINFO).env("LD_LIBRARY_PATH", dir).output() {
        Ok(output) if output.status.success() => {
            let stdout = String::from_utf8_lossy(&output.stdout);
            let hca = stdout.lines().next().unwrap_or_default();
            println!(
                "verbs-libs: {DEVINFO} runs on {}: {hca}",
                dir.join("libibverbs.so.1").display()
            );
            ExitCode::SUCCESS
        }
        Ok(output) => {
            eprintln!(
                "verbs-libs: {DEVINFO} failed on our libibverbs ({}):\n{}",
                output.status,
                String::from_utf8_lossy(&output.stderr)
            );
            ExitCode::FAILURE
        }
        Err(error) => {
            eprintln!("verbs-libs: cannot run {DEVINFO}: {error}");
            ExitCode::FAILURE
        }
    }
}

/// `ib_send_bw` must take all five libraries from `dir` and behave as with
/// Debian's.
fn check_loading(dir: &Path) -> ExitCode {
    let traced = Command::new(CHECK_TOOL)
        .env("LD_TRACE_LOADED_OBJECTS", "1")
        .env("LD_LIBRARY_PATH", dir)
        .output();
    let traced = match traced {
        Ok(output) => String::from_utf8_lossy(&output.stdout).into_owned(),
        Err(error) => {
            eprintln!("verbs-libs: cannot run {CHECK_TOOL}: {error}");
            return ExitCode::FAILURE;
        }
    };
    let mut loaded_all = true;
    for (_, _, soname) in LIBRARIES {
        let expected = format!("{soname} => {}", dir.join(soname).display());
        if !traced.contains(&expected) {
            eprintln!(
                "verbs-libs: {CHECK_TOOL} does not load {soname} from {}",
                dir.display()
            );
            loaded_all = false;
        }
    }
    if !loaded_all {
        eprintln!("{traced}");
        return ExitCode::FAILURE;
    }

    let debian = Command::new(CHECK_TOOL)
        .arg("--help")
        .env_remove("LD_LIBRARY_PATH")
        .output();
    let ours = Command::new(CHECK_TOOL)
        .arg("--help")
        .env("LD_LIBRARY_PATH", dir)
        .output();
    match (debian, ours) {
        (Ok(debian), Ok(ours))
            if debian.status.code() == ours.status.code()
                && debian.stdout == ours.stdout
                && debian.stderr == ours.stderr =>
        {
            println!(
                "verbs-libs: {CHECK_TOOL} --help loads all five from {} and behaves as with Debian's (exit {:?})",
                dir.display(),
                ours.status.code()
            );
            ExitCode::SUCCESS
        }
        (Ok(debian), Ok(ours)) => {
            eprintln!(
                "verbs-libs: {CHECK_TOOL} --help differs: exit {:?} (Debian's {:?})\n{}",
                ours.status.code(),
                debian.status.code(),
                String::from_utf8_lossy(&ours.stderr)
            );
            ExitCode::FAILURE
        }
        (Err(error), _) | (_, Err(error)) => {
            eprintln!("verbs-libs: cannot run {CHECK_TOOL}: {error}");
            ExitCode::FAILURE
        }
    }
}
