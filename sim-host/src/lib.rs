//! Simulated Windows host: the PnP, power, request, IRQL, DMA, registry and
//! verifier contracts the drivers' cores rely on, enforced so they are tested
//! rather than assumed (`docs/host-model.md`).
//!
//! Status: not written yet (issue 4). The crate exists so the workspace has
//! its final shape; it exports nothing.
