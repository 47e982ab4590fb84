//! Creating many QPs on a threaded host (worker threads run the DPCs, so
//! two drains of the event queue can overlap): every `CreateQp` completes,
//! with success, in order of submission within a small window of requests
//! in flight. This is the load that found the lost event-queue hand-off
//! (issue 9, defects 1 and 10): a command completion left in the EQ behind
//! an unarmed EQ, so the next command timed out. On a failure the test
//! runs one more DPC and reports how many EQEs it found stranded.
//!
//! The default run creates a few thousand QPs on the device's default 4K
//! table; the long run fills a 64K table, several times
//! (`MANY_QPS_RUNS`, default 3):
//! `cargo test -p hca-miniport-core --test scenarios_many_qps filling -- --ignored --nocapture`.

mod support;

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use driver_platform::RequestorMode;
use hca_miniport_core::init::HcaConfig;
use ib_types::cq::CqAttr;
use ib_types::handle::{CqHandle, PdHandle};
use ib_types::ioctl::{AllocPd, CreateCq, CreateQp, Empty, OpenCa, OpenCaIn, Verb};
use ib_types::qp::{QpCaps, QpCreate, QpType};
use ib_types::status::IbStatus;
use sim_hca::device::DeviceConfig;
use sim_host::request::RequestHandle;
use support::{World, response};

const KERNEL: RequestorMode = RequestorMode::Kernel;

/// `CreateQp` requests kept in flight: enough that commands complete while
/// others are submitted, so DPCs overlap.
const WINDOW: usize = 8;

fn call<V: Verb>(w: &World, handle: u64, input: &V::In) -> u64 {
    let done = w.call_in_dpc_waiting_at::<V>(0, KERNEL, handle, input, 0);
    let r = response::<V>(&done);
    assert_eq!(r.status, IbStatus::Success, "{}", V::ID.name());
    r.handle
}

fn qp_create(pd: u64, cq: u64) -> QpCreate {
    QpCreate {
        qp_type: QpType::Ud,
        pd: PdHandle::from_raw(pd),
        send_cq: CqHandle::from_raw(cq),
        recv_cq: CqHandle::from_raw(cq),
        srq: None,
        caps: QpCaps {
            max_send_wr: 1,
            max_recv_wr: 1,
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline_data: 0,
        },
        sq_sig_all: false,
        port: None,
    }
}

/// Queues a DPC that submits `CreateQp`.
fn submit_create(w: &World, ca: u64, input: &QpCreate) -> RequestHandle {
    let (request, issuer) = w.request::<CreateQp>(KERNEL, ca, input, 0);
    let hca = w.hca();
    w.in_dpc(move || hca.submit_request(request));
    issuer
}

/// Waits for `issuer`'s answer; on a failure (or no answer) names QP
/// `index`, the EQ and command counters, and how many EQEs one more DPC
/// found left in the ring.
fn expect_created(w: &World, issuer: &RequestHandle, index: usize) {
    let deadline = Instant::now() + Duration::from_secs(20);
    let status = loop {
        if let Some(done) = issuer.completion() {
            break Some(response::<CreateQp>(&done).status);
        }
        if Instant::now() >= deadline {
            break None;
        }
        std::thread::sleep(Duration::from_micros(50));
    };
    if status == Some(IbStatus::Success) {
        return;
    }
    let hca = w.hca();
    let before = hca.eq_counters();
    let commands = hca.command_counters();
    let probe = hca.clone();
    w.in_dpc(move || probe.dpc());
    std::thread::sleep(Duration::from_millis(200));
    let after = hca.eq_counters();
    panic!(
        "CreateQp #{index}: {status:?} (failure {:?}); EQ {before:?}, commands {commands:?}; \
         one more DPC found {} EQEs left in the ring",
        hca.failure(),
        after.eqes - before.eqes
    );
}

/// A two-port HCA with `2^log_qps` QP slots.
fn device_with_qps(log_qps: u8) -> DeviceConfig {
    let mut device = DeviceConfig::with_ports(support::NODE_GUID, &[[10, 0, 0, 1], [10, 0, 1, 1]]);
    device.limits.log_max_qps = log_qps;
    device
}

/// Creates `count` QPs on a threaded host whose HCA has `2^log_qps` QP
/// slots; returns how long the creates took.
fn create_many(log_qps: u8, count: usize) -> Duration {
    let (w, took) = create_many_on(log_qps, count);
    w.finish();
    took
}

/// [`create_many`], leaving the host running.
fn create_many_on(log_qps: u8, count: usize) -> (World, Duration) {
    let w = World::threaded_with_hcas(2, vec![device_with_qps(log_qps)], HcaConfig::default());
    let ca = call::<OpenCa>(&w, 0, &OpenCaIn::CURRENT);
    let pd = call::<AllocPd>(&w, ca, &Empty);
    let attr = CqAttr {
        cqe: 64,
        comp_vector: 0,
    };
    let cq = call::<CreateCq>(&w, ca, &attr);
    let input = qp_create(pd, cq);
    let started = Instant::now();
    let mut in_flight = VecDeque::new();
    for index in 0..count {
        if in_flight.len() == WINDOW {
            let (oldest, issuer) = in_flight.pop_front().expect("window is full");
            expect_created(&w, &issuer, oldest);
        }
        in_flight.push_back((index, submit_create(&w, ca, &input)));
    }
    for (index, issuer) in in_flight {
        expect_created(&w, &issuer, index);
    }
    let took = started.elapsed();
    (w, took)
}

#[test]
fn creating_thousands_of_qps_on_a_threaded_host_never_stalls() {
    let count = 3_000;
    let took = create_many(12, count);
    eprintln!("{count} QPs in {took:?}");
}

/// The 64K-QP run of issue 9, repeated (a few minutes in release).
#[test]
#[ignore = "long: fills a 64K QP table several times"]
fn filling_a_64k_qp_table_on_a_threaded_host_never_stalls() {
    let runs: usize = std::env::var("MANY_QPS_RUNS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(3);
    for run in 0..runs {
        let count = 65_000;
        let took = create_many(16, count);
        eprintln!("run {run}: {count} QPs in {took:?}");
    }
}
