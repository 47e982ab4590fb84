//! Scenario: the user-mode proxy of the real IBAL bus filter
//! (`sim_shells::ibal_proxy`) over the real miniport, two HCAs with two
//! ports each, user processes opening the HCAs through their device
//! interfaces: one interface per HCA, enabled while its stack runs; a verb
//! round trip; an ABI mismatch refused at open; a handle forged across
//! opens of one process refused before the miniport; malformed buffers of
//! every verb refused with a clear status; the administrator IOCTL refused
//! to a standard user and applied for an administrator; an open the
//! stack's security descriptor denies; a process dying with objects open
//! leaving nothing locked, mapped or alive; requests sent while the HCA
//! sleeps completed after resume; a surprise-removed HCA losing its
//! interface while the other keeps serving. Every test ends with the host shut down
//! and the verifier report empty.
#![cfg(not(windows))]

mod support;

use std::sync::Arc;

use driver_platform::SystemPowerState;
use hca_miniport_core::hca::Hca;
use ib_types::access::AccessFlags;
use ib_types::interface::{GUID_IB_AL_DEVICE_INTERFACE, InterfaceVersion};
use ib_types::ioctl::{
    self as v, Empty, OpenCaIn, REQUEST_HEADER_SIZE, RESPONSE_HEADER_SIZE, Verb, VerbId,
    decode_response, encode_request, request_len, response_len,
};
use ib_types::mr::MrRegister;
use ib_types::scalars::PKey;
use ib_types::status::{IbStatus, NtStatus};
use ibal_bus_core::children::ChildEntry;
use ibal_bus_core::proxy::{
    ChildEntryChange, IOCTL_IBAL_CHILD_ENTRY, PROXY_SDDL, STATUS_REVISION_MISMATCH, invalid_handle,
};
use sim_host::file::FileHandle;
use sim_host::host::{Host, HostConfig};
use sim_host::memory::Process;
use sim_host::platform::SimPlatform;
use sim_host::pnp::DevNodeId;
use sim_host::request::{Completion, RequestHandle};
use sim_host::security::Token;
use sim_shells::hca_miniport::MiniportDriver;
use sim_shells::ibal_bus::{IbalBusDevice, IbalBusDriver};

use support::{finish, hca_configs_of, register_stack, settle};

const HCAS: [u64; 2] = [0x0002_C900_0000_3000, 0x0002_C900_0000_4000];
/// Private output room every request of these tests offers.
const ROOM: u32 = 64;
/// Room for `QueryCa`'s attribute block.
const QUERY_ROOM: u32 = 16 * 1024;
/// A handle no open created.
const FORGED: u64 = 0x5A5A_0000_0001;

struct World {
    host: Host,
    filter: Arc<IbalBusDriver>,
    miniport: Arc<MiniportDriver<SimPlatform>>,
}

impl World {
    fn new(seed: u64) -> Self {
        let configs = hca_configs_of(&HCAS, 1);
        let host = Host::new(HostConfig::deterministic(seed, configs)).unwrap();
        let (filter, miniport) = register_stack(&host);
        host.boot();
        let w = Self {
            host,
            filter,
            miniport,
        };
        w.settle();
        w
    }

    /// [`World::new`] with user process `pid` holding one open on the
    /// first HCA's interface: (world, that HCA, the process, the open).
    fn with_open(seed: u64, pid: u32) -> (Self, DevNodeId, Process, FileHandle) {
        let w = Self::new(seed);
        let node = w.interfaces()[0];
        let process = Process::new(pid);
        let h = w.open(&process, node);
        (w, node, process, h)
    }

    fn settle(&self) {
        settle(&self.host);
    }

    /// The HCA devnodes user mode finds through the proxy's interface.
    fn interfaces(&self) -> Vec<DevNodeId> {
        self.host
            .pnp()
            .devices_with_interface(GUID_IB_AL_DEVICE_INTERFACE)
    }

    fn open(&self, process: &Process, hca: DevNodeId) -> FileHandle {
        self.host.pnp().open_file(process, hca).expect("open")
    }

    fn hca(&self, node: DevNodeId) -> Arc<Hca<SimPlatform>> {
        self.miniport
            .devices()
            .into_iter()
            .find(|d| d.node() == node)
            .and_then(|d| d.hca())
            .expect("the miniport of that HCA")
    }

    fn filter_of(&self, node: DevNodeId) -> Arc<IbalBusDevice> {
        let hcas = self.host.hcas();
        let at = hcas.iter().position(|n| *n == node).unwrap();
        self.filter.devices()[at].clone()
    }

    fn children(&self) -> usize {
        self.filter
            .devices()
            .iter()
            .map(|d| d.children().len())
            .sum()
    }

    /// Sends `V` and settles; the completion.
    fn verb<V: Verb>(&self, h: &FileHandle, object: u64, input: &V::In) -> Completion {
        let issuer = send::<V>(h, object, input, ROOM);
        self.settle();
        issuer.completion().expect("completed")
    }

    /// Sends `V` (no fixed input) on `object` and settles; it must
    /// succeed.
    fn verb_succeeds<V: Verb<In = Empty>>(&self, h: &FileHandle, object: u64) {
        let status = self.verb::<V>(h, object, &Empty).status;
        assert_eq!(status, NtStatus::SUCCESS, "{:?}", V::ID);
    }

    /// Sends raw bytes and settles; the completion.
    fn raw(&self, h: &FileHandle, ioctl: u32, input: Vec<u8>, output: usize) -> Completion {
        let issuer = h.send(ioctl, input, output);
        self.settle();
        issuer.completion().expect("completed")
    }

    fn finish(self) {
        finish(self.host);
    }
}

fn send<V: Verb>(h: &FileHandle, object: u64, input: &V::In, room: u32) -> RequestHandle {
    let mut bytes = vec![0; request_len::<V>(0).unwrap()];
    encode_request::<V>(object, input, &[], room, &mut bytes).unwrap();
    h.send(
        V::ID.ioctl().raw(),
        bytes,
        response_len::<V>(room as usize).unwrap(),
    )
}

/// The handle a successful create answered (the response decoded).
fn created<V: Verb>(c: &Completion) -> u64 {
    assert_eq!(c.status, NtStatus::SUCCESS, "{:?}", V::ID);
    let response = decode_response::<V>(&c.output[..c.information as usize]).unwrap();
    assert_eq!(response.status, IbStatus::Success);
    assert_ne!(response.handle, 0);
    response.handle
}

fn open_ca(w: &World, h: &FileHandle) -> u64 {
    created::<v::OpenCa>(&w.verb::<v::OpenCa>(h, 0, &OpenCaIn::CURRENT))
}

fn alloc_pd(w: &World, h: &FileHandle, ca: u64) -> u64 {
    created::<v::AllocPd>(&w.verb::<v::AllocPd>(h, ca, &Empty))
}

#[test]
fn each_hca_has_its_own_interface_and_a_user_process_round_trips_verbs_on_each() {
    let w = World::new(31);
    let hcas = w.host.hcas();
    assert_eq!(w.interfaces(), hcas, "one interface per HCA, enabled");
    for node in &hcas {
        let sd = w.host.pnp().security(*node).expect("a descriptor");
        assert_eq!(sd.sddl(), PROXY_SDDL);
    }
    let process = Process::new(40);
    for node in w.interfaces() {
        let h = w.open(&process, node);
        let ca = open_ca(&w, &h);
        // QueryCa answers this HCA's attribute block.
        let issuer = send::<v::QueryCa>(&h, ca, &Empty, QUERY_ROOM);
        w.settle();
        let c = issuer.completion().unwrap();
        assert_eq!(c.status, NtStatus::SUCCESS);
        let answer = decode_response::<v::QueryCa>(&c.output[..c.information as usize]).unwrap();
        assert!(!answer.private.is_empty());
        let pd = alloc_pd(&w, &h, ca);
        let proxy = w.filter_of(node);
        assert_eq!(proxy.proxy().object_count(), 2, "CA and PD recorded");
        w.verb_succeeds::<v::DeallocPd>(&h, pd);
        // A destroyed handle is forgotten: using it again is refused here.
        assert_eq!(
            w.verb::<v::DeallocPd>(&h, pd, &Empty).status,
            IbStatus::InvalidPdHandle.to_ntstatus()
        );
        w.verb_succeeds::<v::CloseCa>(&h, ca);
        assert_eq!(proxy.proxy().object_count(), 0);
        assert_eq!(w.hca(node).user_context_count(), 0);
        h.close();
    }
    // A stopped stack's interface is disabled, and enabled again on restart.
    let first = hcas[0];
    w.host.pnp().stop(first).unwrap();
    w.settle();
    assert_eq!(w.interfaces(), [hcas[1]]);
    w.host.pnp().restart(first);
    w.settle();
    assert_eq!(w.interfaces(), hcas);
    w.finish();
}

/// An `OpenCa` request speaking `version`, encoded by hand (the encoder
/// refuses versions this crate cannot serve).
fn open_ca_bytes(version: InterfaceVersion) -> Vec<u8> {
    let mut bytes = vec![0; request_len::<v::OpenCa>(0).unwrap()];
    encode_request::<v::OpenCa>(0, &OpenCaIn::CURRENT, &[], ROOM, &mut bytes).unwrap();
    bytes[REQUEST_HEADER_SIZE..REQUEST_HEADER_SIZE + 2]
        .copy_from_slice(&version.packed().to_le_bytes());
    bytes
}

#[test]
fn an_open_speaking_another_abi_version_is_refused_at_the_proxy() {
    let (w, node, process, h) = World::with_open(32, 41);
    let out = response_len::<v::OpenCa>(ROOM as usize).unwrap();
    for version in [
        InterfaceVersion::new(2, 0),
        InterfaceVersion::new(0, 9),
        // A newer minor than the proxy serves.
        InterfaceVersion::new(1, 1),
    ] {
        let c = w.raw(&h, v::OpenCa::ID.ioctl().raw(), open_ca_bytes(version), out);
        assert_eq!(c.status, STATUS_REVISION_MISMATCH, "{version:?}");
        assert_eq!(c.information, 0);
    }
    // Nothing reached the miniport: no context, no doorbell page mapped.
    assert_eq!(w.hca(node).user_context_count(), 0);
    assert_eq!(process.space().device_mapping_count(), 0);
    // The version this build speaks opens.
    let ca = open_ca(&w, &h);
    w.verb_succeeds::<v::CloseCa>(&h, ca);
    h.close();
    w.finish();
}

#[test]
fn a_handle_created_by_another_open_of_the_same_process_is_refused_before_the_miniport() {
    let w = World::new(33);
    let node = w.interfaces()[0];
    let process = Process::new(42);
    let (a, b) = (w.open(&process, node), w.open(&process, node));
    let ca_a = open_ca(&w, &a);
    let pd_a = alloc_pd(&w, &a, ca_a);
    let ca_b = open_ca(&w, &b);
    let va = process.alloc(4096).unwrap();
    let region = MrRegister {
        vaddr: va,
        length: 4096,
        access: AccessFlags::LOCAL_WRITE,
    };
    // The miniport would take these (same process); the proxy refuses them
    // because open B did not create them.
    let refused = [
        (
            w.verb::<v::DeallocPd>(&b, pd_a, &Empty).status,
            IbStatus::InvalidPdHandle,
        ),
        (
            w.verb::<v::AllocPd>(&b, ca_a, &Empty).status,
            IbStatus::InvalidCaHandle,
        ),
        (
            w.verb::<v::RegMr>(&b, pd_a, &region).status,
            IbStatus::InvalidPdHandle,
        ),
        // A PD handle where a CA handle belongs is the wrong kind.
        (
            w.verb::<v::AllocPd>(&a, pd_a, &Empty).status,
            IbStatus::InvalidCaHandle,
        ),
        // A forged number.
        (
            w.verb::<v::QueryCa>(&b, 0x7777_0001, &Empty).status,
            IbStatus::InvalidCaHandle,
        ),
    ];
    for (got, want) in refused {
        assert_eq!(got, want.to_ntstatus());
    }
    assert_eq!(process.space().locked_pages(), 0, "RegMr never reached it");
    // A's PD is intact: A deallocates it.
    w.verb_succeeds::<v::DeallocPd>(&a, pd_a);
    // Another process cannot use A's CA either.
    let other = Process::new(43);
    let c = w.open(&other, node);
    assert_eq!(
        w.verb::<v::AllocPd>(&c, ca_b, &Empty).status,
        IbStatus::InvalidCaHandle.to_ntstatus()
    );
    for (h, ca) in [(&a, ca_a), (&b, ca_b)] {
        assert_eq!(
            w.verb::<v::CloseCa>(h, ca, &Empty).status,
            NtStatus::SUCCESS
        );
    }
    for h in [a, b, c] {
        h.close();
    }
    w.finish();
}

/// A request header: handle, private_in_len, private_out_max.
fn header(handle: u64, private_in: u32, private_out: u32) -> Vec<u8> {
    let mut bytes = handle.to_le_bytes().to_vec();
    bytes.extend_from_slice(&private_in.to_le_bytes());
    bytes.extend_from_slice(&private_out.to_le_bytes());
    bytes
}

#[test]
fn malformed_buffers_of_every_verb_are_refused_with_a_clear_status() {
    let (w, node, _process, h) = World::with_open(34, 44);
    let ca = open_ca(&w, &h);
    let hca = w.hca(node);
    let invalid = NtStatus::INVALID_PARAMETER;
    for verb in VerbId::ALL.iter().copied() {
        let code = verb.ioctl().raw();
        let fixed_in = REQUEST_HEADER_SIZE + verb.in_size();
        let out = RESPONSE_HEADER_SIZE + verb.out_size() + ROOM as usize;
        // A forged handle where the verb names one: nothing here may reach
        // the open's CA context even if a frame were wrongly accepted.
        let target = if verb.target().is_some() { FORGED } else { 0 };
        let mut exact = header(target, 0, ROOM);
        exact.resize(fixed_in, 0);
        let mut cases: Vec<(&str, u32, Vec<u8>)> = vec![
            ("empty input", code, Vec::new()),
            ("one byte short", code, exact[..fixed_in - 1].to_vec()),
            ("one byte long", code, [&exact[..], &[0]].concat()),
            ("private length past the buffer", code, {
                let mut b = header(target, 8, ROOM);
                b.resize(fixed_in, 0);
                b
            }),
            ("private length u32::MAX", code, {
                let mut b = header(target, u32::MAX, ROOM);
                b.resize(fixed_in, 0);
                b
            }),
            ("handle where none belongs, or none where one does", code, {
                let mut b = header(if target == 0 { FORGED } else { 0 }, 0, ROOM);
                b.resize(fixed_in, 0);
                b
            }),
        ];
        if verb.in_size() > 0 {
            cases.push(("header only", code, header(target, 0, ROOM)));
        }
        // The codes around the verb's: other access bits, other method.
        cases.push(("access bits", code ^ (1 << 14), exact.clone()));
        cases.push(("method", code | 0b11, exact.clone()));
        for (what, ioctl, input) in cases {
            let c = w.raw(&h, ioctl, input, out);
            let expected = if ioctl != code {
                NtStatus::INVALID_DEVICE_REQUEST
            } else {
                invalid
            };
            assert_eq!(c.status, expected, "{verb:?}: {what}");
            assert_eq!(c.information, 0, "{verb:?}: {what}");
        }
        // An exact frame of zeros: refused by the layout's own rules, the
        // ABI version (OpenCa), the kernel-only rule, or the forged handle.
        let c = w.raw(&h, code, exact, out);
        let mut clear = vec![invalid, IbStatus::InvalidPermission.to_ntstatus()];
        match verb.target() {
            Some(kind) => clear.push(invalid_handle(kind).to_ntstatus()),
            None => clear.push(STATUS_REVISION_MISMATCH),
        }
        assert!(
            clear.contains(&c.status),
            "{verb:?}: zeros answered {:?}",
            c.status
        );
        assert_eq!(c.information, 0);
    }
    // Output room: smaller than the fixed answer, or than private_out_max.
    let mut query = vec![0; request_len::<v::QueryCa>(0).unwrap()];
    encode_request::<v::QueryCa>(ca, &Empty, &[], QUERY_ROOM, &mut query).unwrap();
    let code = v::QueryCa::ID.ioctl().raw();
    let c = w.raw(&h, code, query.clone(), 4);
    assert_eq!(c.status, NtStatus::BUFFER_TOO_SMALL);
    let c = w.raw(&h, code, query, response_len::<v::QueryCa>(0).unwrap());
    assert_eq!(c.status, invalid, "private_out_max past the output");
    // A kernel-only verb, well formed, from user mode.
    let mad = v::LocalMadIn {
        port: ib_types::scalars::PortNum::new(1).unwrap(),
        mad: [0; v::MAD_SIZE],
    };
    assert_eq!(
        w.verb::<v::LocalMad>(&h, ca, &mad).status,
        IbStatus::InvalidPermission.to_ntstatus()
    );
    // A code that is no verb at all.
    let c = w.raw(&h, 0x0022_2000, Vec::new(), 0);
    assert_eq!(c.status, NtStatus::INVALID_DEVICE_REQUEST);
    // The one context this process opened is all the miniport has.
    assert_eq!(hca.user_context_count(), 1);
    w.verb_succeeds::<v::CloseCa>(&h, ca);
    h.close();
    w.finish();
}

fn child_entry_request(change: &ChildEntryChange) -> Vec<u8> {
    change.encode().expect("encodable")
}

#[test]
fn the_admin_ioctl_is_refused_to_a_standard_user_and_changes_the_children_for_an_administrator() {
    let w = World::new(35);
    let node = w.interfaces()[0];
    let before = w.children();
    assert_eq!(before, 4, "one IPoIB child per port of each HCA");
    let storage = ChildEntryChange::Add(ChildEntry {
        name: "Storage".into(),
        device_id: "IBA\\STORAGE".into(),
        hardware_ids: vec!["IBA\\STORAGE".into()],
        compatible_ids: vec!["IBA\\PORT_CLIENT".into()],
        description: "Storage".into(),
        pkey: PKey::new(0x8001),
    });
    let code = IOCTL_IBAL_CHILD_ENTRY.raw();

    let user = Process::new(45);
    let h = w.open(&user, node);
    let c = w.raw(&h, code, child_entry_request(&storage), 0);
    assert_eq!(c.status, NtStatus::ACCESS_DENIED);
    assert_eq!(w.children(), before);
    h.close();

    let admin = Process::with_token(46, Token::administrator());
    let h = w.open(&admin, node);
    // Hostile input from an administrator is still refused.
    for bad in [
        Vec::new(),
        vec![1, 0, 0, 0, 0, 0, 0, 0],
        vec![9, 1, 0, 0, 0, 0, 0, 0, b'x'],
        [child_entry_request(&storage), vec![0]].concat(),
    ] {
        let c = w.raw(&h, code, bad, 0);
        assert_eq!(c.status, NtStatus::INVALID_PARAMETER);
    }
    assert_eq!(w.children(), before);
    let c = w.raw(&h, code, child_entry_request(&storage), 0);
    assert_eq!(c.status, NtStatus::SUCCESS);
    w.settle();
    assert_eq!(
        w.children(),
        8,
        "a Storage child on every port of both HCAs"
    );
    let remove = ChildEntryChange::Remove("Storage".into());
    let c = w.raw(&h, code, child_entry_request(&remove), 0);
    assert_eq!(c.status, NtStatus::SUCCESS);
    w.settle();
    assert_eq!(w.children(), before);
    let c = w.raw(&h, code, child_entry_request(&remove), 0);
    assert_eq!(c.status, NtStatus::NOT_FOUND);
    h.close();
    w.finish();
}

#[test]
fn an_open_the_stacks_security_descriptor_does_not_grant_is_denied() {
    let w = World::new(36);
    let node = w.interfaces()[0];
    let anonymous = Process::with_token(47, Token::anonymous());
    assert_eq!(
        w.host.pnp().open_file(&anonymous, node).unwrap_err(),
        NtStatus::ACCESS_DENIED
    );
    assert_eq!(w.filter_of(node).proxy().open_count(), 0);
    // System opens.
    let system = Process::with_token(48, Token::system());
    w.open(&system, node).close();
    w.finish();
}

#[test]
fn a_process_dying_with_objects_open_on_both_hcas_leaves_nothing_locked_mapped_or_alive() {
    let w = World::new(37);
    let process = Process::new(49);
    let mut waits = Vec::new();
    for node in w.interfaces() {
        // Two opens on each HCA, each with its own CA context and objects.
        for _ in 0..2 {
            let h = w.open(&process, node);
            let ca = open_ca(&w, &h);
            let pd = alloc_pd(&w, &h, ca);
            let va = process.alloc(2 * 4096).unwrap();
            let region = MrRegister {
                vaddr: va,
                length: 2 * 4096,
                access: AccessFlags::LOCAL_WRITE,
            };
            created::<v::RegMr>(&w.verb::<v::RegMr>(&h, pd, &region));
            waits.push(send::<v::GetAsyncEvent>(&h, ca, &Empty, 0));
            // The process leaks its handle.
            drop(h);
        }
        assert_eq!(w.filter_of(node).proxy().object_count(), 6);
    }
    w.settle();
    assert_eq!(process.space().locked_pages(), 8);
    assert_eq!(process.space().device_mapping_count(), 4);

    assert_eq!(w.host.pnp().exit_process(&process), 0, "no page locked");
    w.settle();
    assert_eq!(process.space().device_mapping_count(), 0, "nothing mapped");
    assert!(waits.iter().all(RequestHandle::is_done));
    for node in w.interfaces() {
        assert_eq!(w.hca(node).user_context_count(), 0, "nothing alive");
        let proxy = w.filter_of(node);
        assert_eq!(proxy.proxy().open_count(), 0);
        assert_eq!(proxy.proxy().object_count(), 0);
        assert_eq!(w.host.pnp().file_object_count(node), 0);
    }
    w.finish();
}

#[test]
fn requests_a_process_sends_while_the_hca_sleeps_complete_after_resume() {
    let (w, _node, _process, h) = World::with_open(38, 50);
    let ca = open_ca(&w, &h);
    w.host
        .pnp()
        .set_system_power(SystemPowerState::S3)
        .expect("sleep");
    w.settle();
    let pd = send::<v::AllocPd>(&h, ca, &Empty, ROOM);
    let query = send::<v::QueryCa>(&h, ca, &Empty, QUERY_ROOM);
    // A bad request is refused at once, even while the HCA sleeps.
    let refused = send::<v::DeallocPd>(&h, 0x1234, &Empty, ROOM);
    w.settle();
    assert!(!pd.is_done() && !query.is_done(), "held below D0");
    assert_eq!(
        refused.completion().unwrap().status,
        IbStatus::InvalidPdHandle.to_ntstatus()
    );
    w.host
        .pnp()
        .set_system_power(SystemPowerState::S0)
        .expect("resume");
    w.settle();
    let pd = created::<v::AllocPd>(&pd.completion().expect("completed after resume"));
    assert_eq!(query.completion().unwrap().status, NtStatus::SUCCESS);
    // The proxy recorded the PD from the late answer: it is usable.
    w.verb_succeeds::<v::DeallocPd>(&h, pd);
    w.verb_succeeds::<v::CloseCa>(&h, ca);
    h.close();
    w.finish();
}

#[test]
fn a_surprise_removed_hca_loses_its_interface_and_its_opens_fail_while_the_other_keeps_working() {
    let w = World::new(39);
    let [gone, kept] = <[DevNodeId; 2]>::try_from(w.interfaces()).unwrap();
    let process = Process::new(51);
    let (h_gone, h_kept) = (w.open(&process, gone), w.open(&process, kept));
    let (ca_gone, ca_kept) = (open_ca(&w, &h_gone), open_ca(&w, &h_kept));
    let wait = send::<v::GetAsyncEvent>(&h_gone, ca_gone, &Empty, 0);
    w.settle();
    assert!(!wait.is_done());

    w.host.pnp().surprise_remove(gone);
    w.settle();
    assert_eq!(w.interfaces(), [kept], "only the HCA still present");
    let ended = wait.completion().expect("the wait ended at removal");
    assert!(!ended.status.is_success());
    // A request on the removed HCA's open fails; the other HCA serves.
    let c = w.verb::<v::AllocPd>(&h_gone, ca_gone, &Empty);
    assert!(!c.status.is_success());
    let pd = alloc_pd(&w, &h_kept, ca_kept);
    w.verb_succeeds::<v::DeallocPd>(&h_kept, pd);
    // The process exits: nothing stays locked or mapped anywhere.
    drop((h_gone, h_kept));
    assert_eq!(w.host.pnp().exit_process(&process), 0);
    w.settle();
    assert_eq!(process.space().device_mapping_count(), 0);
    assert_eq!(w.hca(kept).user_context_count(), 0);
    w.finish();
}

/// The security descriptor the simulated shell assigns is the one the INF
/// gives the HCA's devnode on Windows (its `Security` property).
#[test]
fn the_infs_security_descriptor_is_the_proxys() {
    let infs = sim_host::inf::InfSet::load_dir(sim_host::inf::workspace_inf_dir()).unwrap();
    let inf = infs
        .get("hca-miniport.inf")
        .unwrap_or_else(|| panic!("the HCA's INF: {:?}", infs.rejected()));
    let section = inf
        .section("IbalBus_Security_AddReg")
        .expect("the security add-registry section");
    let security: Vec<&str> = section
        .iter()
        .filter(|line| line.fields.get(2).is_some_and(|f| f == "Security"))
        .filter_map(|line| line.fields.get(4).map(String::as_str))
        .collect();
    assert_eq!(
        security,
        [ibal_bus_core::proxy::PROXY_SDDL.trim_matches('"')],
        "{section:?}"
    );
}
