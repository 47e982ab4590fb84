//! Protection domains and memory registration: `ibv_alloc_pd`,
//! `ibv_dealloc_pd`, `ibv_reg_mr`, `ibv_reg_mr_iova2`, `ibv_dereg_mr`.
//!
//! **Ownership.** A program frees its objects in any order and holds them
//! only by pointer, so the C objects cannot borrow each other the way the
//! access library's [`ibal_user::Pd`] borrows its context. Each owns what
//! it depends on through an `Arc` instead ([`ibal_user::SharedPd`] its
//! context, [`ibal_user::SharedMr`] its PD), and the library keeps every
//! object in a registry by the address of the rdma-core struct at its
//! front (QPs, CQs, SRQs and address handles in tables of slots,
//! `crate::slots`): a pointer that
//! is not ours is refused with `EINVAL`, never dereferenced. A PD counts the objects made in it (regions here,
//! address handles in `crate::ah`); deallocating it while any remain is
//! refused with `EBUSY`, as rdma-core's kernel does.
//!
//! **The program's memory.** `ibv_reg_mr` registers the program's own
//! buffer: the machine first makes its pages reachable by the device
//! ([`Machine::expose_user_memory`]; on the simulated machine the
//! simulated process adopts them, on Windows nothing is needed), then
//! registers them (`RegMr`, which locks them). `ibv_dereg_mr` deregisters,
//! then releases the pages. Every failure path releases what it took.

use std::collections::HashMap;
use std::ffi::{c_int, c_void};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use ib_types::access::AccessFlags;
use ibal_user::{SharedMr, SharedPd};
use ibverbs_abi::{
    IBV_ACCESS_HUGETLB, IBV_ACCESS_ON_DEMAND, IBV_ACCESS_OPTIONAL_RANGE, IBV_ACCESS_ZERO_BASED,
    IbvContext, IbvMr, IbvPd,
};

use crate::device::open_context;
use crate::state::{Context, Machine, machine};
use crate::util::{errno_of, guard, lock, set_errno};

/// A protection domain: rdma-core's `ibv_pd` first (the pointer a program
/// holds), then the access library's PD.
#[repr(C)]
pub(crate) struct ProtectionDomain {
    pub(crate) raw: IbvPd,
    pub(crate) pd: Arc<SharedPd>,
    /// Keeps the context (and its `ibv_context`, which `raw` names) alive
    /// while the PD exists, even past `ibv_close_device`.
    pub(crate) context: Arc<Context>,
    /// Objects made in this PD and not destroyed yet (regions, ...).
    pub(crate) children: AtomicUsize,
}

// SAFETY: `raw.context` points into `context` (an `Arc` this PD holds), is
// never written after the PD is built, and is only read; the rest is
// `Send + Sync`.
unsafe impl Send for ProtectionDomain {}
// SAFETY: as for `Send`: shared references only read `raw`.
unsafe impl Sync for ProtectionDomain {}

impl ProtectionDomain {
    pub(crate) fn as_ptr(&self) -> *mut IbvPd {
        std::ptr::from_ref(&self.raw).cast_mut()
    }
}

/// A registered region: rdma-core's `ibv_mr` first, then the access
/// library's region and the range the machine exposed for it.
#[repr(C)]
pub(crate) struct MemoryRegion {
    raw: IbvMr,
    mr: SharedMr,
    pd: Arc<ProtectionDomain>,
}

// SAFETY: `raw`'s pointers name the PD and context this region holds
// (`pd`) and the program's buffer, which the library never dereferences;
// `raw` is never written after the region is built.
unsafe impl Send for MemoryRegion {}
// SAFETY: as for `Send`: shared references only read `raw`.
unsafe impl Sync for MemoryRegion {}

impl MemoryRegion {
    fn as_ptr(&self) -> *mut IbvMr {
        std::ptr::from_ref(&self.raw).cast_mut()
    }
}

/// Live objects of one kind, by the address of their rdma-core struct.
pub(crate) type Registry<T> = Mutex<Option<HashMap<usize, Arc<T>>>>;

static PDS: Registry<ProtectionDomain> = Mutex::new(None);
static MRS: Registry<MemoryRegion> = Mutex::new(None);

pub(crate) fn remember<T>(registry: &Registry<T>, address: usize, object: Arc<T>) {
    lock(registry)
        .get_or_insert_with(HashMap::new)
        .insert(address, object);
}

/// The PD `ptr` names, if it is one of ours.
pub(crate) fn pd_at(ptr: *const IbvPd) -> Option<Arc<ProtectionDomain>> {
    lock(&PDS).as_ref()?.get(&(ptr as usize)).cloned()
}

/// The PD `ptr` names, with one more child counted (taken under the
/// registry's lock, so a concurrent dealloc sees it): `EINVAL` if it is
/// not ours.
pub(crate) fn pd_for_child(ptr: *const IbvPd) -> Result<Arc<ProtectionDomain>, c_int> {
    let pds = lock(&PDS);
    let pd = pds
        .as_ref()
        .and_then(|pds| pds.get(&(ptr as usize)))
        .ok_or(libc::EINVAL)?;
    pd.children.fetch_add(1, Ordering::AcqRel);
    Ok(Arc::clone(pd))
}

/// `ibv_alloc_pd(context)`: a PD (`AllocPd`); NULL with `errno` (`EINVAL`
/// for a context that is not open, the access library's error otherwise).
///
/// # Safety
///
/// None beyond C's: the pointer is checked against the open contexts.
pub unsafe extern "C" fn ibv_alloc_pd(context: *mut IbvContext) -> *mut IbvPd {
    guard(std::ptr::null_mut(), || {
        let made = open_context(context).and_then(|context| {
            let pd = SharedPd::new(Arc::clone(&context.ca)).map_err(|e| errno_of(&e))?;
            Ok(Arc::new(ProtectionDomain {
                raw: IbvPd {
                    context: context.as_ptr(),
                    handle: truncated_handle(pd.handle()),
                },
                pd: Arc::new(pd),
                context,
                children: AtomicUsize::new(0),
            }))
        });
        match made {
            Ok(pd) => {
                let ptr = pd.as_ptr();
                remember(&PDS, ptr as usize, pd);
                ptr
            }
            Err(errno) => {
                set_errno(errno);
                std::ptr::null_mut()
            }
        }
    })
}

/// rdma-core's 32-bit `handle` field: the access library's handle's low
/// 32 bits (programs only print it).
pub(crate) fn truncated_handle(handle: u64) -> u32 {
    (handle & u64::from(u32::MAX)) as u32
}

/// `ibv_dealloc_pd(pd)`: 0, or an errno value: `EINVAL` for a PD that is
/// not ours, `EBUSY` while regions or address handles made in it remain, the access
/// library's error (the PD stays) otherwise.
///
/// # Safety
///
/// None beyond C's: the pointer is checked against the live PDs.
pub unsafe extern "C" fn ibv_dealloc_pd(pd: *mut IbvPd) -> c_int {
    guard(libc::EIO, || {
        let taken = {
            let mut pds = lock(&PDS);
            let Some(pds) = pds.as_mut() else {
                return libc::EINVAL;
            };
            match pds.get(&(pd as usize)) {
                None => return libc::EINVAL,
                Some(found) if found.children.load(Ordering::Acquire) != 0 => {
                    return libc::EBUSY;
                }
                Some(_) => pds.remove(&(pd as usize)),
            }
        };
        let Some(taken) = taken else {
            return libc::EINVAL;
        };
        match taken.pd.dealloc() {
            Ok(()) => 0,
            Err(error) => {
                remember(&PDS, pd as usize, taken);
                errno_of(&error)
            }
        }
    })
}

/// The access rights `access` asks for, or the errno value refusing them:
/// bits in `IBV_ACCESS_OPTIONAL_RANGE` are hints a provider may ignore
/// (perftest adds `IBV_ACCESS_RELAXED_ORDERING`), and so is
/// `IBV_ACCESS_HUGETLB`; on-demand paging and zero-based regions are not
/// supported (`EOPNOTSUPP`); any other unknown bit, or remote write or
/// atomic without local write, is `EINVAL`.
fn access_rights(access: u32) -> Result<AccessFlags, c_int> {
    let mandatory = access & !IBV_ACCESS_OPTIONAL_RANGE & !IBV_ACCESS_HUGETLB;
    if mandatory & (IBV_ACCESS_ON_DEMAND | IBV_ACCESS_ZERO_BASED) != 0 {
        return Err(libc::EOPNOTSUPP);
    }
    let rights = AccessFlags::from_bits(mandatory).ok_or(libc::EINVAL)?;
    if !rights.is_valid_for_region() {
        return Err(libc::EINVAL);
    }
    Ok(rights)
}

/// Registers `length` bytes at `addr` in `pd`: exposes the pages to the
/// device, registers them, and fills the `ibv_mr`; releases what it took
/// on failure.
fn register(
    pd: *mut IbvPd,
    addr: *mut c_void,
    length: usize,
    access: u32,
) -> Result<*mut IbvMr, c_int> {
    let rights = access_rights(access)?;
    if addr.is_null() || length == 0 {
        return Err(libc::EINVAL);
    }
    let machine = machine().map_err(|_| libc::ENODEV)?;
    let pd = pd_for_child(pd)?;
    let made = register_in(&*machine, &pd, addr, length, rights);
    match made {
        Ok(region) => {
            let ptr = region.as_ptr();
            remember(&MRS, ptr as usize, region);
            Ok(ptr)
        }
        Err(errno) => {
            pd.children.fetch_sub(1, Ordering::AcqRel);
            Err(errno)
        }
    }
}

fn register_in(
    machine: &dyn Machine,
    pd: &Arc<ProtectionDomain>,
    addr: *mut c_void,
    length: usize,
    rights: AccessFlags,
) -> Result<Arc<MemoryRegion>, c_int> {
    let va = addr.addr() as u64;
    // SAFETY: `ibv_reg_mr`'s contract, which the program promised: the
    // buffer is its memory, mapped read-write, kept until the region is
    // deregistered, and touched only as verbs allow meanwhile; the release
    // below and in `ibv_dereg_mr` comes only after the registration is
    // gone (or was never made).
    unsafe { machine.expose_user_memory(addr.cast(), length) }?;
    // SAFETY: the same contract lets the device access the buffer as
    // `rights` allow until the region is deregistered, which
    // `ibv_dereg_mr` does before the pages are released.
    let registered = unsafe { SharedMr::register(&pd.pd, va, length as u64, rights) };
    let mr = match registered {
        Ok(mr) => mr,
        Err(error) => {
            // Nothing registered: the pages are the program's again. A
            // failed release leaves them reachable, which is harmless.
            let _ = machine.release_user_memory(va, length);
            return Err(errno_of(&error));
        }
    };
    let keys = mr.keys();
    Ok(Arc::new(MemoryRegion {
        raw: IbvMr {
            context: pd.raw.context,
            pd: pd.as_ptr(),
            addr,
            length,
            handle: truncated_handle(mr.handle()),
            lkey: keys.lkey.get(),
            rkey: keys.rkey.get(),
        },
        mr,
        pd: Arc::clone(pd),
    }))
}

/// `ibv_reg_mr(pd, addr, length, access)`: registers the program's buffer
/// (`access_rights` for `access`); NULL with `errno` on failure
/// (`EINVAL` for a PD that is not ours, NULL `addr` or zero `length`).
///
/// # Safety
///
/// rdma-core's: `addr..addr+length` is the program's memory and stays
/// allocated until the region is deregistered.
pub unsafe extern "C" fn ibv_reg_mr(
    pd: *mut IbvPd,
    addr: *mut c_void,
    length: usize,
    access: c_int,
) -> *mut IbvMr {
    // SAFETY: the caller's contract is this function's.
    unsafe { ibv_reg_mr_iova2(pd, addr, length, addr.addr() as u64, access as u32) }
}

/// `ibv_reg_mr_iova2(pd, addr, length, iova, access)`: as [`ibv_reg_mr`];
/// the region's I/O virtual address must be its address (`EOPNOTSUPP`
/// otherwise: the device addresses regions by their virtual address).
///
/// # Safety
///
/// As [`ibv_reg_mr`].
pub unsafe extern "C" fn ibv_reg_mr_iova2(
    pd: *mut IbvPd,
    addr: *mut c_void,
    length: usize,
    iova: u64,
    access: u32,
) -> *mut IbvMr {
    guard(std::ptr::null_mut(), || {
        let made = if iova == addr.addr() as u64 {
            register(pd, addr, length, access)
        } else {
            Err(libc::EOPNOTSUPP)
        };
        made.unwrap_or_else(|errno| {
            set_errno(errno);
            std::ptr::null_mut()
        })
    })
}

/// `ibv_dereg_mr(mr)`: deregisters the region (`DeregMr`), then releases
/// its pages. 0, or an errno value: `EINVAL` for a region that is not
/// ours, the access library's error (the region stays) otherwise. Pages
/// the machine cannot release (still locked: a driver defect) are
/// reported on standard error and left reachable.
///
/// # Safety
///
/// None beyond C's: the pointer is checked against the live regions.
pub unsafe extern "C" fn ibv_dereg_mr(mr: *mut IbvMr) -> c_int {
    guard(libc::EIO, || {
        let Some(region) = lock(&MRS)
            .as_mut()
            .and_then(|mrs| mrs.remove(&(mr as usize)))
        else {
            return libc::EINVAL;
        };
        if let Err(error) = region.mr.deregister() {
            remember(&MRS, mr as usize, region);
            return errno_of(&error);
        }
        let (va, len) = (region.mr.va(), region.raw.length);
        if let Ok(machine) = machine()
            && let Err(errno) = machine.release_user_memory(va, len)
        {
            eprintln!(
                "libibverbs: the pages of a deregistered region ({len} bytes at {va:#x}) stay reachable: {}",
                std::io::Error::from_raw_os_error(errno)
            );
        }
        region.pd.children.fetch_sub(1, Ordering::AcqRel);
        0
    })
}
