//! Steady-state data movement makes no heap allocation (issue 3): after a
//! warm-up, thousands of RC sends, RDMA writes and their completions go
//! through the fast-mode fabric and both devices without one allocation.
//!
//! A counting global allocator sees every allocation of this test binary;
//! the measured loop uses only paths that must not allocate (the test
//! driver's post and poll included).

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use ib_types::access::AccessFlags;
use ib_types::qp::QpType;
use ib_types::scalars::Mtu;
use ib_types::wc::WcStatus;
use ib_types::wr::{RemoteAddr, SendFlags, SendOp, SendWr};
use sim_hca::device::{Device, DeviceConfig};
use sim_hca::fast::FastFabric;
use sim_hca::host::{InterruptSink, SimMemory};
use sim_hca::testkit::Driver;

struct Counting;

static ALLOCATIONS: AtomicU64 = AtomicU64::new(0);

// SAFETY: every method forwards to the system allocator with the caller's
// arguments unchanged; counting has no effect on the memory returned.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: the caller upholds `GlobalAlloc::alloc`'s contract.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from `alloc` above with this `layout`.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: the caller upholds `GlobalAlloc::realloc`'s contract.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

struct NoIrq;
impl InterruptSink for NoIrq {
    fn raise(&self, _vector: u16) {}
}

const IPS: [[u8; 4]; 2] = [[10, 9, 0, 1], [10, 9, 0, 2]];

#[test]
fn steady_state_sends_and_writes_do_not_allocate() {
    let mems: Vec<Arc<SimMemory>> = (0..2u64)
        .map(|i| Arc::new(SimMemory::new(0x8_0000_0000 * (i + 1))))
        .collect();
    let devices = (0..2)
        .map(|i| {
            Device::new(
                DeviceConfig::with_ports(0x77 + i as u64, &[IPS[i]]),
                mems[i].clone(),
                Arc::new(NoIrq),
            )
        })
        .collect();
    let fabric = FastFabric::new(devices);
    let rights = AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE;
    let mut nodes = Vec::new();
    for (i, mem) in mems.iter().enumerate() {
        let mem = mem.clone();
        nodes.push(fabric.with_device(i, |dev| {
            let mut drv = Driver::bring_up(dev, mem);
            let cq = drv.create_cq(dev, 10).unwrap();
            let qp = drv
                .create_qp(dev, QpType::Rc, 1, 1, &cq, &cq, None, (8, 8))
                .unwrap();
            let mr = drv.reg_mr(dev, 256 * 1024, 1, rights).unwrap();
            (drv, cq, qp, mr)
        }));
    }
    let qpns = [nodes[0].2.qpn, nodes[1].2.qpn];
    for (i, (drv, _, qp, _)) in nodes.iter_mut().enumerate() {
        fabric
            .with_device(i, |dev| {
                drv.connect(dev, qp, IPS[1 - i], qpns[1 - i], Mtu::Mtu1024)
            })
            .unwrap();
    }
    let (mut b, mut a) = (nodes.pop().unwrap(), nodes.pop().unwrap());
    let remote = RemoteAddr {
        addr: b.3.va,
        rkey: b.3.rkey,
    };

    let round = |a: &mut (
        Driver,
        sim_hca::testkit::Cq,
        sim_hca::testkit::Qp,
        sim_hca::testkit::Mr,
    ),
                 b: &mut (
        Driver,
        sim_hca::testkit::Cq,
        sim_hca::testkit::Qp,
        sim_hca::testkit::Mr,
    ),
                 i: u64| {
        let sge = Driver::sge(&b.3, 0, 4096);
        b.0.post_recv(&mut b.2, i, &[sge]);
        let sg = [Driver::sge(&a.3, 0, 3000)];
        let send = SendWr {
            wr_id: i,
            op: SendOp::Send,
            flags: SendFlags::SIGNALED,
            sg_list: &sg,
            ud: None,
        };
        let write = SendWr {
            wr_id: i,
            op: SendOp::RdmaWrite { remote },
            flags: SendFlags::SIGNALED,
            sg_list: &sg,
            ud: None,
        };
        fabric.with_device(0, |dev| {
            a.0.post_send(dev, &mut a.2, &send, None, None, false)
                .unwrap();
            a.0.post_send(dev, &mut a.2, &write, None, None, true)
                .unwrap();
        });
        for _ in 0..2 {
            let c =
                a.0.poll_cq(&mut a.1)
                    .expect("the fabric delivered synchronously");
            assert_eq!(c.status, WcStatus::Success.code());
        }
        let c = b.0.poll_cq(&mut b.1).expect("received");
        assert_eq!(c.status, WcStatus::Success.code());
    };
    for i in 0..300 {
        round(&mut a, &mut b, i);
    }
    let before = ALLOCATIONS.load(Ordering::Relaxed);
    for i in 300..2300 {
        round(&mut a, &mut b, i);
    }
    let allocations = ALLOCATIONS.load(Ordering::Relaxed) - before;
    assert_eq!(
        allocations, 0,
        "{allocations} allocations in 2000 rounds of 3-packet sends and writes"
    );
}
