//! The CA's and its ports' attributes, decoded: `QueryCa`'s attribute
//! block ([`Context::query_raw`]) checked as untrusted bytes
//! (`ib_types::ca::CaAttrView`) and returned owned.

use ib_types::ca::{CaAttr, CaAttrView, PortAttr};
use ib_types::ioctl::VerbId;
use ib_types::scalars::{Gid, PKey, PortNum};

use crate::context::Context;
use crate::error::{Error, Result};

/// One port: its attributes and its tables.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PortInfo {
    /// State, MTUs, LIDs, capabilities, counters.
    pub attr: PortAttr,
    /// The GID table (index 0 first).
    pub gids: Vec<Gid>,
    /// The P_Key table.
    pub pkeys: Vec<PKey>,
}

impl Context {
    fn attr_view<T>(&self, read: impl FnOnce(CaAttrView<'_>) -> T) -> Result<T> {
        let bytes = self.query_raw()?;
        let view = CaAttrView::parse(&bytes).map_err(|error| Error::Abi {
            verb: VerbId::QueryCa,
            error,
        })?;
        Ok(read(view))
    }

    /// The CA's attributes (`QueryCa`): identity, limits, capabilities and
    /// the number of ports.
    pub fn query(&self) -> Result<CaAttr> {
        self.attr_view(|view| view.attr())
    }

    /// Port `port`'s attributes and tables (`QueryCa`, read now: a port
    /// that went down or up since shows its new state). A port the CA does
    /// not have is [`Error::InvalidArgument`].
    pub fn query_port(&self, port: PortNum) -> Result<PortInfo> {
        self.attr_view(|view| {
            view.port(port).map(|p| PortInfo {
                attr: p.attr(),
                gids: p.gids().to_vec(),
                pkeys: p.pkeys().to_vec(),
            })
        })?
        .ok_or(Error::InvalidArgument("the CA has no such port"))
    }
}
