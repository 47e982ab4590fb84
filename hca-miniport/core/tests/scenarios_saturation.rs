//! Command-queue saturation at the verb level, on the deterministic host
//! over several seeds: far more concurrent verbs (creates, registrations,
//! modifies, destroys, each from its own DPC) than the command interface
//! has slots. Every request completes exactly once with the right result;
//! modifies issued in order from one DPC complete in that order (the
//! command interface's FIFO, `cmd`). Then the same load against a device
//! that stopped answering: every request completes with an error when the
//! command watchdog fires, and nothing leaks. Each run ends with the host
//! shut down and the verifier clean.

mod support;

use driver_platform::{Mmio, RequestorMode};
use hca_miniport_core::init::HcaConfig;
use hca_prm::regs::{CmdqConfig, offset};
use ib_types::access::AccessFlags;
use ib_types::cq::CqAttr;
use ib_types::ioctl::{
    AllocPd, CloseCa, CreateCq, CreateQp, DeallocPd, DeregMr, DestroyCq, DestroyQp, Empty,
    ModifyQp, OpenCa, OpenCaIn, QueryCq, QueryMr, QueryQp, RegMr, ResizeCq, Verb,
};
use ib_types::mr::MrRegister;
use ib_types::qp::{QpModify, QpState, QpType};
use ib_types::scalars::PortNum;
use ib_types::status::IbStatus;
use sim_host::memory::PoolBlock;
use sim_host::request::RequestHandle;
use support::{World, response};

const KERNEL: RequestorMode = RequestorMode::Kernel;
const SEEDS: [u64; 4] = [5, 11, 77, 2024];

fn call<V: Verb>(w: &World, handle: u64, input: &V::In) -> (u64, Option<V::Out>) {
    let done = w.call_in_dpc::<V>(KERNEL, handle, input, 0);
    let r = response::<V>(&done);
    assert_eq!(r.status, IbStatus::Success, "{}", V::ID.name());
    (r.handle, r.output)
}

/// Queues a DPC submitting `V` (the machine does not run).
fn submit<V: Verb>(w: &World, handle: u64, input: &V::In) -> RequestHandle {
    let (request, issuer) = w.request::<V>(KERNEL, handle, input, 0);
    let hca = w.hca();
    w.in_dpc(move || hca.submit_request(request));
    issuer
}

/// The answer of a request that must have completed.
fn answer<V: Verb>(issuer: &RequestHandle) -> (IbStatus, u64, Option<V::Out>) {
    let done = issuer.completion().expect("the request completed");
    let r = response::<V>(&done);
    (r.status, r.handle, r.output)
}

fn pages(w: &World, count: usize) -> Vec<PoolBlock> {
    (0..count)
        .map(|_| {
            w.host
                .pool()
                .alloc(support::DRIVER, *b"Satu", 2 * 4096)
                .unwrap()
        })
        .collect()
}

fn register(block: &PoolBlock) -> MrRegister {
    MrRegister {
        vaddr: block.va(),
        length: 2 * 4096,
        access: AccessFlags::LOCAL_WRITE,
    }
}

fn saturated(seed: u64) {
    let w = World::deterministic(seed);
    let slots = w.hca().command_slots();
    let n = 3 * slots;
    let (ca, _) = call::<OpenCa>(&w, 0, &OpenCaIn::CURRENT);
    let (pd, _) = call::<AllocPd>(&w, ca, &Empty);
    // Room for every QP's work queues (the CQ-overflow rule, `cq::Room`).
    let (qp_cq, _) = call::<CreateCq>(
        &w,
        ca,
        &CqAttr {
            cqe: 1024,
            comp_vector: 0,
        },
    );
    let blocks = pages(&w, n);

    // Creates and registrations, each from its own DPC, all at once.
    let cq_sizes: Vec<u32> = (0..n as u32).map(|k| 16 + 8 * k).collect();
    let cqs: Vec<RequestHandle> = cq_sizes
        .iter()
        .map(|&cqe| {
            submit::<CreateCq>(
                &w,
                ca,
                &CqAttr {
                    cqe,
                    comp_vector: 0,
                },
            )
        })
        .collect();
    let mrs: Vec<RequestHandle> = blocks
        .iter()
        .map(|b| submit::<RegMr>(&w, pd, &register(b)))
        .collect();
    let qps: Vec<RequestHandle> = (0..n)
        .map(|_| submit::<CreateQp>(&w, ca, &support::small_qp_create(QpType::Rc, pd, qp_cq)))
        .collect();
    w.settle();
    let mut cq_handles = Vec::new();
    for (issuer, &size) in cqs.iter().zip(&cq_sizes) {
        let (status, handle, out) = answer::<CreateCq>(issuer);
        assert_eq!(status, IbStatus::Success);
        let granted = out.unwrap().cqe;
        assert!(granted >= size && granted < 2 * size.next_power_of_two());
        assert_eq!(call::<QueryCq>(&w, handle, &Empty).1.unwrap().cqe, granted);
        cq_handles.push(handle);
    }
    let mut mr_handles = Vec::new();
    let mut lkeys = Vec::new();
    for (issuer, block) in mrs.iter().zip(&blocks) {
        let (status, handle, keys) = answer::<RegMr>(issuer);
        assert_eq!(status, IbStatus::Success);
        let q = call::<QueryMr>(&w, handle, &Empty).1.unwrap();
        assert_eq!((q.vaddr, q.length), (block.va(), 2 * 4096));
        lkeys.push(keys.unwrap().lkey);
        mr_handles.push(handle);
    }
    lkeys.sort_unstable_by_key(|k| k.get());
    lkeys.dedup();
    assert_eq!(lkeys.len(), n, "every region its own key");
    let mut qp_handles = Vec::new();
    let mut qpns = Vec::new();
    for issuer in &qps {
        let (status, handle, out) = answer::<CreateQp>(issuer);
        assert_eq!(status, IbStatus::Success);
        qpns.push(out.unwrap().qpn.get());
        qp_handles.push(handle);
    }
    qpns.sort_unstable();
    qpns.dedup();
    assert_eq!(qpns.len(), n, "every QP its own number");

    // Modifies, in order from one DPC: one MODIFY_QP each, more than the
    // slots, so most wait in the command FIFO. Their requests complete in
    // submission order; step by step, a later one never before an earlier.
    let to_init = QpModify {
        state: Some(QpState::Init),
        pkey_index: Some(0),
        port: Some(PortNum::new(1).unwrap()),
        access: Some(AccessFlags::REMOTE_WRITE),
        ..QpModify::default()
    };
    let (requests, modifies): (Vec<_>, Vec<_>) = qp_handles
        .iter()
        .map(|&qp| w.request::<ModifyQp>(KERNEL, qp, &to_init, 0))
        .unzip();
    let hca = w.hca();
    w.in_dpc(move || {
        for request in requests {
            hca.submit_request(request);
        }
    });
    let mut completed_at = vec![None; n];
    let mut step = 0usize;
    while w.host.scheduler().run_one().unwrap().is_some() {
        step += 1;
        for (k, issuer) in modifies.iter().enumerate() {
            if completed_at[k].is_none() && issuer.completion().is_some() {
                completed_at[k] = Some(step);
            }
        }
    }
    let completed_at: Vec<usize> = completed_at.into_iter().map(Option::unwrap).collect();
    assert!(
        completed_at.windows(2).all(|p| p[0] <= p[1]),
        "FIFO: {completed_at:?}"
    );
    for (issuer, &qp) in modifies.iter().zip(&qp_handles) {
        assert_eq!(answer::<ModifyQp>(issuer).0, IbStatus::Success);
        let state = call::<QueryQp>(&w, qp, &Empty).1.unwrap().state;
        assert_eq!(state, QpState::Init);
    }

    // Resizes of every CQ, each from its own DPC.
    let resizes: Vec<RequestHandle> = cq_handles
        .iter()
        .map(|&cq| {
            submit::<ResizeCq>(
                &w,
                cq,
                &CqAttr {
                    cqe: 512,
                    comp_vector: 0,
                },
            )
        })
        .collect();
    w.settle();
    for (issuer, &cq) in resizes.iter().zip(&cq_handles) {
        let (status, _, out) = answer::<ResizeCq>(issuer);
        assert_eq!(status, IbStatus::Success);
        assert_eq!(out.unwrap().cqe, 512);
        assert_eq!(call::<QueryCq>(&w, cq, &Empty).1.unwrap().cqe, 512);
    }

    // Destroys of everything, all at once.
    let destroys: Vec<RequestHandle> = qp_handles
        .iter()
        .map(|&qp| submit::<DestroyQp>(&w, qp, &Empty))
        .chain(
            mr_handles
                .iter()
                .map(|&mr| submit::<DeregMr>(&w, mr, &Empty)),
        )
        .chain(
            cq_handles
                .iter()
                .map(|&cq| submit::<DestroyCq>(&w, cq, &Empty)),
        )
        .collect();
    w.settle();
    for issuer in &destroys {
        // Every destroy answers Empty; the status is in the header.
        let done = issuer.completion().expect("the request completed");
        assert!(done.status.is_success(), "{:?}", done.status);
    }
    call::<DestroyCq>(&w, qp_cq, &Empty);
    call::<DeallocPd>(&w, pd, &Empty);
    call::<CloseCa>(&w, ca, &Empty);
    for block in blocks {
        w.host.pool().free(block);
    }
    w.finish();
}

#[test]
fn far_more_verbs_than_command_slots_all_complete_once_in_fifo_order() {
    for seed in SEEDS {
        saturated(seed);
    }
}

fn device_stops_answering(seed: u64) {
    let timeout_ns = 50_000_000;
    let w = World::with_hcas(
        seed,
        vec![support::two_port_hca()],
        HcaConfig {
            command_timeout_ns: timeout_ns,
            ..HcaConfig::default()
        },
    );
    let slots = w.hca().command_slots();
    let n = 2 * slots;
    let (ca, _) = call::<OpenCa>(&w, 0, &OpenCaIn::CURRENT);
    let (pd, _) = call::<AllocPd>(&w, ca, &Empty);
    // Room for every QP's work queues (the CQ-overflow rule, `cq::Room`).
    let (cq, _) = call::<CreateCq>(
        &w,
        ca,
        &CqAttr {
            cqe: 1024,
            comp_vector: 0,
        },
    );
    let (qp, _) = call::<CreateQp>(&w, ca, &support::small_qp_create(QpType::Rc, pd, cq));
    let blocks = pages(&w, n);
    // The device stops taking commands: its command doorbells are dropped
    // from now on.
    w.function()
        .bar0()
        .write32(offset::CMDQ_CONFIG, CmdqConfig::default().to_bits());

    let creates: Vec<RequestHandle> = (0..n)
        .map(|_| {
            submit::<CreateCq>(
                &w,
                ca,
                &CqAttr {
                    cqe: 32,
                    comp_vector: 0,
                },
            )
        })
        .collect();
    let regs: Vec<RequestHandle> = blocks
        .iter()
        .map(|b| submit::<RegMr>(&w, pd, &register(b)))
        .collect();
    let qps: Vec<RequestHandle> = (0..n)
        .map(|_| submit::<CreateQp>(&w, ca, &support::small_qp_create(QpType::Rc, pd, cq)))
        .collect();
    let modify = submit::<ModifyQp>(&w, qp, &QpModify::to_state(QpState::Err));
    let resize = submit::<ResizeCq>(
        &w,
        cq,
        &CqAttr {
            cqe: 2048,
            comp_vector: 0,
        },
    );
    let started = w.host.scheduler().now_ns();
    w.settle();
    assert!(w.host.scheduler().now_ns() - started >= timeout_ns);
    assert!(
        w.hca().failure().is_some(),
        "the watchdog failed the device"
    );
    let failed = |status: IbStatus| matches!(status, IbStatus::Timeout | IbStatus::InvalidState);
    for issuer in &creates {
        let (status, handle, _) = answer::<CreateCq>(issuer);
        assert!(failed(status), "{status:?}");
        assert_eq!(handle, 0);
    }
    for issuer in &regs {
        let (status, handle, _) = answer::<RegMr>(issuer);
        assert!(failed(status), "{status:?}");
        assert_eq!(handle, 0);
    }
    for issuer in &qps {
        let (status, handle, _) = answer::<CreateQp>(issuer);
        assert!(failed(status), "{status:?}");
        assert_eq!(handle, 0);
    }
    assert!(failed(answer::<ModifyQp>(&modify).0));
    assert!(failed(answer::<ResizeCq>(&resize).0));
    // Later verbs needing the device fail at once.
    let late = w.call_in_dpc::<CreateCq>(
        KERNEL,
        ca,
        &CqAttr {
            cqe: 8,
            comp_vector: 0,
        },
        0,
    );
    assert!(failed(response::<CreateCq>(&late).status));
    // Nothing leaks: the failed registrations unlocked their pages (the
    // test's blocks are freed), the shell's teardown of the failed device
    // frees what the verbs still hold, and the verifier (pool, common
    // buffers, mappings, locked pages) is clean.
    for block in blocks {
        w.host.pool().free(block);
    }
    w.finish();
}

#[test]
fn saturation_against_a_device_that_stopped_answering_fails_everything_and_leaks_nothing() {
    for seed in SEEDS {
        device_stops_answering(seed);
    }
}
