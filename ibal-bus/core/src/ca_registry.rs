//! Binding the filter to an HCA and the registry of bound CAs
//! (docs/ibal-bus.md "Binding to the HCA").
//!
//! Binding takes two steps, because the ports come from a control verb
//! that completes later (`crate::ci`): [`check_version`] when the
//! interface is queried (a provider that does not satisfy
//! [`REQUIRED_CI_VERSION`] fails the filter's start with
//! [`BindError::VersionMismatch`], `STATUS_REVISION_MISMATCH`, before
//! anything is opened); then [`OpenedCa::open`] (version again, identity,
//! open with the filter's callbacks) and, once the port query answered,
//! [`OpenedCa::with_ports`], which gives the [`BoundCa`] or hands the
//! opened CA back for the shell to close at PASSIVE_LEVEL, so a failed
//! bind leaves nothing behind.
//! [`CaRegistry`] holds the bound CAs by CA GUID: any number, arriving
//! and leaving in any order; a second CA with a GUID already registered is
//! refused ([`BindError::AlreadyRegistered`]).

use alloc::collections::BTreeMap;
use alloc::sync::Arc;
use alloc::vec::Vec;
use core::fmt;

use ib_types::interface::InterfaceVersion;
use ib_types::scalars::NodeGuid;
use ib_types::status::{IbStatus, NtStatus};

use crate::ci::{CaEvents, CaIdentity, CiAccess, PortIdentity, REQUIRED_CI_VERSION};

/// `STATUS_REVISION_MISMATCH`: the interface's version is not one the
/// filter can use.
pub const STATUS_REVISION_MISMATCH: NtStatus = NtStatus::from_raw(0xC000_0059);
/// `STATUS_OBJECT_NAME_COLLISION`: a CA with that GUID is registered.
pub const STATUS_OBJECT_NAME_COLLISION: NtStatus = NtStatus::from_raw(0xC000_0035);

/// Why an HCA could not be bound or registered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BindError {
    /// The provider's version does not satisfy [`REQUIRED_CI_VERSION`].
    VersionMismatch {
        /// What the provider answered with.
        got: InterfaceVersion,
        /// What the filter needs.
        required: InterfaceVersion,
    },
    /// The identity query failed.
    Identity(IbStatus),
    /// Opening the CA failed.
    Open(IbStatus),
    /// The port query failed (the CA was closed again).
    QueryPorts(IbStatus),
    /// The CA reported no port (the CA was closed again).
    NoPorts,
    /// A CA with this GUID is already registered.
    AlreadyRegistered(NodeGuid),
}

impl BindError {
    /// The status the filter's start fails with.
    pub fn nt_status(&self) -> NtStatus {
        match self {
            Self::VersionMismatch { .. } => STATUS_REVISION_MISMATCH,
            Self::AlreadyRegistered(_) => STATUS_OBJECT_NAME_COLLISION,
            Self::NoPorts => NtStatus::INVALID_DEVICE_STATE,
            Self::Identity(status) | Self::Open(status) | Self::QueryPorts(status) => {
                status.to_ntstatus()
            }
        }
    }
}

impl fmt::Display for BindError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::VersionMismatch { got, required } => write!(
                f,
                "CI interface version {got:?} does not satisfy the required {required:?}"
            ),
            Self::Identity(s) => write!(f, "CA identity query failed: {s:?}"),
            Self::Open(s) => write!(f, "opening the CA failed: {s:?}"),
            Self::QueryPorts(s) => write!(f, "port query failed: {s:?}"),
            Self::NoPorts => write!(f, "the CA reports no port"),
            Self::AlreadyRegistered(guid) => write!(f, "CA {guid} is already registered"),
        }
    }
}

/// An HCA the filter is bound to: its interface, identity, open CA handle
/// and ports.
pub struct BoundCa<C: CiAccess> {
    ci: Arc<C>,
    identity: CaIdentity,
    ca: u64,
    ports: Vec<PortIdentity>,
}

impl<C: CiAccess> fmt::Debug for BoundCa<C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BoundCa")
            .field("identity", &self.identity)
            .field("ca", &self.ca)
            .field("ports", &self.ports)
            .finish_non_exhaustive()
    }
}

/// Whether a provider that answered at `got` can serve this filter.
pub fn check_version(got: InterfaceVersion) -> Result<(), BindError> {
    if got.satisfies(REQUIRED_CI_VERSION) {
        Ok(())
    } else {
        Err(BindError::VersionMismatch {
            got,
            required: REQUIRED_CI_VERSION,
        })
    }
}

/// A CA the filter opened and whose ports it has not learnt yet.
pub struct OpenedCa<C: CiAccess> {
    ci: Arc<C>,
    identity: CaIdentity,
    ca: u64,
}

impl<C: CiAccess> fmt::Debug for OpenedCa<C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OpenedCa")
            .field("identity", &self.identity)
            .field("ca", &self.ca)
            .finish_non_exhaustive()
    }
}

impl<C: CiAccess> OpenedCa<C> {
    /// Checks the version, reads the identity and opens the CA with
    /// `events`. DISPATCH_LEVEL or below.
    pub fn open(ci: Arc<C>, events: Arc<dyn CaEvents>) -> Result<Self, BindError> {
        check_version(ci.version())?;
        let identity = ci.identity().map_err(BindError::Identity)?;
        let ca = ci.open_ca(events).map_err(BindError::Open)?;
        Ok(Self { ci, identity, ca })
    }

    /// The interface.
    pub fn ci(&self) -> &Arc<C> {
        &self.ci
    }

    /// The CA handle (what the port query is sent on).
    pub fn ca_handle(&self) -> u64 {
        self.ca
    }

    /// The CA's identity.
    pub fn identity(&self) -> CaIdentity {
        self.identity
    }

    /// Completes the bind with the port query's result: the bound CA, or
    /// this opened CA back with why ([`BindError::QueryPorts`],
    /// [`BindError::NoPorts`]) for the caller to [`close`](Self::close).
    /// DISPATCH_LEVEL or below.
    pub fn with_ports(
        self,
        ports: Result<Vec<PortIdentity>, IbStatus>,
    ) -> Result<BoundCa<C>, (Self, BindError)> {
        match ports {
            Ok(ports) if ports.is_empty() => Err((self, BindError::NoPorts)),
            Ok(ports) => Ok(BoundCa {
                ci: self.ci,
                identity: self.identity,
                ca: self.ca,
                ports,
            }),
            Err(status) => Err((self, BindError::QueryPorts(status))),
        }
    }

    /// Closes the CA again. PASSIVE_LEVEL.
    pub fn close(self) -> Result<(), IbStatus> {
        self.ci.close_ca(self.ca)
    }
}

impl<C: CiAccess> BoundCa<C> {
    /// Closes the CA. PASSIVE_LEVEL. [`IbStatus::ResourceBusy`] while
    /// objects live on it (the access layer, not built yet, would own
    /// them).
    pub fn unbind(self) -> Result<(), IbStatus> {
        self.ci.close_ca(self.ca)
    }

    /// The interface.
    pub fn ci(&self) -> &Arc<C> {
        &self.ci
    }

    /// The CA's identity.
    pub fn identity(&self) -> CaIdentity {
        self.identity
    }

    /// The CA handle the filter opened.
    pub fn ca_handle(&self) -> u64 {
        self.ca
    }

    /// The ports, in port order.
    pub fn ports(&self) -> &[PortIdentity] {
        &self.ports
    }
}

/// The bound CAs, by CA GUID.
pub struct CaRegistry<C: CiAccess> {
    cas: BTreeMap<u64, Arc<BoundCa<C>>>,
}

impl<C: CiAccess> fmt::Debug for CaRegistry<C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.cas.keys()).finish()
    }
}

impl<C: CiAccess> Default for CaRegistry<C> {
    fn default() -> Self {
        Self {
            cas: BTreeMap::new(),
        }
    }
}

impl<C: CiAccess> CaRegistry<C> {
    /// Registers `ca`; refused (and handed back) when its GUID is
    /// registered already.
    pub fn register(&mut self, ca: Arc<BoundCa<C>>) -> Result<(), (Arc<BoundCa<C>>, BindError)> {
        let guid = ca.identity().ca_guid;
        if self.cas.contains_key(&guid.get()) {
            return Err((ca, BindError::AlreadyRegistered(guid)));
        }
        self.cas.insert(guid.get(), ca);
        Ok(())
    }

    /// Removes the CA `guid`, returning it.
    pub fn deregister(&mut self, guid: NodeGuid) -> Option<Arc<BoundCa<C>>> {
        self.cas.remove(&guid.get())
    }

    /// The CA `guid`, if registered.
    pub fn get(&self, guid: NodeGuid) -> Option<&Arc<BoundCa<C>>> {
        self.cas.get(&guid.get())
    }

    /// The registered CA GUIDs, in order.
    pub fn guids(&self) -> Vec<NodeGuid> {
        self.cas.keys().map(|g| NodeGuid::new(*g)).collect()
    }

    /// How many CAs are registered.
    pub fn len(&self) -> usize {
        self.cas.len()
    }

    /// True when none is.
    pub fn is_empty(&self) -> bool {
        self.cas.is_empty()
    }
}
