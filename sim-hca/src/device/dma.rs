//! Address translation: MTT-described buffers (rings and regions, PRM 6.0)
//! and the memory protection checks of PRM 7.1.
//!
//! Every host access the device makes goes through here and then through
//! [`HostMemory`]; a fault is returned to the caller, which decides what the
//! PRM says happens (a completion error, a failed command, a fatal error).

use hca_prm::ctx::BufDesc;
use hca_prm::mpt::{MptEntry, MptKind, key_index, key_tag, mtt_locate};
use ib_types::access::AccessFlags;

use crate::host::{CopyFault, DmaDirection, DmaFault, HostMemory};
use crate::transport::{DeferredCopy, RxData, defer_copy};

/// Why a translated access failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum XlateError {
    /// The MTT range runs past the table or holds no mapping.
    BadMtt,
    /// The host refused the access.
    Fault(DmaFault),
    /// Direct placement: the host refused to read the sender's memory
    /// (the source, not this buffer).
    Source(DmaFault),
}

impl From<DmaFault> for XlateError {
    fn from(f: DmaFault) -> Self {
        Self::Fault(f)
    }
}

/// An MTT-described byte range: the first MTT entry, the offset into the
/// first page and the page size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct MttRange {
    pub mtt_index: u32,
    pub page_offset: u32,
    pub log_page_size: u8,
}

impl MttRange {
    pub(crate) fn of_ring(desc: &BufDesc) -> Self {
        Self {
            mtt_index: desc.mtt_index.get(),
            page_offset: desc.page_offset.get(),
            log_page_size: desc.log_page_size,
        }
    }

    pub(crate) fn of_region(mpt: &MptEntry) -> Self {
        Self {
            mtt_index: mpt.mtt_index.get(),
            page_offset: mpt.page_offset.get(),
            log_page_size: mpt.log_page_size,
        }
    }
}

/// The MTT as the device caches it (software writes it only through
/// `WRITE_MTT`, which writes through to the table in host memory).
#[derive(Debug, Default)]
pub(crate) struct Mtt {
    pub entries: Vec<u64>,
}

impl Mtt {
    /// Calls `f(bus_address, chunk_range)` for each page-contiguous piece of
    /// `offset..offset+len` of the buffer, in order.
    fn for_each_piece(
        &self,
        range: MttRange,
        offset: u64,
        len: usize,
        mut f: impl FnMut(u64, core::ops::Range<usize>) -> Result<(), XlateError>,
    ) -> Result<(), XlateError> {
        let page = 1u64 << range.log_page_size;
        let mut done = 0usize;
        while done < len {
            let (page_no, in_page) =
                mtt_locate(range.page_offset, range.log_page_size, offset + done as u64)
                    .ok_or(XlateError::BadMtt)?;
            let entry = u64::from(range.mtt_index)
                .checked_add(page_no)
                .and_then(|i| usize::try_from(i).ok())
                .and_then(|i| self.entries.get(i))
                .ok_or(XlateError::BadMtt)?;
            let chunk = usize::try_from(page - in_page)
                .unwrap_or(usize::MAX)
                .min(len - done);
            f(entry + in_page, done..done + chunk)?;
            done += chunk;
        }
        Ok(())
    }

    /// Reads `buf.len()` bytes at `offset` of the buffer.
    pub(crate) fn read(
        &self,
        mem: &dyn HostMemory,
        range: MttRange,
        offset: u64,
        buf: &mut [u8],
    ) -> Result<(), XlateError> {
        let len = buf.len();
        self.for_each_piece(range, offset, len, |bus, r| Ok(mem.read(bus, &mut buf[r])?))
    }

    /// Appends the bus address pieces of `len` bytes at `offset` of the
    /// buffer to `pieces`, touching no memory (direct placement reads them
    /// later).
    pub(crate) fn locate(
        &self,
        range: MttRange,
        offset: u64,
        len: usize,
        pieces: &mut Vec<(u64, usize)>,
    ) -> Result<(), XlateError> {
        self.for_each_piece(range, offset, len, |bus, r| {
            pieces.push((bus, r.len()));
            Ok(())
        })
    }

    /// Places bytes `skip..skip + len` of a received payload at `offset`
    /// of the buffer: written from bytes in hand, or copied straight from
    /// the sender's memory (direct placement: one read, one write).
    pub(crate) fn place(
        &self,
        mem: &dyn HostMemory,
        range: MttRange,
        offset: u64,
        data: &RxData<'_>,
        skip: usize,
        len: usize,
    ) -> Result<(), XlateError> {
        match data {
            RxData::Bytes(bytes) => self.write(mem, range, offset, &bytes[skip..skip + len]),
            RxData::InMemory(span) => self.for_each_piece(range, offset, len, |to, r| {
                // Deferred: the destination is probed now, so a fault is
                // found at this packet, as a write would find it.
                if let Some(defer) = span.defer
                    && let Some(probe) = mem.probe(&[(to, r.len())], DmaDirection::Write)
                {
                    probe.map_err(|(_, f)| XlateError::Fault(f))?;
                    let mut copies = defer.borrow_mut();
                    return span.for_each_piece(skip + r.start, r.len(), |from, at, n| {
                        defer_copy(
                            &mut copies,
                            DeferredCopy {
                                from,
                                to: to + at as u64,
                                len: n,
                                packet: span.packet,
                            },
                        );
                        Ok(())
                    });
                }
                span.for_each_piece(skip + r.start, r.len(), |from, at, n| {
                    span.mem
                        .copy_to(from, mem, to + at as u64, n)
                        .map_err(|fault| match fault {
                            CopyFault::Source(f) => XlateError::Source(f),
                            CopyFault::Destination(f) => XlateError::Fault(f),
                        })
                })
            }),
        }
    }

    /// Writes `data` at `offset` of the buffer.
    pub(crate) fn write(
        &self,
        mem: &dyn HostMemory,
        range: MttRange,
        offset: u64,
        data: &[u8],
    ) -> Result<(), XlateError> {
        self.for_each_piece(range, offset, data.len(), |bus, r| {
            Ok(mem.write(bus, &data[r])?)
        })
    }
}

/// Why a memory key check failed (PRM 7.1).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum KeyError {
    /// No live region or window with that index and tag.
    InvalidKey,
    /// The entry's PD is not the QP's.
    PdMismatch,
    /// The access right is missing.
    Access,
    /// The range is outside the region or window.
    Range,
    /// A type 2 window bound to another QP.
    WrongQp,
}

/// What an access needs from a key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Need {
    /// Local read (gather for a send or write).
    LocalRead,
    /// Local write (scatter for a receive, read response or atomic).
    LocalWrite,
    /// Remote RDMA write.
    RemoteWrite,
    /// Remote RDMA read.
    RemoteRead,
    /// Remote atomic.
    RemoteAtomic,
}

impl Need {
    fn right(self) -> AccessFlags {
        match self {
            Self::LocalRead => AccessFlags::empty(),
            Self::LocalWrite => AccessFlags::LOCAL_WRITE,
            Self::RemoteWrite => AccessFlags::REMOTE_WRITE,
            Self::RemoteRead => AccessFlags::REMOTE_READ,
            Self::RemoteAtomic => AccessFlags::REMOTE_ATOMIC,
        }
    }

    fn is_remote(self) -> bool {
        matches!(
            self,
            Self::RemoteWrite | Self::RemoteRead | Self::RemoteAtomic
        )
    }
}

/// A checked access: the region to translate through and the offset of the
/// access from the region's start.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Grant {
    pub range: MttRange,
    pub offset: u64,
}

/// Checks `key` for an access of `len` bytes at virtual address `va` by a QP
/// in `pd` (and, for type 2 windows, QP number `qpn`). Windows resolve to
/// the region they are bound in.
pub(crate) fn check_key(
    mpts: &[MptEntry],
    key: u32,
    pd: u32,
    qpn: u32,
    va: u64,
    len: u64,
    need: Need,
) -> Result<Grant, KeyError> {
    let entry = usize::try_from(key_index(key))
        .ok()
        .and_then(|i| mpts.get(i))
        .ok_or(KeyError::InvalidKey)?;
    if entry.state != 1 || entry.tag != key_tag(key) {
        return Err(KeyError::InvalidKey);
    }
    let kind = MptKind::from_code(entry.kind).map_err(|_| KeyError::InvalidKey)?;
    // Local access goes through regions only; remote access through regions
    // and bound windows.
    let region = match kind {
        MptKind::Free => return Err(KeyError::InvalidKey),
        MptKind::Region => entry,
        MptKind::WindowType1 | MptKind::WindowType2 if need.is_remote() => {
            if kind == MptKind::WindowType2 && entry.bound_qpn.get() != qpn {
                return Err(KeyError::WrongQp);
            }
            usize::try_from(entry.bound_mr.get())
                .ok()
                .and_then(|i| mpts.get(i))
                .filter(|r| r.kind == MptKind::Region.code() && r.state == 1)
                .ok_or(KeyError::InvalidKey)?
        }
        MptKind::WindowType1 | MptKind::WindowType2 => return Err(KeyError::InvalidKey),
    };
    if entry.pd.get() != pd {
        return Err(KeyError::PdMismatch);
    }
    let rights = AccessFlags::from_bits_truncate(entry.access.get());
    if !rights.contains(need.right()) {
        return Err(KeyError::Access);
    }
    let start = entry.start.get();
    let end = start
        .checked_add(entry.length.get())
        .ok_or(KeyError::Range)?;
    let access_end = va.checked_add(len).ok_or(KeyError::Range)?;
    if va < start || access_end > end {
        return Err(KeyError::Range);
    }
    Ok(Grant {
        range: MttRange::of_region(region),
        offset: va - region.start.get(),
    })
}
