//! The DPO training core on the tiny random llama: the trainable model against the inference
//! path, HF export, gradients (every tensor, finite differences), TRL's losses, and a short
//! AdamW run that learns a toy preference.

mod common;
use common::model_util;

use std::path::Path;

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor, Var};
use candle_nn::{AdamW, Optimizer, ParamsAdamW};
use collabllm::engine::llama::{LlamaConfig, LlamaModel, WeightFormat};
use collabllm::engine::tiny::TinySpec;
use collabllm::train::dpo::loss::{dpo_loss, dpo_losses, DpoConfig, LossType};
use collabllm::train::logps::{pair_logps, sequence_logps, PairBatch, TokenizedPair};
use collabllm::train::model::{permute_hf_qk, unpermute_gguf_qk, TrainLlama};
use model_util::*;

fn cpu() -> Device {
    Device::Cpu
}

fn inference_model(dir: &Path) -> LlamaModel {
    let cfg = LlamaConfig::from_hf_json(&dir.join("config.json")).unwrap();
    LlamaModel::from_safetensors(
        &[dir.join("model.safetensors")],
        cfg,
        WeightFormat::F32,
        &cpu(),
    )
    .unwrap()
}

fn inference_logits(model: &LlamaModel, ids: &[u32]) -> Vec<Vec<f32>> {
    let mut cache = model.new_cache(ids.len());
    let t = Tensor::new(ids, &cpu()).unwrap().unsqueeze(0).unwrap();
    model
        .forward_all(&t, &mut cache)
        .unwrap()
        .squeeze(0)
        .unwrap()
        .to_vec2()
        .unwrap()
}

fn train_logits(model: &TrainLlama, rows: &[&[u32]]) -> Vec<Vec<Vec<f32>>> {
    let t = rows.iter().map(|r| r.len()).max().unwrap();
    let mut ids = vec![0u32; rows.len() * t];
    let mut mask = vec![0f32; rows.len() * t];
    for (r, row) in rows.iter().enumerate() {
        for (i, &x) in row.iter().enumerate() {
            ids[r * t + i] = x;
            mask[r * t + i] = 1.0;
        }
    }
    let ids = Tensor::from_vec(ids, (rows.len(), t), &cpu()).unwrap();
    let mask = Tensor::from_vec(mask, (rows.len(), t), &cpu()).unwrap();
    model
        .forward(&ids, Some(&mask))
        .unwrap()
        .to_dtype(DType::F32)
        .unwrap()
        .to_vec3()
        .unwrap()
}

fn max_abs_diff(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
    let mut m = 0f32;
    for (x, y) in a.iter().zip(b) {
        assert_eq!(x.len(), y.len());
        for (p, q) in x.iter().zip(y) {
            m = m.max((p - q).abs());
        }
    }
    m
}

/// Largest absolute element of a tensor.
fn max_abs(t: &Tensor) -> f32 {
    t.abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap()
}

/// Every trainable tensor of `model` has a gradient in both stores, equal to 1e-4 relative
/// to the largest element of the reference gradient.
fn assert_same_gradients(model: &TrainLlama, reference: &GradStore, other: &GradStore, what: &str) {
    let vars = model.named_vars();
    assert!(!vars.is_empty());
    for (name, var) in vars {
        let a = reference
            .get(var.as_tensor())
            .unwrap_or_else(|| panic!("{what} {name}: no reference gradient"));
        let b = other
            .get(var.as_tensor())
            .unwrap_or_else(|| panic!("{what} {name}: no gradient"));
        let scale = max_abs(a).max(1e-3);
        let d = max_abs(&(a - b).unwrap());
        assert!(
            d <= 1e-4 * scale,
            "{what} {name}: differs by {d} (scale {scale})"
        );
    }
}

fn bytes(s: &str) -> Vec<u32> {
    s.bytes().map(u32::from).collect()
}

/// The toy preference set: after a question, answer " yes" (chosen) rather than " no".
fn toy_pairs() -> Vec<TokenizedPair> {
    ["Is it?", "Can we go?", "Ok", "Sea is blue, right?"]
        .iter()
        .map(|q| {
            let mut prompt = vec![257]; // <|im_start|>
            prompt.extend(bytes(q));
            prompt.push(u32::from(b'\n'));
            TokenizedPair {
                prompt,
                chosen: bytes(" yes"),
                rejected: bytes(" no!"),
            }
        })
        .collect()
}

fn untied() -> TinySpec {
    TinySpec {
        tie_word_embeddings: false,
        seed: 7,
        ..TinySpec::default()
    }
}

#[test]
fn logits_match_the_inference_model_tied_and_untied() {
    one_thread();
    for spec in [TinySpec::default(), untied()] {
        let (_g, dir) = tiny_model_dir(&spec);
        let train = TrainLlama::from_hf_dir(&dir, DType::F32, &cpu()).unwrap();
        let infer = inference_model(&dir);
        let expected_vars = 1 + 9 * 2 + 1 + usize::from(!spec.tie_word_embeddings);
        assert_eq!(train.vars().len(), expected_vars);
        assert_eq!(
            train.var_names().contains(&"lm_head.weight".to_string()),
            !spec.tie_word_embeddings
        );
        let long: Vec<u32> = (0..23).map(|i| (i * 37 + 5) % 259).collect();
        let short: Vec<u32> = long[..9].iter().rev().copied().collect();
        // One padded batch: each row equals its own unpadded inference run.
        let got = train_logits(&train, &[&long, &short]);
        let d_long = max_abs_diff(&got[0], &inference_logits(&infer, &long));
        let d_short = max_abs_diff(&got[1][..short.len()], &inference_logits(&infer, &short));
        eprintln!("train vs inference: max |Δlogit| {d_long:e} (long), {d_short:e} (padded short)");
        assert!(d_long < 1e-3 && d_short < 1e-3, "{d_long} {d_short}");
        // And without a mask.
        let ids = Tensor::new(long.as_slice(), &cpu())
            .unwrap()
            .unsqueeze(0)
            .unwrap();
        let plain: Vec<Vec<f32>> = train
            .forward(&ids, None)
            .unwrap()
            .squeeze(0)
            .unwrap()
            .to_vec2()
            .unwrap();
        assert!(max_abs_diff(&plain, &got[0]) < 1e-5);
    }
}

/// A weight finite in f32 but beyond f16's range is refused when saving as f16 (it would be
/// written as inf), by name; f32 and bf16 save it.
#[test]
fn an_f16_save_refuses_weights_beyond_its_range() {
    one_thread();
    let (_g, dir) = tiny_model_dir(&TinySpec::default());
    let mut train = TrainLlama::from_hf_dir(&dir, DType::F32, &cpu()).unwrap();
    let var = train.vars().into_iter().next().unwrap();
    let big = (var.as_tensor().ones_like().unwrap() * 1e6).unwrap();
    var.set(&big).unwrap();
    train.set_save_dtype(DType::F16);
    let out = tempfile::tempdir().unwrap();
    let err = train
        .save_hf(&out.path().join("f16"), Some(&dir))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("F16") && err.contains("weight `") && err.contains("bf16 or f32"),
        "{err}"
    );
    assert!(!out.path().join("f16/model.safetensors").exists());
    for dtype in [DType::BF16, DType::F32] {
        train.set_save_dtype(dtype);
        train
            .save_hf(&out.path().join(format!("{dtype:?}")), Some(&dir))
            .unwrap();
    }
}

#[test]
fn hf_export_reloads_through_the_inference_path() {
    one_thread();
    for spec in [TinySpec::default(), untied()] {
        let (_g, dir) = tiny_model_dir(&spec);
        let train = TrainLlama::from_hf_dir(&dir, DType::F32, &cpu()).unwrap();
        // Move the weights off the checkpoint so that the export is not the input file.
        for var in train.vars() {
            let t = (var.as_tensor() * 1.01).unwrap();
            var.set(&t).unwrap();
        }
        let out = tempfile::tempdir().unwrap();
        train.save_hf(out.path(), Some(&dir)).unwrap();
        for f in ["config.json", "model.safetensors", "tokenizer.json"] {
            assert!(out.path().join(f).is_file(), "{f}");
        }
        let cfg: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(out.path().join("config.json")).unwrap())
                .unwrap();
        assert_eq!(cfg["tie_word_embeddings"], spec.tie_word_embeddings);
        assert_eq!(cfg["bos_token_id"], 257);
        let saved =
            candle_core::safetensors::load(out.path().join("model.safetensors"), &cpu()).unwrap();
        assert_eq!(saved.len(), train.vars().len());
        assert_eq!(
            saved.contains_key("lm_head.weight"),
            !spec.tie_word_embeddings
        );
        let ids: Vec<u32> = (0..17).map(|i| (i * 11 + 3) % 259).collect();
        let reloaded = inference_model(out.path());
        let got = train_logits(&train, &[&ids]);
        let d = max_abs_diff(&got[0], &inference_logits(&reloaded, &ids));
        assert!(d < 1e-3, "{d}");
        // And the trainable model reloads to identical logits.
        let again = TrainLlama::from_hf_dir(out.path(), DType::F32, &cpu()).unwrap();
        assert_eq!(train_logits(&again, &[&ids]), got);
    }
}

#[test]
fn gguf_qk_permutation_round_trips() {
    let w = Tensor::arange(0f32, 8.0 * 3.0, &cpu())
        .unwrap()
        .reshape((8, 3))
        .unwrap();
    // 2 heads of dim 4: GGUF rows (0,1,2,3) = HF rows (0,2,1,3) within each head.
    let hf = unpermute_gguf_qk(&w, 2).unwrap();
    let rows: Vec<f32> = hf
        .narrow(1, 0, 1)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap();
    assert_eq!(rows, vec![0., 6., 3., 9., 12., 18., 15., 21.]);
    let back = permute_hf_qk(&hf, 2).unwrap();
    assert_eq!(back.to_vec2::<f32>().unwrap(), w.to_vec2::<f32>().unwrap());
}

#[test]
fn sequence_logps_mask_the_prompt_after_the_shift() {
    // Vocabulary 3, one row [a=0, b=1, c=2, pad]: prompt [0], completion [1, 2].
    let logits = Tensor::new(
        &[[
            [1.0f32, 2.0, 0.5],
            [0.0, 0.3, 3.0],
            [9.0, 9.0, 9.0],
            [5.0, 0.0, 0.0],
        ]],
        &cpu(),
    )
    .unwrap();
    let ids = Tensor::new(&[[0u32, 1, 2, 0]], &cpu()).unwrap();
    let mask = Tensor::new(&[[0f32, 1.0, 1.0, 0.0]], &cpu()).unwrap();
    let (sum, count) = sequence_logps(&logits, &ids, &mask).unwrap();
    let ls = |row: [f64; 3], k: usize| {
        let z: f64 = row.iter().map(|x| x.exp()).sum();
        row[k] - z.ln()
    };
    let expected = ls([1.0, 2.0, 0.5], 1) + ls([0.0, 0.3, 3.0], 2);
    let got = sum.to_vec1::<f32>().unwrap()[0] as f64;
    assert!((got - expected).abs() < 1e-5, "{got} {expected}");
    assert_eq!(count.to_vec1::<f32>().unwrap(), vec![2.0]);

    // PairBatch packs each pair into one row `prompt | chosen | rejected`, right-padded:
    // the rejected tokens continue the prompt's positions and never see the chosen ones.
    let pairs = vec![
        TokenizedPair {
            prompt: vec![5, 6],
            chosen: vec![7],
            rejected: vec![8, 9, 10],
        },
        TokenizedPair {
            prompt: vec![1],
            chosen: vec![2, 3],
            rejected: vec![4],
        },
    ];
    let b = PairBatch::new(&pairs, 0, &cpu()).unwrap();
    assert_eq!(b.pairs, 2);
    assert_eq!(
        b.input_ids.to_vec2::<u32>().unwrap(),
        vec![vec![5, 6, 7, 8, 9, 10], vec![1, 2, 3, 4, 0, 0]]
    );
    let positions = b.layout.positions.as_ref().unwrap();
    assert_eq!(
        positions.to_vec2::<u32>().unwrap()[0],
        vec![0, 1, 2, 2, 3, 4]
    );
    // Row 0, query 3 (the first rejected token) reads the prompt and itself, not "7".
    let visible = |row: usize, q: usize| -> Vec<bool> {
        let v = b
            .layout
            .bias
            .get(row)
            .unwrap()
            .get(0)
            .unwrap()
            .get(q)
            .unwrap();
        v.to_vec1::<f32>()
            .unwrap()
            .iter()
            .map(|x| *x == 0.0)
            .collect()
    };
    assert_eq!(visible(0, 3), vec![true, true, false, true, false, false]);
    assert_eq!(visible(0, 2), vec![true, true, true, false, false, false]);
    assert_eq!(visible(1, 3), vec![true, false, false, true, false, false]);
    // Targets: (predicting position, token, output row); chosen rows first, then rejected.
    let t = &b.targets;
    let triples: Vec<(u32, u32)> = t
        .positions
        .to_vec1::<u32>()
        .unwrap()
        .into_iter()
        .zip(t.labels.to_vec1::<u32>().unwrap())
        .collect();
    assert_eq!(
        triples,
        vec![(1, 7), (1, 8), (3, 9), (4, 10), (6, 2), (7, 3), (6, 4)]
    );
    assert_eq!(
        t.membership.sum(1).unwrap().to_vec1::<f32>().unwrap(),
        vec![1.0, 2.0, 3.0, 1.0]
    );
}

/// Log-probs of packed pairs equal those of TRL's separate `prompt + chosen` and
/// `prompt + rejected` rows, and so do the gradients of a DPO-style objective.
#[test]
fn packed_pairs_equal_separate_rows_in_values_and_gradients() {
    one_thread();
    let pairs = vec![
        TokenizedPair {
            prompt: bytes("<q> How far is it?"),
            chosen: bytes(" About 3 km."),
            rejected: bytes(" Far."),
        },
        TokenizedPair {
            prompt: bytes("<q> Hi"),
            chosen: bytes(" Hello!"),
            rejected: bytes(" Hello there, how can I help you today?"),
        },
        TokenizedPair {
            prompt: bytes("<q> A longer question about the weather in May?"),
            chosen: bytes(" Mild."),
            rejected: bytes(" Cold"),
        },
    ];
    for spec in [TinySpec::default(), untied()] {
        let (_g, dir) = tiny_model_dir(&spec);
        let model = TrainLlama::from_hf_dir(&dir, DType::F32, &cpu()).unwrap();
        // Separate rows: chosen rows then rejected rows, right-padded, shift-masked.
        let rows: Vec<(&[u32], &[u32])> = pairs
            .iter()
            .map(|p| (p.prompt.as_slice(), p.chosen.as_slice()))
            .chain(
                pairs
                    .iter()
                    .map(|p| (p.prompt.as_slice(), p.rejected.as_slice())),
            )
            .collect();
        let t = rows.iter().map(|(p, c)| p.len() + c.len()).max().unwrap();
        let (mut ids, mut attn, mut loss) = (vec![], vec![], vec![]);
        for (p, c) in &rows {
            for i in 0..t {
                let tok = p.iter().chain(c.iter()).nth(i).copied();
                ids.push(tok.unwrap_or(0));
                attn.push(if tok.is_some() { 1f32 } else { 0.0 });
                loss.push(if tok.is_some() && i >= p.len() {
                    1f32
                } else {
                    0.0
                });
            }
        }
        let n = rows.len();
        let ids = Tensor::from_vec(ids, (n, t), &cpu()).unwrap();
        let attn = Tensor::from_vec(attn, (n, t), &cpu()).unwrap();
        let loss = Tensor::from_vec(loss, (n, t), &cpu()).unwrap();
        let logits = model.forward(&ids, Some(&attn)).unwrap();
        let (separate, _) = sequence_logps(&logits, &ids, &loss).unwrap();
        let batch = PairBatch::new(&pairs, 0, &cpu()).unwrap();
        assert!(
            batch.layout.blocks.is_some(),
            "packed pairs attend block by block"
        );
        let (pc, pr) = pair_logps(&model, &batch, false).unwrap();
        let packed = Tensor::cat(&[&pc, &pr], 0).unwrap();
        let d = max_abs(&(&packed - &separate).unwrap());
        assert!(d < 1e-4, "log-probs differ by {d}");
        // Gradients of Σ chosen − Σ rejected, both ways.
        let objective = |v: &Tensor| -> Tensor {
            (v.narrow(0, 0, 3).unwrap().sum_all().unwrap()
                - v.narrow(0, 3, 3).unwrap().sum_all().unwrap())
            .unwrap()
        };
        let g_sep = objective(&separate).backward().unwrap();
        let g_packed = objective(&packed).backward().unwrap();
        assert_same_gradients(&model, &g_sep, &g_packed, "packed");
    }
}

#[test]
fn each_loss_type_equals_its_hand_computed_value() {
    let t = |v: &[f64]| Tensor::new(v, &cpu()).unwrap();
    let (pc, pr) = (t(&[-10.0, -4.0]), t(&[-12.0, -3.0]));
    let (rc, rr) = (t(&[-11.0, -4.5]), t(&[-11.5, -3.5]));
    // h = (pc − pr) − (rc − rr) = [2 − 0.5, −1 − (−1)] = [1.5, 0].
    let h = [1.5f64, 0.0];
    let ls = |x: f64| -(1.0 + (-x).exp()).ln();
    let (beta, eps) = (0.1, 0.2);
    let mean = |f: &dyn Fn(f64) -> f64| (f(h[0]) + f(h[1])) / 2.0;
    let cases = [
        (LossType::Sigmoid, 0.0, mean(&|h| -ls(beta * h))),
        (
            LossType::Sigmoid,
            eps,
            mean(&|h| -(1.0 - eps) * ls(beta * h) - eps * ls(-beta * h)),
        ),
        (
            LossType::Robust,
            eps,
            mean(&|h| (-(1.0 - eps) * ls(beta * h) + eps * ls(-beta * h)) / (1.0 - 2.0 * eps)),
        ),
        (LossType::Hinge, 0.0, mean(&|h| (1.0 - beta * h).max(0.0))),
        (
            LossType::Ipo,
            0.0,
            mean(&|h| (h - 1.0 / (2.0 * beta)).powi(2)),
        ),
    ];
    for (loss_type, label_smoothing, expected) in cases {
        let cfg = DpoConfig {
            loss_type,
            beta,
            label_smoothing,
        };
        let out = dpo_loss(&pc, &pr, &rc, &rr, &cfg).unwrap();
        let got = out.loss.to_scalar::<f64>().unwrap();
        assert!(
            (got - expected).abs() < 1e-12,
            "{loss_type} ε={label_smoothing}: {got} vs {expected}"
        );
        assert!((out.metrics.loss - expected).abs() < 1e-12);
        let m = &out.metrics;
        // rewards/chosen = β(pc − rc) = 0.1·[1, 0.5]; rewards/rejected = 0.1·[−0.5, 0.5].
        assert!((m.rewards_chosen - 0.075).abs() < 1e-12, "{m:?}");
        assert!((m.rewards_rejected - 0.0).abs() < 1e-12, "{m:?}");
        assert!((m.rewards_margins - 0.075).abs() < 1e-12, "{m:?}");
        // Strictly greater: the tie in the second pair does not count.
        assert_eq!(m.rewards_accuracies, 0.5);
        assert_eq!(m.logps_chosen, -7.0);
        assert_eq!(m.logps_rejected, -7.5);
        let names: Vec<&str> = m.named().iter().map(|(n, _)| *n).collect();
        assert!(names.contains(&"rewards/accuracies") && names.contains(&"logps/rejected"));
    }
    assert_eq!("robust".parse::<LossType>().unwrap(), LossType::Robust);
    assert!("kto".parse::<LossType>().is_err());
    // The stable log-sigmoid holds at extremes.
    let big = dpo_losses(
        &t(&[5e3]),
        &t(&[0.0]),
        &t(&[0.0]),
        &t(&[0.0]),
        &DpoConfig {
            beta: 1.0,
            ..DpoConfig::default()
        },
    )
    .unwrap()
    .to_vec1::<f64>()
    .unwrap();
    assert!(big[0].abs() < 1e-12);
    let neg = dpo_losses(
        &t(&[-5e3]),
        &t(&[0.0]),
        &t(&[0.0]),
        &t(&[0.0]),
        &DpoConfig {
            beta: 1.0,
            ..DpoConfig::default()
        },
    )
    .unwrap()
    .to_vec1::<f64>()
    .unwrap();
    assert!((neg[0] - 5e3).abs() < 1e-9, "{neg:?}");
}

#[test]
fn step_zero_loss_is_ln2_and_every_tensor_gets_a_gradient() {
    one_thread();
    for spec in [TinySpec::default(), untied()] {
        let (_g, dir) = tiny_model_dir(&spec);
        let model = TrainLlama::from_hf_dir(&dir, DType::F32, &cpu()).unwrap();
        let batch = PairBatch::new(&toy_pairs(), 258, &cpu()).unwrap();
        let cfg = DpoConfig::default();
        let (rc, rr) = pair_logps(&model, &batch, false).unwrap();
        let (pc, pr) = pair_logps(&model, &batch, false).unwrap();
        let out = dpo_loss(&pc, &pr, &rc, &rr, &cfg).unwrap();
        let m = &out.metrics;
        assert!((m.loss - std::f64::consts::LN_2).abs() < 1e-4, "{m:?}");
        assert_eq!(m.rewards_accuracies, 0.0);
        assert!(m.rewards_margins.abs() < 1e-6);
        assert!(m.logps_chosen < 0.0 && m.logps_rejected < 0.0);

        let grads = out.loss.backward().unwrap();
        let named = model.named_vars();
        let with_grad: Vec<&str> = named
            .iter()
            .filter(|(_, v)| {
                grads.get(v.as_tensor()).is_some_and(|g| {
                    g.abs()
                        .unwrap()
                        .sum_all()
                        .unwrap()
                        .to_scalar::<f32>()
                        .unwrap()
                        > 0.0
                })
            })
            .map(|(n, _)| n.as_str())
            .collect();
        assert_eq!(
            with_grad.len(),
            named.len(),
            "tensors without gradient: {:?}",
            named
                .iter()
                .map(|(n, _)| n.as_str())
                .filter(|n| !with_grad.contains(n))
                .collect::<Vec<_>>()
        );
        assert_eq!(named.len(), 20 + usize::from(!spec.tie_word_embeddings));
    }
}

/// Autograd against central differences, in f64, on a few weights of different kinds.
#[test]
fn dpo_gradient_matches_finite_differences() {
    one_thread();
    let (_g, dir) = tiny_model_dir(&untied());
    let model = TrainLlama::from_hf_dir(&dir, DType::F64, &cpu()).unwrap();
    let batch = PairBatch::new(&toy_pairs()[..2], 258, &cpu()).unwrap();
    // A fixed reference away from the policy, so that h ≠ 0.
    let rc = Tensor::new(&[-60.0f64, -58.0], &cpu()).unwrap();
    let rr = Tensor::new(&[-57.0f64, -61.0], &cpu()).unwrap();
    for loss_type in [LossType::Sigmoid, LossType::Ipo] {
        let cfg = DpoConfig {
            loss_type,
            beta: 0.1,
            label_smoothing: 0.0,
        };
        let loss = |m: &TrainLlama| {
            let (pc, pr) = pair_logps(m, &batch, loss_type.average_logps()).unwrap();
            dpo_loss(&pc, &pr, &rc, &rr, &cfg).unwrap().loss
        };
        let grads = loss(&model).backward().unwrap();
        let vars = model.named_vars();
        let pick = [
            ("model.embed_tokens.weight", 32usize * 64 + 3), // token b' '
            ("model.layers.0.self_attn.q_proj.weight", 70),
            ("model.layers.1.self_attn.k_proj.weight", 100),
            ("model.layers.0.self_attn.v_proj.weight", 5),
            ("model.layers.1.mlp.down_proj.weight", 333),
            ("model.layers.0.input_layernorm.weight", 9),
            ("model.norm.weight", 17),
            ("lm_head.weight", 121 * 64 + 1), // token b'y'
        ];
        for (name, idx) in pick {
            let var: &Var = &vars.iter().find(|(n, _)| n == name).unwrap().1;
            let auto = grads
                .get(var.as_tensor())
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1::<f64>()
                .unwrap()[idx];
            let orig = var
                .as_tensor()
                .flatten_all()
                .unwrap()
                .to_vec1::<f64>()
                .unwrap();
            let eval = |delta: f64| {
                let mut v = orig.clone();
                v[idx] += delta;
                var.set(&Tensor::from_vec(v, var.shape(), &cpu()).unwrap())
                    .unwrap();
                loss(&model).to_scalar::<f64>().unwrap()
            };
            let e = 1e-5;
            let numeric = (eval(e) - eval(-e)) / (2.0 * e);
            var.set(&Tensor::from_vec(orig, var.shape(), &cpu()).unwrap())
                .unwrap();
            let tol = 1e-6 + 1e-4 * numeric.abs().max(auto.abs());
            assert!(
                (auto - numeric).abs() < tol,
                "{loss_type} {name}[{idx}]: autograd {auto} vs numeric {numeric}"
            );
            assert!(
                auto.abs() > 1e-9,
                "{loss_type} {name}[{idx}] has a zero gradient"
            );
        }
    }
}

#[test]
fn adamw_learns_a_toy_preference() {
    one_thread();
    let (_g, dir) = tiny_model_dir(&TinySpec::default());
    let model = TrainLlama::from_hf_dir(&dir, DType::F32, &cpu()).unwrap();
    let batch = PairBatch::new(&toy_pairs(), 258, &cpu()).unwrap();
    let cfg = DpoConfig::default();
    let reference = model.detached_copy().unwrap();
    let (rc, rr) = pair_logps(&reference, &batch, false).unwrap();
    let (rc, rr) = (rc.detach(), rr.detach());
    let mut opt = AdamW::new(
        model.vars(),
        ParamsAdamW {
            lr: 1e-2,
            weight_decay: 0.0,
            ..Default::default()
        },
    )
    .unwrap();
    let mut history = Vec::new();
    for _ in 0..30 {
        let (pc, pr) = pair_logps(&model, &batch, false).unwrap();
        let out = dpo_loss(&pc, &pr, &rc, &rr, &cfg).unwrap();
        opt.backward_step(&out.loss).unwrap();
        history.push(out.metrics);
    }
    let (pc, pr) = pair_logps(&model, &batch, false).unwrap();
    let last = dpo_loss(&pc, &pr, &rc, &rr, &cfg).unwrap().metrics;
    eprintln!(
        "toy DPO: loss {:.4} -> {:.4}, accuracy {} -> {}, margin {:.3}",
        history[0].loss,
        last.loss,
        history[0].rewards_accuracies,
        last.rewards_accuracies,
        last.rewards_margins
    );
    assert!((history[0].loss - std::f64::consts::LN_2).abs() < 1e-4);
    assert!(
        last.loss < 0.5 * history[0].loss,
        "loss {} -> {}",
        history[0].loss,
        last.loss
    );
    assert!(last.rewards_accuracies > 0.9, "{last:?}");
    assert!(last.rewards_margins > 0.0 && last.rewards_chosen > last.rewards_rejected);
    // The reference copy did not move with the policy.
    let (rc2, rr2) = pair_logps(&reference, &batch, false).unwrap();
    assert_eq!(rc2.to_vec1::<f32>().unwrap(), rc.to_vec1::<f32>().unwrap());
    assert_eq!(rr2.to_vec1::<f32>().unwrap(), rr.to_vec1::<f32>().unwrap());
}

#[test]
fn schedule_and_clipping_follow_hf() {
    use collabllm::train::optim::{
        clip_grad_norm, cosine_with_warmup, trl_adamw_params, warmup_steps,
    };
    assert_eq!(warmup_steps(100, 0.1), 10);
    assert_eq!(warmup_steps(15, 0.1), 2);
    assert_eq!(cosine_with_warmup(0, 100, 10), 0.0);
    assert!((cosine_with_warmup(5, 100, 10) - 0.5).abs() < 1e-12);
    assert_eq!(cosine_with_warmup(10, 100, 10), 1.0);
    assert!((cosine_with_warmup(55, 100, 10) - 0.5).abs() < 1e-12);
    assert!(cosine_with_warmup(100, 100, 10).abs() < 1e-12);
    assert_eq!(cosine_with_warmup(0, 10, 0), 1.0);
    assert_eq!(trl_adamw_params(1e-5).weight_decay, 0.0);

    let a = Var::new(&[3.0f32, 0.0], &cpu()).unwrap();
    let b = Var::new(&[4.0f32], &cpu()).unwrap();
    // loss = ½(a·a + b·b) → gradients a and b, global norm 5.
    let loss = ((a.as_tensor().sqr().unwrap().sum_all().unwrap()
        + b.as_tensor().sqr().unwrap().sum_all().unwrap())
    .unwrap()
        * 0.5)
        .unwrap();
    let vars = [a.clone(), b.clone()];
    let mut grads = loss.backward().unwrap();
    assert!((clip_grad_norm(&mut grads, &vars, 10.0).unwrap() - 5.0).abs() < 1e-6);
    assert_eq!(
        grads.get(&a).unwrap().to_vec1::<f32>().unwrap(),
        vec![3.0, 0.0]
    );
    let norm = clip_grad_norm(&mut grads, &vars, 1.0).unwrap();
    assert!((norm - 5.0).abs() < 1e-6);
    let ga = grads.get(&a).unwrap().to_vec1::<f32>().unwrap();
    let gb = grads.get(&b).unwrap().to_vec1::<f32>().unwrap();
    assert!(
        (ga[0] - 0.6).abs() < 1e-5 && (gb[0] - 0.8).abs() < 1e-5,
        "{ga:?} {gb:?}"
    );
}

/// Gradient checkpointing (per-layer recomputation) gives the same gradients as the plain
/// backward pass, for full fine-tuning and for LoRA.
#[test]
fn checkpointed_gradients_equal_plain_gradients() {
    one_thread();
    let (_g, dir) = tiny_model_dir(&TinySpec::default());
    for lora in [false, true] {
        let mut model = TrainLlama::from_hf_dir(&dir, DType::F32, &cpu()).unwrap();
        if lora {
            let cfg = collabllm::engine::peft::AdapterConfig::lora(
                4,
                8.0,
                0.0,
                &collabllm::engine::peft::LORA_TARGETS,
                "tiny",
            );
            model.enable_lora(cfg, 3).unwrap();
            // Non-zero B so that every adapter matrix gets a gradient.
            for (name, var) in model.named_vars() {
                if name.contains("lora_B") {
                    let t = Tensor::randn(0f32, 0.1, var.shape(), &cpu()).unwrap();
                    var.set(&t).unwrap();
                }
            }
        }
        let batch = PairBatch::new(&toy_pairs(), 0, &cpu()).unwrap();
        let (c, r) = pair_logps(&model, &batch, false).unwrap();
        let plain = (c - r).unwrap().mean_all().unwrap().backward().unwrap();
        let loss_of = |hidden: &Tensor| -> candle_core::Result<Tensor> {
            let (sums, _) =
                collabllm::train::logps::completion_logps(&model, hidden, &batch.targets)?;
            (sums.narrow(0, 0, 4)? - sums.narrow(0, 4, 4)?)?.mean_all()
        };
        let (ckpt, _) = model
            .checkpointed_grads(&batch.input_ids, &batch.layout, |l| Ok((loss_of(l)?, ())))
            .unwrap();
        assert_same_gradients(&model, &plain, &ckpt, &format!("lora={lora}"));
    }
}

/// The fused f32 kernels (custom backward passes) against candle's composed-ops autograd
/// (the f64 path) on a grouped-attention model with three query heads per key/value head,
/// full fine-tuning and LoRA: a gradient scaled by the group size (or any other factor)
/// in the custom ops would show here without the default model.
#[test]
fn fused_gradients_equal_composed_gradients_with_grouped_attention() {
    one_thread();
    let spec = TinySpec {
        hidden_size: 48,
        intermediate_size: 96,
        num_attention_heads: 6,
        num_key_value_heads: 2,
        tie_word_embeddings: false,
        seed: 11,
        ..TinySpec::default()
    };
    let (_g, dir) = tiny_model_dir(&spec);
    let f32_model = TrainLlama::from_hf_dir(&dir, DType::F32, &cpu()).unwrap();
    let f64_model = TrainLlama::from_hf_dir(&dir, DType::F64, &cpu()).unwrap();
    let batch = PairBatch::new(&toy_pairs()[..2], 258, &cpu()).unwrap();
    let grads = |m: &TrainLlama, dtype: DType| {
        let rc = Tensor::new(&[-60.0f64, -58.0], &cpu())
            .unwrap()
            .to_dtype(dtype)
            .unwrap();
        let rr = Tensor::new(&[-57.0f64, -61.0], &cpu())
            .unwrap()
            .to_dtype(dtype)
            .unwrap();
        let (pc, pr) = pair_logps(m, &batch, false).unwrap();
        dpo_loss(&pc, &pr, &rc, &rr, &DpoConfig::default())
            .unwrap()
            .loss
            .backward()
            .unwrap()
    };
    let (g32, g64) = (grads(&f32_model, DType::F32), grads(&f64_model, DType::F64));
    let v64 = f64_model.named_vars();
    for (name, var) in f32_model.named_vars() {
        let a = g32.get(var.as_tensor()).unwrap();
        let other = &v64.iter().find(|(n, _)| *n == name).unwrap().1;
        let b = g64
            .get(other.as_tensor())
            .unwrap()
            .to_dtype(DType::F32)
            .unwrap();
        let (na, nb) = (
            a.sqr()
                .unwrap()
                .sum_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap()
                .sqrt(),
            b.sqr()
                .unwrap()
                .sum_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap()
                .sqrt(),
        );
        let d = max_abs(&(a - &b).unwrap());
        assert!(
            d <= 1e-4 * max_abs(&b).max(1e-3),
            "{name}: differs by {d} (norms {na} vs {nb})"
        );
    }
}

/// What a GPU runs (candle's composed ops, `COLLABLLM_COMPOSED_OPS=1` or
/// `force_composed_ops`), in f32 on the CPU: the same DPO loss and gradients as the fused CPU
/// kernels, for a whole model with grouped-query attention and an untied head.
#[test]
fn forced_composed_ops_give_the_fused_loss_and_gradients() {
    one_thread();
    let spec = TinySpec {
        num_attention_heads: 4,
        num_key_value_heads: 2,
        tie_word_embeddings: false,
        seed: 5,
        ..TinySpec::default()
    };
    let (_g, dir) = tiny_model_dir(&spec);
    let model = TrainLlama::from_hf_dir(&dir, DType::F32, &cpu()).unwrap();
    let batch = PairBatch::new(&toy_pairs(), 258, &cpu()).unwrap();
    let run = || {
        let rc = Tensor::new(&[-60.0f32, -58.0, -59.0, -62.0], &cpu()).unwrap();
        let rr = Tensor::new(&[-57.0f32, -61.0, -60.0, -59.5], &cpu()).unwrap();
        let (pc, pr) = pair_logps(&model, &batch, false).unwrap();
        let out = dpo_loss(&pc, &pr, &rc, &rr, &DpoConfig::default()).unwrap();
        let grads = out.loss.backward().unwrap();
        (out.metrics.loss, grads)
    };
    let (fused_loss, fused) = run();
    collabllm::train::ops::force_composed_ops(true);
    let (composed_loss, composed) = run();
    collabllm::train::ops::force_composed_ops(false);
    assert!(
        (fused_loss - composed_loss).abs() < 1e-5,
        "{fused_loss} vs {composed_loss}"
    );
    assert_same_gradients(&model, &composed, &fused, "fused vs composed (f32)");
}
