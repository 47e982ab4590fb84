//! The verbs objects for callers that cannot hold borrows: a C library's
//! objects (`ibverbs-compat`, our `libibverbs.so.1`), which a program
//! holds by pointer and frees in whatever order it likes. Each owns what
//! it depends on through an [`Arc`] (a region its PD, a PD its context)
//! instead of borrowing it, and is destroyed explicitly with the verb's
//! answer ([`SharedPd::dealloc`], [`SharedMr::deregister`]), so a refused
//! destroy loses nothing, or, if never destroyed, when its last owner
//! drops it. A region covers any range of the process's memory, not only
//! a [`Buffer`](crate::Buffer): the program's own. An address vector
//! ([`SharedAv`]) is kept by the plugin in user mode, as [`crate::Av`].

use std::sync::{Arc, Mutex, PoisonError};

use ib_types::access::AccessFlags;
use ib_types::av::AvAttr;
use ib_types::handle::AvHandle;
use ib_types::ioctl::{self as v, Empty, QueryAvOut};
use ib_types::mr::{MrKeys, MrQuery, MrRegister};

use crate::context::Context;
use crate::error::{Error, Result};

/// Whether the object still exists in the kernel, held while it is being
/// destroyed so that two destroys never both reach the kernel.
#[derive(Debug)]
struct Alive(Mutex<bool>);

impl Alive {
    fn new() -> Self {
        Self(Mutex::new(true))
    }

    /// Runs `destroy` if the object is alive; it is dead once `destroy`
    /// succeeds. A second destroy is an invalid argument.
    fn destroy(&self, destroy: impl FnOnce() -> Result<()>) -> Result<()> {
        let mut alive = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        if !*alive {
            return Err(Error::InvalidArgument("already destroyed"));
        }
        destroy()?;
        *alive = false;
        Ok(())
    }
}

/// A protection domain owning its context. `Send + Sync`.
#[derive(Debug)]
pub struct SharedPd {
    ctx: Arc<Context>,
    handle: u64,
    alive: Alive,
}

impl SharedPd {
    /// Allocates a PD (`AllocPd`).
    pub fn new(ctx: Arc<Context>) -> Result<Self> {
        let answer = ctx.call::<v::AllocPd>(ctx.ca, &Empty)?;
        Ok(Self {
            ctx,
            handle: answer.handle,
            alive: Alive::new(),
        })
    }

    /// The PD handle.
    pub fn handle(&self) -> u64 {
        self.handle
    }

    /// The context.
    pub fn context(&self) -> &Arc<Context> {
        &self.ctx
    }

    /// Deallocates it (`DeallocPd`); refused (the PD stays) with the
    /// kernel's answer, e.g. while regions or QPs use it.
    pub fn dealloc(&self) -> Result<()> {
        self.alive.destroy(|| {
            self.ctx.call::<v::DeallocPd>(self.handle, &Empty)?;
            Ok(())
        })
    }
}

impl Drop for SharedPd {
    fn drop(&mut self) {
        let _ = self.dealloc();
    }
}

/// A registered region over a range of the process's memory, owning its
/// PD. `Send + Sync`.
#[derive(Debug)]
pub struct SharedMr {
    pd: Arc<SharedPd>,
    handle: u64,
    keys: MrKeys,
    va: u64,
    len: u64,
    alive: Alive,
}

impl SharedMr {
    /// Registers `len` bytes at `va` of this process with `access`
    /// (`RegMr`): the kernel locks the pages and the device may access
    /// them as `access` allows until the region is deregistered.
    ///
    /// # Safety
    /// `va..va+len` is memory of this process that the caller lets the
    /// device read, and write as `access` allows, from now until the
    /// region is deregistered (or dropped): nothing else relies on its
    /// contents while a work request may touch them, and it stays
    /// allocated as long as the region exists.
    pub unsafe fn register(
        pd: &Arc<SharedPd>,
        va: u64,
        len: u64,
        access: AccessFlags,
    ) -> Result<Self> {
        if len == 0 {
            return Err(Error::InvalidArgument("an empty region"));
        }
        let input = MrRegister {
            vaddr: va,
            length: len,
            access,
        };
        let answer = pd.ctx.call::<v::RegMr>(pd.handle, &input)?;
        Ok(Self {
            pd: Arc::clone(pd),
            handle: answer.handle,
            keys: answer.output,
            va,
            len,
            alive: Alive::new(),
        })
    }

    /// Its PD.
    pub fn pd(&self) -> &Arc<SharedPd> {
        &self.pd
    }

    /// The address of its first byte.
    pub fn va(&self) -> u64 {
        self.va
    }

    /// Its length in bytes (never zero).
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Always false (a region has at least one byte).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The region handle.
    pub fn handle(&self) -> u64 {
        self.handle
    }

    /// Its L_Key and R_Key.
    pub fn keys(&self) -> MrKeys {
        self.keys
    }

    /// Its PD, range, rights and keys, from the kernel (`QueryMr`).
    pub fn query(&self) -> Result<MrQuery> {
        Ok(self.pd.ctx.call::<v::QueryMr>(self.handle, &Empty)?.output)
    }

    /// Deregisters it (`DeregMr`); refused (the region stays) with the
    /// kernel's answer, e.g. while a memory window is bound to it. The
    /// pages are the process's own again once this succeeds.
    pub fn deregister(&self) -> Result<()> {
        self.alive.destroy(|| {
            self.pd.ctx.call::<v::DeregMr>(self.handle, &Empty)?;
            Ok(())
        })
    }
}

impl Drop for SharedMr {
    fn drop(&mut self) {
        let _ = self.deregister();
    }
}

/// An address vector of a PD, owning its PD; kept by the plugin in user
/// mode (no kernel request), as [`crate::Av`]. `Send + Sync`.
#[derive(Debug)]
pub struct SharedAv {
    pd: Arc<SharedPd>,
    handle: u64,
    alive: Alive,
}

impl SharedAv {
    /// Creates an AV in `pd` (`CreateAv`, finished by the plugin). Needs
    /// the plugin.
    pub fn new(pd: &Arc<SharedPd>, attr: &AvAttr) -> Result<Self> {
        pd.ctx.plugin("CreateAv")?;
        let answer = pd.ctx.call::<v::CreateAv>(pd.handle, attr)?;
        Ok(Self {
            pd: Arc::clone(pd),
            handle: answer.handle,
            alive: Alive::new(),
        })
    }

    /// Its PD.
    pub fn pd(&self) -> &Arc<SharedPd> {
        &self.pd
    }

    /// The AV handle, which a UD send's destination names.
    pub fn handle(&self) -> AvHandle {
        AvHandle::from_raw(self.handle)
    }

    /// Its PD and attributes (`QueryAv`).
    pub fn query(&self) -> Result<QueryAvOut> {
        Ok(self.pd.ctx.call::<v::QueryAv>(self.handle, &Empty)?.output)
    }

    /// Destroys it (`DestroyAv`); refused (the AV stays) with the
    /// plugin's answer.
    pub fn destroy(&self) -> Result<()> {
        self.alive.destroy(|| {
            self.pd.ctx.call::<v::DestroyAv>(self.handle, &Empty)?;
            Ok(())
        })
    }
}

impl Drop for SharedAv {
    fn drop(&mut self) {
        let _ = self.destroy();
    }
}
