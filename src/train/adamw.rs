//! AdamW as PyTorch / HF `Trainer` run it, with its state (first and second moments, step)
//! in the open so that checkpoints can save it and `--resume` continue exactly. candle-nn's
//! `AdamW` keeps its moments private, which makes an exact resume impossible.

use std::cell::RefCell;
use std::collections::HashMap;
use std::path::Path;

use candle_core::backprop::GradStore;
use candle_core::{CpuStorage, DType, InplaceOp1, Layout, Result, Tensor, Var};

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

/// First and second moments of one variable: plain host vectors on the CPU (updated by one
/// fused, parallel pass), tensors on other devices.
enum Moments {
    Host { m: Vec<f32>, v: Vec<f32> },
    Device { m: Tensor, v: Tensor },
}

/// The optimizer over named variables.
pub struct AdamW {
    params: AdamWParams,
    vars: Vec<(String, Var)>,
    moments: Vec<Moments>,
    /// Updates applied so far.
    step: u64,
}

/// Scalars of one update.
#[derive(Clone, Copy)]
struct Coefs {
    lr: f64,
    beta1: f64,
    beta2: f64,
    eps: f64,
    decay: f64,
    bc1: f64,
    bc2: f64,
}

/// One fused AdamW pass over a slice (torch's formula, f32 storage, f64 scalars folded in).
fn update_host(theta: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32], c: Coefs) {
    use rayon::prelude::*;
    const CHUNK: usize = 1 << 14;
    let b1 = c.beta1 as f32;
    let b2 = c.beta2 as f32;
    let keep = (1.0 - c.lr * c.decay) as f32;
    let step = (c.lr / c.bc1) as f32;
    let inv_sqrt_bc2 = (1.0 / c.bc2.sqrt()) as f32;
    let eps = c.eps as f32;
    theta
        .par_chunks_mut(CHUNK)
        .zip(g.par_chunks(CHUNK))
        .zip(m.par_chunks_mut(CHUNK))
        .zip(v.par_chunks_mut(CHUNK))
        .for_each(|(((t, g), m), v)| {
            for i in 0..t.len() {
                let gi = g[i];
                m[i] = b1 * m[i] + (1.0 - b1) * gi;
                v[i] = b2 * v[i] + (1.0 - b2) * gi * gi;
                let denom = v[i].sqrt() * inv_sqrt_bc2 + eps;
                t[i] = t[i] * keep - step * m[i] / denom;
            }
        });
}

/// The fused update applied to an f32 weight's own storage.
struct HostUpdate<'a> {
    g: &'a [f32],
    moments: RefCell<(&'a mut Vec<f32>, &'a mut Vec<f32>)>,
    c: Coefs,
}

impl InplaceOp1 for HostUpdate<'_> {
    fn name(&self) -> &'static str {
        "adamw"
    }

    fn cpu_fwd(&self, storage: &mut CpuStorage, layout: &Layout) -> Result<()> {
        let theta = super::ops::cpu_f32_mut(storage, layout, "weight")?;
        let mut moments = self.moments.borrow_mut();
        let (m, v) = &mut *moments;
        if theta.len() != self.g.len() || m.len() != self.g.len() {
            candle_core::bail!("adamw: weight, gradient and moments differ in size");
        }
        update_host(theta, self.g, m, v, self.c);
        Ok(())
    }
}

/// `n` zeros, written rather than `calloc`ed: the first update reads each moment before
/// writing it, and a page that is read first maps the shared zero page, so the write then
/// faults again and flushes the TLBs of every core (measured: the first step's optimizer
/// pass 3.2 s instead of 0.3 s on SmolLM2-135M).
fn written_zeros(n: usize) -> Vec<f32> {
    let mut out = Vec::with_capacity(n);
    out.resize(n, 0.0);
    out
}

impl AdamW {
    pub fn new(vars: Vec<(String, Var)>, params: AdamWParams) -> Result<Self> {
        let moments = vars
            .iter()
            .map(|(_, v)| -> Result<Moments> {
                if v.device().is_cpu() {
                    let n = v.elem_count();
                    Ok(Moments::Host {
                        m: written_zeros(n),
                        v: written_zeros(n),
                    })
                } else {
                    let z = || Tensor::zeros(v.shape(), DType::F32, v.device());
                    Ok(Moments::Device { m: z()?, v: z()? })
                }
            })
            .collect::<Result<_>>()?;
        Ok(Self {
            params,
            vars,
            moments,
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
        let c = Coefs {
            lr,
            beta1: p.beta1,
            beta2: p.beta2,
            eps: p.eps,
            decay: p.weight_decay,
            bc1: 1.0 - p.beta1.powi(self.step as i32),
            bc2: 1.0 - p.beta2.powi(self.step as i32),
        };
        for ((_, var), moments) in self.vars.iter().zip(self.moments.iter_mut()) {
            let Some(g) = grads.get(var.as_tensor()) else {
                continue;
            };
            match moments {
                Moments::Host { m, v } if var.dtype() == DType::F32 => {
                    // In place: no copy of the weights or the gradient.
                    let g = g.contiguous()?;
                    let (storage, layout) = g.storage_and_layout();
                    let g = super::ops::cpu_f32(&storage, layout, "gradient")?;
                    let update = HostUpdate {
                        g,
                        moments: RefCell::new((m, v)),
                        c,
                    };
                    var.as_tensor().inplace_op1(&update)?;
                }
                Moments::Host { m, v } => {
                    let g = g.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
                    let mut theta = var
                        .as_tensor()
                        .to_dtype(DType::F32)?
                        .flatten_all()?
                        .to_vec1::<f32>()?;
                    update_host(&mut theta, &g, m, v, c);
                    let next = Tensor::from_vec(theta, var.shape(), var.device())?;
                    var.set(&next.to_dtype(var.dtype())?)?;
                }
                Moments::Device { m, v } => {
                    let g = g.to_dtype(DType::F32)?;
                    let m_next = ((&*m * c.beta1)? + (&g * (1.0 - c.beta1))?)?;
                    let v_next = ((&*v * c.beta2)? + (g.sqr()? * (1.0 - c.beta2))?)?;
                    let theta = var.as_tensor().to_dtype(DType::F32)?;
                    let theta = if c.decay > 0.0 {
                        (theta * (1.0 - c.lr * c.decay))?
                    } else {
                        theta
                    };
                    let denom = ((&v_next / c.bc2)?.sqrt()? + c.eps)?;
                    let update = ((&m_next / c.bc1)? / denom)?;
                    let next = (theta - (update * c.lr)?)?;
                    var.set(&next.to_dtype(var.dtype())?)?;
                    *m = m_next;
                    *v = v_next;
                }
            }
        }
        Ok(())
    }

    /// The moments of variable `i` as tensors (m, v).
    fn moment_tensors(&self, i: usize) -> Result<(Tensor, Tensor)> {
        let var = &self.vars[i].1;
        match &self.moments[i] {
            Moments::Host { m, v } => Ok((
                Tensor::from_slice(m, var.shape(), &candle_core::Device::Cpu)?,
                Tensor::from_slice(v, var.shape(), &candle_core::Device::Cpu)?,
            )),
            Moments::Device { m, v } => Ok((m.clone(), v.clone())),
        }
    }

    /// Writes the moments (`m.<name>`, `v.<name>`) to a safetensors file; the step count goes
    /// to the caller's trainer state.
    pub fn save(&self, path: &Path) -> Result<()> {
        let mut map = HashMap::new();
        for (i, (name, _)) in self.vars.iter().enumerate() {
            let (m, v) = self.moment_tensors(i)?;
            map.insert(format!("m.{name}"), m);
            map.insert(format!("v.{name}"), v);
        }
        crate::engine::weights::save_safetensors(&map, path)
    }

    /// Restores moments saved by [`AdamW::save`] and the step count.
    pub fn load(&mut self, path: &Path, step: u64) -> Result<()> {
        let mut map = candle_core::safetensors::load(path, &candle_core::Device::Cpu)?;
        for (i, (name, var)) in self.vars.iter().enumerate() {
            let mut take = |kind: &str| -> Result<Tensor> {
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
                t.to_dtype(DType::F32)
            };
            let (m, v) = (take("m")?, take("v")?);
            self.moments[i] = match &self.moments[i] {
                Moments::Host { .. } => Moments::Host {
                    m: m.flatten_all()?.to_vec1()?,
                    v: v.flatten_all()?.to_vec1()?,
                },
                Moments::Device { .. } => Moments::Device {
                    m: m.to_device(var.device())?,
                    v: v.to_device(var.device())?,
                },
            };
        }
        self.step = step;
        Ok(())
    }

    /// The moments as tensors, for tests that compare optimizer states.
    pub fn moments(&self) -> Result<Vec<(Tensor, Tensor)>> {
        (0..self.vars.len())
            .map(|i| self.moment_tensors(i))
            .collect()
    }
}
