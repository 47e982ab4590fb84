//! The simulator's heap and the program's `malloc` heap never share a page
//! (docs/libibverbs.md, "Memory"): `ibv_reg_mr` adopts the whole pages
//! around a buffer, and the device writes them, so a small `malloc` buffer
//! of the program's must never sit on a page that holds the library's own
//! objects, and a registration of the library's own heap is refused. C
//! programs (`tests/heap/*.c`), built here against Debian's `verbs.h` and
//! run on our `libibverbs.so.1`, as Debian's tools are.

use std::net::Ipv4Addr;
use std::path::PathBuf;
use std::process::{Command, Output};

use verbs_side_support::testing::built_cdylib;

/// This test process's own loopback address `slot` (as `debian_tools.rs`:
/// from the process id, never 127.0.0.x), so concurrent runs never contend.
fn own_address(slot: u8) -> Ipv4Addr {
    let pid = std::process::id();
    Ipv4Addr::new(127, 0x40 | (pid >> 8) as u8 & 0x3F, pid as u8, slot)
}

/// Builds `tests/heap/{name}.c` (linked against Debian's libibverbs) and
/// runs it with our library first on `LD_LIBRARY_PATH`, its port at this
/// process's address `slot`.
fn run_program(name: &str, slot: u8) -> Output {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join("sim-libibverbs-heap")
        .join(format!("{name}.{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let library = dir.join("libibverbs.so.1");
    let _ = std::fs::remove_file(&library);
    std::os::unix::fs::symlink(built_cdylib("libibverbs.so"), &library).unwrap();
    let program = dir.join(name);
    let source = format!("{}/tests/heap/{name}.c", env!("CARGO_MANIFEST_DIR"));
    let built = Command::new("cc")
        .args(["-O1", "-Wall", "-Werror", "-o"])
        .arg(&program)
        .arg(source)
        .arg("-libverbs")
        .output()
        .unwrap();
    assert!(
        built.status.success(),
        "cc failed:\n{}",
        String::from_utf8_lossy(&built.stderr)
    );
    let output = Command::new(&program)
        .env("LD_LIBRARY_PATH", &dir)
        .env("SIM_LIBIBVERBS_ADDR", own_address(slot).to_string())
        .output()
        .unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    output
}

#[test]
fn no_small_malloc_buffer_of_the_program_shares_a_page_with_the_simulators_objects() {
    let output = run_program("page_sharing", 200);
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(
        output.status.code(),
        Some(0),
        "the program's malloc heap shares pages with the simulator's:\n{stdout}\n{stderr}"
    );
    assert!(
        stdout.ends_with(
            "0 of 4096 small malloc buffers share a page with the simulator's objects\n"
        ),
        "{stdout}"
    );
    assert!(stderr.is_empty(), "{stderr}");
}

#[test]
fn registering_the_simulators_own_heap_is_efault_and_the_pd_stays_usable() {
    let output = run_program("simulator_object", 201);
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(0), "{stdout}\n{stderr}");
    assert_eq!(stdout, "refused: Bad address\n");
    assert!(stderr.is_empty(), "{stderr}");
}
