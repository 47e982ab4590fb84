//! The simulator's heap and the program's `malloc` heap never share a page
//! (docs/libibverbs.md, "Memory"): `ibv_reg_mr` adopts the whole pages
//! around a buffer, and the device writes them, so a small `malloc` buffer
//! of the program's must never sit on a page that holds the library's own
//! objects. A C program (`tests/heap/page_sharing.c`, built here against
//! Debian's `verbs.h`, run on our `libibverbs.so.1`) mallocs thousands of
//! small buffers beside the context, PD and region the library allocated
//! for it, and counts those that share a page.

use std::net::Ipv4Addr;
use std::path::PathBuf;
use std::process::Command;

use verbs_side_support::testing::built_cdylib;

/// This test process's own loopback address (as `debian_tools.rs`: from
/// the process id, never 127.0.0.x), so concurrent runs never contend.
fn own_address() -> Ipv4Addr {
    let pid = std::process::id();
    Ipv4Addr::new(127, 0x40 | (pid >> 8) as u8 & 0x3F, pid as u8, 200)
}

#[test]
fn no_small_malloc_buffer_of_the_program_shares_a_page_with_the_simulators_objects() {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join("sim-libibverbs-heap")
        .join(std::process::id().to_string());
    std::fs::create_dir_all(&dir).unwrap();
    std::os::unix::fs::symlink(built_cdylib("libibverbs.so"), dir.join("libibverbs.so.1")).unwrap();
    let program = dir.join("page_sharing");
    let source = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/heap/page_sharing.c");
    // Linked against Debian's libibverbs (libibverbs-dev), run on ours:
    // as Debian's tools are.
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
        .env("SIM_LIBIBVERBS_ADDR", own_address().to_string())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    let _ = std::fs::remove_dir_all(&dir);
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
