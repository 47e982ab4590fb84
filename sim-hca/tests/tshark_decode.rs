//! Wireshark agrees with our frames: a capture of one frame per interesting
//! opcode, written with `PcapWriter`, is dissected by `tshark` as
//! `eth:ethertype:ip:udp:infiniband` with the opcode, QPN, PSN and extension
//! header fields we sent, and the ICRC it displays is the one we computed.
//!
//! Needs `tshark` on `PATH` (CI installs it). Without it the test fails,
//! unless `SIM_HCA_SKIP_TSHARK=1` says to skip it on purpose.
//!
//! Wireshark (4.0 at the time of writing) decodes RoCEv2 on UDP 4791 but
//! does not validate the ICRC and has no validity field for it; it shows the
//! four trailing bytes as a big-endian number. The check here is that those
//! bytes are ours (the CRC's value is checked against zlib in the unit
//! tests).

use std::net::Ipv4Addr;
use std::path::PathBuf;
use std::process::Command;

use ib_types::abi::Be32;
use ib_types::scalars::{PKey, Psn, QKey, Qpn};
use ib_types::wr::RKey;
use sim_hca::pcap::PcapWriter;
use sim_hca::wire::bth::BthRepr;
use sim_hca::wire::eth::MacAddr;
use sim_hca::wire::ext::{
    AethRepr, AtomicAckEthRepr, AtomicEthRepr, CreditCode, DethRepr, ExtRepr, ImmDtRepr, Msn,
    RethRepr, Syndrome,
};
use sim_hca::wire::udp::flow_source_port;
use sim_hca::wire::{Opcode, PacketRepr, RocePacket};

const A: Ipv4Addr = Ipv4Addr::new(10, 0, 0, 1);
const B: Ipv4Addr = Ipv4Addr::new(10, 0, 0, 2);

/// A frame from `src` to `dst` with the given opcode and extension headers.
fn repr(
    src: Ipv4Addr,
    dst: Ipv4Addr,
    opcode: Opcode,
    psn: u32,
    ext: ExtRepr,
    len: usize,
) -> PacketRepr {
    PacketRepr {
        dst_mac: MacAddr::for_ip_destination(dst),
        src_mac: MacAddr::for_ipv4(src),
        src_ip: src,
        dst_ip: dst,
        tos: 0,
        ttl: 64,
        src_port: flow_source_port(0x11 ^ 0x22),
        bth: BthRepr {
            opcode,
            solicited: false,
            mig_req: false,
            pkey: PKey::DEFAULT,
            fecn: false,
            becn: false,
            dest_qp: Qpn::new(if dst == B { 0x22 } else { 0x11 }).unwrap(),
            ack_req: opcode.info().is_request() && opcode.info().position.ends_message(),
            psn: Psn::new(psn).unwrap(),
        },
        ext,
        payload_len: len,
    }
}

fn reth(len: u32) -> RethRepr {
    RethRepr {
        va: 0x7F00_0000_1000,
        rkey: RKey::new(0x0000_3402),
        dma_len: len,
    }
}

fn ack() -> AethRepr {
    AethRepr {
        syndrome: Syndrome::Ack {
            credits: CreditCode::NONE,
        },
        msn: Msn::new(1).unwrap(),
    }
}

/// The frames of the capture, with their payloads.
fn frames() -> Vec<(PacketRepr, Vec<u8>)> {
    use Opcode::*;
    let imm = ImmDtRepr {
        imm: Be32::new(0x1234_5678),
    };
    vec![
        (
            repr(A, B, RcSendOnly, 1, ExtRepr::None, 5),
            b"hello".to_vec(),
        ),
        (
            repr(A, B, RcRdmaWriteFirst, 2, ExtRepr::Reth(reth(300)), 256),
            vec![0xA1; 256],
        ),
        (
            repr(A, B, RcRdmaWriteLast, 3, ExtRepr::None, 44),
            vec![0xA2; 44],
        ),
        (
            repr(B, A, RcAcknowledge, 3, ExtRepr::Aeth(ack()), 0),
            vec![],
        ),
        (
            repr(A, B, RcRdmaReadRequest, 4, ExtRepr::Reth(reth(8)), 0),
            vec![],
        ),
        (
            repr(B, A, RcRdmaReadResponseOnly, 4, ExtRepr::Aeth(ack()), 8),
            vec![0xB0; 8],
        ),
        (
            repr(
                A,
                B,
                RcCompareSwap,
                5,
                ExtRepr::AtomicEth(AtomicEthRepr {
                    va: 0x7F00_0000_2000,
                    rkey: RKey::new(0x0000_3402),
                    swap_add: 2,
                    compare: 1,
                }),
                0,
            ),
            vec![],
        ),
        (
            repr(
                B,
                A,
                RcAtomicAcknowledge,
                5,
                ExtRepr::AethAtomicAckEth(
                    ack(),
                    AtomicAckEthRepr {
                        orig_remote_data: 1,
                    },
                ),
                0,
            ),
            vec![],
        ),
        (
            repr(
                A,
                B,
                UdSendOnlyWithImmediate,
                6,
                ExtRepr::DethImmDt(
                    DethRepr {
                        qkey: QKey::new(0x1111_1111),
                        src_qp: Qpn::new(0x11).unwrap(),
                    },
                    imm,
                ),
                3,
            ),
            b"abc".to_vec(),
        ),
    ]
}

/// The fields asked of tshark, in output order.
const FIELDS: &[&str] = &[
    "frame.protocols",
    "infiniband.bth.opcode",
    "infiniband.bth.destqp",
    "infiniband.bth.psn",
    "infiniband.bth.padcnt",
    "infiniband.reth.va",
    "infiniband.reth.dmalen",
    "infiniband.aeth.msn",
    "infiniband.atomiceth.swapdt",
    "infiniband.atomicacketh.origremdt",
    "infiniband.deth.srcqp",
    "infiniband.invariant.crc",
];

fn temp_capture() -> PathBuf {
    std::env::temp_dir().join(format!("sim-hca-tshark-{}.pcap", std::process::id()))
}

#[test]
fn tshark_dissects_every_frame_as_we_built_it() {
    if Command::new("tshark").arg("--version").output().is_err() {
        if std::env::var_os("SIM_HCA_SKIP_TSHARK").is_some_and(|v| v == "1") {
            eprintln!("tshark not installed; skipped because SIM_HCA_SKIP_TSHARK=1");
            return;
        }
        panic!(
            "tshark is not installed: install it (Debian: apt-get install tshark) \
             or set SIM_HCA_SKIP_TSHARK=1 to skip this test deliberately"
        );
    }

    let frames = frames();
    let mut writer = PcapWriter::new(Vec::new()).unwrap();
    let mut sent = Vec::new();
    for (i, (repr, payload)) in frames.iter().enumerate() {
        let mut buf = vec![0; repr.buffer_len()];
        repr.emit(payload, &mut buf).unwrap();
        let packet = RocePacket::parse(&buf).unwrap();
        sent.push((*repr, packet.icrc()));
        writer.write_frame(i as u64 * 1_000, &buf).unwrap();
    }
    let path = temp_capture();
    std::fs::write(&path, writer.into_inner()).unwrap();

    let mut cmd = Command::new("tshark");
    cmd.arg("-r")
        .arg(&path)
        .args(["-T", "fields", "-E", "separator=|"]);
    // Payload heuristics would claim some payloads as upper protocols
    // (RPC-over-RDMA, ...) and hide the ICRC; show payload as plain data.
    cmd.args(["--disable-heuristic", "rpcrdma_infiniband"]);
    for field in FIELDS {
        cmd.args(["-e", field]);
    }
    let output = cmd.output().expect("run tshark");
    let _ = std::fs::remove_file(&path);
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "tshark failed: {}\n{stdout}",
        String::from_utf8_lossy(&output.stderr)
    );
    println!("{stdout}");

    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(lines.len(), sent.len(), "one line per frame:\n{stdout}");
    for (line, (repr, icrc)) in lines.iter().zip(&sent) {
        let cols: Vec<&str> = line.split('|').collect();
        assert_eq!(cols.len(), FIELDS.len(), "{line}");
        let field = |name: &str| cols[FIELDS.iter().position(|f| *f == name).unwrap()];
        let what = repr.bth.opcode.name();
        let protocols = if repr.payload_len == 0 {
            "eth:ethertype:ip:udp:infiniband"
        } else {
            "eth:ethertype:ip:udp:infiniband:data"
        };
        assert_eq!(field("frame.protocols"), protocols, "{what}: {line}");
        assert_eq!(
            parse_num(field("infiniband.bth.opcode")),
            Some(u64::from(repr.bth.opcode.code())),
            "{what}: {line}"
        );
        assert_eq!(
            parse_num(field("infiniband.bth.destqp")),
            Some(u64::from(repr.bth.dest_qp.get())),
            "{what}"
        );
        assert_eq!(
            parse_num(field("infiniband.bth.psn")),
            Some(u64::from(repr.bth.psn.get())),
            "{what}"
        );
        assert_eq!(
            parse_num(field("infiniband.bth.padcnt")),
            Some(u64::from(repr.pad())),
            "{what}"
        );
        let ext = &repr.ext;
        // Wireshark files the AtomicETH address under the RETH's field.
        let va = ext.reth().map(|r| r.va).or(ext.atomic_eth().map(|a| a.va));
        assert_eq!(parse_num(field("infiniband.reth.va")), va, "{what}");
        assert_eq!(
            parse_num(field("infiniband.reth.dmalen")),
            ext.reth().map(|r| u64::from(r.dma_len)),
            "{what}"
        );
        assert_eq!(
            parse_num(field("infiniband.aeth.msn")),
            ext.aeth().map(|a| u64::from(a.msn.get())),
            "{what}"
        );
        assert_eq!(
            parse_num(field("infiniband.atomiceth.swapdt")),
            ext.atomic_eth().map(|a| a.swap_add),
            "{what}"
        );
        assert_eq!(
            parse_num(field("infiniband.atomicacketh.origremdt")),
            ext.atomic_ack_eth().map(|a| a.orig_remote_data),
            "{what}"
        );
        assert_eq!(
            parse_num(field("infiniband.deth.srcqp")),
            ext.deth().map(|d| u64::from(d.src_qp.get())),
            "{what}"
        );
        // Wireshark shows the four ICRC bytes read big-endian; we send the
        // CRC least significant byte first, so it shows our value swapped.
        let shown = parse_num(field("infiniband.invariant.crc")).expect("tshark shows the ICRC");
        assert_eq!(
            shown,
            u64::from(icrc.swap_bytes()),
            "{what}: ICRC shown {shown:#x}, ours {icrc:#x}"
        );
    }
}

/// A tshark number (decimal or 0x-hex); `None` for an absent field.
fn parse_num(text: &str) -> Option<u64> {
    let text = text.trim();
    if text.is_empty() {
        return None;
    }
    let parsed = match text.strip_prefix("0x") {
        Some(hex) => u64::from_str_radix(hex, 16),
        None => text.parse(),
    };
    Some(parsed.unwrap_or_else(|_| panic!("not a number: {text:?}")))
}
