//! The property of the work queue entries the device (and, for user QPs,
//! the kernel) reads from memory a process wrote (`hca_prm::wqe`, PRM
//! 10.2 and 10.3). Shared by the bounded property test
//! (`tests/fuzz_wqe.rs`) and the `wqe` cargo-fuzz target, which includes
//! this file by path.
//!
//! The first byte picks the QP's transport and whether the rest is a send
//! or a receive WQE; the index the parser expects is taken from the WQE's
//! own index field, so parsing gets past the first check. A send WQE that
//! parses re-emits to exactly the bytes it was parsed from (its `size16`
//! segments) and passes its own shape check; a receive WQE that parses
//! re-emits, into a stride of its own size, the same header and scatter
//! list.

use hca_prm::wqe::{MIN_RECV_STRIDE, RecvWqe, SendWqe, recv_sges_per_stride};
use ib_types::wr::Transport;

/// Checks the property on one input; panics on a violation. Returns
/// whether the WQE parsed.
pub(crate) fn check(data: &[u8]) -> bool {
    let Some((&selector, bytes)) = data.split_first() else {
        return false;
    };
    let transport = Transport::ALL[usize::from(selector & 3) % Transport::ALL.len()];
    if selector & 4 == 0 {
        send(bytes, transport)
    } else {
        recv(bytes)
    }
}

fn send(bytes: &[u8], transport: Transport) -> bool {
    let index = bytes
        .get(4..6)
        .map_or(0, |b| u16::from_le_bytes([b[0], b[1]]));
    let Ok(wqe) = SendWqe::parse(bytes, index, transport) else {
        return false;
    };
    let len = wqe.byte_len();
    assert!(len <= bytes.len() && len % 16 == 0, "{len} bytes");
    assert_eq!(
        usize::from(bytes[2]) * 16,
        len,
        "size16 is the WQE's length"
    );
    let mut again = vec![0xA5; len + 16];
    assert_eq!(wqe.emit(&mut again), Ok(len), "{wqe:?} re-emits");
    assert_eq!(
        &again[..len],
        &bytes[..len],
        "{wqe:?} re-emits the same bytes"
    );
    assert!(
        again[len..].iter().all(|&b| b == 0xA5),
        "emit wrote past the WQE"
    );
    assert_eq!(SendWqe::parse(&again, index, transport), Ok(wqe), "{wqe:?}");
    true
}

fn recv(bytes: &[u8]) -> bool {
    let index = bytes
        .get(2..4)
        .map_or(0, |b| u16::from_le_bytes([b[0], b[1]]));
    let Ok(wqe) = RecvWqe::parse(bytes, index) else {
        return false;
    };
    let used = 16 + 16 * wqe.sges.len();
    assert!(used <= bytes.len());
    assert_eq!(usize::from(bytes[0]), wqe.sges.len(), "num_sges");
    let stride = used.next_power_of_two().max(MIN_RECV_STRIDE);
    assert!(recv_sges_per_stride(stride) >= wqe.sges.len());
    let mut again = vec![0xA5; stride];
    assert_eq!(wqe.emit(stride, &mut again), Ok(()), "{wqe:?} re-emits");
    assert_eq!(
        &again[..used],
        &bytes[..used],
        "{wqe:?} re-emits the same bytes"
    );
    assert!(
        again[used..].iter().all(|&b| b == 0),
        "the stride's tail is zeroed"
    );
    assert_eq!(RecvWqe::parse(&again, index), Ok(wqe));
    true
}

/// WQEs the emitters write, each behind its selector byte: seeds for the
/// fuzzer's corpus and the property test's mutations.
pub(crate) fn seeds() -> Vec<Vec<u8>> {
    use hca_prm::av::Av;
    use hca_prm::wqe::{Payload, UdAddress, WqeFlags, WqeOp};
    use ib_types::av::AvAttr;
    use ib_types::scalars::{Gid, PortNum, QKey, Qpn};
    use ib_types::wr::{LKey, RKey, RemoteAddr, Sge};

    let sges = [
        Sge::new(0x1000, 64, LKey::new(0x100)),
        Sge::new(0x2000, 8, LKey::new(0x200)),
    ];
    let remote = RemoteAddr {
        addr: 0x8000,
        rkey: RKey::new(0x300),
    };
    let av = Av::try_from(&AvAttr::roce(
        PortNum::FIRST,
        Gid::from_ipv4([10, 0, 0, 2]),
        1,
    ))
    .expect("a valid AV");
    let send_wqes = [
        (
            Transport::Rc,
            SendWqe {
                wqe_index: 3,
                flags: WqeFlags::SIGNALED,
                op: WqeOp::RdmaWrite { remote },
                ud: None,
                payload: Payload::Data(&sges),
            },
        ),
        (
            Transport::Rc,
            SendWqe {
                wqe_index: 4,
                flags: WqeFlags::INLINE,
                op: WqeOp::Send,
                ud: None,
                payload: Payload::Inline(b"inline data"),
            },
        ),
        (
            Transport::Ud,
            SendWqe {
                wqe_index: 0xFFFF,
                flags: WqeFlags::SIGNALED | WqeFlags::SOLICITED,
                op: WqeOp::Send,
                ud: Some(UdAddress {
                    av,
                    dest_qpn: Qpn::new(0x44).expect("24 bits"),
                    qkey: QKey::new(0x1111),
                }),
                payload: Payload::Data(&sges[..1]),
            },
        ),
        (
            Transport::Rc,
            SendWqe {
                wqe_index: 7,
                flags: WqeFlags::SIGNALED,
                op: WqeOp::AtomicFa { remote, add: 5 },
                ud: None,
                payload: Payload::Data(&sges[1..]),
            },
        ),
    ];
    let mut seeds = Vec::new();
    for (transport, wqe) in send_wqes {
        let mut bytes = vec![transport.code(); 1 + wqe.byte_len()];
        wqe.emit(&mut bytes[1..]).expect("a valid seed WQE");
        seeds.push(bytes);
    }
    let mut recv = vec![4; 1 + 64];
    RecvWqe {
        wqe_index: 9,
        sges: &sges,
    }
    .emit(64, &mut recv[1..])
    .expect("a valid receive WQE");
    seeds.push(recv);
    seeds
}
