//! The property of MAD handling (`MAD_IFC`, PRM 5.1; the device's local
//! subnet management agent, IBA 13.4 and 14.2) under hostile MADs: what
//! the LocalMad verb hands the device from a kernel client. Shared by the
//! bounded property test (`tests/fuzz_mad.rs`) and the `mad` cargo-fuzz
//! target, which includes this file by path.
//!
//! The first input byte is the port (the device has two), the rest the
//! mailbox. A MAD of the wrong size, or to a port the device lacks, is
//! refused and writes nothing to the output mailbox. Any 256-byte MAD to
//! a port gets a GetResp that keeps the request's header (versions,
//! class, transaction ID, attribute), with the status IBA Table 111 gives
//! (bad version; unsupported method/attribute for anything but a SubnGet
//! of NodeInfo or NodeDescription; the D bit set for directed route), and
//! either echoes the request or carries the attribute the agent answers.

use hca_prm::cmd::{CmdStatus, MAD_BYTES, Opcode};
use sim_hca::device::{Device, DeviceConfig};
use sim_hca::host::{InterruptSink, SimMemory};
use sim_hca::testkit::Driver;
use std::sync::Arc;

const NODE_GUID: u64 = 0x0200_00ff_fe00_0a00;
/// The largest mailbox the test driver has.
const MAILBOX: usize = 4096;

const CLASS_SUBN_LID_ROUTED: u8 = 0x01;
const CLASS_SUBN_DIRECTED_ROUTE: u8 = 0x81;
const METHOD_GET: u8 = 0x01;
const METHOD_GET_RESP: u8 = 0x81;
const ATTR_NODE_DESCRIPTION: u16 = 0x0010;
const ATTR_NODE_INFO: u16 = 0x0011;

struct NoIrq;

impl InterruptSink for NoIrq {
    fn raise(&self, _vector: u16) {}
}

/// Checks the property on one input; panics on a violation. Returns
/// whether the device accepted the MAD.
pub(crate) fn check(data: &[u8]) -> bool {
    let Some((&port, mad)) = data.split_first() else {
        return false;
    };
    let port = port % 4;
    let mad = &mad[..mad.len().min(MAILBOX)];
    let mem = Arc::new(SimMemory::new(0x10_0000_0000));
    let cfg = DeviceConfig::with_ports(NODE_GUID, &[[10, 0, 0, 1], [10, 0, 0, 2]]);
    let mut dev = Device::new(cfg, mem.clone(), Arc::new(NoIrq));
    let mut drv = Driver::bring_up(&mut dev, mem);

    // Fill the output mailbox with a known answer first.
    let known = node_description_get();
    let (status, before) = drv.cmd(&mut dev, Opcode::MadIfc, 0, 1, &known, MAD_BYTES);
    assert_eq!(status, CmdStatus::Ok);

    let (status, reply) = drv.cmd(&mut dev, Opcode::MadIfc, 0, port.into(), mad, MAD_BYTES);
    let port_exists = (1..=2).contains(&port);
    if mad.len() != MAD_BYTES || !port_exists {
        assert_ne!(status, CmdStatus::Ok, "port {port}, {} bytes", mad.len());
        assert_eq!(reply, before, "a refused MAD writes nothing");
        return false;
    }
    assert_eq!(status, CmdStatus::Ok);
    check_reply(port, mad, &reply);
    // The device still runs commands.
    assert_eq!(drv.cmd_param(&mut dev, Opcode::Nop, 0, 0).0, CmdStatus::Ok);
    true
}

fn check_reply(port: u8, req: &[u8], resp: &[u8]) {
    assert_eq!(resp.len(), MAD_BYTES);
    assert_eq!(resp[3], METHOD_GET_RESP, "a GetResp");
    assert_eq!(resp[..3], req[..3], "base version, class, class version");
    assert_eq!(
        resp[8..64],
        req[8..64],
        "transaction ID, attribute, header rest"
    );
    let class = req[1];
    let attr = u16::from_be_bytes([req[16], req[17]]);
    let smp = matches!(class, CLASS_SUBN_LID_ROUTED | CLASS_SUBN_DIRECTED_ROUTE);
    let answered = req[0] == 1 && smp && req[3] == METHOD_GET;
    let expected_status: u16 = match attr {
        _ if req[0] != 1 => 0x0004,
        ATTR_NODE_INFO | ATTR_NODE_DESCRIPTION if answered => 0,
        _ => 0x000C,
    };
    let direction = if class == CLASS_SUBN_DIRECTED_ROUTE {
        0x8000
    } else {
        0
    };
    assert_eq!(
        u16::from_be_bytes([resp[4], resp[5]]),
        expected_status | direction,
        "status"
    );
    assert_eq!(resp[6..8], req[6..8], "class-specific field");
    let data = &resp[64..];
    match (expected_status, attr) {
        (0, ATTR_NODE_INFO) => {
            assert_eq!(data[..4], [1, 1, 1, 2], "versions, CA, two ports");
            assert_eq!(data[12..20], NODE_GUID.to_be_bytes(), "node GUID");
            let port_guid = NODE_GUID + u64::from(port);
            assert_eq!(data[20..28], port_guid.to_be_bytes(), "port GUID");
            assert_eq!(data[36], port, "local port");
            assert!(data[40..].iter().all(|&b| b == 0), "rest zero");
        }
        (0, _) => {
            let text = b"simulated RoCE HCA";
            assert_eq!(&data[..text.len()], text);
            assert!(data[text.len()..].iter().all(|&b| b == 0), "rest zero");
        }
        _ => assert_eq!(data, &req[64..], "an unanswered MAD is echoed"),
    }
}

/// A SubnGet(NodeDescription), LID routed.
fn node_description_get() -> Vec<u8> {
    let mut mad = vec![0u8; MAD_BYTES];
    mad[..4].copy_from_slice(&[1, CLASS_SUBN_LID_ROUTED, 1, METHOD_GET]);
    mad[8..16].copy_from_slice(&0x1234_5678_9ABC_DEF0u64.to_be_bytes());
    mad[16..18].copy_from_slice(&ATTR_NODE_DESCRIPTION.to_be_bytes());
    mad
}

/// MADs the agent answers, and some it does not: seeds for the fuzzer's
/// corpus and the property test's mutations.
pub(crate) fn seeds() -> Vec<Vec<u8>> {
    let on_port = |port: u8, mad: Vec<u8>| [vec![port], mad].concat();
    let description = node_description_get();
    let mut info = description.clone();
    info[16..18].copy_from_slice(&ATTR_NODE_INFO.to_be_bytes());
    let mut directed = info.clone();
    directed[1] = CLASS_SUBN_DIRECTED_ROUTE;
    let mut set = info.clone();
    set[3] = 0x02;
    let mut perf = info.clone();
    perf[1] = 0x04;
    vec![
        on_port(1, description),
        on_port(2, info),
        on_port(1, directed),
        on_port(2, set),
        on_port(1, perf),
    ]
}
