//! Memory window binding and key invalidation (PRM 7.1, IBA 10.6.7).

use hca_prm::Le32;
use hca_prm::Le64;
use hca_prm::mpt::{MptEntry, MptKind, key_index, key_tag};
use hca_prm::wqe::{Bind, MwType};
use ib_types::access::AccessFlags;

/// Why a bind or an invalidation was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum MwError {
    /// The key names no window (or the wrong type).
    NotWindow,
    /// A type 2 window that is already bound.
    Busy,
    /// A zero-length bind of a type 2 window (IBA o10-37.2.40: a type 2
    /// window is unbound only by invalidation, never by a bind).
    ZeroLengthType2,
    /// The region key is invalid or the region lacks MW_BIND.
    BadRegion,
    /// PD mismatch between QP, window and region.
    Pd,
    /// The window is not inside the region.
    Range,
    /// Remote write or atomic on a window over a region without local write.
    Rights,
    /// Type 1 windows cannot be invalidated by a work request.
    Type1,
}

fn entry(mpts: &[MptEntry], key: u32) -> Option<(usize, &MptEntry)> {
    let i = usize::try_from(key_index(key)).ok()?;
    mpts.get(i).map(|e| (i, e))
}

/// Executes a BIND_MW WQE of a QP in `pd` with number `qpn`.
pub(crate) fn bind(mpts: &mut [MptEntry], bind: &Bind, pd: u32, qpn: u32) -> Result<(), MwError> {
    let key = bind.new_rkey.get();
    let (wi, window) = entry(mpts, key).ok_or(MwError::NotWindow)?;
    let kind = MptKind::from_code(window.kind).map_err(|_| MwError::NotWindow)?;
    let want = match bind.mw_type {
        MwType::Type1 => MptKind::WindowType1,
        MwType::Type2 => MptKind::WindowType2,
    };
    if kind != want {
        return Err(MwError::NotWindow);
    }
    if window.pd.get() != pd {
        return Err(MwError::Pd);
    }
    if kind == MptKind::WindowType2 && window.state == 1 {
        return Err(MwError::Busy);
    }
    if kind == MptKind::WindowType2 && bind.length == 0 {
        return Err(MwError::ZeroLengthType2);
    }
    let old_region = (window.state == 1).then_some(window.bound_mr.get());
    if bind.length == 0 {
        // A zero-length bind unbinds a type 1 window (type 2: refused
        // above).
        let w = &mut mpts[wi];
        w.state = 0;
        w.tag = key_tag(key);
        if let Some(r) = old_region {
            super::resource::unbind_from_region(mpts, r);
        }
        return Ok(());
    }
    let mr_key = bind.mr_key.get();
    let (ri, region) = entry(mpts, mr_key).ok_or(MwError::BadRegion)?;
    let rights = AccessFlags::from_bits_truncate(region.access.get());
    if region.kind != MptKind::Region.code()
        || region.state != 1
        || region.tag != key_tag(mr_key)
        || !rights.contains(AccessFlags::MW_BIND)
    {
        return Err(MwError::BadRegion);
    }
    if region.pd.get() != pd {
        return Err(MwError::Pd);
    }
    let end = bind.va.checked_add(bind.length).ok_or(MwError::Range)?;
    let region_end = region.start.get().saturating_add(region.length.get());
    if bind.va < region.start.get() || end > region_end {
        return Err(MwError::Range);
    }
    let needs_local_write = bind
        .access
        .intersects(AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_ATOMIC);
    if needs_local_write && !rights.contains(AccessFlags::LOCAL_WRITE) {
        return Err(MwError::Rights);
    }
    if let Some(r) = old_region {
        super::resource::unbind_from_region(mpts, r);
    }
    let w = &mut mpts[wi];
    w.state = 1;
    w.tag = key_tag(key);
    w.access = Le32::new(bind.access.bits());
    w.start = Le64::new(bind.va);
    w.length = Le64::new(bind.length);
    w.bound_mr = Le32::new(ri as u32);
    w.bound_qpn = Le32::new(if kind == MptKind::WindowType2 { qpn } else { 0 });
    let r = &mut mpts[ri];
    r.window_count = Le32::new(r.window_count.get() + 1);
    Ok(())
}

/// Invalidates `key` for a QP in `pd` (LOCAL_INV, or SEND_WITH_INV when
/// `remote`): a type 2 window goes back to free, a region becomes invalid.
pub(crate) fn invalidate(
    mpts: &mut [MptEntry],
    key: u32,
    pd: u32,
    remote: bool,
) -> Result<(), MwError> {
    let _ = remote;
    let (i, e) = entry(mpts, key).ok_or(MwError::NotWindow)?;
    if e.tag != key_tag(key) || e.state != 1 {
        return Err(MwError::NotWindow);
    }
    if e.pd.get() != pd {
        return Err(MwError::Pd);
    }
    match MptKind::from_code(e.kind).ok() {
        Some(MptKind::WindowType2) => {
            let region = e.bound_mr.get();
            let w = &mut mpts[i];
            w.state = 0;
            w.bound_qpn = Le32::new(0);
            super::resource::unbind_from_region(mpts, region);
            Ok(())
        }
        Some(MptKind::Region) if e.window_count.get() == 0 => {
            mpts[i].state = 0;
            Ok(())
        }
        Some(MptKind::Region) => Err(MwError::Busy),
        Some(MptKind::WindowType1) => Err(MwError::Type1),
        _ => Err(MwError::NotWindow),
    }
}
