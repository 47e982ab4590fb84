//! The main job (`cargo xtask run`, README "Quick start"): the whole stack
//! on the simulated Windows host, watched and checked.
//!
//! [`run`] boots a deterministic simulated machine (every choice from the
//! seed) with `hcas` HCAs of `ports` ports each on one fabric, binds the
//! drivers from our INF files — the real miniport (`hcaminiport`), the
//! real IBAL bus filter (`ibalbus`) and the real sample kernel client
//! (`ibportclient`, `sim_shells::port_client`) on every port child — and
//! goes through its steps, each checked:
//!
//! 1. **ABI contract**: the proxy IOCTL codes, layouts and QP state table
//!    checked (`abi`).
//! 2. **Boot**: the device tree with the children per port.
//! 3. **Kernel clients**: the port clients pair (HCA 2k's port p with HCA
//!    2k + 1's, an odd last HCA's ports with each other, its last port
//!    waiting alone when the port count is odd, which the job says:
//!    `PortClientDriver::pair_cas`), find each other over UD, connect RC
//!    and run checked ping-pong rounds; more rounds are timed.
//! 4. **User application**: a process through the access library and the
//!    plugin does sends, RDMA writes and reads, and atomics between the
//!    first two HCAs, byte-checked (`user_app`).
//! 5. **S3 with traffic in flight**: pings in flight when the machine
//!    sleeps; every driver's D0 callbacks recorded (`tree::PowerTrace`),
//!    printed, and the order checked (children leave D0 before their HCA
//!    and come back after it); each pair said goodbye over the fabric with
//!    no round lost and reconnects after wake.
//! 6. **Surprise removal** of the first pair's responder's HCA with pings
//!    in flight: its clients close without a word, the others keep their
//!    AL open (its partner's initiators see the connection lost, the other
//!    pairs run on), and a user application on a survivor moves checked
//!    traffic.
//! 7. **Re-plug** of that HCA (`Host::replug_hca`): its children and
//!    clients come back, reconnect and run checked rounds; a user
//!    application crosses it.
//! 8. **Shutdown**: every client closed its AL and gave its references
//!    back; the verifier report must be empty.
//!
//! A failed step ends the sequence (the machine is still shut down and
//! its verifier read); the [`Report`] says which step failed and why.

pub mod abi;
pub mod tree;
pub mod user_app;

use std::fmt::Write as _;
use std::fs::File;
use std::io::BufWriter;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use driver_platform::SystemPowerState;
use hca_miniport_core::init::HcaConfig;
use ib_port_client_core::session::{Counters, Phase};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use sim_hca::cluster::CaptureDirections;
use sim_hca::device::DeviceConfig;
use sim_hca::fabric::FaultConfig;
use sim_host::host::{Host, HostConfig};
use sim_host::memory::Process;
use sim_host::pnp::{DevNodeId, PnpState};
use sim_shells::hca_miniport::MiniportDriver;
use sim_shells::ibal_bus::IbalBusDriver;
use sim_shells::port_client::{PortClientDevice, PortClientDriver};

use crate::tree::PowerTrace;
use crate::user_app::{PortAddress, UserTraffic};

/// Most scheduler items one settle may run (the deterministic host runs
/// until nothing is ready and no timer is armed).
pub const SETTLE_STEPS: usize = 5_000_000;

/// The fewest HCAs `--hcas` takes.
pub const MIN_HCAS: usize = 2;
/// The most HCAs `--hcas` takes.
pub const MAX_HCAS: usize = 8;

/// Node GUID of the first HCA; the i-th adds `i * 0x1000`.
const FIRST_GUID: u64 = 0x0002_C900_0000_1000;

/// A deliberately broken step: the run must fail, naming it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sabotage {
    /// A byte of the user application's first RDMA read is flipped after
    /// it landed, before the check.
    CorruptRead,
    /// The fabric loses every frame from the user application on.
    DropFrames,
}

/// What to run.
#[derive(Debug, Clone)]
pub struct Options {
    /// HCAs on the PCI bus (2: the sample port client pairs two).
    pub hcas: usize,
    /// Ports per HCA (2 to 4).
    pub ports: u8,
    /// Every choice of the simulation derives from it.
    pub seed: u64,
    /// Where to write a pcap capture of the fabric's frames.
    pub capture: Option<PathBuf>,
    /// Ping-pong rounds per kernel-client connection.
    pub rounds: u32,
    /// Rounds of the user application (each a send, an RDMA write, an
    /// RDMA read and two atomics).
    pub user_rounds: u32,
    /// Payload bytes of the user application's send, write and read.
    pub user_bytes: usize,
    /// Show progress bars (on a terminal) and echo each line as it comes.
    pub interactive: bool,
    /// Break a step on purpose.
    pub sabotage: Option<Sabotage>,
    /// Print the ABI contract's full tables.
    pub abi_tables: bool,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            hcas: 2,
            ports: 2,
            seed: 2026,
            capture: None,
            rounds: 64,
            user_rounds: 256,
            user_bytes: 4096,
            interactive: true,
            sabotage: None,
            abi_tables: false,
        }
    }
}

/// One step's outcome: what it showed, or why it failed.
#[derive(Debug, Clone)]
pub struct StepReport {
    /// The step's name.
    pub name: &'static str,
    /// Its one-line summary, or the failure.
    pub outcome: Result<String, String>,
    /// Its wall time.
    pub elapsed: Duration,
}

/// The run's result.
#[derive(Debug, Clone, Default)]
pub struct Report {
    /// The steps that ran, in order.
    pub steps: Vec<StepReport>,
    /// Everything the steps printed, in order.
    pub log: String,
    /// The short closing report (tree, power order, operations and rates,
    /// verifier report, the verdict).
    pub summary: String,
    /// Verifier violations at shutdown (`None` if it was not reached).
    pub violations: Option<Vec<String>>,
    /// Wall time of the whole run.
    pub elapsed: Duration,
}

impl Report {
    /// Every step ran and passed, and the verifier report is empty.
    pub fn success(&self) -> bool {
        self.steps.iter().all(|s| s.outcome.is_ok())
            && self.violations.as_ref().is_some_and(Vec::is_empty)
    }

    /// The first step that failed.
    pub fn failed_step(&self) -> Option<&StepReport> {
        self.steps.iter().find(|s| s.outcome.is_err())
    }
}

/// The progress display and the log.
struct Console {
    bar: ProgressBar,
    echo: bool,
    log: String,
}

impl Console {
    fn new(steps: u64, interactive: bool) -> Self {
        let bar = if interactive {
            ProgressBar::new(steps)
        } else {
            ProgressBar::with_draw_target(Some(steps), ProgressDrawTarget::hidden())
        };
        if let Ok(style) = ProgressStyle::with_template(
            "{spinner:.green} [{elapsed_precise}] step {pos}/{len} {msg}",
        ) {
            bar.set_style(style);
        }
        bar.enable_steady_tick(Duration::from_millis(100));
        Self {
            bar,
            echo: interactive,
            log: String::new(),
        }
    }

    /// A line of the log, printed above the bar as it comes.
    fn say(&mut self, line: impl AsRef<str>) {
        let line = line.as_ref();
        self.log.push_str(line);
        self.log.push('\n');
        if self.echo {
            if self.bar.is_hidden() {
                println!("{line}");
            } else {
                self.bar.println(line);
            }
        }
    }

    fn status(&self, message: String) {
        self.bar.set_message(message);
    }
}

/// Two port clients that pair: (HCA, port) each.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Pair((usize, u8), (usize, u8));

impl std::fmt::Display for Pair {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let Pair(a, b) = self;
        write!(f, "HCA {} port {} <-> HCA {} port {}", a.0, a.1, b.0, b.1)
    }
}

impl Pair {
    fn has_hca(&self, hca: usize) -> bool {
        self.0.0 == hca || self.1.0 == hca
    }
}

/// The booted machine and what the job keeps of it.
struct Machine {
    host: Arc<Host>,
    root: DevNodeId,
    clients: Arc<PortClientDriver>,
    trace: PowerTrace,
    /// Each HCA's GUID and its ports' addresses.
    hcas: Vec<(u64, Vec<[u8; 4]>)>,
    /// The HCAs' devnodes, function order (a re-plugged HCA's newest).
    nodes: Vec<DevNodeId>,
    /// The HCA the surprise removal took (function order).
    gone: Option<usize>,
}

impl Machine {
    /// Runs everything, lets PnP act on bus relations, runs again.
    fn settle(&self) -> Result<(), String> {
        let run = || {
            self.host
                .scheduler()
                .run_until_idle(SETTLE_STEPS)
                .map(|_| ())
                .map_err(|e| e.to_string())
        };
        run()?;
        self.host.pnp().process_bus_relations();
        run()
    }

    fn address(&self, hca: usize, port: u8) -> PortAddress {
        let (guid, ips) = &self.hcas[hca];
        PortAddress {
            guid: *guid,
            port,
            ip: ips[usize::from(port) - 1],
        }
    }

    /// The newest client on `port` of HCA `hca`.
    fn client(&self, hca: usize, port: u8) -> Result<Arc<PortClientDevice>, String> {
        let guid = self.hcas[hca].0;
        self.clients
            .devices()
            .into_iter()
            .rev()
            .find(|c| {
                c.port_data()
                    .is_some_and(|d| d.ca_guid.get() == guid && d.port.get() == port)
            })
            .ok_or(format!("no port client on HCA {hca} port {port}"))
    }

    /// The pairs the port clients form (`PortClientDriver::pair_cas`,
    /// docs/port-client.md "Discovery"): HCA 2k's port p with HCA 2k + 1's,
    /// an odd last HCA's port 1 with its port 2 (3 with 4).
    fn pairs(&self) -> Vec<Pair> {
        let ports = self.hcas[0].1.len() as u8;
        let mut pairs = Vec::new();
        for first in (0..self.hcas.len()).step_by(2) {
            if first + 1 < self.hcas.len() {
                pairs.extend((1..=ports).map(|p| Pair((first, p), (first + 1, p))));
            } else {
                pairs.extend(
                    (1..ports)
                        .step_by(2)
                        .map(|p| Pair((first, p), (first, p + 1))),
                );
            }
        }
        pairs
    }

    /// The port with no peer under the pairing: the last port of an odd
    /// last HCA with an odd number of ports. Its client stays discovering.
    fn unpaired(&self) -> Option<(usize, u8)> {
        let ports = self.hcas[0].1.len() as u8;
        (self.hcas.len() % 2 == 1 && ports % 2 == 1).then(|| (self.hcas.len() - 1, ports))
    }

    /// The two clients of a pair (the newest on each end).
    fn ends(&self, pair: Pair) -> Result<(Arc<PortClientDevice>, Arc<PortClientDevice>), String> {
        let Pair(a, b) = pair;
        Ok((self.client(a.0, a.1)?, self.client(b.0, b.1)?))
    }

    /// The two clients of a pair: initiator first.
    fn pair(&self, pair: Pair) -> Result<(Arc<PortClientDevice>, Arc<PortClientDevice>), String> {
        let (x, y) = self.ends(pair)?;
        match (x.is_initiator(), y.is_initiator()) {
            (true, false) => Ok((x, y)),
            (false, true) => Ok((y, x)),
            roles => Err(format!("{pair}: initiator roles {roles:?}, one expected")),
        }
    }

    fn ports(&self) -> std::ops::RangeInclusive<u8> {
        1..=self.hcas[0].1.len() as u8
    }

    /// The started children of each HCA still present.
    fn families(&self) -> Vec<(DevNodeId, Vec<DevNodeId>)> {
        let pnp = self.host.pnp();
        self.host
            .hcas()
            .into_iter()
            .map(|hca| {
                let children = pnp
                    .children(hca)
                    .into_iter()
                    .filter(|c| pnp.state(*c) == Some(PnpState::Started))
                    .collect();
                (hca, children)
            })
            .collect()
    }
}

fn sum(a: Counters, b: Counters) -> Counters {
    Counters {
        rounds: a.rounds + b.rounds,
        pongs_sent: a.pongs_sent + b.pongs_sent,
        bad_payloads: a.bad_payloads + b.bad_payloads,
        bad_datagrams: a.bad_datagrams + b.bad_datagrams,
        connections: a.connections + b.connections,
        goodbyes_acknowledged: a.goodbyes_acknowledged + b.goodbyes_acknowledged,
        goodbyes_answered: a.goodbyes_answered + b.goodbyes_answered,
        goodbye_timeouts: a.goodbye_timeouts + b.goodbye_timeouts,
        connections_lost: a.connections_lost + b.connections_lost,
        hellos_resent: a.hellos_resent + b.hellos_resent,
        duplicates: a.duplicates + b.duplicates,
    }
}

fn per_second(count: u64, elapsed: Duration) -> f64 {
    count as f64 / elapsed.as_secs_f64().max(1e-9)
}

/// The closing report's facts, filled as the steps run.
#[derive(Debug, Default)]
struct Facts {
    tree: String,
    power_order: Vec<String>,
    operations: Vec<String>,
    frames: Option<u64>,
    stacks: Option<String>,
}

/// The steps, in order.
const STEPS: [&str; 8] = [
    "ABI contract",
    "boot",
    "kernel clients",
    "user application",
    "S3 with traffic in flight",
    "surprise removal",
    "re-plug",
    "shutdown",
];

/// Runs the main job; never panics on a failed check (the report says
/// what failed).
pub fn run(options: &Options) -> Report {
    let started = Instant::now();
    let mut console = Console::new(STEPS.len() as u64, options.interactive);
    let mut report = Report::default();
    let mut facts = Facts::default();
    if let Err(e) = check_options(options) {
        report.steps.push(StepReport {
            name: "options",
            outcome: Err(e),
            elapsed: Duration::ZERO,
        });
        report.summary = summary(&report, &facts);
        return report;
    }
    console.say(format!(
        "== main job: {} HCAs x {} ports on one fabric, seed {} ==",
        options.hcas, options.ports, options.seed
    ));

    let mut machine: Option<Machine> = None;
    for (index, name) in STEPS.iter().copied().enumerate() {
        console.status(format!("{name}..."));
        console.say(format!("\n-- {}. {name} --", index + 1));
        let step_started = Instant::now();
        let outcome = match name {
            "ABI contract" => abi_step(options, &mut console),
            "boot" => boot(options, &mut console, &mut facts).map(|(m, line)| {
                machine = Some(m);
                line
            }),
            _ => match machine.as_mut() {
                None => Err("no machine".to_owned()),
                Some(m) => match name {
                    "kernel clients" => kernel_clients(m, options, &mut console, &mut facts),
                    "user application" => user_application(m, options, &mut console, &mut facts),
                    "S3 with traffic in flight" => sleep(m, &mut console, &mut facts),
                    "surprise removal" => surprise_removal(m, options, &mut console, &mut facts),
                    "re-plug" => replug(m, options, &mut console, &mut facts),
                    "shutdown" => shutdown(m, &mut console, &mut facts, &mut report),
                    other => Err(format!("unknown step {other}")),
                },
            },
        };
        let elapsed = step_started.elapsed();
        match &outcome {
            Ok(line) => console.say(format!("ok: {line} ({:.2} s)", elapsed.as_secs_f64())),
            Err(e) => console.say(format!("FAILED: {e}")),
        }
        let failed = outcome.is_err();
        report.steps.push(StepReport {
            name,
            outcome,
            elapsed,
        });
        console.bar.inc(1);
        if failed {
            break;
        }
    }
    // A failed step still shuts the machine down and reads its verifier.
    if report.failed_step().is_some()
        && let Some(m) = machine.as_mut()
    {
        let _ = shutdown(m, &mut console, &mut facts, &mut report);
    }
    console.bar.finish_and_clear();
    report.elapsed = started.elapsed();
    report.log = std::mem::take(&mut console.log);
    report.summary = summary(&report, &facts);
    report
}

fn check_options(options: &Options) -> Result<(), String> {
    // The port clients pair any number of HCAs (docs/port-client.md,
    // "Discovery"); two are needed for the surprise removal to leave a
    // survivor with a partner, and beyond eight the run only gets longer.
    if !(MIN_HCAS..=MAX_HCAS).contains(&options.hcas) {
        return Err(format!(
            "--hcas {}: {MIN_HCAS} to {MAX_HCAS} (HCA 2k pairs with HCA 2k + 1, an odd last HCA with itself)",
            options.hcas
        ));
    }
    // After the surprise removal the survivor's traffic runs between two
    // of its own ports (the fabric does not loop a port back to itself).
    if !(2..=4).contains(&options.ports) {
        return Err(format!(
            "--ports {}: 2 to 4 (the survivor of the surprise removal talks between two of its ports)",
            options.ports
        ));
    }
    if options.user_bytes == 0 || options.user_bytes > 1 << 20 {
        return Err(format!(
            "user payload of {} bytes: 1 to 1 MiB",
            options.user_bytes
        ));
    }
    Ok(())
}

fn abi_step(options: &Options, console: &mut Console) -> Result<String, String> {
    let abi = abi::check();
    if options.abi_tables {
        console.say(abi.text.trim_end());
    }
    if abi.problems.is_empty() {
        Ok(format!(
            "{} verb codes distinct and decoding back, RC/UD bring-up legal, CA attributes of the guide's size",
            abi.verbs
        ))
    } else {
        Err(abi.problems.join("; "))
    }
}

fn boot(
    options: &Options,
    console: &mut Console,
    facts: &mut Facts,
) -> Result<(Machine, String), String> {
    let hcas: Vec<(u64, Vec<[u8; 4]>)> = (0..options.hcas)
        .map(|i| {
            let ips = (1..=options.ports).map(|p| [10, 0, i as u8, p]).collect();
            (FIRST_GUID + 0x1000 * i as u64, ips)
        })
        .collect();
    let configs = hcas
        .iter()
        .map(|(guid, ips)| DeviceConfig::with_ports(*guid, ips))
        .collect();
    let host = Arc::new(
        Host::new(HostConfig::deterministic(options.seed, configs)).map_err(|e| e.to_string())?,
    );
    if let Some(path) = &options.capture {
        let file = File::create(path).map_err(|e| format!("{}: {e}", path.display()))?;
        host.backplane()
            .with_cluster(|c| c.capture_to(BufWriter::new(file), CaptureDirections::Transmitted))
            .ok_or("no capture on this host")?
            .map_err(|e| e.to_string())?;
        console.say(format!("capturing the fabric to {}", path.display()));
    }
    // Stand-ins for the services of `inf/` that are not ours to run here;
    // the miniport, the filter and the port client replace theirs.
    let _stand_in_log = sim_host::samples::register_stand_ins(&host);
    MiniportDriver::register(&host, HcaConfig::default());
    IbalBusDriver::register(&host);
    let clients = PortClientDriver::register(&host, options.rounds);
    let guids: Vec<u64> = hcas.iter().map(|(guid, _)| *guid).collect();
    clients.pair_cas(&guids);
    let trace = PowerTrace::attach(&host);
    let root = host.boot();
    let mut machine = Machine {
        nodes: Vec::new(),
        host,
        root,
        clients,
        trace,
        hcas,
        gone: None,
    };
    machine.settle()?;
    machine.nodes = machine.host.hcas();
    machine.trace.take();
    facts.tree = tree::render(&machine.host, root);
    console.say("device tree, bound from inf/*.inf:");
    console.say(facts.tree.trim_end());
    let expected = options.hcas * usize::from(options.ports);
    let started = machine
        .clients
        .devices()
        .iter()
        .filter(|c| {
            c.closed().is_none() && machine.host.pnp().state(c.node()) == Some(PnpState::Started)
        })
        .count();
    if machine.nodes.len() != options.hcas || started != expected {
        return Err(format!(
            "{} HCAs and {started} started port clients; {} and {expected} expected",
            machine.nodes.len(),
            options.hcas
        ));
    }
    Ok((
        machine,
        format!(
            "{} HCAs started, {started} port children each with ibportclient started",
            options.hcas
        ),
    ))
}

fn kernel_clients(
    m: &Machine,
    options: &Options,
    console: &mut Console,
    facts: &mut Facts,
) -> Result<String, String> {
    let pairs = m.pairs();
    for &pair in &pairs {
        let (initiator, responder) = m.pair(pair)?;
        let (i, r) = (initiator.counters(), responder.counters());
        console.say(format!(
            "{pair}: initiator {} and responder {}: {} rounds, {} pongs, {} bad payloads, phases {:?}/{:?}",
            tree::short_name(&m.host, initiator.node()),
            tree::short_name(&m.host, responder.node()),
            i.rounds,
            r.pongs_sent,
            i.bad_payloads + r.bad_payloads,
            initiator.phase(),
            responder.phase()
        ));
        if i.rounds != u64::from(options.rounds) || r.pongs_sent != u64::from(options.rounds) {
            return Err(format!("{pair}: {} rounds of {}", i.rounds, options.rounds));
        }
        if i.bad_payloads + r.bad_payloads != 0 {
            return Err(format!("{pair}: bad payloads"));
        }
        if (initiator.phase(), responder.phase()) != (Phase::Running, Phase::Running) {
            return Err(format!("{pair}: not both running"));
        }
    }
    // A port the pairing leaves alone is said, and must be waiting for a
    // peer, not failed or talking to someone.
    if let Some((hca, port)) = m.unpaired() {
        let client = m.client(hca, port)?;
        let phase = client.phase();
        console.say(format!(
            "HCA {hca} port {port}: no peer (an odd last HCA with an odd port count); its client waits, {phase:?}"
        ));
        if phase != Phase::Discovering || client.counters().rounds != 0 {
            return Err(format!(
                "HCA {hca} port {port} has no peer but its client is {phase:?} with {} rounds",
                client.counters().rounds
            ));
        }
    }
    // More rounds on the live connections, timed.
    let initiators = pairs
        .iter()
        .map(|&p| m.pair(p).map(|(i, _)| i))
        .collect::<Result<Vec<_>, String>>()?;
    let before: u64 = initiators.iter().map(|i| i.counters().rounds).sum();
    let started = Instant::now();
    for initiator in &initiators {
        initiator.run_more(options.rounds);
    }
    m.settle()?;
    let elapsed = started.elapsed();
    let after: u64 = initiators.iter().map(|i| i.counters().rounds).sum();
    let want = u64::from(options.rounds) * pairs.len() as u64;
    if after - before != want {
        return Err(format!("{} more rounds of {want}", after - before));
    }
    let rate = per_second(after - before, elapsed);
    facts.operations.push(format!(
        "kernel clients: {} checked ping-pong rounds (64-byte RC sends both ways), {rate:.0} rounds/s",
        after
    ));
    Ok(format!(
        "{} pairs ran {} checked rounds each; {} more in {:.1} ms ({rate:.0} rounds/s)",
        pairs.len(),
        options.rounds,
        after - before,
        elapsed.as_secs_f64() * 1e3
    ))
}

fn user_traffic_line(what: &str, t: &UserTraffic) -> String {
    let ops = t.sends + t.writes + t.reads + t.atomics;
    format!(
        "{what}: {} sends, {} RDMA writes, {} RDMA reads, {} atomics; {} bytes checked; {:.0} ops/s, {:.1} MB/s",
        t.sends,
        t.writes,
        t.reads,
        t.atomics,
        t.bytes_checked,
        per_second(ops, t.elapsed),
        per_second(t.bytes_checked, t.elapsed) / 1e6
    )
}

fn run_user_app(
    m: &Machine,
    options: &Options,
    console: &mut Console,
    ends: (PortAddress, PortAddress),
    pid: u32,
    sabotage: Option<user_app::Sabotage>,
) -> Result<UserTraffic, String> {
    let process = Process::new(pid);
    let bar = console.bar.clone();
    let total = options.user_rounds;
    let traffic = user_app::run(
        &m.host,
        &process,
        ends,
        options.user_rounds,
        options.user_bytes,
        sabotage,
        &mut |round| {
            if round % 16 == 0 || round == total {
                bar.set_message(format!("user application: round {round}/{total}"));
            }
        },
    );
    // The process ends: everything it had is gone (the library destroyed
    // its objects; the exit closes what is left).
    let locked = process.exit();
    m.settle()?;
    let traffic = traffic?;
    if locked != 0 {
        return Err(format!("{locked} user pages still locked after exit"));
    }
    Ok(traffic)
}

fn user_application(
    m: &Machine,
    options: &Options,
    console: &mut Console,
    facts: &mut Facts,
) -> Result<String, String> {
    if options.sabotage == Some(Sabotage::DropFrames) {
        m.host
            .backplane()
            .with_cluster(|c| {
                c.fabric_mut().set_faults(FaultConfig {
                    drop_ppm: 1_000_000,
                    ..FaultConfig::default()
                })
            })
            .ok_or("no fabric faults on this host")?;
        console.say("sabotage: the fabric now loses every frame");
    }
    let sabotage = (options.sabotage == Some(Sabotage::CorruptRead))
        .then_some(user_app::Sabotage::CorruptRead);
    let ends = (m.address(0, 1), m.address(1, 1));
    let t = run_user_app(m, options, console, ends, 100, sabotage)?;
    let line = user_traffic_line("user application (HCA 0 port 1 -> HCA 1 port 1)", &t);
    console.say(&line);
    facts.operations.push(line);
    Ok(format!(
        "{} rounds through ibal-user and the plugin, every byte and atomic result checked",
        t.sends
    ))
}

fn sleep(m: &Machine, console: &mut Console, facts: &mut Facts) -> Result<String, String> {
    let pairs = m.pairs();
    let pair_counters = |pair: Pair| -> Result<Counters, String> {
        let (x, y) = m.ends(pair)?;
        Ok(sum(x.counters(), y.counters()))
    };
    let before: Vec<Counters> = pairs
        .iter()
        .map(|&p| pair_counters(p))
        .collect::<Result<_, _>>()?;
    // Pings posted and not answered when the sleep starts.
    for &pair in &pairs {
        m.pair(pair)?.0.run_more(1000);
    }
    let families = m.families();
    m.trace.take();
    m.host
        .pnp()
        .set_system_power(SystemPowerState::S3)
        .map_err(|veto| format!("S3 vetoed: {veto}"))?;
    let down = m.trace.take();
    // Checked after the wake: a failure must not leave the machine asleep.
    let asleep = (|| -> Result<(), String> {
        for (k, &ends) in pairs.iter().enumerate() {
            let pair = pair_counters(ends)?;
            let said = pair.goodbyes_acknowledged - before[k].goodbyes_acknowledged;
            let answered = pair.goodbyes_answered - before[k].goodbyes_answered;
            console.say(format!(
                "{ends}: {} rounds ran before the sleep took them, goodbye sent and acknowledged {said}, answered {answered}, waits run out {}",
                pair.rounds - before[k].rounds,
                pair.goodbye_timeouts - before[k].goodbye_timeouts
            ));
            if (said, answered) != (1, 1) || pair.goodbye_timeouts != before[k].goodbye_timeouts {
                return Err(format!(
                    "{ends}: the goodbye was not answered over the fabric"
                ));
            }
            if pair.rounds <= before[k].rounds {
                return Err(format!("{ends}: no traffic was running"));
            }
            if pair.rounds != pair.pongs_sent || pair.bad_payloads != 0 {
                return Err(format!(
                    "{ends}: {} rounds, {} pongs, {} bad: a round was lost",
                    pair.rounds, pair.pongs_sent, pair.bad_payloads
                ));
            }
        }
        Ok(())
    })();
    m.host
        .pnp()
        .set_system_power(SystemPowerState::S0)
        .map_err(|veto| format!("S0 vetoed: {veto}"))?;
    m.settle()?;
    asleep?;
    let up = m.trace.take();
    let down_lines = tree::render_steps(&m.host, &down);
    let up_lines = tree::render_steps(&m.host, &up);
    console.say("S0 -> S3 (sleep), in the order the drivers' D0 exits ran:");
    for line in &down_lines {
        console.say(format!("  {line}"));
    }
    console.say("S3 -> S0 (wake), in the order the drivers' D0 entries ran:");
    for line in &up_lines {
        console.say(format!("  {line}"));
    }
    tree::check_order(&m.host, &down, &families, true)?;
    tree::check_order(&m.host, &up, &families, false)?;
    facts.power_order = down_lines
        .iter()
        .map(|l| format!("sleep: {l}"))
        .chain(up_lines.iter().map(|l| format!("wake:  {l}")))
        .collect();
    for (k, &ends) in pairs.iter().enumerate() {
        let pair = pair_counters(ends)?;
        let (x, y) = m.ends(ends)?;
        if pair.connections - before[k].connections != 2
            || (x.phase(), y.phase()) != (Phase::Running, Phase::Running)
        {
            return Err(format!(
                "{ends}: not reconnected after wake ({:?}/{:?})",
                x.phase(),
                y.phase()
            ));
        }
        if pair.bad_payloads != 0 {
            return Err(format!("{ends}: bad payloads after wake"));
        }
    }
    let children: usize = families.iter().map(|(_, c)| c.len()).sum();
    Ok(format!(
        "{children} children left D0 before their HCA and came back after it; every pair said goodbye with no round lost and reconnected"
    ))
}

fn surprise_removal(
    m: &mut Machine,
    options: &Options,
    console: &mut Console,
    facts: &mut Facts,
) -> Result<String, String> {
    // The HCA of the first pair's responder goes: the initiators on its
    // partner have a ping in flight to a peer that vanishes without a
    // goodbye.
    let pairs = m.pairs();
    let responder = m.pair(pairs[0])?.1;
    let gone = m
        .hcas
        .iter()
        .position(|(guid, _)| {
            responder
                .port_data()
                .is_some_and(|d| d.ca_guid.get() == *guid)
        })
        .ok_or("the responder's HCA")?;
    // The survivors' initiators whose peer is on the HCA that goes, with
    // their connections lost so far.
    let mut cut_off = Vec::new();
    for &pair in &pairs {
        let (initiator, _) = m.pair(pair)?;
        if pair.has_hca(gone)
            && initiator
                .port_data()
                .is_none_or(|d| d.ca_guid.get() != m.hcas[gone].0)
        {
            cut_off.push((initiator.clone(), initiator.counters().connections_lost));
        }
        initiator.run_more(1000);
    }
    let goodbyes_before: Vec<Counters> = m
        .ports()
        .map(|port| m.client(gone, port).map(|c| c.counters()))
        .collect::<Result<_, _>>()?;
    let node = m.nodes[gone];
    console.say(format!(
        "surprise removal of HCA {gone} ({}) with pings in flight towards it",
        tree::short_name(&m.host, node)
    ));
    m.host.pnp().surprise_remove(node);
    m.settle()?;
    m.gone = Some(gone);
    let survivors: Vec<usize> = (0..m.hcas.len()).filter(|&h| h != gone).collect();
    for (port, before) in m.ports().zip(goodbyes_before) {
        let lost = m.client(gone, port)?;
        let c = lost.counters();
        // No fabric to say goodbye on: nothing tried, nothing waited for.
        let said = c.goodbyes_acknowledged - before.goodbyes_acknowledged;
        let waited = c.goodbye_timeouts - before.goodbye_timeouts;
        if lost.closed() != Some(Ok(())) || said != 0 || waited != 0 {
            return Err(format!(
                "HCA {gone} port {port}: closed {:?}, goodbyes {said}, waits run out {waited}",
                lost.closed(),
            ));
        }
    }
    for &hca in &survivors {
        for port in m.ports() {
            let stays = m.client(hca, port)?;
            let refused = stays
                .stats()
                .refused
                .load(std::sync::atomic::Ordering::Relaxed);
            if stays.closed().is_some() || refused != 0 {
                return Err(format!(
                    "HCA {hca} port {port}: closed {:?}, {refused} requests refused",
                    stays.closed()
                ));
            }
            console.say(format!(
                "HCA {hca} port {port}: AL open, {:?}, connections lost {}",
                stays.phase(),
                stays.counters().connections_lost
            ));
        }
    }
    // An initiator's ping ran out of retries: it tore the connection down
    // and waits for a peer.
    for (initiator, lost_before) in &cut_off {
        if initiator.counters().connections_lost != lost_before + 1
            || initiator.phase() != Phase::PeerClosed
        {
            return Err(format!(
                "{}: the lost connection was not noticed ({:?})",
                tree::short_name(&m.host, initiator.node()),
                initiator.phase()
            ));
        }
    }
    // The pairs the removal did not touch run on.
    for &pair in pairs.iter().filter(|p| !p.has_hca(gone)) {
        let (x, y) = m.ends(pair)?;
        if (x.phase(), y.phase()) != (Phase::Running, Phase::Running) {
            return Err(format!(
                "{pair}: {:?}/{:?} after another HCA's removal",
                x.phase(),
                y.phase()
            ));
        }
    }
    // The survivor keeps working: a user application between two of its
    // ports.
    let survivor = survivors[0];
    let ends = (m.address(survivor, 1), m.address(survivor, 2));
    let t = run_user_app(m, options, console, ends, 101, None)?;
    let line = user_traffic_line(
        &format!(
            "user application on the survivor (HCA {survivor} port {} -> port {})",
            ends.0.port, ends.1.port
        ),
        &t,
    );
    console.say(&line);
    facts.operations.push(line);
    let left = m.host.hcas().len();
    if left != survivors.len() {
        return Err(format!(
            "{left} HCAs in the tree, {} expected",
            survivors.len()
        ));
    }
    facts.tree = tree::render(&m.host, m.root);
    Ok(format!(
        "HCA {gone} gone, its clients closed without a word; the survivors' clients saw the loss with their AL open; checked traffic on HCA {survivor}"
    ))
}

/// Plugs the removed HCA in again: its port children and clients come
/// back, reconnect to their peers and run checked rounds.
fn replug(
    m: &mut Machine,
    options: &Options,
    console: &mut Console,
    facts: &mut Facts,
) -> Result<String, String> {
    let gone = m.gone.ok_or("no HCA was removed")?;
    m.host
        .replug_hca(gone)
        .map_err(|status| format!("re-plug of HCA {gone}: {status:?}"))?;
    m.settle()?;
    m.nodes = m.host.hcas();
    if m.nodes.len() != m.hcas.len() {
        return Err(format!(
            "{} HCAs in the tree after the re-plug, {} expected",
            m.nodes.len(),
            m.hcas.len()
        ));
    }
    let node = m.nodes[gone];
    let pnp = m.host.pnp();
    let children = pnp
        .children(node)
        .into_iter()
        .filter(|c| pnp.state(*c) == Some(PnpState::Started))
        .count();
    console.say(format!(
        "HCA {gone} plugged in again as {}: {children} port children started",
        tree::short_name(&m.host, node)
    ));
    if children != usize::from(options.ports) {
        return Err(format!(
            "HCA {gone}: {children} port children started, {} expected",
            options.ports
        ));
    }
    let pairs: Vec<Pair> = m.pairs().into_iter().filter(|p| p.has_hca(gone)).collect();
    let mut rounds = 0;
    for &pair in &pairs {
        let (initiator, responder) = m.pair(pair)?;
        let (i, r) = (initiator.counters(), responder.counters());
        // The new client on the re-plugged HCA counts from zero: it ran
        // this connection's rounds whichever role it has.
        let initiator_is_new = initiator
            .port_data()
            .is_some_and(|d| d.ca_guid.get() == m.hcas[gone].0);
        let new = if initiator_is_new {
            i.rounds
        } else {
            r.pongs_sent
        };
        console.say(format!(
            "{pair}: reconnected, {:?}/{:?}, {new} rounds on the new connection",
            initiator.phase(),
            responder.phase()
        ));
        if (initiator.phase(), responder.phase()) != (Phase::Running, Phase::Running)
            || new != u64::from(options.rounds)
            || i.bad_payloads + r.bad_payloads != 0
        {
            return Err(format!(
                "{pair}: {:?}/{:?}, {new} rounds of {} after the re-plug",
                initiator.phase(),
                responder.phase(),
                options.rounds
            ));
        }
        let before = i.rounds;
        initiator.run_more(options.rounds);
        m.settle()?;
        let more = initiator.counters().rounds - before;
        if more != u64::from(options.rounds) {
            return Err(format!("{pair}: {more} more rounds of {}", options.rounds));
        }
        rounds += u64::from(options.rounds) + more;
    }
    // A user application across the re-plugged HCA and its partner.
    let partner = pairs
        .first()
        .map(|p| if p.0.0 == gone { p.1 } else { p.0 })
        .ok_or("no pair on the re-plugged HCA")?;
    let ends = (m.address(gone, 1), m.address(partner.0, partner.1));
    let t = run_user_app(m, options, console, ends, 102, None)?;
    let line = user_traffic_line(
        &format!(
            "user application after the re-plug (HCA {gone} port 1 -> HCA {} port {})",
            partner.0, partner.1
        ),
        &t,
    );
    console.say(&line);
    facts.operations.push(line);
    facts.tree = tree::render(&m.host, m.root);
    Ok(format!(
        "HCA {gone} back with {children} port clients; {} pairs reconnected and ran {rounds} checked rounds; user traffic checked",
        pairs.len()
    ))
}

fn shutdown(
    m: &mut Machine,
    console: &mut Console,
    facts: &mut Facts,
    report: &mut Report,
) -> Result<String, String> {
    if report.violations.is_some() {
        return Ok("already shut down".into());
    }
    m.host.shut_down();
    let violations: Vec<String> = m
        .host
        .verifier()
        .violations()
        .iter()
        .map(ToString::to_string)
        .collect();
    facts.frames = m
        .host
        .backplane()
        .with_cluster(|c| c.fabric().total_counters().tx_frames);
    if let Some(capture) = m
        .host
        .backplane()
        .with_cluster(|c| c.finish_capture::<BufWriter<File>>())
    {
        match capture {
            Ok(writer) => {
                writer
                    .into_inner()
                    .map_err(|e| format!("capture: {e}"))?
                    .sync_all()
                    .map_err(|e| format!("capture: {e}"))?;
            }
            Err(sim_hca::cluster::CaptureError::NotCapturing) => {}
            Err(e) => return Err(format!("capture: {e}")),
        }
    }
    // Kernel-stack overuse is a violation; the high-water marks say how
    // close each kind of routine came (docs/host-model.md, "Kernel stack").
    let high_water = sim_host::stack::high_water()
        .iter()
        .map(|(kind, bytes)| format!("{kind:?} {:.1} KiB", *bytes as f64 / 1024.0))
        .collect::<Vec<_>>()
        .join(", ");
    facts.stacks = Some(format!(
        "kernel stacks used (most, this process): {high_water}; budget {} KiB in this build",
        sim_host::stack::budget() / 1024
    ));
    report.violations = Some(violations.clone());
    for v in &violations {
        console.say(format!("verifier: {v}"));
    }
    let mut problems = Vec::new();
    for client in m.clients.devices() {
        if client.closed() != Some(Ok(())) || client.driver_references() != 0 {
            problems.push(format!(
                "{}: closed {:?}, {} references",
                tree::short_name(&m.host, client.node()),
                client.closed(),
                client.driver_references()
            ));
        }
    }
    if !violations.is_empty() {
        problems.push(format!("{} verifier violation(s)", violations.len()));
    }
    if problems.is_empty() {
        Ok(format!(
            "every driver unloaded, {} port clients closed their AL, verifier: 0 violations",
            m.clients.devices().len()
        ))
    } else {
        Err(problems.join("; "))
    }
}

/// The closing report.
fn summary(report: &Report, facts: &Facts) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "\n== main job report ==");
    if !facts.tree.is_empty() {
        let _ = writeln!(out, "device tree (at the end):\n{}", facts.tree.trim_end());
    }
    if !facts.power_order.is_empty() {
        let _ = writeln!(
            out,
            "power order (children before HCA going down, after it coming up):"
        );
        for line in &facts.power_order {
            let _ = writeln!(out, "  {line}");
        }
    }
    if !facts.operations.is_empty() {
        let _ = writeln!(out, "operations and rates (wall clock):");
        for line in &facts.operations {
            let _ = writeln!(out, "  {line}");
        }
    }
    if let Some(frames) = facts.frames {
        let _ = writeln!(out, "frames on the fabric: {frames}");
    }
    let _ = writeln!(out, "steps:");
    for step in &report.steps {
        let _ = match &step.outcome {
            Ok(line) => writeln!(out, "  ok     {:<26} {line}", step.name),
            Err(e) => writeln!(out, "  FAILED {:<26} {e}", step.name),
        };
    }
    if let Some(stacks) = &facts.stacks {
        let _ = writeln!(out, "{stacks}");
    }
    let _ = match &report.violations {
        Some(v) => writeln!(out, "verifier report: {} violation(s)", v.len()),
        None => writeln!(out, "verifier report: not reached"),
    };
    let _ = writeln!(
        out,
        "{} in {:.2} s",
        if report.success() {
            "SUCCESS"
        } else {
            "FAILURE"
        },
        report.elapsed.as_secs_f64()
    );
    out
}
