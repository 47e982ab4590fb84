//! `insn_count`: the fixed workloads whose instructions per operation
//! callgrind counts (issue 13, measurement 4; docs/performance.md
//! "Instructions per operation"). `cargo xtask bench-insn` runs each
//! under `valgrind --tool=callgrind --toggle-collect=<its measured
//! function>`, so only the operations are counted, never the set-up or the
//! simulated device and fabric in between.
//!
//! Workloads (the first argument), each on a deterministic simulated host
//! with two HCAs on one fabric, an RC QP on HCA 0 sending to one on HCA 1:
//! - `driver-post`: a kernel client's `CiProvider::post_send` of one
//!   64-byte inline signaled send, at DISPATCH_LEVEL in the miniport's
//!   context ([`measured_driver_post`]);
//! - `driver-poll`: `CiProvider::poll_cq` taking one CQE
//!   ([`measured_driver_poll`]);
//! - `plugin-post`: the same send posted by a user process through the
//!   access library into the UVP plugin ([`measured_plugin_post`]);
//! - `plugin-poll`: the plugin polling one CQE ([`measured_plugin_poll`]);
//! - `compat-post`, `compat-recv`, `compat-poll`: our `libibverbs.so.1`'s
//!   data path (`ibverbs-compat`) over the plugin: the same send, one
//!   receive, one CQE, called through the context's ops as `verbs.h`'s
//!   inlines call them ([`compat`]).
//!
//! Each round posts [`PER_ROUND`] sends (one call each), lets the device
//! and fabric run, then polls their [`PER_ROUND`] completions one call
//! each; every completion is checked (its `wr_id`, success, and the
//! receiver got every byte). The program prints `ops <workload> <n>`: the
//! number of calls of the measured function, which the counter divides
//! the collected instructions by.
//!
//! The plugin's poll workload also checks that its poll allocates
//! nothing: the program's allocator counts each thread's allocations, and
//! a measured plugin poll that made one fails the run (and the test
//! `plugin_poll_allocates_nothing`). A post is not checked: its doorbell
//! store runs the simulated device in the posting thread, which allocates
//! (its packets), and its allocations cannot be told from the plugin's.

use std::sync::Arc;

use driver_platform::{Irql, RequestorMode};
use hca_miniport_core::ci::CiProvider;
use hca_miniport_core::hca::Hca;
use hca_miniport_core::init::HcaConfig;
use ib_types::access::AccessFlags;
use ib_types::cq::CqAttr;
use ib_types::handle::{CqHandle, PdHandle};
use ib_types::ioctl::{
    AllocPd, CreateCq, CreateQp, Empty, ModifyQp, OpenCa, OpenCaIn, RegMr, Verb, decode_response,
    encode_request, request_len, response_len,
};
use ib_types::mr::MrRegister;
use ib_types::qp::{QpCaps, QpCreate, QpType};
use ib_types::scalars::{Gid, PortNum, Qpn};
use ib_types::status::{IbStatus, NtStatus};
use ib_types::wc::{WcStatus, WorkCompletion};
use ib_types::wr::{LKey, RecvWr, SendFlags, SendOp, SendWr, Sge};
use ibal_user::{Buffer, CaSelector, Context, Cq, Mr, Pd, PluginSource, Qp, QpInit, UserSend};
use sim_hca::device::DeviceConfig;
use sim_host::context;
use sim_host::driver::{DeviceCallbacks, DeviceInit, DriverEntry};
use sim_host::host::{Host, HostConfig};
use sim_host::irql::IrqlGuard;
use sim_host::memory::{PoolBlock, Process};
use sim_host::platform::SimPlatform;
use sim_host::pnp::DeviceServices;
use sim_host::request::HostRequest;
use sim_shells::hca_miniport::{MiniportDriver, SERVICE};
use sim_shells::ibal_bus::IbalBusDriver;
use sim_shells::rc_path::rc_to_rts_steps;
use sim_shells::user_io::{SimIo, settle};

#[path = "insn_count/compat.rs"]
mod compat;

/// Bytes of the inline send.
const INLINE: usize = 64;
/// Sends posted (and completions polled) per round, one call each.
const PER_ROUND: usize = 16;
/// Rounds unless the second argument says otherwise.
const DEFAULT_ROUNDS: usize = 32;
/// Each HCA's port addresses.
const IPS: [[[u8; 4]; 2]; 2] = [
    [[10, 3, 0, 1], [10, 3, 0, 2]],
    [[10, 3, 1, 1], [10, 3, 1, 2]],
];
/// Bytes the receiver has per message.
const SLOT: usize = 256;

/// One kernel client's post of `wrs` to `qp`: what the count of
/// `driver-post` covers.
#[inline(never)]
fn measured_driver_post(ci: &CiProvider<SimPlatform>, qp: u64, wrs: &[SendWr<'_>]) -> usize {
    let (posted, status) = ci.post_send(qp, wrs);
    assert_eq!(status, IbStatus::Success);
    posted
}

/// One kernel client's poll of `cq`: what the count of `driver-poll`
/// covers.
#[inline(never)]
fn measured_driver_poll(
    ci: &CiProvider<SimPlatform>,
    cq: u64,
    wcs: &mut [WorkCompletion],
) -> usize {
    ci.poll_cq(cq, wcs).expect("the CQ polls")
}

/// The system allocator, counting each thread's allocations (and
/// reallocations), so a workload can check its measured calls made none.
struct CountingAllocator;

thread_local! {
    static ALLOCATIONS: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

fn count_allocation() {
    // `try_with`: an allocation while the thread's locals are being
    // destroyed is not counted rather than a panic in the allocator.
    let _ = ALLOCATIONS.try_with(|n| n.set(n.get() + 1));
}

// SAFETY: every method forwards to `System` with the caller's arguments
// unchanged, so `System`'s guarantees are this allocator's; counting
// touches only a thread-local `Cell` and never allocates.
unsafe impl std::alloc::GlobalAlloc for CountingAllocator {
    unsafe fn alloc(&self, layout: std::alloc::Layout) -> *mut u8 {
        count_allocation();
        // SAFETY: the caller's contract for `alloc`, passed on.
        unsafe { std::alloc::System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: std::alloc::Layout) {
        // SAFETY: `ptr` came from `System` (every allocation here does).
        unsafe { std::alloc::System.dealloc(ptr, layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: std::alloc::Layout) -> *mut u8 {
        count_allocation();
        // SAFETY: the caller's contract for `alloc_zeroed`, passed on.
        unsafe { std::alloc::System.alloc_zeroed(layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: std::alloc::Layout, new: usize) -> *mut u8 {
        count_allocation();
        // SAFETY: the caller's contract for `realloc`, passed on; `ptr`
        // came from `System`.
        unsafe { std::alloc::System.realloc(ptr, layout, new) }
    }
}

#[global_allocator]
static ALLOCATOR: CountingAllocator = CountingAllocator;

/// Runs `call` and fails if it allocated on this thread: the plugin's
/// fast path allocates nothing.
fn allocating_nothing<T>(what: &str, call: impl FnOnce() -> T) -> T {
    let before = ALLOCATIONS.with(std::cell::Cell::get);
    let out = call();
    let made = ALLOCATIONS.with(std::cell::Cell::get) - before;
    assert_eq!(made, 0, "{what} allocated {made} times");
    out
}

/// One user post of `sends` through the access library into the plugin.
#[inline(never)]
fn measured_plugin_post(qp: &mut Qp<'_, '_>, sends: &[UserSend<'_>]) -> usize {
    qp.post_send(sends).expect("the plugin posts")
}

/// One user poll of `cq` through the access library into the plugin.
#[inline(never)]
fn measured_plugin_poll(cq: &Cq<'_>, wcs: &mut [WorkCompletion]) -> usize {
    cq.poll(wcs).expect("the plugin polls")
}

/// The simulated machine: two two-port HCAs on one fabric, the miniport
/// and the bus filter (whose proxy the access library talks to).
struct World {
    host: Arc<Host>,
    miniport: Arc<MiniportDriver<SimPlatform>>,
}

/// An `ibalbus` upper filter that passes everything down: a kernel client
/// opens the CA itself (the bus filter would hold the one open).
struct PassThroughFilter;

impl DriverEntry for PassThroughFilter {
    fn add_device(
        &self,
        _init: &DeviceInit,
        _host: &DeviceServices,
    ) -> Result<Arc<dyn DeviceCallbacks>, NtStatus> {
        Ok(Arc::new(PassThrough))
    }
}

struct PassThrough;

impl DeviceCallbacks for PassThrough {
    fn power_managed_queue(&self) -> bool {
        false
    }
}

impl World {
    /// With the bus filter (`user`, for the access library) or a
    /// pass-through filter in its place (a kernel client's world).
    fn new(user: bool) -> Self {
        let configs = [0x0002_C900_0000_7000u64, 0x0002_C900_0000_8000]
            .iter()
            .zip(IPS.iter())
            .map(|(guid, ips)| DeviceConfig::with_ports(*guid, ips))
            .collect();
        let host = Arc::new(Host::new(HostConfig::deterministic(13, configs)).expect("a host"));
        let _log = sim_host::samples::register_stand_ins(&host);
        let miniport = MiniportDriver::register(&host, HcaConfig::default());
        if user {
            IbalBusDriver::register(&host);
        } else {
            host.register_driver("ibalbus", Arc::new(PassThroughFilter));
        }
        host.boot();
        settle(&host);
        host.pnp().process_bus_relations();
        settle(&host);
        Self { host, miniport }
    }

    /// The miniport device of HCA `at` (the host's order).
    fn device(&self, at: usize) -> Arc<sim_shells::hca_miniport::MiniportDevice<SimPlatform>> {
        let node = self.host.hcas()[at];
        self.miniport
            .devices()
            .into_iter()
            .find(|d| d.node() == node)
            .expect("the miniport of that HCA")
    }

    fn hca(&self, at: usize) -> Arc<Hca<SimPlatform>> {
        self.device(at).hca().expect("started")
    }

    /// Submits kernel verb `V` to HCA `at` and runs the machine until it
    /// completed; its handle and output.
    fn call<V: Verb>(&self, at: usize, handle: u64, input: &V::In) -> (u64, Option<V::Out>) {
        let mut bytes = vec![0; request_len::<V>(0).expect("a request length")];
        encode_request::<V>(handle, input, &[], 0, &mut bytes).expect("an encodable request");
        let (request, issuer) = HostRequest::new(
            self.host.verifier(),
            V::ID.ioctl().raw(),
            RequestorMode::Kernel,
            bytes,
            response_len::<V>(0).expect("a response length"),
        );
        self.hca(at).submit_request(request);
        settle(&self.host);
        let done = issuer.completion().expect("the request completed");
        let response = decode_response::<V>(&done.output[..done.information as usize])
            .expect("a valid response");
        assert_eq!(response.status, IbStatus::Success, "{}", V::ID.name());
        (response.handle, response.output)
    }
}

/// The GID of port 1 of HCA `at`.
fn port1_gid(at: usize) -> Gid {
    Gid::from_ipv4(IPS[at][0])
}

fn port1() -> PortNum {
    PortNum::new(1).expect("port 1")
}

/// An RC QP's create: `depth` WRs each way, one SGE, 64 bytes inline.
fn caps(depth: u32) -> QpCaps {
    QpCaps {
        max_send_wr: depth,
        max_recv_wr: depth,
        max_send_sge: 1,
        max_recv_sge: 1,
        max_inline_data: INLINE as u32,
    }
}

/// A kernel RC QP on HCA `at`: its CQ, QP handle and number, and a
/// registered buffer.
struct KernelSide {
    cq: u64,
    qp: u64,
    qpn: u32,
    block: PoolBlock,
    lkey: LKey,
}

fn kernel_side(w: &World, at: usize) -> KernelSide {
    let (ca, _) = w.call::<OpenCa>(at, 0, &OpenCaIn::CURRENT);
    let (pd, _) = w.call::<AllocPd>(at, ca, &Empty);
    let attr = CqAttr {
        cqe: 64,
        comp_vector: 0,
    };
    let (cq, _) = w.call::<CreateCq>(at, ca, &attr);
    let create = QpCreate {
        qp_type: QpType::Rc,
        pd: PdHandle::from_raw(pd),
        send_cq: CqHandle::from_raw(cq),
        recv_cq: CqHandle::from_raw(cq),
        srq: None,
        caps: caps(PER_ROUND as u32 * 2),
        sq_sig_all: false,
        port: None,
    };
    let (qp, created) = w.call::<CreateQp>(at, ca, &create);
    let block = w
        .host
        .pool()
        .alloc(SERVICE, *b"Insn", SLOT * PER_ROUND)
        .expect("pool memory");
    let reg = MrRegister {
        vaddr: block.va(),
        length: (SLOT * PER_ROUND) as u64,
        access: AccessFlags::LOCAL_WRITE,
    };
    let (_, keys) = w.call::<RegMr>(at, pd, &reg);
    KernelSide {
        cq,
        qp,
        qpn: created.expect("a created QP").qpn.get(),
        block,
        lkey: keys.expect("keys").lkey,
    }
}

/// The payload of message `n`.
fn payload(n: usize) -> [u8; INLINE] {
    core::array::from_fn(|i| (n as u8).wrapping_mul(29) ^ (i as u8).wrapping_mul(7))
}

/// Kernel client to kernel client: `driver-post` or `driver-poll`
/// (`measure_poll`); returns the measured calls.
fn driver_workload(rounds: usize, measure_poll: bool) -> usize {
    let w = World::new(false);
    let sender = kernel_side(&w, 0);
    let receiver = kernel_side(&w, 1);
    for (side, dest, at) in [(&sender, &receiver, 1), (&receiver, &sender, 0)] {
        let steps = rc_to_rts_steps(
            port1(),
            AccessFlags::empty(),
            Qpn::new(dest.qpn).expect("a QPN"),
            port1_gid(at),
            1,
        );
        for step in &steps {
            w.call::<ModifyQp>(1 - at, side.qp, step);
        }
    }
    let ci = w.device(0).provider().expect("the CI provider");
    let receiver_ci = w.device(1).provider().expect("the CI provider");
    let source = w
        .host
        .pool()
        .alloc(SERVICE, *b"Insn", INLINE)
        .expect("pool memory");
    let mut calls = 0;
    let mut sent = 0;
    for _ in 0..rounds {
        // Receives for the round, unmeasured.
        let sges: Vec<[Sge; 1]> = (0..PER_ROUND)
            .map(|i| {
                [Sge::new(
                    receiver.block.va() + (i * SLOT) as u64,
                    SLOT as u32,
                    receiver.lkey,
                )]
            })
            .collect();
        let recvs: Vec<RecvWr<'_>> = sges
            .iter()
            .enumerate()
            .map(|(i, sg_list)| RecvWr {
                wr_id: (sent + i) as u64,
                sg_list,
            })
            .collect();
        assert_eq!(receiver_ci.post_recv(receiver.qp, &recvs).0, PER_ROUND);

        let _context = context::enter(context::Context::driver(w.host.verifier().clone(), SERVICE));
        let _irql = IrqlGuard::at(Irql::DISPATCH);
        for n in sent..sent + PER_ROUND {
            assert!(source.write(0, &payload(n)));
            let sge = [Sge::new(source.va(), INLINE as u32, LKey::new(0))];
            let wr = [SendWr {
                wr_id: n as u64,
                op: SendOp::Send,
                flags: SendFlags::SIGNALED | SendFlags::INLINE,
                sg_list: &sge,
                ud: None,
            }];
            if measure_poll {
                assert_eq!(ci.post_send(sender.qp, &wr).0, 1);
            } else {
                assert_eq!(measured_driver_post(&ci, sender.qp, &wr), 1);
                calls += 1;
            }
            // The message is in the WQE: the source may change at once.
        }
        drop(_irql);
        drop(_context);
        settle(&w.host);

        let _context = context::enter(context::Context::driver(w.host.verifier().clone(), SERVICE));
        let _irql = IrqlGuard::at(Irql::DISPATCH);
        for n in sent..sent + PER_ROUND {
            let mut wc = [WorkCompletion::EMPTY];
            let got = if measure_poll {
                calls += 1;
                measured_driver_poll(&ci, sender.cq, &mut wc)
            } else {
                ci.poll_cq(sender.cq, &mut wc).expect("the CQ polls")
            };
            assert_eq!(got, 1, "the send's completion is there");
            assert_eq!((wc[0].wr_id, wc[0].status), (n as u64, WcStatus::Success));
            let got = receiver_ci
                .poll_cq(receiver.cq, &mut wc)
                .expect("the CQ polls");
            assert_eq!(got, 1, "the receive's completion is there");
            assert_eq!((wc[0].wr_id, wc[0].status), (n as u64, WcStatus::Success));
            let mut bytes = [0u8; INLINE];
            assert!(receiver.block.read((n - sent) * SLOT, &mut bytes));
            assert_eq!(bytes, payload(n), "message {n} arrived whole");
        }
        sent += PER_ROUND;
    }
    calls
}

/// User process to user process through the access library and the
/// plugin: `plugin-post` or `plugin-poll` (`measure_poll`).
fn plugin_workload(rounds: usize, measure_poll: bool) -> usize {
    let w = World::new(true);
    let process = Process::new(71);
    let io: Arc<dyn ibal_user::DeviceIo> = SimIo::new(&w.host, &process);
    let sender = Context::open(&io, CaSelector::Index(0), &PluginSource::Linked).expect("HCA 0");
    let receiver = Context::open(&io, CaSelector::Index(1), &PluginSource::Linked).expect("HCA 1");
    let (spd, rpd) = (
        Pd::new(&sender).expect("a PD"),
        Pd::new(&receiver).expect("a PD"),
    );
    let rbuf = Buffer::new(&receiver, SLOT * PER_ROUND).expect("a buffer");
    let rmr = Mr::new(&rpd, &rbuf, AccessFlags::LOCAL_WRITE).expect("an MR");
    let (scq, rcq) = (
        Cq::new(&sender, 64).expect("a CQ"),
        Cq::new(&receiver, 64).expect("a CQ"),
    );
    let init = QpInit {
        qp_type: QpType::Rc,
        caps: caps(PER_ROUND as u32 * 2),
        sq_sig_all: false,
    };
    let mut sqp = Qp::new(&spd, &scq, &scq, &init).expect("a QP");
    let mut rqp = Qp::new(&rpd, &rcq, &rcq, &init).expect("a QP");
    for (qp, dest, at) in [(&sqp, &rqp, 1), (&rqp, &sqp, 0)] {
        let steps = rc_to_rts_steps(
            port1(),
            AccessFlags::empty(),
            Qpn::new(dest.qpn()).expect("a QPN"),
            port1_gid(at),
            1,
        );
        for step in &steps {
            qp.modify(step).expect("the modify");
        }
    }
    let mut calls = 0;
    let mut sent = 0;
    for _ in 0..rounds {
        let sges: Vec<[Sge; 1]> = (0..PER_ROUND)
            .map(|i| {
                [Sge::new(
                    rbuf.va() + (i * SLOT) as u64,
                    SLOT as u32,
                    rmr.keys().lkey,
                )]
            })
            .collect();
        let recvs: Vec<RecvWr<'_>> = sges
            .iter()
            .enumerate()
            .map(|(i, sg_list)| RecvWr {
                wr_id: (sent + i) as u64,
                sg_list,
            })
            .collect();
        assert_eq!(rqp.post_recv(&recvs).expect("receives"), PER_ROUND);
        for n in sent..sent + PER_ROUND {
            let data = payload(n);
            let sge = [Sge::new(data.as_ptr() as u64, INLINE as u32, LKey::new(0))];
            let send = [UserSend {
                wr: SendWr {
                    wr_id: n as u64,
                    op: SendOp::Send,
                    flags: SendFlags::SIGNALED | SendFlags::INLINE,
                    sg_list: &sge,
                    ud: None,
                },
                inline: Some(&data),
            }];
            if measure_poll {
                assert_eq!(sqp.post_send(&send).expect("the plugin posts"), 1);
            } else {
                assert_eq!(measured_plugin_post(&mut sqp, &send), 1);
                calls += 1;
            }
        }
        settle(&w.host);
        for n in sent..sent + PER_ROUND {
            let mut wc = [WorkCompletion::EMPTY];
            let got = if measure_poll {
                calls += 1;
                allocating_nothing("a plugin poll", || measured_plugin_poll(&scq, &mut wc))
            } else {
                scq.poll(&mut wc).expect("the plugin polls")
            };
            assert_eq!(got, 1, "the send's completion is there");
            assert_eq!((wc[0].wr_id, wc[0].status), (n as u64, WcStatus::Success));
            assert_eq!(rcq.poll(&mut wc).expect("the plugin polls"), 1);
            assert_eq!((wc[0].wr_id, wc[0].status), (n as u64, WcStatus::Success));
            let mut bytes = [0u8; INLINE];
            rbuf.read((n - sent) * SLOT, &mut bytes).expect("a read");
            assert_eq!(bytes, payload(n), "message {n} arrived whole");
        }
        sent += PER_ROUND;
    }
    calls
}

fn main() {
    let mut args = std::env::args().skip(1);
    let workload = args.next().unwrap_or_default();
    let rounds = args
        .next()
        .map(|r| r.parse().expect("rounds is a number"))
        .unwrap_or(DEFAULT_ROUNDS);
    let measure_poll = workload.ends_with("poll");
    let run: Box<dyn FnOnce(usize) -> usize + Send> = match workload.as_str() {
        "driver-post" | "driver-poll" => Box::new(move |r| driver_workload(r, measure_poll)),
        "plugin-post" | "plugin-poll" => Box::new(move |r| plugin_workload(r, measure_poll)),
        "compat-post" => Box::new(|r| compat::compat_workload(r, compat::Measured::Post)),
        "compat-recv" => Box::new(|r| compat::compat_workload(r, compat::Measured::Recv)),
        "compat-poll" => Box::new(|r| compat::compat_workload(r, compat::Measured::Poll)),
        other => {
            eprintln!(
                "usage: insn_count <driver-post|driver-poll|plugin-post|plugin-poll|compat-post|compat-recv|compat-poll> [rounds]; got {other:?}"
            );
            std::process::exit(2);
        }
    };
    // On a thread of its own: the simulated host paints the stack below
    // each driver routine (sim_host::stack), which needs the whole stack
    // mapped, as a thread's is (valgrind maps the main thread's lazily).
    let calls = std::thread::Builder::new()
        .stack_size(16 << 20)
        .spawn(move || run(rounds))
        .expect("a thread")
        .join()
        .expect("the workload ran");
    println!("ops {workload} {calls}");
}

#[cfg(test)]
mod tests {
    use super::{compat, plugin_workload};

    /// One round of the library's post workload: the objects are made with
    /// its entry points, and every send arrives (the workload checks each
    /// completion and byte). One per test process: the library boots its
    /// machine once.
    #[test]
    fn compat_workload_sends_through_the_library() {
        let calls = std::thread::Builder::new()
            .stack_size(16 << 20)
            .spawn(|| compat::compat_workload(1, compat::Measured::Post))
            .expect("a thread")
            .join()
            .expect("the workload ran");
        assert_eq!(calls, super::PER_ROUND);
    }

    /// One round of the plugin's poll workload: every measured poll is
    /// checked to allocate nothing (`allocating_nothing`).
    #[test]
    fn plugin_poll_allocates_nothing() {
        let calls = std::thread::Builder::new()
            .stack_size(16 << 20)
            .spawn(|| plugin_workload(1, true))
            .expect("a thread")
            .join()
            .expect("the workload ran");
        assert!(calls > 0);
    }
}
