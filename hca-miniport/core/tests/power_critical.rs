//! A critical sleep (sim-host `set_system_power_critical`: the power
//! manager sends set-power with no query, as for a failing battery) under
//! UD traffic on two HCAs: the miniport leaves D0 with sends still in
//! flight, and after the resume every handle, key and posted WR is intact
//! and traffic flows again; the verifier stays clean.

mod power_kit;
mod support;

use driver_platform::SystemPowerState;
use ib_types::ioctl::{DestroyQp, Empty};
use ib_types::qp::{QpState, QpType};
use ib_types::scalars::{QKey, Qpn};
use ib_types::status::IbStatus;
use ib_types::wc::WcStatus;
use ib_types::wr::{RecvWr, SendFlags, SendOp, SendWr, UdDest};
use power_kit::*;
use sim_host::power::CriticalSleep;
use support::response;

const QKEY: u32 = 0x2222;
const LEN: usize = 64;

fn ud_send(wr_id: u64, sg_list: &'static [ib_types::wr::Sge], to: u32) -> SendWr<'static> {
    SendWr {
        wr_id,
        op: SendOp::Send,
        flags: SendFlags::SIGNALED,
        sg_list,
        ud: Some(UdDest {
            av: ib_types::handle::AvHandle::from_raw(1),
            remote_qpn: Qpn::new(to).unwrap(),
            remote_qkey: QKey::new(QKEY),
        }),
    }
}

#[test]
fn a_critical_sleep_with_sends_in_flight_keeps_every_object() {
    for seed in [11, 12, 13] {
        critical_sleep_under_traffic(seed, CriticalSleep::Unqueried);
        critical_sleep_under_traffic(seed, CriticalSleep::AfterVeto);
    }
}

fn critical_sleep_under_traffic(seed: u64, query: CriticalSleep) {
    let (w, [x, y]) = two_hcas(seed, hca_miniport_core::init::HcaConfig::default());
    let (sx, sy) = (side(&w, x), side(&w, y));
    let (mx, my) = (Mem::new(&w, x, sx.pd), Mem::new(&w, y, sy.pd));
    let keys_before = (mx.query(&w), my.query(&w));
    let (ua, qpn_ua) = create_qp(&w, &sx, QpType::Ud, None);
    let (ub, _) = create_qp(&w, &sy, QpType::Ud, None);
    ud_to_rts(&w, x, ua, QKEY);
    ud_to_rts(&w, y, ub, QKEY);
    let av_x = hca_prm::av::Av::try_from(&av_to(HCA_IPS[0][0])).unwrap();

    // Eight receives on X; four sends from Y posted and left in flight
    // (no settle) when the power fails.
    let recvs: Vec<_> = (0..8u64)
        .map(|id| RecvWr {
            wr_id: id,
            sg_list: mx.sge(id as usize * 1024, 1024),
        })
        .collect();
    assert_eq!(post_recv(&w, x, ua, recvs), (8, IbStatus::Success));
    let sends = |ids: std::ops::Range<u64>| -> Vec<SendWr<'static>> {
        ids.map(|id| {
            let at = id as usize * 1024;
            my.write(at, &pattern(id as u8, LEN));
            ud_send(id, my.sge(at, LEN as u32), qpn_ua)
        })
        .collect()
    };
    assert_eq!(
        post_send(&w, y, ub, sends(0..4), Some(av_x)),
        (4, IbStatus::Success)
    );

    let overridden = w
        .host
        .pnp()
        .set_system_power_critical(SystemPowerState::S3, query);
    assert!(overridden.is_empty(), "the miniport never vetoes");
    w.settle();
    for i in [x, y] {
        assert!(w.hca_at(i).is_below_d0(), "seed {seed}: HCA {i} slept");
    }
    w.resume();

    // Unconnected QPs keep their state, memory its keys.
    assert_eq!(qp_state(&w, x, ua), QpState::Rts, "seed {seed}");
    assert_eq!(qp_state(&w, y, ub), QpState::Rts, "seed {seed}");
    assert_eq!((mx.query(&w), my.query(&w)), keys_before, "seed {seed}");
    // Four more sends after the resume: every send completes once, in
    // order, and every datagram lands intact in its receive.
    assert_eq!(
        post_send(&w, y, ub, sends(4..8), Some(av_x)),
        (4, IbStatus::Success)
    );
    w.settle();
    let sent: Vec<_> = poll_all(&w, y, sy.cq)
        .iter()
        .map(|wc| (wc.wr_id, wc.status))
        .collect();
    assert_eq!(
        sent,
        (0..8).map(|id| (id, WcStatus::Success)).collect::<Vec<_>>(),
        "seed {seed} {query:?}"
    );
    let received = poll_all(&w, x, sx.cq);
    assert_eq!(received.len(), 8, "seed {seed} {query:?}");
    for (wc, id) in received.iter().zip(0u64..) {
        assert_eq!((wc.wr_id, wc.status), (id, WcStatus::Success));
        // A UD receive starts with the 40-byte GRH.
        let at = id as usize * 1024 + 40;
        assert_eq!(mx.read(at, LEN), pattern(id as u8, LEN), "seed {seed}");
    }

    for (i, qp, cq) in [(x, ua, sx.cq), (y, ub, sy.cq)] {
        let r = w.call_in_dpc_at::<DestroyQp>(i, KERNEL, qp, &Empty, 0);
        assert_eq!(response::<DestroyQp>(&r).status, IbStatus::Success);
        let _ = poll_all(&w, i, cq);
    }
    mx.free(&w);
    my.free(&w);
    w.finish();
}
