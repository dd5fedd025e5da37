//! The RL training core on the tiny random llama with synthetic scored groups: learning
//! from rewards (full and LoRA), exact gradient accumulation, the loss mask, the non-finite
//! stop, resume after a checkpoint, and weight sync into an inference engine.

mod common;
use collabllm::train::settings::{RlDefaults, TrainerSettings};
use common::model_util::{self, max_abs_diff};

use std::path::Path;

use candle_core::{DType, Device, Tensor, Var};
use collabllm::engine::llama::WeightFormat;
use collabllm::engine::peft::AdapterConfig;
use collabllm::engine::tiny::TinySpec;
use collabllm::engine::ChatCodec;
use collabllm::llm::spec::LocalModelFiles;
use collabllm::llm::ChatMessage;
use collabllm::train::logps::target_token_logps;
use collabllm::train::model::TrainLlama;
use collabllm::train::rl::batch::{RlBatch, RlSample};
use collabllm::train::rl::loss::{ppo_loss, LossAgg, PpoConfig, TokenTerms};
use collabllm::train::rl::step::{RlConfig, RlError, RlTrainer};
use collabllm::train::rl::{state, sync, Group, ScoredResponse};
use model_util::*;

const ANSWERS: [&str; 4] = ["yes", "no", "maybe", "ok"];

fn msg(role: &str, content: &str) -> ChatMessage {
    ChatMessage {
        role: role.into(),
        content: content.into(),
    }
}

fn group(task: &str, rewards: &[Option<f64>]) -> Group {
    Group {
        task_id: task.into(),
        prompt: vec![msg("user", &format!("{task}: say yes"))],
        responses: ANSWERS
            .iter()
            .zip(rewards)
            .map(|(t, r)| ScoredResponse {
                text: t.to_string(),
                reward: *r,
                metrics: Default::default(),
                truncated: false,
                token_ids: None,
            })
            .collect(),
    }
}

/// "yes" is rewarded in every group.
fn yes_groups() -> Vec<Group> {
    let r = [Some(1.0), Some(0.0), Some(0.2), None];
    vec![group("a", &r), group("b", &r)]
}

fn setup() -> (tempfile::TempDir, std::path::PathBuf, ChatCodec) {
    one_thread();
    let (g, dir) = tiny_model_dir(&TinySpec::default());
    let codec = ChatCodec::load(&LocalModelFiles::HfDir(dir.clone())).unwrap();
    (g, dir, codec)
}

fn policy(dir: &Path, lora: bool) -> TrainLlama {
    let mut m = TrainLlama::from_hf_dir(dir, DType::F32, &Device::Cpu).unwrap();
    if lora {
        let cfg = AdapterConfig::lora(4, 8.0, 0.0, &["q_proj", "v_proj", "down_proj"], "tiny");
        m.enable_lora(cfg, 7).unwrap();
    }
    m
}

fn config(lr: f64) -> RlConfig {
    RlConfig {
        optim: optim(lr, 5),
        mini_batch: 3,
        micro_batch: 2,
        ppo_epochs: 2,
        ..Default::default()
    }
}

fn optim(lr: f64, seed: u64) -> TrainerSettings<RlDefaults> {
    TrainerSettings {
        lr,
        seed,
        ..Default::default()
    }
}

/// Sum of the response's token log-probs under `model`.
fn response_logp(
    model: &TrainLlama,
    trainer: &RlTrainer,
    codec: &ChatCodec,
    g: &Group,
    r: usize,
) -> f64 {
    let (samples, _, _) = trainer.samples(codec, std::slice::from_ref(g)).unwrap();
    let s = samples.iter().find(|s| s.response == r).unwrap();
    let b = RlBatch::new(&[s], 0, &Device::Cpu).unwrap();
    let h = model.hidden_states_in(&b.input_ids, &b.layout).unwrap();
    let lp = target_token_logps(model, &h, &b.targets).unwrap();
    lp.sum_all().unwrap().to_scalar::<f32>().unwrap() as f64
}

fn learns_the_rewarded_response(lora: bool, lr: f64) {
    let (_g, dir, codec) = setup();
    let mut t = RlTrainer::new(policy(&dir, lora), config(lr), codec.eos_ids[0]).unwrap();
    let probe = group("probe", &[Some(1.0), Some(0.0), Some(0.0), Some(0.0)]);
    let before: Vec<f64> = (0..3)
        .map(|r| response_logp(t.policy(), &t, &codec, &probe, r))
        .collect();
    let groups = yes_groups();
    for u in 0..6 {
        let rep = t.update(&codec, &groups).unwrap();
        assert_eq!(
            rep.samples, 6,
            "the response without a reward left its group"
        );
        assert_eq!(rep.advantage.invalid_rewards, 2);
        // 6 samples, mini-batches of 3, 2 epochs.
        assert_eq!(rep.optimizer_steps, 4);
        let first = rep.steps[0].named();
        let get = |k: &str| first.iter().find(|(n, _)| *n == k).unwrap().1;
        // The first mini-batch runs on the weights that produced the old log-probs.
        assert!(
            (get("ratio_mean") - 1.0).abs() < 1e-5,
            "update {u}: {first:?}"
        );
        assert_eq!(get("pg_clipfrac"), 0.0);
        if u == 0 {
            assert!(get("kl_loss").abs() < 1e-6, "no KL before any update");
        }
        // Later steps may be fully clipped (zero gradient); the first one never is.
        assert!(rep.grad_norms[0] > 0.0, "update {u}: {:?}", rep.grad_norms);
        assert!(rep.grad_norms.iter().all(|n| n.is_finite()));
    }
    let after: Vec<f64> = (0..3)
        .map(|r| response_logp(t.policy(), &t, &codec, &probe, r))
        .collect();
    assert!(
        after[0] > before[0] + 0.5,
        "log p(yes) {before:?} -> {after:?}"
    );
    assert!(after[1] < before[1], "log p(no) {before:?} -> {after:?}");
}

#[test]
fn repeated_updates_raise_the_rewarded_response_full() {
    learns_the_rewarded_response(false, 2e-3);
}

#[test]
fn repeated_updates_raise_the_rewarded_response_lora() {
    learns_the_rewarded_response(true, 3e-3);
}

/// The fused output head (f32 CPU) and candle's composed ops (what CUDA runs, forced here)
/// give the same update: losses and gradient norms of every optimizer step, and weights —
/// with a tied head (its gradient joins the embedding's), an untied one, and LoRA (the head
/// frozen), with the entropy bonus and KL term on and two PPO epochs (old log-probs used).
#[test]
fn the_fused_head_gives_the_composed_update() {
    one_thread();
    for (tie, lora) in [(true, false), (false, false), (true, true)] {
        let spec = TinySpec {
            tie_word_embeddings: tie,
            ..TinySpec::default()
        };
        let (_g, dir) = tiny_model_dir(&spec);
        let codec = ChatCodec::load(&LocalModelFiles::HfDir(dir.clone())).unwrap();
        let run = |composed: bool| {
            collabllm::train::ops::force_composed_ops(composed);
            let cfg = RlConfig {
                ppo: PpoConfig {
                    entropy_coef: 0.01,
                    ..Default::default()
                },
                ..config(1e-3)
            };
            let mut t = RlTrainer::new(policy(&dir, lora), cfg, codec.eos_ids[0]).unwrap();
            let rep = t.update(&codec, &yes_groups()).unwrap();
            collabllm::train::ops::force_composed_ops(false);
            (rep.losses, rep.grad_norms, t.policy().hf_tensors().unwrap())
        };
        let (fused, composed) = (run(false), run(true));
        let what = format!("tie {tie}, lora {lora}");
        assert!(fused.0.len() >= 2, "{what}: {} steps", fused.0.len());
        for (a, b) in fused.0.iter().zip(&composed.0) {
            assert!(
                (a - b).abs() < 1e-5 * b.abs().max(1.0),
                "{what}: loss {a} vs {b}"
            );
        }
        for (a, b) in fused.1.iter().zip(&composed.1) {
            assert!((a - b).abs() < 1e-4 * b, "{what}: grad norm {a} vs {b}");
        }
        for (k, v) in &fused.2 {
            let d = (v - &composed.2[k])
                .unwrap()
                .abs()
                .unwrap()
                .mean_all()
                .unwrap();
            let d = d.to_scalar::<f32>().unwrap();
            assert!(d < 1e-6, "{what} {k}: mean |Δ| {d}");
        }
    }
}

#[test]
fn micro_batches_accumulate_to_the_mini_batch_step() {
    for agg in [
        LossAgg::TokenMean,
        LossAgg::SeqMeanTokenMean,
        LossAgg::SeqMeanTokenSumNorm,
    ] {
        micro_batches_match(agg);
    }
}

fn micro_batches_match(agg: LossAgg) {
    let (_g, dir, codec) = setup();
    let mut results = Vec::new();
    for micro in [1, 0] {
        let cfg = RlConfig {
            micro_batch: micro,
            mini_batch: 0,
            ppo_epochs: 1,
            optim: optim(1e-3, 0),
            ppo: PpoConfig {
                agg,
                entropy_coef: 0.01,
                ..Default::default()
            },
            ..Default::default()
        };
        let mut t = RlTrainer::new(policy(&dir, false), cfg, codec.eos_ids[0]).unwrap();
        let rep = t.update(&codec, &yes_groups()).unwrap();
        let named = rep.named();
        let entropy = named.iter().find(|(k, _)| k == "entropy").unwrap().1;
        // Mean per-token entropy over a 259-token vocabulary: positive, at most ln 259.
        assert!(entropy > 0.0 && entropy <= 259f64.ln() + 1e-6, "{entropy}");
        results.push((
            rep.losses[0],
            rep.grad_norms[0],
            t.policy().hf_tensors().unwrap(),
        ));
    }
    let (a, b) = (&results[0], &results[1]);
    assert!((a.0 - b.0).abs() < 1e-6, "{agg}: loss {} vs {}", a.0, b.0);
    assert!(
        (a.1 - b.1).abs() < 1e-4 * a.1,
        "grad norm {} vs {}",
        a.1,
        b.1
    );
    // Adam's first step is ~lr·sign(g): where a gradient is ~0, rounding can flip its sign
    // and move that weight by up to 2·lr, so the weights are compared on average.
    for (k, v) in &a.2 {
        let d = (v - &b.2[k]).unwrap().abs().unwrap().mean_all().unwrap();
        let d = d.to_scalar::<f32>().unwrap();
        assert!(d < 1e-6, "{agg} {k}: mean |Δ| {d}");
    }
}

#[test]
fn only_response_tokens_carry_the_loss_and_futures_are_not_in_the_sequence() {
    let (_g, dir, codec) = setup();
    let t = RlTrainer::new(policy(&dir, false), RlConfig::default(), codec.eos_ids[0]).unwrap();
    let groups = yes_groups();
    let (samples, _, _) = t.samples(&codec, &groups[..1]).unwrap();
    let refs: Vec<&RlSample> = samples.iter().collect();
    let b = RlBatch::new(&refs, 0, &Device::Cpu).unwrap();
    // The sequence is the prompt and the sampled replies, nothing else.
    let row: Vec<u32> = b.input_ids.get(0).unwrap().to_vec1().unwrap();
    let mut want = codec
        .encode(&codec.render(&groups[0].prompt, true).unwrap())
        .unwrap();
    for s in &samples {
        want.extend(&s.response_ids);
    }
    assert_eq!(row, want);
    let text = codec.tokenizer.decode(&row, false).unwrap();
    assert!(
        text.ends_with("yes<|im_end|>no<|im_end|>maybe<|im_end|>"),
        "{text}"
    );

    // Gradient w.r.t. the final hidden states: nonzero exactly at the positions that
    // predict a response token.
    let model = t.policy();
    let hidden = model.hidden_states_in(&b.input_ids, &b.layout).unwrap();
    let hv = Var::from_tensor(&hidden.detach()).unwrap();
    let logp = target_token_logps(model, hv.as_tensor(), &b.targets).unwrap();
    let k = b.tokens;
    let old = (logp.detach() - 0.1).unwrap();
    let w = Tensor::new(vec![1.0f32 / k as f32; k], &Device::Cpu).unwrap();
    let out = ppo_loss(
        &TokenTerms {
            logp: &logp,
            old_logp: &old,
            ref_logp: Some(&old),
            advantages: &b.advantages,
            weights: &w,
            entropy: None,
        },
        &PpoConfig::default(),
    )
    .unwrap();
    let g = out.loss.backward().unwrap();
    let gh = g.get(hv.as_tensor()).unwrap().get(0).unwrap();
    let norms: Vec<f32> = gh.sqr().unwrap().sum(1).unwrap().to_vec1().unwrap();
    let predictors: Vec<usize> = b
        .targets
        .positions
        .to_vec1::<u32>()
        .unwrap()
        .iter()
        .map(|p| *p as usize)
        .collect();
    let np = samples[0].prompt.len();
    for (pos, n) in norms.iter().enumerate() {
        assert_eq!(
            *n > 0.0,
            predictors.contains(&pos),
            "position {pos} (prompt {np})"
        );
    }
    // The last prompt position predicts the first token of every response; no other
    // prompt position carries loss.
    assert!(predictors.iter().filter(|p| **p < np).all(|p| *p == np - 1));
}

#[test]
fn a_non_finite_loss_stops_before_the_weights_change() {
    let (_g, dir, codec) = setup();
    let mut t = RlTrainer::new(policy(&dir, false), config(1e-3), codec.eos_ids[0]).unwrap();
    let before = t.policy().hf_tensors().unwrap();
    // Rewards whose sum overflows: GRPO advantages become NaN.
    let groups = vec![group(
        "x",
        &[Some(1.7e308), Some(1.7e308), Some(0.0), Some(0.0)],
    )];
    let err = t.update(&codec, &groups).unwrap_err();
    assert!(matches!(err, RlError::NonFinite { .. }), "{err}");
    assert!(err.to_string().contains("non-finite"), "{err}");
    for (k, v) in t.policy().hf_tensors().unwrap() {
        let d = (v - &before[&k]).unwrap().abs().unwrap().max_all().unwrap();
        assert_eq!(d.to_scalar::<f32>().unwrap(), 0.0, "{k} changed");
    }
}

#[test]
fn resume_after_a_checkpoint_takes_the_same_next_step() {
    for lora in [false, true] {
        let (g, dir, codec) = setup();
        let ckpt = g.path().join("checkpoint-1");
        let batch1 = yes_groups();
        let batch2 = vec![group("c", &[Some(0.0), Some(1.0), Some(0.5), Some(0.1)])];
        let mut a = RlTrainer::new(policy(&dir, lora), config(3e-3), codec.eos_ids[0]).unwrap();
        a.update(&codec, &batch1).unwrap();
        state::save(&a, Some(&codec), &ckpt, serde_json::json!({"cursor": 2})).unwrap();
        let want = a.update(&codec, &batch2).unwrap();

        let mut b = RlTrainer::new(policy(&dir, lora), config(3e-3), codec.eos_ids[0]).unwrap();
        let st = state::load(&mut b, &ckpt).unwrap();
        assert_eq!(st.updates, 1);
        assert_eq!(st.rollout["cursor"], 2);
        let got = b.update(&codec, &batch2).unwrap();
        assert_eq!(got.losses.len(), want.losses.len());
        for (x, y) in got.losses.iter().zip(&want.losses) {
            assert!(
                (x - y).abs() < 1e-7,
                "lora {lora}: {:?} vs {:?}",
                got.losses,
                want.losses
            );
        }
        // Without the checkpoint the next step differs (the test can tell).
        let mut c = RlTrainer::new(policy(&dir, lora), config(3e-3), codec.eos_ids[0]).unwrap();
        let fresh = c.update(&codec, &batch2).unwrap();
        assert!(
            (fresh.losses[1] - want.losses[1]).abs() > 1e-7,
            "lora {lora}"
        );
        // A different seed is refused by name.
        let mut d = RlTrainer::new(
            policy(&dir, lora),
            RlConfig {
                optim: optim(3e-3, 6),
                ..config(3e-3)
            },
            codec.eos_ids[0],
        )
        .unwrap();
        let err = state::load(&mut d, &ckpt).unwrap_err().to_string();
        assert!(err.contains("--seed"), "{err}");
    }
}

fn last_logits(engine: &collabllm::engine::Engine, ids: &[u32]) -> Vec<f32> {
    engine.next_token_logits(ids).unwrap()
}

fn train_last_logits(model: &TrainLlama, ids: &[u32]) -> Vec<f32> {
    let t = Tensor::new(ids, &Device::Cpu)
        .unwrap()
        .unsqueeze(0)
        .unwrap();
    let logits = model.forward(&t, None).unwrap();
    logits
        .get(0)
        .unwrap()
        .get(ids.len() - 1)
        .unwrap()
        .to_vec1()
        .unwrap()
}

#[test]
fn sync_serves_the_updated_weights() {
    for lora in [false, true] {
        let (_g, dir, codec) = setup();
        let mut t = RlTrainer::new(policy(&dir, lora), config(1e-2), codec.eos_ids[0]).unwrap();
        let ids = codec.encode("<|im_start|>user\nhi<|im_end|>\n").unwrap();
        let codec2 = || ChatCodec::load(&LocalModelFiles::HfDir(dir.clone())).unwrap();
        let e0 =
            sync::policy_engine(t.policy(), codec2(), "tiny", 0, None, WeightFormat::F32).unwrap();
        let l0 = last_logits(&e0, &ids);
        assert!(max_abs_diff(&l0, &train_last_logits(t.policy(), &ids)) < 1e-4);
        t.update(&codec, &yes_groups()).unwrap();
        let start = std::time::Instant::now();
        let backend =
            sync::policy_backend(t.policy(), codec2(), "tiny", 1, None, WeightFormat::F32).unwrap();
        eprintln!("sync (tiny, f32, lora {lora}): {:?}", start.elapsed());
        let l1 = last_logits(backend.engine(), &ids);
        assert!(
            max_abs_diff(&l1, &train_last_logits(t.policy(), &ids)) < 1e-4,
            "lora {lora}"
        );
        assert!(
            max_abs_diff(&l0, &l1) > 1e-3,
            "lora {lora}: the update changed nothing"
        );
        assert_eq!(backend.engine().fingerprint(), "update-1");
        // The engine of the previous version kept its own weights.
        assert!(
            max_abs_diff(&last_logits(&e0, &ids), &l0) < 1e-6,
            "lora {lora}"
        );
        // Q8 re-quantization serves approximately the same weights.
        let q =
            sync::policy_engine(t.policy(), codec2(), "tiny", 1, None, WeightFormat::Q8_0).unwrap();
        assert!(max_abs_diff(&last_logits(&q, &ids), &l1) < 0.5);
    }
}

/// With two mini-batches a step the second runs on weights the first changed: its ratio
/// leaves 1 and, with a large enough step, the clip band, so the clip fractions it reports
/// are non-zero (one optimizer step a batch would keep the ratio at exactly 1).
#[test]
fn a_second_mini_batch_moves_the_ratio_and_clips() {
    let (_g, dir, codec) = setup();
    let cfg = RlConfig {
        optim: optim(5e-2, 5),
        mini_batch: 3,
        micro_batch: 0,
        ppo_epochs: 1,
        ..Default::default()
    };
    let mut t = RlTrainer::new(policy(&dir, false), cfg, codec.eos_ids[0]).unwrap();
    let rep = t.update(&codec, &yes_groups()).unwrap();
    assert_eq!(rep.optimizer_steps, 2);
    let get = |step: usize, k: &str| {
        let named = rep.steps[step].named();
        named.iter().find(|(n, _)| *n == k).unwrap().1
    };
    assert!((get(0, "ratio_mean") - 1.0).abs() < 1e-5);
    assert_eq!(get(0, "pg_clipfrac"), 0.0);
    let (lo, hi) = (get(1, "ratio_min"), get(1, "ratio_max"));
    assert!(
        lo < 0.8 || hi > 1.2,
        "ratio stayed in the band: [{lo}, {hi}]"
    );
    assert!(get(1, "pg_clipfrac") > 0.0, "{:?}", rep.steps[1].named());
}
