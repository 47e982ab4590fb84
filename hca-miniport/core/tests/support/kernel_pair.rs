//! Two two-port HCAs on one fabric and a kernel CA, PD and CQ on either:
//! the common start of the kernel verbs tests that move data between HCAs.

use driver_platform::RequestorMode;
use ib_types::cq::CqAttr;
use ib_types::ioctl::{AllocPd, CreateCq, DeallocPd, DestroyCq, Empty, OpenCa, OpenCaIn};
use ib_types::status::IbStatus;
use sim_hca::device::DeviceConfig;

use super::{World, response};

const KERNEL: RequestorMode = RequestorMode::Kernel;

/// A host with two two-port HCAs (node GUIDs `guids`, port addresses
/// `ips`) on one fabric, kernel lockers installed; returns it and each
/// HCA's index in `guids` order.
pub(crate) fn two_two_port_hcas(
    seed: u64,
    guids: [u64; 2],
    ips: &[[[u8; 4]; 2]; 2],
) -> (World, [usize; 2]) {
    let configs = vec![
        DeviceConfig::with_ports(guids[0], &ips[0]),
        DeviceConfig::with_ports(guids[1], &ips[1]),
    ];
    let w = World::with_hcas(seed, configs, hca_miniport_core::init::HcaConfig::default());
    let guid = |i: usize| w.hca_at(i).report().unwrap().capabilities.node_guid.get();
    let first = if guid(0) == guids[0] { 0 } else { 1 };
    for i in 0..2 {
        w.install_kernel_locker(i);
    }
    (w, [first, 1 - first])
}

/// A kernel CA, PD and 64-entry CQ on HCA `i`.
pub(crate) struct Setup {
    pub(crate) i: usize,
    pub(crate) ca: u64,
    pub(crate) pd: u64,
    pub(crate) cq: u64,
}

/// Opens a CA on HCA `i` and makes a PD and a CQ on it.
pub(crate) fn setup(w: &World, i: usize) -> Setup {
    let r = w.call_in_dpc_at::<OpenCa>(i, KERNEL, 0, &OpenCaIn::CURRENT, 0);
    let ca = response::<OpenCa>(&r).handle;
    let r = w.call_in_dpc_at::<AllocPd>(i, KERNEL, ca, &Empty, 0);
    let pd = response::<AllocPd>(&r);
    assert_eq!(pd.status, IbStatus::Success);
    let pd = pd.handle;
    let attr = CqAttr {
        cqe: 64,
        comp_vector: 0,
    };
    let r = w.call_in_dpc_at::<CreateCq>(i, KERNEL, ca, &attr, 0);
    let cq = response::<CreateCq>(&r).handle;
    Setup { i, ca, pd, cq }
}

/// Destroys the CQ and frees the PD of `s` (the CA closes with the world).
#[track_caller]
pub(crate) fn teardown(w: &World, s: &Setup) {
    let r = w.call_in_dpc_at::<DestroyCq>(s.i, KERNEL, s.cq, &Empty, 0);
    assert_eq!(response::<DestroyCq>(&r).status, IbStatus::Success);
    let r = w.call_in_dpc_at::<DeallocPd>(s.i, KERNEL, s.pd, &Empty, 0);
    assert_eq!(response::<DeallocPd>(&r).status, IbStatus::Success);
}

/// Kernel pool memory registered with RegMr on one HCA's side.
pub(crate) struct KernelBuf {
    pub(crate) block: sim_host::memory::PoolBlock,
    pub(crate) mr: u64,
    pub(crate) keys: ib_types::mr::MrKeys,
}

impl KernelBuf {
    /// `len` bytes of pool memory tagged `tag`, registered in `s`'s PD
    /// with `access`.
    pub(crate) fn register(
        w: &World,
        s: &Setup,
        tag: [u8; 4],
        len: usize,
        access: ib_types::access::AccessFlags,
    ) -> Self {
        use ib_types::ioctl::RegMr;
        let block = w.host.pool().alloc(super::DRIVER, tag, len).unwrap();
        let input = ib_types::mr::MrRegister {
            vaddr: block.va(),
            length: len as u64,
            access,
        };
        let r = w.call_in_dpc_at::<RegMr>(s.i, KERNEL, s.pd, &input, 0);
        let resp = response::<RegMr>(&r);
        assert_eq!(resp.status, IbStatus::Success);
        Self {
            block,
            mr: resp.handle,
            keys: resp.output.unwrap(),
        }
    }

    /// The address of byte `offset`.
    pub(crate) fn addr(&self, offset: usize) -> u64 {
        self.block.va() + offset as u64
    }

    /// `len` bytes from `offset` under the local key.
    pub(crate) fn sge(&self, offset: usize, len: u32) -> ib_types::wr::Sge {
        ib_types::wr::Sge::new(self.addr(offset), len, self.keys.lkey)
    }

    pub(crate) fn write(&self, offset: usize, bytes: &[u8]) {
        assert!(self.block.write(offset, bytes));
    }

    pub(crate) fn read(&self, offset: usize, len: usize) -> Vec<u8> {
        let mut out = vec![0; len];
        assert!(self.block.read(offset, &mut out));
        out
    }

    /// Deregisters the region on HCA `i` and frees the memory.
    pub(crate) fn free(self, w: &World, i: usize) {
        use ib_types::ioctl::DeregMr;
        let r = w.call_in_dpc_at::<DeregMr>(i, KERNEL, self.mr, &Empty, 0);
        assert_eq!(response::<DeregMr>(&r).status, IbStatus::Success);
        w.host.pool().free(self.block);
    }
}

/// Polls everything CQ `cq` of HCA `i` holds, from a DPC (a poll that
/// fails panics).
pub(crate) fn poll_all(w: &World, i: usize, cq: u64) -> Vec<ib_types::wc::WorkCompletion> {
    use ib_types::wc::WorkCompletion;
    let out = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let (hca, sink) = (w.hca_at(i), out.clone());
    w.in_dpc(move || {
        let mut wcs = [WorkCompletion::EMPTY; 4];
        loop {
            let n = hca.poll_cq(cq, &mut wcs).unwrap();
            if n == 0 {
                break;
            }
            super::lock(&sink).extend_from_slice(&wcs[..n]);
        }
    });
    w.settle();
    super::lock(&out).clone()
}
