//! Issue 13, measurement 3, at the device level: 1 MiB RDMA writes between
//! two devices on the fast-mode fabric against a single-thread memcpy of
//! the same size, interleaved in one process. `#[ignore]`d (a timing run):
//!
//! ```sh
//! CARGO_INCREMENTAL=0 cargo test --release -p sim-hca --test bandwidth -- --ignored --nocapture
//! ```

use std::time::{Duration, Instant};

use ib_types::access::AccessFlags;
use ib_types::qp::QpType;
use ib_types::scalars::Mtu;
use ib_types::wc::WcStatus;
use ib_types::wr::{RemoteAddr, SendFlags, SendOp, SendWr};
use sim_hca::testkit::Driver;
use sim_hca::testkit::{PAIR_IPS as IPS, fast_pair};

const PD: u32 = 3;
const MIB: usize = 1 << 20;

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort_unstable();
    v[v.len() / 2]
}

#[test]
#[ignore = "timing run; see the module doc"]
fn rdma_write_1mib_against_memcpy() {
    let (fabric, mems) = fast_pair(true, |mem| mem);
    let mut nodes = Vec::new();
    for (i, mem) in mems.iter().enumerate() {
        let mem = mem.clone();
        nodes.push(fabric.with_device(i, |dev| {
            let mut drv = Driver::bring_up(dev, mem);
            let cq = drv.create_cq(dev, 6).unwrap();
            let qp = drv
                .create_qp(dev, QpType::Rc, 1, PD, &cq, &cq, None, (6, 6))
                .unwrap();
            let access = AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE;
            let mr = drv.reg_mr(dev, MIB, PD, access).unwrap();
            (drv, cq, qp, mr)
        }));
    }
    let qpns = [nodes[0].2.qpn, nodes[1].2.qpn];
    for (i, (drv, _, qp, _)) in nodes.iter_mut().enumerate() {
        fabric
            .with_device(i, |dev| {
                drv.connect(dev, qp, IPS[1 - i], qpns[1 - i], Mtu::Mtu4096)
            })
            .unwrap();
    }
    let (rx, mut tx) = (nodes.pop().unwrap(), nodes.pop().unwrap());
    let pattern: Vec<u8> = (0..MIB).map(|i| (i * 7 + i / 4096) as u8).collect();
    tx.0.write_mr(&tx.3, 0, &pattern);
    let remote = RemoteAddr {
        addr: rx.3.va,
        rkey: rx.3.rkey,
    };
    let sg = [Driver::sge(&tx.3, 0, MIB as u32)];
    let mut write_once = || {
        let wr = SendWr {
            wr_id: 1,
            op: SendOp::RdmaWrite { remote },
            flags: SendFlags::SIGNALED,
            sg_list: &sg,
            ud: None,
        };
        let (drv, cq, qp, _) = &mut tx;
        fabric
            .with_device(0, |dev| drv.post_send(dev, qp, &wr, None, None, true))
            .unwrap();
        loop {
            if let Some(c) = fabric.with_device(0, |_| drv.poll_cq(cq)) {
                assert_eq!(c.status, WcStatus::Success.code());
                break;
            }
        }
    };
    write_once();
    assert!(rx.0.read_mr(&rx.3, 0, MIB) == pattern, "the write landed");

    let src = vec![0x5Au8; MIB];
    let mut dst = vec![0u8; MIB];
    let (mut writes, mut copies) = (Vec::new(), Vec::new());
    for _ in 0..200 {
        let t = Instant::now();
        write_once();
        writes.push(t.elapsed());
        let t = Instant::now();
        dst.copy_from_slice(std::hint::black_box(&src));
        std::hint::black_box(&mut dst);
        copies.push(t.elapsed());
    }
    let (w, c) = (median(writes), median(copies));
    let gbps = |d: Duration| MIB as f64 / d.as_secs_f64() / 1e9;
    println!(
        "1 MiB RDMA write {:.2} GB/s ({w:?}); memcpy {:.2} GB/s ({c:?}); ratio {:.2} (goal 0.8)",
        gbps(w),
        gbps(c),
        c.as_secs_f64() / w.as_secs_f64()
    );
}
