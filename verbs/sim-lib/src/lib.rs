//! Our `libibverbs.so.1` on Linux (issue 14, docs/libibverbs.md): the
//! product's entry points (`ibverbs-compat`) exported under rdma-core's
//! symbol versions, over a simulated machine that the library boots inside
//! the program itself: no daemon.
//!
//! Loading the library registers the boot with the product (a constructor
//! in `.init_array`, which does nothing else); the first
//! `ibv_get_device_list` boots the machine
//! ([`sim_shells::embedded::EmbeddedMachine`]: the threaded host, one HCA
//! with one port, the real miniport and IBAL bus filter from our INFs, and
//! a simulated user process whose OS seam is
//! [`sim_shells::user_io::ThreadedSimIo`]), with the plugin linked.
//!
//! **Its own address.** The HCA's port is a real RoCEv2 endpoint (UDP
//! port 4791, `sim_hca::udp`) on an address of the process's own: the one
//! [`ADDRESS_VARIABLE`] names, or with no configuration the first free
//! loopback address (127.0.0.1, 127.0.0.2, ...), so two processes get
//! two addresses, and GID 0 is the address's IPv4-mapped GID. A value
//! that is not an address, or one the process cannot bind, is printed
//! once and the device list comes back NULL with `ENODEV`.
//!
//! **Process exit.** The boot registers an `atexit` handler that ends the
//! machine when the program returns from `main` (or calls `exit`): the
//! simulated process exits (the drivers clean what the program left
//! open), the host shuts down, and its verifier is read. Anything wrong —
//! a violation, pages left locked, or a shutdown that took more than
//! [`EXIT_TIMEOUT`] (the program then exits anyway, its threads with it)
//! — is printed to standard error, prefixed `libibverbs:`; a clean exit
//! prints nothing (unless [`EXIT_REPORT_VARIABLE`] is set).
//!
//! **Its own heap.** The library's Rust code allocates from mimalloc
//! ([`SIMULATOR_HEAP`]), whose memory is its own `mmap`ed segments, never
//! the program's `malloc` heap: `ibv_reg_mr` hands the device the whole
//! pages around a program's buffer, and those pages must hold nothing of
//! the simulator's (`Process::adopt`'s contract; `tests/heap.rs`).

use std::ffi::OsStr;
use std::net::Ipv4Addr;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use ibal_user::{DeviceIo, PluginSource};
use ibverbs_compat::Machine;
use sim_hca::udp::PortAddress;
use sim_shells::embedded::MemoryError;
use sim_shells::embedded::{EmbeddedMachine, Fabric};

ibverbs_compat::export_libibverbs!();

/// The simulator's heap: pages of its own, apart from the program's
/// `malloc` heap, so no page the device is given (a registered buffer's,
/// adopted whole) holds a simulator object.
#[global_allocator]
pub static SIMULATOR_HEAP: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// How long the machine may take to shut down at process exit.
pub const EXIT_TIMEOUT: Duration = Duration::from_secs(5);

/// The booted machine, for the exit handler.
static MACHINE: OnceLock<Arc<SimMachine>> = OnceLock::new();

/// The embedded machine as the product's [`Machine`].
#[derive(Debug)]
struct SimMachine(EmbeddedMachine);

impl Machine for SimMachine {
    fn io(&self) -> Arc<dyn DeviceIo> {
        self.0.io()
    }

    fn plugin(&self) -> PluginSource {
        PluginSource::Linked
    }

    /// The simulated process adopts the program's pages; a page of the
    /// simulator's own heap ([`SIMULATOR_HEAP`]) is refused, `EFAULT`.
    unsafe fn expose_user_memory(&self, addr: *mut u8, len: usize) -> Result<(), i32> {
        if touches_simulator_heap(addr as usize, len) {
            return Err(libc::EFAULT);
        }
        // SAFETY: the caller promised `Machine::expose_user_memory`'s
        // contract, which is `Process::adopt`'s for the program's memory.
        unsafe { self.0.adopt_user_memory(addr, len) }
            .map(drop)
            .map_err(errno_of)
    }

    fn release_user_memory(&self, addr: u64, len: usize) -> Result<(), i32> {
        self.0.release_user_memory(addr, len).map_err(errno_of)
    }
}

/// Whether a page around `addr..addr+len` is [`SIMULATOR_HEAP`]'s: one
/// question per page (mimalloc's page map), so a buffer of the program's
/// that the library's own objects are on is never handed to the device.
fn touches_simulator_heap(addr: usize, len: usize) -> bool {
    // The model's page (sim-host's `PAGE_SIZE`), which `Process::adopt`
    // adopts whole; asking every 4 KiB also covers any larger OS page.
    const PAGE: usize = 4096;
    let first = addr & !(PAGE - 1);
    let end = addr.saturating_add(len.max(1));
    (first..end).step_by(PAGE).any(|page| {
        // SAFETY: `mi_is_in_heap_region` only looks the address up in
        // mimalloc's page map; it never dereferences it.
        unsafe { libmimalloc_sys::mi_is_in_heap_region(page as *const _) }
    })
}

/// The errno value of an adoption's refusal: memory the device cannot be
/// given (not the program's, or the simulator's own) is `EFAULT`, as a
/// kernel's refusal to pin it; pages still locked `EBUSY`.
fn errno_of(error: MemoryError) -> i32 {
    match error {
        MemoryError::AdoptedPagesInUse { .. } => libc::EBUSY,
        MemoryError::ProcessExited => libc::ENODEV,
        MemoryError::NotAdopted { .. } => libc::EINVAL,
        _ => libc::EFAULT,
    }
}

/// The environment variable that pins the port's address: an IPv4
/// address the port's RoCEv2 endpoint (UDP port 4791) binds, e.g.
/// `127.0.0.5`. Unset or empty, the port takes the first free of
/// 127.0.0.1 to 127.0.0.254, so processes on one machine get distinct
/// addresses with no configuration.
pub const ADDRESS_VARIABLE: &str = "SIM_LIBIBVERBS_ADDR";

/// The fabric [`ADDRESS_VARIABLE`]'s value asks for (`None`: unset): the
/// UDP fabric at that address, or automatic. A value that is not a
/// unicast IPv4 address is an error saying so.
pub fn fabric_from(value: Option<&OsStr>) -> Result<Fabric, String> {
    let Some(value) = value.filter(|v| !v.is_empty()) else {
        return Ok(Fabric::UDP_AUTOMATIC);
    };
    let bad = |why: &str| format!("{ADDRESS_VARIABLE}={}: {why}", value.to_string_lossy());
    let text = value.to_str().ok_or_else(|| bad("not text"))?;
    let address: Ipv4Addr = text
        .parse()
        .map_err(|_| bad("not an IPv4 address (a.b.c.d, e.g. 127.0.0.5)"))?;
    if address.is_unspecified() || address.is_multicast() || address.is_broadcast() {
        return Err(bad("not a unicast address a port can bind"));
    }
    Ok(Fabric::Udp {
        address: PortAddress::Fixed(address),
    })
}

/// Boots the machine on the UDP fabric, at the address
/// [`ADDRESS_VARIABLE`] names or the first free loopback address.
fn boot() -> Result<Arc<dyn Machine>, String> {
    let fabric = fabric_from(std::env::var_os(ADDRESS_VARIABLE).as_deref())?;
    let machine = Arc::new(SimMachine(EmbeddedMachine::boot(
        fabric,
        std::process::id(),
    )?));
    if MACHINE.set(Arc::clone(&machine)).is_ok() {
        // SAFETY: `atexit` has no preconditions; the handler is an
        // `extern "C" fn()` that never unwinds.
        let registered = unsafe { libc::atexit(shut_down_at_exit) };
        if registered != 0 {
            eprintln!("libibverbs: cannot register the machine's shutdown at exit");
        }
    }
    Ok(machine)
}

/// Set (to anything) in the environment, the exit handler also says when
/// the shutdown was clean, how long it took and how many CAs the program
/// had left open (the tests use it).
pub const EXIT_REPORT_VARIABLE: &str = "SIM_LIBIBVERBS_EXIT_REPORT";

/// The `atexit` handler: ends the machine, saying what went wrong. It runs
/// on the main thread after its thread-locals were destroyed, so the
/// machine is ended from a helper thread (`EmbeddedMachine::shut_down`).
extern "C" fn shut_down_at_exit() {
    let started = std::time::Instant::now();
    let outcome = std::panic::catch_unwind(|| {
        MACHINE
            .get()
            .map(|machine| machine.0.shut_down(EXIT_TIMEOUT))
            .unwrap_or_default()
    });
    match outcome {
        Ok(report) if report.problems.is_empty() => {
            if std::env::var_os(EXIT_REPORT_VARIABLE).is_some() {
                eprintln!(
                    "libibverbs: at exit: the machine shut down cleanly in {} ms ({} CAs left open)",
                    started.elapsed().as_millis(),
                    report.left_open
                );
            }
        }
        Ok(report) => {
            for problem in report.problems {
                eprintln!("libibverbs: at exit: {problem}");
            }
        }
        Err(_) => eprintln!("libibverbs: at exit: the machine's shutdown panicked"),
    }
}

/// Registers [`boot`] with the product when the library is loaded.
extern "C" fn register_boot() {
    ibverbs_compat::set_boot(boot);
}

/// Runs [`register_boot`] as the loader initialises the library.
#[used]
// SAFETY: `.init_array` holds pointers to `extern "C" fn()` the loader
// calls once at load; `register_boot` is one, and only stores a function
// pointer (no allocation order, no other library needed).
#[unsafe(link_section = ".init_array")]
static REGISTER_BOOT: extern "C" fn() = register_boot;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_address_variable_unset_or_empty_is_automatic_and_set_is_pinned() {
        assert_eq!(fabric_from(None), Ok(Fabric::UDP_AUTOMATIC));
        assert_eq!(fabric_from(Some(OsStr::new(""))), Ok(Fabric::UDP_AUTOMATIC));
        assert_eq!(
            fabric_from(Some(OsStr::new("127.0.0.5"))),
            Ok(Fabric::Udp {
                address: PortAddress::Fixed(Ipv4Addr::new(127, 0, 0, 5))
            })
        );
        assert_eq!(
            fabric_from(Some(OsStr::new(" 127.0.0.5"))),
            Err(format!(
                "{ADDRESS_VARIABLE}= 127.0.0.5: not an IPv4 address (a.b.c.d, e.g. 127.0.0.5)"
            ))
        );
    }

    #[test]
    fn an_address_variable_that_is_not_text_is_a_clear_error() {
        use std::os::unix::ffi::OsStrExt;
        let value = OsStr::from_bytes(b"127.0.0.\xff");
        assert_eq!(
            fabric_from(Some(value)),
            Err(format!("{ADDRESS_VARIABLE}=127.0.0.\u{FFFD}: not text"))
        );
    }
}
