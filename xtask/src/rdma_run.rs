//! The main job's RDMA run: two simulated HCAs in fast mode, programmed
//! through the PRM by the device's test-side driver, move real data —
//! streaming sends, RDMA writes read back, and fetch-adds — and the data is
//! checked. This exercises the device model and transport; the full stack
//! (simulated Windows host, miniport, bus filter, user mode) takes over this
//! job as those pieces land.

use std::sync::Arc;
use std::time::{Duration, Instant};

use ib_types::access::AccessFlags;
use ib_types::qp::QpType;
use ib_types::scalars::Mtu;
use ib_types::wc::WcStatus;
use ib_types::wr::{RemoteAddr, SendFlags, SendOp, SendWr};
use sim_hca::device::{Device, DeviceConfig};
use sim_hca::fast::FastFabric;
use sim_hca::host::{InterruptSink, SimMemory};
use sim_hca::testkit::{Cq, Driver, Mr, Qp};

struct NoInterrupts;
impl InterruptSink for NoInterrupts {
    fn raise(&self, _vector: u16) {}
}

const IPS: [[u8; 4]; 2] = [[10, 0, 0, 1], [10, 0, 0, 2]];
const PD: u32 = 1;
const MSG: u32 = 4096;
const SENDS: u32 = 5000;
const WRITES: u32 = 200;
const WRITE_SIZE: u32 = 64 * 1024;
const ATOMICS: u32 = 500;

struct Node {
    drv: Driver,
    cq: Cq,
    qp: Qp,
    mr: Mr,
}

fn fail(what: impl Into<String>) -> String {
    what.into()
}

/// Polls `node`'s CQ until one completion arrives; it must be a success.
fn wait_one(fabric: &FastFabric, index: usize, node: &mut Node, what: &str) -> Result<(), String> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Some(c) = fabric.with_device(index, |_| node.drv.poll_cq(&mut node.cq)) {
            if c.status != WcStatus::Success.code() {
                return Err(fail(format!("{what}: completion status {:#x}", c.status)));
            }
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(fail(format!("{what}: no completion within 30 s")));
        }
        std::thread::yield_now();
    }
}

/// Runs the workload and prints what it did; `Err` on any wrong byte or
/// failed completion.
pub(crate) fn run() -> Result<(), String> {
    println!("\n== RDMA on two simulated HCAs (fast mode) ==");
    let mems: Vec<Arc<SimMemory>> = (0..2u64)
        .map(|i| Arc::new(SimMemory::new(0x10_0000_0000 * (i + 1))))
        .collect();
    let devices = (0..2)
        .map(|i| {
            let cfg = DeviceConfig::with_ports(0x0200_00ff_fe00_0100 + i as u64, &[IPS[i]]);
            Device::new(cfg, mems[i].clone(), Arc::new(NoInterrupts))
        })
        .collect();
    let fabric = Arc::new(FastFabric::new(devices));
    let _timers = fabric.spawn_timer_thread(Duration::from_millis(1));
    let rights = AccessFlags::LOCAL_WRITE
        | AccessFlags::REMOTE_READ
        | AccessFlags::REMOTE_WRITE
        | AccessFlags::REMOTE_ATOMIC;
    let mut nodes = Vec::new();
    for (i, mem) in mems.iter().enumerate() {
        let mem = mem.clone();
        let node = fabric.with_device(i, |dev| -> Result<Node, String> {
            let mut drv = Driver::bring_up(dev, mem);
            let cq = drv
                .create_cq(dev, 12)
                .map_err(|s| format!("create CQ: {s:?}"))?;
            let qp = drv
                .create_qp(dev, QpType::Rc, 1, PD, &cq, &cq, None, (10, 10))
                .map_err(|s| format!("create QP: {s:?}"))?;
            let mr = drv
                .reg_mr(dev, 4 << 20, PD, rights)
                .map_err(|s| format!("register: {s:?}"))?;
            Ok(Node { drv, cq, qp, mr })
        })?;
        nodes.push(node);
    }
    let qpns = [nodes[0].qp.qpn, nodes[1].qp.qpn];
    for (i, n) in nodes.iter_mut().enumerate() {
        let peer = 1 - i;
        fabric
            .with_device(i, |dev| {
                n.drv
                    .connect(dev, &n.qp, IPS[peer], qpns[peer], Mtu::Mtu4096)
            })
            .map_err(|s| format!("connect: {s:?}"))?;
    }
    let mut b = nodes.pop().ok_or("two nodes")?;
    let mut a = nodes.pop().ok_or("two nodes")?;

    // Streaming sends, B checking every message's bytes in its own thread.
    let start = Instant::now();
    let fabric_b = fabric.clone();
    let receiver = std::thread::spawn(move || -> Result<Node, String> {
        let mut posted = 0u32;
        let mut received = 0u32;
        while received < SENDS {
            while posted < SENDS && posted - received < 128 {
                let slot = u64::from(posted % 128) * u64::from(MSG);
                let sge = Driver::sge(&b.mr, slot, MSG);
                b.drv.post_recv(&mut b.qp, u64::from(posted), &[sge]);
                posted += 1;
            }
            match fabric_b.with_device(1, |_| b.drv.poll_cq(&mut b.cq)) {
                Some(c) if c.status == WcStatus::Success.code() => {
                    let slot = (received % 128) as usize * MSG as usize;
                    let data = b.drv.read_mr(&b.mr, slot, MSG as usize);
                    if data.iter().any(|&x| x != received as u8) {
                        return Err(format!("message {received} arrived damaged"));
                    }
                    received += 1;
                }
                Some(c) => return Err(format!("receive status {:#x}", c.status)),
                None => std::thread::yield_now(),
            }
        }
        Ok(b)
    });
    let (mut sent, mut done) = (0u32, 0u32);
    while done < SENDS {
        while sent < SENDS && sent - done < 64 {
            let slot = u64::from(sent % 64) * u64::from(MSG);
            a.drv
                .write_mr(&a.mr, slot as usize, &vec![sent as u8; MSG as usize]);
            let sg = [Driver::sge(&a.mr, slot, MSG)];
            let wr = SendWr {
                wr_id: u64::from(sent),
                op: SendOp::Send,
                flags: SendFlags::SIGNALED,
                sg_list: &sg,
                ud: None,
            };
            fabric
                .with_device(0, |dev| {
                    a.drv.post_send(dev, &mut a.qp, &wr, None, None, true)
                })
                .map_err(|e| format!("post send: {e}"))?;
            sent += 1;
        }
        wait_one(&fabric, 0, &mut a, "send")?;
        done += 1;
    }
    let b = receiver
        .join()
        .map_err(|_| "the receiver thread panicked")??;
    let elapsed = start.elapsed();
    let bytes = f64::from(SENDS) * f64::from(MSG);
    println!(
        "  {SENDS} sends of {MSG} B: {:.0} msg/s, {:.1} MB/s (data checked)",
        f64::from(SENDS) / elapsed.as_secs_f64(),
        bytes / elapsed.as_secs_f64() / 1e6
    );

    // RDMA writes of 64 KiB, then one read back of each region.
    let start = Instant::now();
    let remote = RemoteAddr {
        addr: b.mr.va,
        rkey: b.mr.rkey,
    };
    for i in 0..WRITES {
        let pattern: Vec<u8> = (0..WRITE_SIZE).map(|j| (j as u8) ^ (i as u8)).collect();
        a.drv.write_mr(&a.mr, 0, &pattern);
        let sg = [Driver::sge(&a.mr, 0, WRITE_SIZE)];
        let offset = u64::from(i % 32) * u64::from(WRITE_SIZE);
        let wr = SendWr {
            wr_id: u64::from(i),
            op: SendOp::RdmaWrite {
                remote: RemoteAddr {
                    addr: remote.addr + offset,
                    ..remote
                },
            },
            flags: SendFlags::SIGNALED,
            sg_list: &sg,
            ud: None,
        };
        fabric
            .with_device(0, |dev| {
                a.drv.post_send(dev, &mut a.qp, &wr, None, None, true)
            })
            .map_err(|e| format!("post write: {e}"))?;
        wait_one(&fabric, 0, &mut a, "write")?;
        let back = [Driver::sge(&a.mr, u64::from(WRITE_SIZE), WRITE_SIZE)];
        let read = SendWr {
            wr_id: u64::from(i),
            op: SendOp::RdmaRead {
                remote: RemoteAddr {
                    addr: remote.addr + offset,
                    ..remote
                },
            },
            flags: SendFlags::SIGNALED,
            sg_list: &back,
            ud: None,
        };
        fabric
            .with_device(0, |dev| {
                a.drv.post_send(dev, &mut a.qp, &read, None, None, true)
            })
            .map_err(|e| format!("post read: {e}"))?;
        wait_one(&fabric, 0, &mut a, "read")?;
        if a.drv
            .read_mr(&a.mr, WRITE_SIZE as usize, WRITE_SIZE as usize)
            != pattern
        {
            return Err(fail(format!("write/read {i}: the data read back differs")));
        }
    }
    let elapsed = start.elapsed();
    println!(
        "  {WRITES} RDMA writes of {} KiB, each read back: {:.1} MB/s moved (data checked)",
        WRITE_SIZE / 1024,
        2.0 * f64::from(WRITES) * f64::from(WRITE_SIZE) / elapsed.as_secs_f64() / 1e6
    );

    // Fetch-adds: every old value is distinct and the counter ends right.
    let start = Instant::now();
    let counter = RemoteAddr {
        addr: b.mr.va + (3 << 20),
        rkey: b.mr.rkey,
    };
    let mut olds = Vec::with_capacity(ATOMICS as usize);
    for i in 0..ATOMICS {
        let sg = [Driver::sge(&a.mr, 8, 8)];
        let wr = SendWr {
            wr_id: u64::from(i),
            op: SendOp::FetchAdd {
                remote: counter,
                add: 1,
            },
            flags: SendFlags::SIGNALED,
            sg_list: &sg,
            ud: None,
        };
        fabric
            .with_device(0, |dev| {
                a.drv.post_send(dev, &mut a.qp, &wr, None, None, true)
            })
            .map_err(|e| format!("post fetch-add: {e}"))?;
        wait_one(&fabric, 0, &mut a, "fetch-add")?;
        let old = a.drv.read_mr(&a.mr, 8, 8);
        olds.push(u64::from_le_bytes(old.try_into().map_err(|_| "8 bytes")?));
    }
    let last = u64::from_le_bytes(
        b.drv
            .read_mr(&b.mr, 3 << 20, 8)
            .try_into()
            .map_err(|_| "8 bytes")?,
    );
    if olds != (0..u64::from(ATOMICS)).collect::<Vec<_>>() || last != u64::from(ATOMICS) {
        return Err(fail("fetch-add results are not 0, 1, 2, ..."));
    }
    println!(
        "  {ATOMICS} fetch-adds: {:.0} op/s, results 0..{ATOMICS} in order, counter = {last}",
        f64::from(ATOMICS) / start.elapsed().as_secs_f64()
    );
    Ok(())
}
