//! Critical sleep (`docs/host-model.md`, "Critical sleep"): the power
//! manager may send set-power with no query, or after a driver vetoed the
//! query, and a driver must survive both. Shown with a small function
//! driver in three variants: one that handles it, one that prepares for
//! sleep only in the query (and so finds itself unprepared), and one that
//! refuses the sleep it vetoed.

use std::sync::{Arc, Mutex};

use driver_platform::{DevicePowerState, SystemPowerState};
use ib_types::status::NtStatus;
use sim_host::driver::{DeviceCallbacks, DeviceInit, DriverEntry, SUCCESS, UNSUCCESSFUL};
use sim_host::pnp::{Binder, DeviceServices, PnpManager, StackPlan};
use sim_host::power::CriticalSleep;
use sim_host::verifier::{Verifier, ViolationKind};

type Log = Arc<Mutex<Vec<String>>>;

/// How the sample driver treats query-power.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Variant {
    /// Vetoes the query (it is busy) but saves its device state in D0
    /// exit, whatever came before: correct.
    VetoesButSurvives,
    /// Saves its device state in the query and refuses D0 exit without
    /// it: assumes every sleep is queried first.
    SavesOnlyInQuery,
    /// Vetoes the query and then refuses the D0 exit that follows:
    /// assumes a vetoed sleep never happens.
    RefusesWhatItVetoed,
}

struct SampleBinder;

impl Binder for SampleBinder {
    fn bind(&self, _: &str, _: &[String], _: &[String]) -> Result<StackPlan, String> {
        Ok(StackPlan {
            function: "sample".into(),
            upper_filters: vec![],
            lower_filters: vec![],
            security: None,
        })
    }
}

struct Sample {
    variant: Variant,
    log: Log,
    /// The device state saved for the sleep (what a real driver keeps
    /// while the device is in D3).
    saved: Mutex<Option<u32>>,
    vetoed: Mutex<bool>,
    started: Mutex<bool>,
}

impl Sample {
    fn note(&self, what: &str) {
        self.log.lock().unwrap().push(what.to_owned());
    }
}

impl DeviceCallbacks for Sample {
    fn query_power(&self, _target: SystemPowerState) -> NtStatus {
        self.note("query");
        match self.variant {
            Variant::SavesOnlyInQuery => {
                *self.saved.lock().unwrap() = Some(0x5A);
                SUCCESS
            }
            Variant::VetoesButSurvives | Variant::RefusesWhatItVetoed => {
                *self.vetoed.lock().unwrap() = true;
                UNSUCCESSFUL
            }
        }
    }
    fn d0_exit(&self, _to: DevicePowerState) -> NtStatus {
        self.note("d0_exit");
        match self.variant {
            Variant::VetoesButSurvives => {
                *self.saved.lock().unwrap() = Some(0x5A);
                SUCCESS
            }
            Variant::SavesOnlyInQuery if self.saved.lock().unwrap().is_none() => UNSUCCESSFUL,
            Variant::RefusesWhatItVetoed if *self.vetoed.lock().unwrap() => UNSUCCESSFUL,
            _ => SUCCESS,
        }
    }
    fn d0_entry(&self, _from: DevicePowerState) -> NtStatus {
        self.note("d0_entry");
        *self.vetoed.lock().unwrap() = false;
        let mut started = self.started.lock().unwrap();
        if !*started {
            *started = true;
            return SUCCESS; // the first start: nothing to restore
        }
        match self.saved.lock().unwrap().take() {
            Some(_) => SUCCESS,
            // Nothing to restore the device from.
            None => UNSUCCESSFUL,
        }
    }
}

struct SampleDriver {
    variant: Variant,
    log: Log,
}

impl DriverEntry for SampleDriver {
    fn add_device(
        &self,
        _: &DeviceInit,
        _: &DeviceServices,
    ) -> Result<Arc<dyn DeviceCallbacks>, NtStatus> {
        Ok(Arc::new(Sample {
            variant: self.variant,
            log: self.log.clone(),
            saved: Mutex::new(None),
            vetoed: Mutex::new(false),
            started: Mutex::new(false),
        }))
    }
}

/// A root-enumerated device under the sample, started; the log cleared.
fn machine(variant: Variant) -> (PnpManager, Verifier, Log) {
    let verifier = Verifier::new();
    let pnp = PnpManager::new(verifier.clone(), Box::new(SampleBinder));
    let log = Log::default();
    pnp.register_driver(
        "sample",
        Arc::new(SampleDriver {
            variant,
            log: log.clone(),
        }),
    );
    struct RootPdo;
    impl DeviceCallbacks for RootPdo {}
    let node = pnp.add_device(
        None,
        "ROOT\\SAMPLE\\0000",
        vec![],
        vec![],
        Arc::new(RootPdo),
    );
    assert_eq!(pnp.power(node), Some(DevicePowerState::D0));
    log.lock().unwrap().clear();
    (pnp, verifier, log)
}

fn taken(log: &Log) -> Vec<String> {
    std::mem::take(&mut *log.lock().unwrap())
}

/// The violations, as `(driver, detail)` of each `Protocol` one.
fn protocol_violations(v: &Verifier) -> Vec<(Option<String>, String)> {
    v.take()
        .into_iter()
        .map(|v| match v.kind {
            ViolationKind::Protocol { detail } => (v.driver, detail),
            other => panic!("unexpected violation {other:?}"),
        })
        .collect()
}

#[test]
fn an_ordinary_sleep_is_queried_and_a_veto_stops_it() {
    let (pnp, verifier, log) = machine(Variant::VetoesButSurvives);
    let veto = pnp.set_system_power(SystemPowerState::S3).unwrap_err();
    assert_eq!(veto.service, "sample");
    assert_eq!(taken(&log), ["query"], "nothing moved after the veto");
    verifier.assert_clean();
}

#[test]
fn a_critical_sleep_after_a_veto_still_sleeps_and_a_correct_driver_survives_it() {
    let (pnp, verifier, log) = machine(Variant::VetoesButSurvives);
    let overridden = pnp.set_system_power_critical(SystemPowerState::S3, CriticalSleep::AfterVeto);
    assert_eq!(overridden.len(), 1, "the veto is reported: {overridden:?}");
    assert_eq!(overridden[0].service, "sample");
    let node = pnp.find("ROOT\\SAMPLE\\0000").unwrap();
    assert_eq!(pnp.power(node), Some(DevicePowerState::D3), "slept anyway");
    pnp.set_system_power(SystemPowerState::S0).unwrap();
    assert_eq!(taken(&log), ["query", "d0_exit", "d0_entry"]);
    verifier.assert_clean();
}

#[test]
fn a_critical_sleep_without_a_query_sends_none_and_a_correct_driver_survives_it() {
    let (pnp, verifier, log) = machine(Variant::VetoesButSurvives);
    let overridden = pnp.set_system_power_critical(SystemPowerState::S4, CriticalSleep::Unqueried);
    assert!(overridden.is_empty());
    pnp.set_system_power_critical(SystemPowerState::S0, CriticalSleep::Unqueried);
    assert_eq!(taken(&log), ["d0_exit", "d0_entry"], "no query at all");
    verifier.assert_clean();
}

#[test]
fn a_driver_that_prepares_only_in_the_query_is_caught_by_an_unqueried_sleep() {
    // Queried sleeps hide the defect.
    let (pnp, verifier, _log) = machine(Variant::SavesOnlyInQuery);
    pnp.set_system_power(SystemPowerState::S3).unwrap();
    pnp.set_system_power(SystemPowerState::S0).unwrap();
    verifier.assert_clean();
    // A failing battery sleeps without asking.
    pnp.set_system_power_critical(SystemPowerState::S3, CriticalSleep::Unqueried);
    pnp.set_system_power(SystemPowerState::S0).unwrap();
    let violations = protocol_violations(&verifier);
    assert_eq!(violations.len(), 2, "{violations:?}");
    assert_eq!(violations[0].0.as_deref(), Some("sample"));
    assert!(violations[0].1.contains("D0 exit failed"), "{violations:?}");
    assert!(violations[1].1.contains("resume"), "{violations:?}");
    assert!(
        violations[1].1.contains("D0 entry failed"),
        "{violations:?}"
    );
}

#[test]
fn a_driver_that_refuses_the_sleep_it_vetoed_is_caught() {
    let (pnp, verifier, log) = machine(Variant::RefusesWhatItVetoed);
    assert!(pnp.set_system_power(SystemPowerState::S3).is_err());
    verifier.assert_clean();
    let overridden = pnp.set_system_power_critical(SystemPowerState::S3, CriticalSleep::AfterVeto);
    assert_eq!(overridden.len(), 1);
    assert_eq!(taken(&log), ["query", "query", "d0_exit"]);
    let violations = protocol_violations(&verifier);
    assert_eq!(violations.len(), 1, "{violations:?}");
    assert_eq!(violations[0].0.as_deref(), Some("sample"));
    assert!(violations[0].1.contains("D0 exit failed"), "{violations:?}");
}
