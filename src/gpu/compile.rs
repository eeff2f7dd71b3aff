//! Compiling pipelines on a device: a [`PipelineSpec`] (or a wrapper's typed key) to a
//! compute pipeline, validated by naga first and kept in the device's
//! [`PipelineCache`](super::pipeline::PipelineCache)
//! (`pipeline.rs`, below the [`Gpu`] that owns it).

use super::pipeline::{PipelineKey, PipelineSpec};
use super::Gpu;
use crate::{Error, Result};
use std::collections::HashMap;
use std::sync::Arc;

impl Gpu {
    /// The pipeline of a wrapper's typed `key`: one lookup in a map of that key type, without
    /// building the variant's label and defines. [`PipelineKey::spec`] makes them on the
    /// key's first use, compiled through [`Gpu::pipeline`] (so two keys of the same variant
    /// share its pipeline).
    pub fn pipeline_for<K: PipelineKey>(&self, key: K) -> Result<Arc<wgpu::ComputePipeline>> {
        type Map<K> = HashMap<K, Arc<wgpu::ComputePipeline>>;
        let id = std::any::TypeId::of::<K>();
        {
            let typed = self.pipelines.typed.lock().unwrap();
            if let Some(p) = typed
                .get(&id)
                .and_then(|m| m.downcast_ref::<Map<K>>())
                .and_then(|m| m.get(&key))
            {
                return Ok(p.clone());
            }
        }
        let p = self.pipeline(&key.spec())?;
        let mut typed = self.pipelines.typed.lock().unwrap();
        typed
            .entry(id)
            .or_insert_with(|| Box::new(Map::<K>::new()))
            .downcast_mut::<Map<K>>()
            .expect("one map type per key type")
            .insert(key, p.clone());
        Ok(p)
    }

    /// The pipeline for `spec`, compiled on first use. Shader errors become `Error::Gpu`
    /// naming the variant (never a panic).
    pub fn pipeline(&self, spec: &PipelineSpec) -> Result<Arc<wgpu::ComputePipeline>> {
        let key = spec.key();
        if let Some(bucket) = self.pipelines.map.lock().unwrap().get(&key) {
            if let Some((p, _)) = bucket.iter().find(|(_, s)| s.same_variant(spec)) {
                return Ok(p.clone());
            }
        }
        let wgsl = spec.wgsl()?;
        // Validate with naga first: wgpu would report a bad shader through the uncaptured
        // error handler and hand back an invalid pipeline.
        let module = naga::front::wgsl::parse_str(&wgsl).map_err(|e| {
            Error::Gpu(format!(
                "{}: WGSL parse error: {}",
                spec.label,
                e.emit_to_string(&wgsl)
            ))
        })?;
        naga::valid::Validator::new(
            naga::valid::ValidationFlags::all(),
            naga::valid::Capabilities::all(),
        )
        .validate(&module)
        .map_err(|e| {
            Error::Gpu(format!(
                "{}: WGSL validation error: {}",
                spec.label,
                e.emit_to_string(&wgsl)
            ))
        })?;
        // Bounds checks stay on; naga's forced loop bounding is off: its counter in every
        // loop stops drivers from unrolling, and register arrays then spill (measured 4-5x
        // slower attention on the H200). Every lathe loop has a trip count bounded by its
        // uniforms, so the counter only guards against our own bugs.
        // A spec marked `unchecked` drops the bounds checks too (see `PipelineSpec::unchecked`).
        let checks = wgpu::ShaderRuntimeChecks {
            force_loop_bounding: false,
            bounds_checks: !spec.unchecked,
            ..wgpu::ShaderRuntimeChecks::checked()
        };
        // SAFETY: the module was validated by naga above; runtime bounds checks remain but
        // for specs whose wrappers prove their indices in range (`PipelineSpec::unchecked`);
        // the infinite-loop guard is dropped (see above).
        let sm = unsafe {
            self.device.create_shader_module_trusted(
                wgpu::ShaderModuleDescriptor {
                    label: Some(&spec.label),
                    source: wgpu::ShaderSource::Wgsl(wgsl.into()),
                },
                checks,
            )
        };
        let p = self
            .device
            .create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
                label: Some(&spec.label),
                layout: None,
                module: &sm,
                entry_point: Some(spec.entry),
                compilation_options: Default::default(),
                cache: self.disk_cache.as_ref().map(|c| c.cache()),
            });
        if let Some(c) = &self.disk_cache {
            c.touch();
        }
        self.check()?;
        let p = Arc::new(p);
        self.pipelines
            .map
            .lock()
            .unwrap()
            .entry(key)
            .or_default()
            .push((p.clone(), spec.clone()));
        Ok(p)
    }

    /// Every pipeline variant compiled so far (for the cross-backend translation test).
    pub fn compiled_specs(&self) -> Vec<PipelineSpec> {
        let mut v: Vec<PipelineSpec> = self
            .pipelines
            .map
            .lock()
            .unwrap()
            .values()
            .flatten()
            .map(|(_, s)| s.clone())
            .collect();
        v.sort_by(|a, b| a.label.cmp(&b.label));
        v
    }
}
