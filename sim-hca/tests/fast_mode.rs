//! The fast mode: two devices on the zero-latency fabric, driven from two
//! threads, with real time and a timer thread for RNR retries.

use std::sync::Arc;
use std::time::Duration;

use ib_types::access::AccessFlags;
use ib_types::qp::QpType;
use ib_types::scalars::Mtu;
use ib_types::wc::WcStatus;
use ib_types::wr::{SendFlags, SendOp, SendWr};
use sim_hca::testkit::Driver;
use sim_hca::testkit::{PAIR_IPS as IPS, fast_pair};

const PD: u32 = 3;

#[test]
fn streaming_sends_between_threads() {
    let (fabric, mems) = fast_pair(true, |mem| mem);
    let fabric = Arc::new(fabric);
    let _timers = fabric.spawn_timer_thread(Duration::from_millis(1));

    // Bring up both nodes and create an RC endpoint on each.
    let mut setup = Vec::new();
    for (i, mem) in mems.iter().enumerate() {
        let mem = mem.clone();
        let (drv, cq, qp, mr) = fabric.with_device(i, |dev| {
            let mut drv = Driver::bring_up(dev, mem);
            let cq = drv.create_cq(dev, 10).unwrap();
            let qp = drv
                .create_qp(dev, QpType::Rc, 1, PD, &cq, &cq, None, (8, 8))
                .unwrap();
            let mr = drv
                .reg_mr(dev, 1 << 20, PD, AccessFlags::LOCAL_WRITE)
                .unwrap();
            (drv, cq, qp, mr)
        });
        setup.push((drv, cq, qp, mr));
    }
    let qpns = [setup[0].2.qpn, setup[1].2.qpn];
    for (i, (drv, _, qp, _)) in setup.iter_mut().enumerate() {
        let peer = 1 - i;
        fabric
            .with_device(i, |dev| {
                drv.connect(dev, qp, IPS[peer], qpns[peer], Mtu::Mtu4096)
            })
            .unwrap();
    }
    let (mut rx, mut tx) = (setup.pop().unwrap(), setup.pop().unwrap());
    const MESSAGES: u32 = 2000;
    const SIZE: u32 = 4096;

    let fabric_rx = fabric.clone();
    let receiver = std::thread::spawn(move || {
        let (drv, cq, qp, mr) = (&mut rx.0, &mut rx.1, &mut rx.2, &rx.3);
        // Keep 64 receives posted; check each message's contents.
        let mut posted = 0u32;
        let mut received = 0u32;
        while received < MESSAGES {
            while posted < MESSAGES && posted - received < 64 {
                let slot = u64::from(posted % 64) * u64::from(SIZE);
                drv.post_recv(qp, u64::from(posted), &[Driver::sge(mr, slot, SIZE)]);
                posted += 1;
            }
            let cqe = fabric_rx.with_device(1, |_| drv.poll_cq(cq));
            match cqe {
                Some(c) => {
                    assert_eq!(c.status, WcStatus::Success.code());
                    let slot = (received % 64) as usize * SIZE as usize;
                    let data = drv.read_mr(mr, slot, SIZE as usize);
                    assert!(
                        data.iter().all(|&b| b == received as u8),
                        "message {received} intact"
                    );
                    received += 1;
                }
                None => std::thread::yield_now(),
            }
        }
        received
    });

    let (drv, cq, qp, mr) = (&mut tx.0, &mut tx.1, &mut tx.2, &tx.3);
    let mut sent = 0u32;
    let mut completed = 0u32;
    while completed < MESSAGES {
        while sent < MESSAGES && sent - completed < 32 {
            let slot = u64::from(sent % 32) * u64::from(SIZE);
            drv.write_mr(mr, slot as usize, &vec![sent as u8; SIZE as usize]);
            let sg = [Driver::sge(mr, slot, SIZE)];
            let wr = SendWr {
                wr_id: u64::from(sent),
                op: SendOp::Send,
                flags: SendFlags::SIGNALED,
                sg_list: &sg,
                ud: None,
            };
            fabric
                .with_device(0, |dev| drv.post_send(dev, qp, &wr, None, None, true))
                .unwrap();
            sent += 1;
        }
        match fabric.with_device(0, |_| drv.poll_cq(cq)) {
            Some(c) => {
                assert_eq!(c.status, WcStatus::Success.code(), "send {completed}");
                completed += 1;
            }
            None => std::thread::yield_now(),
        }
    }
    assert_eq!(receiver.join().unwrap(), MESSAGES);
}
