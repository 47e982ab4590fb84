//! One simulated machine embedded in a process (issue 14's
//! `libibverbs.so.1`, `verbs/sim-lib`): the threaded host with one HCA,
//! the real miniport and IBAL bus filter bound from our INFs, and one
//! simulated user process reaching them through the access library's
//! threaded OS seam ([`ThreadedSimIo`]). It is booted by one function,
//! [`EmbeddedMachine::boot`], which takes the fabric the HCA's port sits
//! on, and ended by [`EmbeddedMachine::shut_down`], bounded in time.

use std::net::Ipv4Addr;
use std::sync::Arc;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use hca_miniport_core::init::HcaConfig;
use ibal_user::DeviceIo;
use sim_hca::device::DeviceConfig;
use sim_hca::udp::PortAddress;
use sim_hca::wire::udp::ROCEV2_PORT;
use sim_host::host::{Host, HostConfig, HostError};
pub use sim_host::memory::MemoryError;
use sim_host::memory::Process;
use sim_host::platform::SimPlatform;

use crate::hca_miniport::MiniportDriver;
use crate::ibal_bus::IbalBusDriver;
use crate::user_io::ThreadedSimIo;

/// The fabric the HCA's port is on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fabric {
    /// The threaded host's in-process fabric: the port reaches only ports
    /// of this machine (there are none besides it), so its QPs talk only
    /// to each other. Its GID is `::ffff:` + `port_address`.
    InProcess {
        /// The port's IPv4 address.
        port_address: [u8; 4],
    },
    /// RoCEv2 over real UDP (`sim_hca::udp`): the port is a UDP endpoint
    /// (port 4791) bound at `address`, so machines in other processes
    /// reach it as another host. Its GID is `::ffff:` + the bound address.
    Udp {
        /// Where the port binds: a fixed address, or the first free of a
        /// range.
        address: PortAddress,
    },
}

impl Fabric {
    /// The in-process fabric, the port at 127.0.0.1 (what the tests that
    /// need no network use).
    pub const DEFAULT: Self = Self::InProcess {
        port_address: [127, 0, 0, 1],
    };

    /// The UDP fabric with no configuration: the first free of 127.0.0.1
    /// to 127.0.0.254.
    pub const UDP_AUTOMATIC: Self = Self::Udp {
        address: PortAddress::AUTOMATIC,
    };
}

/// Worker threads of the host (they block when idle).
const WORKERS: usize = 2;

/// How long the machine may take to come up.
const BOOT_TIMEOUT: Duration = Duration::from_secs(20);

/// The embedded machine: its host, the simulated process the program is,
/// and that process's OS seam.
pub struct EmbeddedMachine {
    host: Arc<Host>,
    process: Process,
    io: Arc<dyn DeviceIo>,
    miniport: Arc<MiniportDriver<SimPlatform>>,
}

impl std::fmt::Debug for EmbeddedMachine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EmbeddedMachine")
            .field("pid", &self.process.pid())
            .finish_non_exhaustive()
    }
}

impl EmbeddedMachine {
    /// The HCA's node GUID for a port at `address`: the PRM's IEEE vendor
    /// ID (`0x020000`) as the OUI, `FFFE` and the address's low 24 bits
    /// (an EUI-64 from the MAC-like tail), so that machines on distinct
    /// addresses have distinct GUIDs.
    pub fn node_guid(address: [u8; 4]) -> u64 {
        let [_, b, c, d] = address;
        0x0200_00FF_FE00_0000 | u64::from(u32::from_be_bytes([0, b, c, d]))
    }

    /// The HCA's configuration for a port at `address`.
    fn device(address: [u8; 4]) -> DeviceConfig {
        DeviceConfig::with_ports(Self::node_guid(address), &[address])
    }

    /// A threaded host whose HCA's port is bound on the UDP fabric at
    /// `address`. The node GUID follows the address, so each candidate is
    /// bound as a fixed address: a cheap probe skips the ones held, and a
    /// candidate another process takes between the probe and the fabric's
    /// bind is skipped too.
    fn udp_host(address: PortAddress) -> Result<Host, String> {
        let (first, count) = match address {
            PortAddress::Fixed(addr) => (addr, 1),
            PortAddress::FirstFree { first, count } => (first, count),
        };
        let start = u32::from(first);
        for offset in 0..count {
            let Some(candidate) = start.checked_add(offset).map(Ipv4Addr::from) else {
                break;
            };
            let in_use = |e: &std::io::Error| e.kind() == std::io::ErrorKind::AddrInUse;
            let bound = PortAddress::Fixed(candidate).bind().and_then(|probe| {
                drop(probe);
                let config = HostConfig::threaded_udp(
                    WORKERS,
                    vec![Self::device(candidate.octets())],
                    vec![PortAddress::Fixed(candidate)],
                );
                Host::new(config).map_err(|e| match e {
                    HostError::Udp(io) => io,
                    other => std::io::Error::other(other.to_string()),
                })
            });
            match bound {
                Ok(host) => return Ok(host),
                Err(e) if in_use(&e) && count > 1 => continue,
                Err(e) => {
                    return Err(format!(
                        "cannot bind the port's RoCEv2 endpoint {candidate}:{ROCEV2_PORT} (UDP): {e}"
                    ));
                }
            }
        }
        Err(format!(
            "no free address for the port's RoCEv2 endpoint (UDP port {ROCEV2_PORT}) among the {count} from {first}"
        ))
    }

    /// Boots the machine: one HCA with one port on `fabric`, the real
    /// miniport and filter, and user process `pid`; waits (up to 20 s)
    /// until the HCA started and its port child is reported. On the UDP
    /// fabric an address no socket holds is taken (the first free one of
    /// a range); a fixed address another socket holds, or one this machine
    /// has not, is an error naming it.
    pub fn boot(fabric: Fabric, pid: u32) -> Result<Self, String> {
        let host = match fabric {
            Fabric::InProcess { port_address } => Host::new(HostConfig::threaded(
                WORKERS,
                vec![Self::device(port_address)],
            ))
            .map_err(|e| format!("the threaded host: {e}"))?,
            Fabric::Udp { address } => Self::udp_host(address)?,
        };
        let host = Arc::new(host);
        // Stand-ins for the drivers of the devnodes that are not ours.
        let _log = sim_host::samples::register_stand_ins(&host);
        let miniport = MiniportDriver::register(&host, HcaConfig::default());
        let filter = IbalBusDriver::register(&host);
        host.boot();
        let deadline = Instant::now() + BOOT_TIMEOUT;
        loop {
            let _ = host.scheduler().quiesce();
            host.pnp().process_bus_relations();
            let devices = miniport.devices();
            let started = devices.len() == 1 && matches!(devices[0].started(), Some(Ok(_)));
            let children: usize = filter.devices().iter().map(|d| d.children().len()).sum();
            if started && children == 1 {
                break;
            }
            if let Some(Some(Err(error))) = devices.first().map(|d| d.started()) {
                host.shut_down();
                return Err(format!("the HCA did not start: {error:?}"));
            }
            if Instant::now() > deadline {
                host.shut_down();
                return Err(format!(
                    "the HCA did not come up within {} s",
                    BOOT_TIMEOUT.as_secs()
                ));
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        let process = Process::new(pid);
        let io: Arc<dyn DeviceIo> = ThreadedSimIo::new(&host, &process);
        Ok(Self {
            host,
            process,
            io,
            miniport,
        })
    }

    /// The access library's OS seam of the machine's user process.
    pub fn io(&self) -> Arc<dyn DeviceIo> {
        Arc::clone(&self.io)
    }

    /// The simulated user process the program is (its memory: adopted
    /// pages, locked pages).
    pub fn process(&self) -> &Process {
        &self.process
    }

    /// Adopts the whole pages around `addr..addr+len` of the program's
    /// own memory into the simulated process at their own addresses, so
    /// the device reaches the program's buffer (a registration's,
    /// `ibv_reg_mr`); see [`Process::adopt`].
    ///
    /// # Safety
    /// [`Process::adopt`]'s contract.
    pub unsafe fn adopt_user_memory(&self, addr: *mut u8, len: usize) -> Result<u64, MemoryError> {
        // SAFETY: the caller promised `Process::adopt`'s contract.
        unsafe { self.process.adopt(addr, len) }
    }

    /// Ends one [`adopt_user_memory`](Self::adopt_user_memory) of the
    /// same range; see [`Process::release_adoption`].
    pub fn release_user_memory(&self, va: u64, len: usize) -> Result<(), MemoryError> {
        self.process.release_adoption(va, len)
    }

    /// The host.
    pub fn host(&self) -> &Arc<Host> {
        &self.host
    }

    /// The HCA's user contexts the miniport holds (one per open CA).
    pub fn user_contexts(&self) -> usize {
        user_contexts(&self.miniport)
    }

    /// Ends the machine as process exit does: the user process exits (its
    /// handles closed, what it left open cleaned by the drivers), then the
    /// host shuts down. Waits at most `timeout`. Everything runs on a
    /// helper thread: at process exit the calling (main) thread's
    /// thread-locals are already destroyed, and the host's locks use them.
    pub fn shut_down(&self, timeout: Duration) -> ShutdownReport {
        let (host, process) = (Arc::clone(&self.host), self.process.clone());
        let miniport = Arc::clone(&self.miniport);
        let (done, finished) = mpsc::channel();
        let worker = std::thread::Builder::new()
            .name("embedded-machine-shutdown".into())
            .spawn(move || {
                let left_open = user_contexts(&miniport);
                let locked = host.pnp().exit_process(&process);
                host.shut_down();
                let mut problems: Vec<String> = host
                    .verifier()
                    .violations()
                    .iter()
                    .map(|v| format!("verifier: {v:?}"))
                    .collect();
                if locked != 0 {
                    problems.push(format!("{locked} pages left locked at process exit"));
                }
                let _ = done.send(ShutdownReport {
                    left_open,
                    problems,
                });
            });
        let timed_out = |problem: String| ShutdownReport {
            left_open: 0,
            problems: vec![problem],
        };
        if let Err(error) = worker {
            return timed_out(format!("cannot start the shutdown: {error}"));
        }
        finished.recv_timeout(timeout).unwrap_or_else(|_| {
            timed_out(format!(
                "the machine did not shut down within {} ms",
                timeout.as_millis()
            ))
        })
    }
}

/// How the machine ended ([`EmbeddedMachine::shut_down`]).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ShutdownReport {
    /// The CAs the process still had open (user contexts in the miniport)
    /// when it exited; its exit closed them.
    pub left_open: usize,
    /// What went wrong (verifier violations, pages left locked, a timeout);
    /// empty when the shutdown was clean.
    pub problems: Vec<String>,
}

fn user_contexts(miniport: &MiniportDriver<SimPlatform>) -> usize {
    miniport
        .devices()
        .iter()
        .filter_map(|d| d.hca())
        .map(|hca| hca.user_context_count())
        .sum()
}
