//! The host's binder: built-in drivers (the PCI bus) by hardware ID, then
//! our INF files, whose registry sections are applied as the device
//! installs. See `docs/host-model.md` (Binding).

use crate::inf::InfSet;
use crate::pnp::{Binder, StackPlan};
use crate::registry::RegistryStore;

/// Binds devices from built-in rules first, then from an [`InfSet`].
#[derive(Debug)]
pub struct InfBinder {
    infs: InfSet,
    registry: RegistryStore,
    builtin: Vec<(String, String)>,
    arch: &'static str,
}

impl InfBinder {
    /// Binds from `infs` for amd64 and writes INF registry sections to
    /// `registry`.
    pub fn new(infs: InfSet, registry: RegistryStore) -> Self {
        Self {
            infs,
            registry,
            builtin: Vec::new(),
            arch: "NTamd64",
        }
    }

    /// Binds `hardware_id` to the in-box driver `service` without an INF
    /// (Windows ships these in its own INFs: `machine.inf` for the PCI bus).
    pub fn with_builtin(mut self, hardware_id: &str, service: &str) -> Self {
        self.builtin
            .push((hardware_id.to_owned(), service.to_owned()));
        self
    }

    /// Binds for another architecture (`NTarm64`, `NTx86`).
    pub fn for_arch(mut self, arch: &'static str) -> Self {
        self.arch = arch;
        self
    }
}

impl Binder for InfBinder {
    fn bind(
        &self,
        instance_path: &str,
        hardware_ids: &[String],
        compatible_ids: &[String],
    ) -> Result<StackPlan, String> {
        if let Some((_, service)) = self
            .builtin
            .iter()
            .find(|(id, _)| hardware_ids.iter().any(|h| h.eq_ignore_ascii_case(id)))
        {
            return Ok(StackPlan {
                function: service.clone(),
                upper_filters: Vec::new(),
                lower_filters: Vec::new(),
                security: None,
            });
        }
        let hw: Vec<&str> = hardware_ids.iter().map(String::as_str).collect();
        let compat: Vec<&str> = compatible_ids.iter().map(String::as_str).collect();
        let binding = self
            .infs
            .bind(&hw, &compat, self.arch)
            .map_err(|e| e.to_string())?;
        binding
            .apply(&self.registry, instance_path)
            .map_err(|e| format!("installing from {}: {e}", binding.inf_name))?;
        Ok(StackPlan {
            function: binding.function_service,
            upper_filters: binding.upper_filters,
            lower_filters: binding.lower_filters,
            security: binding.security,
        })
    }
}
