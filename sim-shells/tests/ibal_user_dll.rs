//! Scenario: the access library loads the UVP plugin from a directory (the
//! `uvp-plugin` crate built as its shared library, `libuvp_plugin.so`) on
//! the simulated host, through the real IBAL bus filter's proxy over the
//! real miniport, and moves data with the loaded library's post and poll.
//! The loaded library has its own statics: it reaches the process's memory
//! and the device only through the platform the access library hands it
//! at load (`uvp_set_platform`, docs/ibal-user.md "The plugin").
#![cfg(all(unix, not(windows)))]

mod support;

use std::path::PathBuf;
use std::sync::Arc;

use ib_types::access::AccessFlags;
use ib_types::qp::{QpCaps, QpType};
use ib_types::scalars::{Gid, PortNum, Qpn};
use ib_types::wc::{WcStatus, WorkCompletion};
use ib_types::wr::{RecvWr, SendFlags, SendOp, SendWr, Sge};
use ibal_user::{Buffer, CaSelector, Context, Cq, Mr, Pd, PluginSource, Qp, QpInit, UserSend};
use sim_host::host::{Host, HostConfig};
use sim_host::memory::Process;
use sim_shells::rc_path::rc_to_rts_steps;
use sim_shells::user_io::{SimIo, settle};

/// Deterministic, non-trivial bytes.
fn pattern(seed: u32, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u32).wrapping_mul(31).wrapping_add(seed * 7) as u8)
        .collect()
}

/// A directory holding only the plugin's shared library, copied from the
/// one cargo built next to this test (a dependency's `cdylib` goes to the
/// same `deps` directory as the test binary).
fn plugin_directory() -> PathBuf {
    let deps = std::env::current_exe()
        .unwrap()
        .parent()
        .unwrap()
        .to_owned();
    let built = deps.join("libuvp_plugin.so");
    assert!(
        built.is_file(),
        "cargo builds the plugin's cdylib: {built:?}"
    );
    let dir = std::env::temp_dir().join(format!("ibal-user-dll-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::copy(&built, dir.join("libuvp_plugin.so")).unwrap();
    dir
}

const RC_INIT: QpInit = QpInit {
    qp_type: QpType::Rc,
    caps: QpCaps {
        max_send_wr: 8,
        max_recv_wr: 8,
        max_send_sge: 1,
        max_recv_sge: 1,
        max_inline_data: 0,
    },
    sq_sig_all: false,
};

/// One signaled send of `len` bytes at `va`.
fn send(qp: &mut Qp<'_, '_>, wr_id: u64, va: u64, len: u32, mr: &Mr<'_, '_>) {
    let sge = [Sge::new(va, len, mr.keys().lkey)];
    let wr = SendWr {
        wr_id,
        op: SendOp::Send,
        flags: SendFlags::SIGNALED,
        sg_list: &sge,
        ud: None,
    };
    assert_eq!(qp.post_send(&[UserSend { wr, inline: None }]).unwrap(), 1);
}

/// One receive of `len` bytes at `va`.
fn recv(qp: &mut Qp<'_, '_>, wr_id: u64, va: u64, len: u32, mr: &Mr<'_, '_>) {
    let sge = [Sge::new(va, len, mr.keys().lkey)];
    let wr = RecvWr {
        wr_id,
        sg_list: &sge,
    };
    assert_eq!(qp.post_recv(&[wr]).unwrap(), 1);
}

/// Every completion waiting in `cq`: `(wr_id, status, byte_len)`.
fn poll(cq: &Cq<'_>) -> Vec<(u64, WcStatus, u32)> {
    let mut wcs = [WorkCompletion::EMPTY; 8];
    let got = cq.poll(&mut wcs).unwrap();
    wcs[..got]
        .iter()
        .map(|wc| (wc.wr_id, wc.status, wc.byte_len))
        .collect()
}

/// Two contexts, one per HCA, each with the plugin loaded from the
/// directory: an RC pair between them moves byte-checked data both ways,
/// 20 rounds (every ring wraps), with post and poll alone.
#[test]
fn a_plugin_loaded_from_its_directory_moves_data() {
    let host = Arc::new(Host::new(HostConfig::deterministic(61, support::hca_configs())).unwrap());
    let _stack = support::register_stack(&host);
    host.boot();
    settle(&host);
    host.pnp().process_bus_relations();
    settle(&host);
    let dir = plugin_directory();
    let process = Process::new(81);
    let io: Arc<dyn ibal_user::DeviceIo> = SimIo::new(&host, &process);
    {
        let source = PluginSource::Directory(dir.clone());
        let a = Context::open(&io, CaSelector::Index(0), &source).unwrap();
        let b = Context::open(&io, CaSelector::Index(1), &source).unwrap();
        assert!(a.loaded_plugin().is_some() && b.loaded_plugin().is_some());
        let (apd, bpd) = (Pd::new(&a).unwrap(), Pd::new(&b).unwrap());
        let (abuf, bbuf) = (
            Buffer::new(&a, 8192).unwrap(),
            Buffer::new(&b, 8192).unwrap(),
        );
        let amr = Mr::new(&apd, &abuf, AccessFlags::LOCAL_WRITE).unwrap();
        let bmr = Mr::new(&bpd, &bbuf, AccessFlags::LOCAL_WRITE).unwrap();
        let (acq, bcq) = (Cq::new(&a, 16).unwrap(), Cq::new(&b, 16).unwrap());
        let mut aqp = Qp::new(&apd, &acq, &acq, &RC_INIT).unwrap();
        let mut bqp = Qp::new(&bpd, &bcq, &bcq, &RC_INIT).unwrap();
        // Port 1 of HCA i has the address 10.0.i.1 (`hca_configs`).
        let steps = |dest: &Qp<'_, '_>, ip: [u8; 4]| {
            rc_to_rts_steps(
                PortNum::FIRST,
                AccessFlags::empty(),
                Qpn::new(dest.qpn()).unwrap(),
                Gid::from_ipv4(ip),
                1,
            )
        };
        for step in &steps(&bqp, [10, 0, 1, 1]) {
            aqp.modify(step).unwrap();
        }
        for step in &steps(&aqp, [10, 0, 0, 1]) {
            bqp.modify(step).unwrap();
        }

        let requests = process.requests_issued();
        for round in 0..20u32 {
            let (there, back) = (pattern(round, 1500), pattern(100 + round, 700));
            abuf.write(0, &there).unwrap();
            bbuf.write(4096, &back).unwrap();
            recv(&mut bqp, 1000 + u64::from(round), bbuf.va(), 2048, &bmr);
            recv(
                &mut aqp,
                2000 + u64::from(round),
                abuf.va() + 4096,
                2048,
                &amr,
            );
            send(&mut aqp, u64::from(round), abuf.va(), 1500, &amr);
            send(
                &mut bqp,
                3000 + u64::from(round),
                bbuf.va() + 4096,
                700,
                &bmr,
            );
            settle(&host);
            let r = u64::from(round);
            let mut at_a = poll(&acq);
            at_a.sort_unstable();
            assert_eq!(
                at_a,
                [
                    (r, WcStatus::Success, 1500),
                    (2000 + r, WcStatus::Success, 700)
                ],
                "round {round}"
            );
            let mut at_b = poll(&bcq);
            at_b.sort_unstable();
            assert_eq!(
                at_b,
                [
                    (1000 + r, WcStatus::Success, 1500),
                    (3000 + r, WcStatus::Success, 700)
                ],
                "round {round}"
            );
            let mut got = vec![0; 1500];
            bbuf.read(0, &mut got).unwrap();
            assert_eq!(got, there, "round {round}");
            let mut got = vec![0; 700];
            abuf.read(4096, &mut got).unwrap();
            assert_eq!(got, back, "round {round}");
        }
        assert_eq!(
            process.requests_issued(),
            requests,
            "post and poll stayed in user mode"
        );
    }
    std::fs::remove_dir_all(&dir).unwrap();
    assert_eq!(process.exit(), 0);
    host.shut_down();
    host.verifier().assert_clean();
}
