//! The scripted capture (`cargo xtask capture`): every frame is a valid
//! RoCEv2 frame by our own parser (ICRC included), the mix contains every
//! operation, a retransmission, an RNR NAK and a remote access error NAK, and
//! Wireshark's `tshark` dissects every frame as RoCEv2.
//!
//! Needs `tshark` (CI installs it); without it the tshark part fails unless
//! `SIM_HCA_SKIP_TSHARK=1` says to skip it on purpose.

use std::collections::{BTreeSet, HashMap};
use std::process::Command;

use sim_hca::capture::scripted_mix;
use sim_hca::pcap::PcapReader;
use sim_hca::wire::ext::{ExtRepr, NakCode, Syndrome};
use sim_hca::wire::{Opcode, RocePacket};

fn capture() -> Vec<u8> {
    let (report, bytes) = scripted_mix(Vec::new(), 7).expect("the mix runs as scripted");
    assert!(report.frames > 40, "{report:?}");
    assert!(report.completions >= 25, "{report:?}");
    bytes
}

#[test]
fn every_frame_is_valid_and_the_mix_is_complete() {
    let bytes = capture();
    let reader = PcapReader::new(&bytes).expect("a pcap file");
    let mut opcodes = BTreeSet::new();
    let mut seen_psn: HashMap<(u32, u32), u32> = HashMap::new();
    let (mut retransmitted, mut rnr, mut access_nak) = (0, 0, 0);
    let mut frames = 0;
    for record in reader {
        let record = record.expect("a valid record");
        let pkt = RocePacket::parse(record.data).expect("every captured frame is valid RoCEv2");
        let bth = pkt.repr().bth;
        opcodes.insert(bth.opcode);
        frames += 1;
        if bth.opcode.info().is_request() {
            let key = (bth.dest_qp.get(), bth.psn.get());
            let count = seen_psn.entry(key).or_default();
            *count += 1;
            if *count == 2 {
                retransmitted += 1;
            }
        }
        if let ExtRepr::Aeth(aeth) = pkt.repr().ext {
            match aeth.syndrome {
                Syndrome::RnrNak { .. } => rnr += 1,
                Syndrome::Nak(NakCode::RemoteAccessError) => access_nak += 1,
                _ => {}
            }
        }
    }
    assert!(frames > 40);
    assert!(retransmitted > 0, "a request was retransmitted");
    assert!(rnr > 0, "an RNR NAK was sent");
    assert!(access_nak > 0, "a remote access error NAK was sent");
    use Opcode as O;
    for op in [
        O::RcSendFirst,
        O::RcSendMiddle,
        O::RcSendLast,
        O::RcSendOnly,
        O::RcSendOnlyWithImmediate,
        O::RcSendOnlyWithInvalidate,
        O::RcRdmaWriteFirst,
        O::RcRdmaWriteMiddle,
        O::RcRdmaWriteLast,
        O::RcRdmaWriteOnly,
        O::RcRdmaWriteOnlyWithImmediate,
        O::RcRdmaReadRequest,
        O::RcRdmaReadResponseFirst,
        O::RcRdmaReadResponseMiddle,
        O::RcRdmaReadResponseLast,
        O::RcAcknowledge,
        O::RcAtomicAcknowledge,
        O::RcCompareSwap,
        O::RcFetchAdd,
        O::UcSendFirst,
        O::UcSendLast,
        O::UcRdmaWriteFirst,
        O::UcRdmaWriteMiddle,
        O::UcRdmaWriteLast,
        O::UcRdmaWriteOnlyWithImmediate,
        O::UdSendOnly,
        O::UdSendOnlyWithImmediate,
    ] {
        assert!(
            opcodes.contains(&op),
            "{} is missing from the mix",
            op.info().name
        );
    }
}

#[test]
fn the_capture_is_deterministic() {
    assert_eq!(capture(), capture());
}

#[test]
fn tshark_decodes_every_frame_as_rocev2() {
    if Command::new("tshark").arg("--version").output().is_err() {
        if std::env::var_os("SIM_HCA_SKIP_TSHARK").is_some() {
            eprintln!("tshark not installed: skipped (SIM_HCA_SKIP_TSHARK is set)");
            return;
        }
        panic!("tshark is not installed; install it (CI does) or set SIM_HCA_SKIP_TSHARK=1");
    }
    let bytes = capture();
    let frames = PcapReader::new(&bytes).expect("pcap").count();
    let dir = std::env::temp_dir().join(format!("sim-hca-capture-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("mix.pcap");
    std::fs::write(&path, &bytes).unwrap();
    let out = Command::new("tshark")
        .arg("-r")
        .arg(&path)
        .args(["--disable-heuristic", "rpcrdma_infiniband"])
        .args([
            "-T",
            "fields",
            "-E",
            "separator=|",
            "-e",
            "frame.protocols",
            "-e",
            "infiniband.bth.opcode",
        ])
        .output()
        .expect("tshark runs");
    std::fs::remove_dir_all(&dir).ok();
    assert!(
        out.status.success(),
        "tshark failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), frames, "tshark saw every frame");
    for line in lines {
        let mut fields = line.split('|');
        let protocols = fields.next().unwrap_or_default();
        assert!(
            protocols.starts_with("eth:ethertype:ip:udp:infiniband"),
            "not dissected as RoCEv2: {line}"
        );
        assert!(
            fields.next().is_some_and(|op| !op.is_empty()),
            "no BTH opcode: {line}"
        );
    }
}
