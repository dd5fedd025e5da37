//! AdamW as PyTorch / HF `Trainer` run it, with its state (first and second moments, step)
//! in the open so that checkpoints can save it and `--resume` continue exactly. candle-nn's
//! `AdamW` keeps its moments private, which makes an exact resume impossible.

use std::collections::HashMap;
use std::path::Path;

use candle_core::backprop::GradStore;
use candle_core::{DType, Result, Tensor, Var};

/// Hyper-parameters (HF defaults: β₁ 0.9, β₂ 0.999, ε 1e-8, no weight decay).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamWParams {
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
}

impl Default for AdamWParams {
    fn default() -> Self {
        Self {
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
        }
    }
}

/// The optimizer over named variables.
pub struct AdamW {
    params: AdamWParams,
    vars: Vec<(String, Var)>,
    m: Vec<Tensor>,
    v: Vec<Tensor>,
    /// Updates applied so far.
    step: u64,
}

impl AdamW {
    pub fn new(vars: Vec<(String, Var)>, params: AdamWParams) -> Result<Self> {
        let zeros = |v: &Var| Tensor::zeros(v.shape(), DType::F32, v.device());
        let m = vars.iter().map(|(_, v)| zeros(v)).collect::<Result<_>>()?;
        let v = vars.iter().map(|(_, v)| zeros(v)).collect::<Result<_>>()?;
        Ok(Self {
            params,
            vars,
            m,
            v,
            step: 0,
        })
    }

    pub fn step_count(&self) -> u64 {
        self.step
    }

    /// One update with learning rate `lr` (`torch.optim.AdamW`: decoupled decay, then the
    /// bias-corrected Adam step). Variables without a gradient are left alone. Moments are
    /// kept in f32 whatever the weights' dtype.
    pub fn step(&mut self, grads: &GradStore, lr: f64) -> Result<()> {
        self.step += 1;
        let p = self.params;
        let bc1 = 1.0 - p.beta1.powi(self.step as i32);
        let bc2 = 1.0 - p.beta2.powi(self.step as i32);
        for (i, (_, var)) in self.vars.iter().enumerate() {
            let Some(g) = grads.get(var.as_tensor()) else {
                continue;
            };
            let g = g.to_dtype(DType::F32)?;
            let m = ((&self.m[i] * p.beta1)? + (&g * (1.0 - p.beta1))?)?;
            let v = ((&self.v[i] * p.beta2)? + (g.sqr()? * (1.0 - p.beta2))?)?;
            let theta = var.as_tensor().to_dtype(DType::F32)?;
            let theta = if p.weight_decay > 0.0 {
                (theta * (1.0 - lr * p.weight_decay))?
            } else {
                theta
            };
            let denom = ((&v / bc2)?.sqrt()? + p.eps)?;
            let update = ((&m / bc1)? / denom)?;
            let next = (theta - (update * lr)?)?;
            var.set(&next.to_dtype(var.dtype())?)?;
            self.m[i] = m;
            self.v[i] = v;
        }
        Ok(())
    }

    /// Writes the moments (`m.<name>`, `v.<name>`) to a safetensors file; the step count goes
    /// to the caller's trainer state.
    pub fn save(&self, path: &Path) -> Result<()> {
        let mut map = HashMap::new();
        for (i, (name, _)) in self.vars.iter().enumerate() {
            map.insert(format!("m.{name}"), self.m[i].clone());
            map.insert(format!("v.{name}"), self.v[i].clone());
        }
        candle_core::safetensors::save(&map, path)
    }

    /// Restores moments saved by [`AdamW::save`] and the step count.
    pub fn load(&mut self, path: &Path, step: u64) -> Result<()> {
        let dev = self
            .vars
            .first()
            .map(|(_, v)| v.device().clone())
            .unwrap_or(candle_core::Device::Cpu);
        let mut map = candle_core::safetensors::load(path, &dev)?;
        for (i, (name, var)) in self.vars.iter().enumerate() {
            for (kind, slot) in [("m", &mut self.m[i]), ("v", &mut self.v[i])] {
                let key = format!("{kind}.{name}");
                let t = map.remove(&key).ok_or_else(|| {
                    candle_core::Error::Msg(format!(
                        "{}: optimizer state has no `{key}`",
                        path.display()
                    ))
                })?;
                if t.dims() != var.dims() {
                    candle_core::bail!(
                        "{}: `{key}` has shape {:?}, expected {:?}",
                        path.display(),
                        t.dims(),
                        var.dims()
                    );
                }
                *slot = t.to_dtype(DType::F32)?;
            }
        }
        self.step = step;
        Ok(())
    }

    /// The moments, for tests that compare optimizer states.
    pub fn moments(&self) -> (&[Tensor], &[Tensor]) {
        (&self.m, &self.v)
    }
}
