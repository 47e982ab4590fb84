//! The property of the UVP private data records (`hca_prm::uverbs`, PRM
//! 13) under hostile bytes, shared by the bounded property test
//! (`tests/fuzz_uvp_private.rs`) and the `uvp_private` cargo-fuzz target,
//! which includes this file by path.
//!
//! Every record's `parse` is tried on the bytes. Whatever parses re-emits
//! to exactly the same bytes, and the ranges the kernel would pin satisfy
//! the module's contract: non-empty, aligned (rings on 64 bytes, doorbell
//! records on 4), not wrapping the address space, pairwise disjoint, and
//! ring lengths exactly what the logarithms say.

use hca_prm::uverbs::*;
use zerocopy::IntoBytes;

/// Checks the property on one input; panics on a violation. Returns how
/// many records parsed the bytes.
pub(crate) fn check(bytes: &[u8]) -> usize {
    let mut parsed = 0;
    if let Ok(r) = OpenCaPriv::parse(bytes) {
        assert_eq!(r.emit().as_bytes(), bytes, "OpenCaPriv re-emits");
        assert_ne!(r.uar_index, 0, "never the kernel's UAR page");
        parsed += 1;
    }
    if let Ok(r) = CreateCqPriv::parse(bytes) {
        assert_eq!(r.emit().as_bytes(), bytes, "CreateCqPriv re-emits");
        ring(&r.ring, 5 + u32::from(r.log_entries));
        dbr(&r.dbr);
        disjoint(&[r.ring, r.dbr]);
        parsed += 1;
    }
    if let Ok(r) = CreateCqPrivOut::parse(bytes) {
        assert_eq!(r.emit().as_bytes(), bytes, "CreateCqPrivOut re-emits");
        parsed += 1;
    }
    if let Ok(r) = ResizeCqPriv::parse(bytes) {
        assert_eq!(r.emit().as_bytes(), bytes, "ResizeCqPriv re-emits");
        ring(&r.ring, 5 + u32::from(r.log_entries));
        parsed += 1;
    }
    if let Ok(r) = CreateQpPriv::parse(bytes) {
        assert_eq!(r.emit().as_bytes(), bytes, "CreateQpPriv re-emits");
        ring(&r.sq, 6 + u32::from(r.sq_log_bbs));
        assert!(r.log_wqe_bbs <= r.sq_log_bbs, "a WQE fits its ring");
        if let Some(rq) = r.rq {
            ring(
                &rq.ring,
                u32::from(rq.log_entries) + u32::from(rq.log_stride),
            );
            assert!(rq.log_stride >= 5, "receive stride of at least 32 bytes");
            dbr(&rq.dbr);
            disjoint(&[r.sq, rq.ring, rq.dbr]);
        }
        parsed += 1;
    }
    if let Ok(r) = CreateQpPrivOut::parse(bytes) {
        assert_eq!(r.emit().as_bytes(), bytes, "CreateQpPrivOut re-emits");
        parsed += 1;
    }
    if let Ok(r) = CreateSrqPriv::parse(bytes) {
        assert_eq!(r.emit().as_bytes(), bytes, "CreateSrqPriv re-emits");
        ring(&r.ring, u32::from(r.log_entries) + u32::from(r.log_stride));
        assert!(r.log_stride >= 5, "receive stride of at least 32 bytes");
        dbr(&r.dbr);
        disjoint(&[r.ring, r.dbr]);
        parsed += 1;
    }
    if let Ok(r) = CreateSrqPrivOut::parse(bytes) {
        assert_eq!(r.emit().as_bytes(), bytes, "CreateSrqPrivOut re-emits");
        parsed += 1;
    }
    parsed
}

/// Non-empty and not wrapping.
fn range(r: &UserRange) {
    assert!(r.va != 0 && r.len != 0, "{r:?} is empty or at 0");
    assert!(r.va.checked_add(r.len).is_some(), "{r:?} wraps");
}

/// A ring of exactly `2^log_bytes` bytes (within the largest ring),
/// 64-byte aligned.
fn ring(r: &UserRange, log_bytes: u32) {
    range(r);
    assert!(
        log_bytes <= u32::from(MAX_LOG_RING_BYTES),
        "{r:?}: 2^{log_bytes}"
    );
    assert_eq!(r.len, 1 << log_bytes, "{r:?}: ring length");
    assert_eq!(r.va % RING_ALIGN, 0, "{r:?}: ring alignment");
}

/// A doorbell record.
fn dbr(r: &UserRange) {
    range(r);
    assert_eq!(r.len, DBR_BYTES, "{r:?}: record length");
    assert_eq!(r.va % DBR_ALIGN, 0, "{r:?}: record alignment");
}

fn disjoint(ranges: &[UserRange]) {
    for (i, a) in ranges.iter().enumerate() {
        for b in &ranges[i + 1..] {
            assert!(!a.overlaps(b), "{a:?} overlaps {b:?}");
        }
    }
}

/// Valid records made by the constructors and emitters: seeds for the
/// fuzzer's corpus and the property test's mutations.
pub(crate) fn seeds() -> Vec<Vec<u8>> {
    const PAGE: u64 = 0x1000;
    let cq = CreateCqPriv::new(6, 0x10 * PAGE, 0x20 * PAGE + 0x40).expect("valid CQ record");
    let resize = ResizeCqPriv::new(8, 0x30 * PAGE).expect("valid resize record");
    let qp = CreateQpPriv::new(6, 1, 0x40 * PAGE, Some((6, 6, 0x50 * PAGE, 0x60 * PAGE)))
        .expect("valid QP record");
    let qp_on_srq = CreateQpPriv::new(4, 0, 0x40 * PAGE, None).expect("valid SRQ-QP record");
    let srq = CreateSrqPriv::new(6, 6, 0x70 * PAGE, 0x80 * PAGE).expect("valid SRQ record");
    vec![
        cq.emit().as_bytes().to_vec(),
        resize.emit().as_bytes().to_vec(),
        qp.emit().as_bytes().to_vec(),
        qp_on_srq.emit().as_bytes().to_vec(),
        srq.emit().as_bytes().to_vec(),
        CreateCqPrivOut {
            cqn: 7,
            log_entries: 6,
        }
        .emit()
        .as_bytes()
        .to_vec(),
        CreateQpPrivOut {
            qpn: 9,
            uar_index: 3,
        }
        .emit()
        .as_bytes()
        .to_vec(),
        CreateSrqPrivOut { srqn: 2 }.emit().as_bytes().to_vec(),
    ]
}
