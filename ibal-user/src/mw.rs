//! Memory windows (guide 7.2): allocated, queried and deallocated through
//! the proxy (`AllocMw`, `QueryMw`, `DeallocMw`); bound by a work request
//! on a QP of the window's PD, which the plugin writes into the send ring
//! like any other (the request surface has no Bind MW verb: the kernel's
//! part is the window's entry, the device checks the bind). Both types
//! bind this way (PRM 7.1, 10.2): the plugin recorded the window's type at
//! `AllocMw` and its bind segment carries it.

use std::marker::PhantomData;

use ib_types::access::AccessFlags;
use ib_types::handle::MwHandle;
use ib_types::ioctl::{self as v, Empty, QueryMwOut};
use ib_types::mr::{MwAttr, MwType};
use ib_types::uvp::UserSend;
use ib_types::wr::{MwBind, RKey, SendFlags, SendOp, SendWr};

use crate::error::{Error, Result};
use crate::verbs::{Mr, Pd, Qp};

/// The next R_Key of a window: the same index, the consumer-owned low
/// byte incremented (IBA 10.6.7.2.2: the key changes on every bind, so a
/// peer holding the old one is refused; rdma-core's `ibv_inc_rkey`).
fn next_rkey(rkey: RKey) -> RKey {
    RKey::new(rkey.index() << 8 | u32::from(rkey.tag().wrapping_add(1)))
}

/// A memory window of a PD. `'mr` is the lifetime of every region it was
/// bound to: the borrow checker keeps those regions registered until the
/// window is gone (the device refuses to deregister a region a window is
/// bound in). `Send + Sync`: its calls are the proxy's; a bind takes
/// `&mut` of the window and of the QP it is posted on.
///
/// ```no_run
/// # use ib_types::{access::AccessFlags, mr::MwType};
/// # use ibal_user::{Buffer, Mr, Mw, Pd, Qp};
/// fn window(pd: &Pd<'_>, qp: &mut Qp<'_, '_>, buf: &Buffer<'_>) -> ibal_user::Result<()> {
///     let mr = Mr::new(pd, buf, AccessFlags::LOCAL_WRITE | AccessFlags::MW_BIND)?;
///     let mut mw = Mw::new(pd, MwType::Type2)?;
///     mw.bind(qp, 1, &mr, 0, 64, AccessFlags::REMOTE_READ)?;
///     drop(mw);
///     drop(mr);
///     Ok(())
/// }
/// ```
///
/// The region cannot go first:
///
/// ```compile_fail,E0505
/// # use ib_types::{access::AccessFlags, mr::MwType};
/// # use ibal_user::{Buffer, Mr, Mw, Pd, Qp};
/// fn window(pd: &Pd<'_>, qp: &mut Qp<'_, '_>, buf: &Buffer<'_>) -> ibal_user::Result<()> {
///     let mr = Mr::new(pd, buf, AccessFlags::LOCAL_WRITE | AccessFlags::MW_BIND)?;
///     let mut mw = Mw::new(pd, MwType::Type2)?;
///     mw.bind(qp, 1, &mr, 0, 64, AccessFlags::REMOTE_READ)?;
///     drop(mr);
///     drop(mw);
///     Ok(())
/// }
/// ```
#[derive(Debug)]
pub struct Mw<'pd, 'mr> {
    pd: &'pd Pd<'pd>,
    handle: u64,
    mw_type: MwType,
    rkey: RKey,
    _regions: PhantomData<&'mr ()>,
}

impl<'pd, 'mr> Mw<'pd, 'mr> {
    /// Allocates a window of `mw_type` in `pd` (`AllocMw`): unbound, its
    /// first R_Key names no memory yet.
    pub fn new(pd: &'pd Pd<'pd>, mw_type: MwType) -> Result<Self> {
        let input = MwAttr {
            mw_type,
            rkey: RKey::new(0),
        };
        let answer = pd.context().call::<v::AllocMw>(pd.handle(), &input)?;
        Ok(Self {
            pd,
            handle: answer.handle,
            mw_type,
            rkey: answer.output.rkey,
            _regions: PhantomData,
        })
    }

    /// The window handle.
    pub fn handle(&self) -> u64 {
        self.handle
    }

    /// Its type.
    pub fn mw_type(&self) -> MwType {
        self.mw_type
    }

    /// The R_Key of the last bind posted (the first key before any): what
    /// a peer names once that bind completed successfully.
    pub fn rkey(&self) -> RKey {
        self.rkey
    }

    /// Its PD and type and the R_Key the device holds (`QueryMw`): the key
    /// of the last bind the device executed.
    pub fn query(&self) -> Result<QueryMwOut> {
        Ok(self
            .pd
            .context()
            .call::<v::QueryMw>(self.handle, &Empty)?
            .output)
    }

    /// Binds the window to `len` bytes of `mr` from `offset`, with the
    /// remote rights `access`, by a bind work request `wr_id` posted on
    /// `qp` in user mode (always signaled): returns the window's new
    /// R_Key, valid once that request completes successfully (else the
    /// completion is `MwBindErr` and the device keeps the old binding). A
    /// type 2 window is bound to `qp`: only requests arriving on it may use
    /// the key, and it must be invalidated
    /// ([`invalidate`](Self::invalidate)) before it is bound again. A type
    /// 1 window is bound in any state (a new bind replaces the old one, the
    /// old key then refused) and any QP of the PD may use its key; it is
    /// unbound when deallocated.
    ///
    /// Refused before any post: a QP or region of another PD, a range
    /// outside the region, and a zero length (which would not unbind a
    /// type 2 window; this API does not offer a type 1 window's
    /// zero-length unbind).
    pub fn bind(
        &mut self,
        qp: &mut Qp<'_, '_>,
        wr_id: u64,
        mr: &'mr Mr<'_, '_>,
        offset: u64,
        len: u64,
        access: AccessFlags,
    ) -> Result<RKey> {
        if !std::ptr::eq(qp.pd(), self.pd) || !std::ptr::eq(mr.pd(), self.pd) {
            return Err(Error::InvalidArgument(
                "the QP and the region must be of the window's PD",
            ));
        }
        match offset.checked_add(len) {
            Some(end) if len > 0 && end <= mr.len() => {}
            _ => {
                return Err(Error::InvalidArgument(
                    "a bind of no bytes or past the end of the region",
                ));
            }
        }
        let rkey = next_rkey(self.rkey);
        let send = UserSend {
            wr: SendWr {
                wr_id,
                op: SendOp::BindMw {
                    mw: MwHandle::from_raw(self.handle),
                    rkey,
                    bind: MwBind {
                        mr_lkey: mr.keys().lkey,
                        addr: mr.va() + offset,
                        length: len,
                        access,
                    },
                },
                flags: SendFlags::SIGNALED,
                sg_list: &[],
                ud: None,
            },
            inline: None,
        };
        qp.post_send(&[send])?;
        self.rkey = rkey;
        Ok(rkey)
    }

    /// Ends a type 2 window's binding with a local invalidate `wr_id`
    /// posted on `qp` in user mode (always signaled); the window is free
    /// again once it completes. A type 1 window is unbound by the device
    /// at deallocation, never by an invalidate
    /// ([`Error::InvalidArgument`]).
    pub fn invalidate(&mut self, qp: &mut Qp<'_, '_>, wr_id: u64) -> Result<()> {
        if self.mw_type == MwType::Type1 {
            return Err(Error::InvalidArgument(
                "a type 1 window cannot be invalidated",
            ));
        }
        let send = UserSend {
            wr: SendWr {
                wr_id,
                op: SendOp::LocalInvalidate { rkey: self.rkey },
                flags: SendFlags::SIGNALED,
                sg_list: &[],
                ud: None,
            },
            inline: None,
        };
        qp.post_send(&[send])?;
        Ok(())
    }
}

impl Drop for Mw<'_, '_> {
    fn drop(&mut self) {
        // The device unbinds a bound window from its region first.
        let _ = self.pd.context().call::<v::DeallocMw>(self.handle, &Empty);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_next_key_keeps_the_index_and_wraps_the_low_byte() {
        assert_eq!(next_rkey(RKey::new(0x1234_5601)).get(), 0x1234_5602);
        assert_eq!(next_rkey(RKey::new(0x1234_56FF)).get(), 0x1234_5600);
    }
}
