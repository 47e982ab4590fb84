//! One accessor for every object table in [`Objects`]: find a live object
//! behind a client's raw handle (generation-checked, the CA visible to the
//! requestor), and take or drop a use of it. Each kind says where its table
//! is and, for counted kinds, whether an object may take a new use now;
//! a bad handle gets the kind's own invalid-handle status.

use alloc::sync::Arc;

use driver_platform::{Platform, RequestorMode};
use ib_types::status::IbStatus;

use super::{Objects, cq, qp, srq};
use crate::hca::Hca;
use crate::resources::{Handle, ObjectKind, ObjectTable, kind};

/// An object kind whose table lives in [`Objects`].
pub(crate) trait Tabled<P: Platform>: ObjectKind + Sized {
    /// What the table holds (cheap to clone: an `Arc` or a plain value).
    type Object: Clone;
    /// The kind's table.
    fn table(o: &Objects<P>) -> &ObjectTable<Self, Self::Object>;
}

/// A kind whose objects count the uses other objects hold of them.
pub(crate) trait Counted<P: Platform>: Tabled<P> {
    /// The kind's table, to count uses in.
    fn table_mut(o: &mut Objects<P>) -> &mut ObjectTable<Self, Self::Object>;
    /// Whether the object may take a new use now (not being created,
    /// resized or destroyed).
    fn takes_uses(_object: &Self::Object) -> bool {
        true
    }
}

impl<P: Platform> Tabled<P> for kind::Pd {
    type Object = super::pd::Pd;
    fn table(o: &Objects<P>) -> &ObjectTable<Self, Self::Object> {
        &o.pds
    }
}

impl<P: Platform> Counted<P> for kind::Pd {
    fn table_mut(o: &mut Objects<P>) -> &mut ObjectTable<Self, Self::Object> {
        &mut o.pds
    }
}

impl<P: Platform> Tabled<P> for kind::Cq {
    type Object = Arc<cq::Cq<P>>;
    fn table(o: &Objects<P>) -> &ObjectTable<Self, Self::Object> {
        &o.cqs
    }
}

impl<P: Platform> Counted<P> for kind::Cq {
    fn table_mut(o: &mut Objects<P>) -> &mut ObjectTable<Self, Self::Object> {
        &mut o.cqs
    }
    fn takes_uses(object: &Self::Object) -> bool {
        object.ring.lock().life == cq::Life::Live
    }
}

impl<P: Platform> Tabled<P> for kind::Srq {
    type Object = Arc<srq::Srq<P>>;
    fn table(o: &Objects<P>) -> &ObjectTable<Self, Self::Object> {
        &o.srqs
    }
}

impl<P: Platform> Counted<P> for kind::Srq {
    fn table_mut(o: &mut Objects<P>) -> &mut ObjectTable<Self, Self::Object> {
        &mut o.srqs
    }
    fn takes_uses(object: &Self::Object) -> bool {
        object.ring.lock().life == srq::Life::Live
    }
}

impl<P: Platform> Tabled<P> for kind::Av {
    type Object = super::av::Av;
    fn table(o: &Objects<P>) -> &ObjectTable<Self, Self::Object> {
        &o.avs
    }
}

impl<P: Platform> Tabled<P> for kind::Qp {
    type Object = Arc<qp::Qp<P>>;
    fn table(o: &Objects<P>) -> &ObjectTable<Self, Self::Object> {
        o.qps.objects()
    }
}

impl<P: Platform> Hca<P> {
    /// The live object behind a raw handle, for a request of `mode`; the
    /// kind's invalid-handle status for a stale, foreign-kind or
    /// invisible one.
    pub(crate) fn find_object<K: Tabled<P>>(
        &self,
        raw: u64,
        mode: RequestorMode,
    ) -> Result<K::Object, IbStatus> {
        let invalid = K::KIND.invalid_handle_status();
        self.with_objects(|o| {
            if !Self::ca_visible(o, mode) {
                return Err(invalid);
            }
            K::table(o)
                .get(Handle::<K>::from_raw(raw))
                .cloned()
                .ok_or(invalid)
        })?
    }

    /// Records a use of the object behind `raw` (its destroy is refused
    /// while uses are outstanding); returns the new use count. The kind's
    /// invalid-handle status for a stale handle, [`IbStatus::InvalidState`]
    /// for an object that takes no use now.
    pub(crate) fn reference_object<K: Counted<P>>(&self, raw: u64) -> Result<u32, IbStatus> {
        self.with_objects_mut(|o| {
            let handle = Handle::<K>::from_raw(raw);
            let object = K::table(o)
                .get(handle)
                .ok_or(K::KIND.invalid_handle_status())?;
            if !K::takes_uses(object) {
                return Err(IbStatus::InvalidState);
            }
            K::table_mut(o).acquire(handle).map_err(IbStatus::from)
        })?
    }

    /// Drops a use recorded by [`reference_object`](Self::reference_object);
    /// returns the new use count.
    pub(crate) fn release_object<K: Counted<P>>(&self, raw: u64) -> Result<u32, IbStatus> {
        self.with_objects_mut(|o| {
            K::table_mut(o)
                .release(Handle::<K>::from_raw(raw))
                .map_err(IbStatus::from)
        })?
    }
}
