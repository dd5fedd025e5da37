#!/usr/bin/env bash
# Does training work? The method's results on the embedded default model, end to end, offline.
#
# Study 1, 20 Questions on held-out objects (never the hidden object of a training game),
#   per seed (seeds share no generated data; each has its own SFT start):
#     sft      SFT on demonstrator games of training objects (the start of every arm below);
#   then from that start, matched arms (the same optimizer steps, lr, schedule, and trained
#   tokens within 10%: `eval_multiturn --study` refuses the study otherwise):
#     dagger   the control: SFT on DAgger data — every state of the demonstrator's games and
#              of the start model's own games, labelled with the demonstrator's question;
#     dpo_mr   DPO (with an NLL term on the chosen question, weight 1) on pairs ranked by the
#              multiturn-aware reward with futures that play the game out (`20q-game`: the
#              demonstrator asks the later questions; success, then questions to a win);
#     dpo_st   the same trainer on pairs from the same start ranked by the single-turn reward
#              (--samples 0: the candidate question alone, by its expected information gain);
#   every model evaluated greedily on the held-out objects (table oracle, strict win rule),
#   with the reference and random questioners as anchors.
#   Primary endpoint, fixed before the runs: success within 20 questions.
# Study 2, the ablation: multiturn-aware reward (MR) against the single-turn reward on
#   clarify-or-answer, held-out *templates*: near (new wordings of the training detail kinds)
#   and far (detail kinds no training template has). Per seed, everything its own (its
#   demonstrator conversations, warm start, data order, pairs and evaluation seed):
#     warm        SFT on the mixed demonstrator's conversations of training requests (asks on
#                 vague requests with probability ASK_RATE, needlessly on stated ones with
#                 NEEDLESS_ASK_RATE; two conversations a request), so a request's own samples
#                 hold both actions; its sampled ask rates are measured before any training;
#   then from that warm start
#     dpo_mr      two rounds of DPO (with an NLL term on the chosen reply) on generate_conv
#                 pairs ranked by MR (one future: the scripted user answers, the policy
#                 replies): action-contrast pairs (a question against an answer) balanced
#                 1:1 between vague and stated requests per template; round 2's pairs come
#                 from the round-1 model on the other half of the training requests,
#     dpo_st      the same on pairs ranked by the single-turn reward (--samples 0), the same
#                 requests, sampler and settings (round 1: the same number of pairs),
#     grpo_mr     GRPO with MR: every step half vague, half stated requests, a quarter of the
#                 prompts one exchange later (the policy's own first reply and the answer),
#     grpo_st     the same with the single-turn reward;
#   every arm (and the base) evaluated in f32 weights, greedy and sampled (T 0.7).
#   Primary endpoint, fixed before the runs: the task reward (detail used − 0.3 per question)
#   on the held-out templates pooled over seeds; primary test: the template-level sign-flip
#   test (the template-resampling bootstrap interval beside it; per-seed sign tests
#   secondary). Also reported: ask rate on vague and on stated requests, macro F1 of the
#   ask/answer decision, conversations with a repeated question, turns, tokens; near and far
#   apart.
#
# Each study's statistics come from `eval_multiturn --study`. The results go to
# docs/results/method_results.json (--quick: method_results_quick.json; a study that is not
# run keeps its section there) and the figures to docs/figures/.
#
# Usage: bash scripts/method_results.sh [--quick] [--only 20q|clarify] [--out DIR]
#   --quick  small sizes everywhere (a smoke run of the whole pipeline, its numbers mean
#            nothing).
#            Without it: 20 Questions ~2.5 h (per seed: SFT start 13 min, DAgger games 5,
#            pairs 12, three matched arms of 16 steps 15; evaluation of 15 models 10 min; the
#            futures cost no model call), clarify ~1.5-2 h a seed on 2 cores (seeds in separate sittings: RECORDED_SEEDS) (see
#            docs/results.md for each stage's cost).
#   --only   run one study.
#   --out    working directory [default: outputs/method_results or outputs/method_results-quick]
# Every stage resumes: rerun the same command after an interruption.
# BIN_DIR=DIR uses the binaries in DIR instead of building target/release; THREADS=N sets
# the compute threads; SEEDS="1 2 3" the seeds; ASK_RATE / NEEDLESS_ASK_RATE the
# demonstrator's rates; LR_20Q the one learning rate of the matched 20 Questions arms.
# RECORDED_SEEDS="1" (clarify only): seeds run in an earlier sitting, pooled from what their
# studies recorded under docs/results/clarify_seeds/sN/ (every arm's outcomes per held-out
# request and its training summary, written when a seed finishes) instead of being run
# again; e.g. `RECORDED_SEEDS=1 SEEDS=2` runs seed 2 and pools it with seed 1. Seeds take
# about 2 h each on 2 cores, so three fit one sitting only on a larger machine.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

quick=0
out=""
only=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    --quick) quick=1 ;;
    --out) out="$2"; shift ;;
    --only)
      only="$2"; shift
      [[ $only == 20q || $only == clarify ]] || { echo "--only: 20q or clarify" >&2; exit 2; }
      ;;
    -h|--help) sed -n 2,45p "$0"; exit 0 ;;
    *) echo "unknown argument: $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done

read -r -a seeds <<< "${SEEDS:-1 2 3}"
read -r -a recorded <<< "${RECORDED_SEEDS:-}"
for r in "${recorded[@]}"; do
  for s in "${seeds[@]}"; do
    [[ $r == "$s" ]] && { echo "seed $s is in SEEDS and RECORDED_SEEDS: give it once" >&2; exit 2; }
  done
done
[[ ${#recorded[@]} -gt 0 && $only != clarify ]] && {
  echo "RECORDED_SEEDS is for the clarify study: add --only clarify" >&2; exit 2; }
ask_rate="${ASK_RATE:-0.5}"
needless_ask_rate="${NEEDLESS_ASK_RATE:-0.15}"
if [[ $quick == 1 ]]; then
  out="${out:-outputs/method_results-quick}"
  results=docs/results/method_results_quick.json
  seeds_dir=docs/results/clarify_seeds_quick
  demo_repeats=1; sft_steps=(--max-steps 12)
  dagger_games=(--objects 12); max_pairs_20q=1000000; batch_tokens_20q=2048
  # A few steps cannot average batches out: --quick states a looser match.
  token_tolerance=0.3
  gen=(--max-tasks 16 --max-messages 5)
  # Clarify: demonstrator repeats, warm-start SFT, probe and pair sizes, DPO epochs, GRPO,
  # sampled evaluation repeats.
  c_demo=(--repeats 1); c_sft=(--max-steps 10)
  c_probe=(--max-tasks 40 --repeats 1)
  c_gen=(--max-tasks 48); c_candidates=4; c_epochs=1
  c_grpo=(--max-steps 3 --batch-prompts 2)
  c_eval=(--max-tasks 24); c_sampled=1
else
  out="${out:-outputs/method_results}"
  results=docs/results/method_results.json
  seeds_dir=docs/results/clarify_seeds
  # Sizes for 2 cores (an SFT step of 8 rows ~24 s, a DPO step ~16 s, a matched DAgger step
  # ~35 s; pairs from 64 games ~12 min): ~55 min a seed.
  demo_repeats=2; sft_steps=(--epochs 1)
  dagger_games=(--objects 40); max_pairs_20q=64; batch_tokens_20q=2048
  token_tolerance=0.1
  gen=(--max-messages 9 --max-tasks 64)
  c_demo=(--repeats 2); c_sft=(--epochs 1)
  c_probe=(--max-tasks 120 --repeats 1)
  c_gen=(); c_candidates=6; c_epochs=3
  c_grpo=(--max-steps 48 --batch-prompts 4)
  c_eval=(); c_sampled=1
fi
# Clarify settings shared by --quick and the full run, chosen on a validation split of the
# training templates (docs/results.md): action-contrast pairs, DPO lr and epochs, the NLL
# weight on chosen replies (0 made DPO stop asking altogether), GRPO's lr and the share of
# prompts one exchange later.
c_dpo_lr="${C_DPO_LR:-5e-5}"; c_nll="${C_NLL:-1}"
c_grpo_lr="${C_GRPO_LR:-3e-5}"; c_continue="${C_CONTINUE:-0.25}"
threads="${THREADS:-$(nproc)}"
bin="${BIN_DIR:-target/release}"

bash scripts/fetch_default_model.sh
if [[ -z "${BIN_DIR:-}" ]]; then
  cargo build --release --bin generate_conv --bin dpo_train --bin eval_multiturn --bin plot \
    --bin rl_train
fi
mkdir -p "$out" docs/results docs/figures
started=$(date +%s)
# The revision the models are trained with (a resumed run keeps training at its own start).
revision=$(git rev-parse HEAD 2>/dev/null || echo unknown)
commands=()
# Runs a command and records it for the results file.
run() {
  echo "== $*"
  commands+=("$*")
  "$@"
}
# A dpo_train run that resumes when interrupted and is skipped when finished.
train() {
  local dir="$1"; shift
  [[ -d "$dir/final" ]] && { commands+=("$bin/dpo_train $* --output $dir"); return; }
  local resume=()
  [[ -d "$dir" ]] && resume=(--resume)
  run "$bin/dpo_train" "$@" --threads "$threads" --output "$dir" "${resume[@]}"
}

study_20q() {
# --- Study 1: 20 Questions -----------------------------------------------------------------
  q="$out/20q"
  local lr="${LR_20Q:-5e-5}"
  for s in "${seeds[@]}"; do
    local d="$q/s$s"
    # Demonstrator games with this seed's own draws: the SFT start, and the first DAgger rows.
    run "$bin/eval_multiturn" --task twenty_questions --model demonstrator --split train \
      --repeats "$demo_repeats" --seed "$((1000 * s))" --sft --dagger "$d/dagger.parquet" \
      --output "$d/demo"
    train "$d/sft" --loss sft --data "$d/demo/sft/demonstrator.parquet" --lr 1e-4 \
      --batch-size 8 "${sft_steps[@]}" --seed "$s"
    local sft="$d/sft/final"
    # DAgger: the start model's own games on training objects, every state labelled.
    run "$bin/eval_multiturn" --task twenty_questions --model "$sft" --split train \
      --weights q8 --seed "$((1000 * s + 1))" "${dagger_games[@]}" --dagger "$d/dagger.parquet" \
      --threads "$threads" --output "$d/dagger-games"
    # Pairs from the same start: full-game futures (MR), or the candidate alone (single-turn)
    # under the strongest single-turn reward, the question's expected information gain (the
    # 20q-game weights scored alone tell no two non-winning questions apart: 2 pairs against
    # 22 from the same 16 games in the --quick run).
    for reward in mr st; do
      local scoring=(--samples 1 --metric-preset 20q-game)
      [[ $reward == st ]] && scoring=(--samples 0 --metric-preset 20q-infogain)
      run "$bin/generate_conv" --task-type twenty_questions --tasks 20q:train --policy "$sft" \
        --candidates 4 "${scoring[@]}" --midgame 10 "${gen[@]}" --seed "$s" --threads "$threads" \
        --output "$d/pairs-$reward"
    done
    # Matched: every arm runs as many steps as one epoch of the smaller pair set at 4 pairs a
    # step (at most max_pairs_20q pairs), and every step reads about batch_tokens_20q tokens
    # (`--batch-tokens` fills a batch with examples while they bring it nearer the target), so
    # arms whose pairs or rows differ in length read the same tokens; the study checks the
    # totals within token_tolerance.
    local n_mr n_st k steps
    n_mr=$(pair_count "$d/pairs-mr"); n_st=$(pair_count "$d/pairs-st")
    k=$(( n_mr < n_st ? n_mr : n_st )); k=$(( k < max_pairs_20q ? k : max_pairs_20q ))
    steps=$(epoch_steps "$k")
    for reward in mr st; do
      train "$d/dpo_$reward" --data "$d/pairs-$reward" --model "$sft" --lr "$lr" --sft-weight 1 \
        --batch-tokens "$batch_tokens_20q" --max-steps "$steps" --seed "$s"
    done
    train "$d/dagger" --loss sft --data "$d/dagger.parquet" --model "$sft" --lr "$lr" \
      --batch-tokens "$batch_tokens_20q" --max-steps "$steps" --seed "$s"
  done
  evaluate20() {
    run "$bin/eval_multiturn" --task twenty_questions --split test --oracle table --weights q8 \
      --model "$2" --threads "$threads" --output "$q/eval/$1"
  }
  evaluate20 base default
  evaluate20 reference reference
  evaluate20 random random
  for s in "${seeds[@]}"; do
    evaluate20 "sft-s$s" "$q/s$s/sft/final"
    for arm in dagger dpo_mr dpo_st; do evaluate20 "$arm-s$s" "$q/s$s/$arm/final"; done
  done
}

# --- Study 2: the ablation on clarify-or-answer ---------------------------------------------
# Evaluates model $2 as arm $1 with evaluation seed $3: greedy on every held-out request (near
# and far templates), and sampled (T 0.7, c_sampled samples per request); f32 weights for every
# arm, the base included.
evaluate_clarify() {
  local common=(--task clarify --tasks clarify:heldout --weights f32 --max-tokens 48
    --seed "$3" --threads "$threads" "${c_eval[@]}")
  run "$bin/eval_multiturn" "${common[@]}" --model "$2" --output "$c/eval/greedy/$1"
  run "$bin/eval_multiturn" "${common[@]}" --model "$2" --temperature 0.7 \
    --repeats "$c_sampled" --output "$c/eval/sampled/$1"
}
# The sampled ask rates of model $2 on training requests (T 0.7), as probe $1 of seed $3.
probe_clarify() {
  run "$bin/eval_multiturn" --task clarify --tasks clarify:train --weights f32 --max-tokens 48 \
    --temperature 0.7 --seed "$3" "${c_probe[@]}" --threads "$threads" --model "$2" \
    --output "$c/probe/$1"
}
# Training pairs of a generate_conv run.
pair_count() {
  python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["counts"]["pairs_train"])' \
    "$1/manifest.json"
}
# Optimizer steps in one epoch of $1 pairs at batch 4.
epoch_steps() { echo $(( ($1 + 3) / 4 )); }

# Pairs of round $2 for reward $1 (mr: one future; st: the reply alone) from policy $3, on
# shard $4 of the training requests, into $5: action-contrast pairs (the best reply against the
# worst one that takes the other action: ask vs answer; in round 2, where a turn's replies all
# take one action, best against worst), balanced 1:1 between vague and stated requests within
# each template.
clarify_pairs() {
  local samples=1; [[ $1 == st ]] && samples=0
  local c_pairs=contrast; [[ $2 == 2 ]] && c_pairs=contrast_or_best
  run "$bin/generate_conv" --task-type clarify --tasks clarify:train --policy "$3" \
    --assistant "$3" --candidates "$c_candidates" --temperature 1.0 --samples "$samples" \
    --window 2 --max-messages 5 --proact-ratio 0 --max-tokens policy=48 --pairs "$c_pairs" \
    --balance-by stated --balance-within template --shard "$4" "${c_gen[@]}" --seed "$s" \
    --threads "$threads" --output "$5"
}

study_clarify() {
  c="$out/clarify"
  for s in "${seeds[@]}"; do
    local d="$c/s$s"
    # This seed's warm start: its own demonstrator conversations of training requests, SFT
    # with its own data order.
    run "$bin/eval_multiturn" --task clarify --tasks clarify:train --model demonstrator \
      --ask-rate "$ask_rate" --needless-ask-rate "$needless_ask_rate" "${c_demo[@]}" \
      --seed "$((100 * s))" --sft --output "$d/demo"
    train "$d/warm" --loss sft --data "$d/demo/sft/demonstrator.parquet" --lr 1e-4 \
      --batch-size 8 "${c_sft[@]}" --seed "$s"
    local warm="$d/warm/final"
    # Exploration, measured before any preference or RL training: sampled ask rates.
    probe_clarify "warm-s$s" "$warm" "$((100 * s + 7))"
    # Offline DPO, two rounds: round 1 on pairs from the warm start (half of the training
    # requests), round 2 on pairs from the round-1 model itself (the other half), so the
    # second round scores the trained policy's own mistakes. Both rewards see the same
    # requests, candidates' sampler and settings; round 1 trains on as many pairs for both.
    local n_mr n_st k round
    for round in 1 2; do
      for reward in mr st; do
        local policy="$warm"
        [[ $round == 2 ]] && policy="$d/dpo_$reward-r1/final"
        clarify_pairs "$reward" "$round" "$policy" "$((round - 1))/2" "$d/pairs-$reward-r$round"
      done
      n_mr=$(pair_count "$d/pairs-mr-r$round"); n_st=$(pair_count "$d/pairs-st-r$round")
      k=$(( n_mr < n_st ? n_mr : n_st ))
      for reward in mr st; do
        local start="$warm" limit=(--max-pairs "$k")
        [[ $round == 2 ]] && { start="$d/dpo_$reward-r1/final"; limit=(); }
        # A round-1 model whose candidates all score alike leaves round 2 no pair (the
        # single-turn arm, once it never asks): the round-1 model is then the arm's model.
        if [[ $round == 2 && $(pair_count "$d/pairs-$reward-r2") == 0 ]]; then
          echo "== no round-2 pair for $reward (seed $s): dpo_$reward-r2 is dpo_$reward-r1"
          ln -sfn "dpo_$reward-r1" "$d/dpo_$reward-r2"
          continue
        fi
        train "$d/dpo_$reward-r$round" --data "$d/pairs-$reward-r$round" --model "$start" \
          --lr "$c_dpo_lr" --sft-weight "$c_nll" --batch-size 4 --epochs "$c_epochs" \
          "${limit[@]}" --seed "$s"
        probe_clarify "dpo_$reward-r$round-s$s" "$d/dpo_$reward-r$round/final" "$((100 * s + 7))"
      done
    done
    # Online GRPO from the warm start: MR (one future) against the single-turn reward; every
    # step half vague, half stated requests; a share of the prompts one exchange later (after
    # the policy's own first reply and the user's answer); ask rates logged every step.
    for reward in mr st; do
      local samples=1; [[ $reward == st ]] && samples=0
      run "$bin/rl_train" --model "$warm" --tasks clarify:train --samples "$samples" \
        --window 2 --algo grpo --balance-by stated --continue-rate "$c_continue" \
        --temperature 1.0 --top-p 1.0 --future-temperature 0 --loss-agg seq-mean-token-mean \
        --lr "$c_grpo_lr" --kl-coef 0.01 --group-size 8 --micro-batch 8 --max-new-tokens 48 \
        "${c_grpo[@]}" --seed "$s" --threads "$threads" --output "$d/grpo_$reward" --resume
    done
  done
  evaluate_clarify base default 0
  for s in "${seeds[@]}"; do
    local d="$c/s$s" e=$((1000 * s))
    evaluate_clarify "warm-s$s" "$d/warm/final" "$e"
    for reward in mr st; do
      evaluate_clarify "dpo_$reward-s$s" "$d/dpo_$reward-r2/final" "$e"
      evaluate_clarify "grpo_$reward-s$s" "$d/grpo_$reward/final" "$e"
    done
  done
}

# --- Statistics, results file, figures -----------------------------------------------------
meta() {
  local wall=$(( $(date +%s) - started ))
  printf '[meta]\nrevision = "%s"\nquick = %s\nwall_s = %s\ncommands = [\n' \
    "$revision" "$([[ $quick == 1 ]] && echo true || echo false)" "$wall"
  for c_ in "${commands[@]}"; do printf '  "%s",\n' "${c_//\"/\\\"}"; done
  printf ']\n'
}
runs() { local a=(); for s in "${seeds[@]}"; do a+=("\"$1-s$s\""); done; (IFS=,; echo "${a[*]}"); }
suffix=""; [[ $quick == 1 ]] && suffix="-quick"

# The training runs of 20 Questions arm $1, one per seed.
trained20() { local a=(); for s in "${seeds[@]}"; do a+=("\"$q/s$s/$1\""); done; (IFS=,; echo "${a[*]}"); }

stats_20q() {
  {
    cat <<EOF
title = "20 Questions, held-out objects: success within 20 questions (greedy, table oracle)"
primary = "success"
secondary = ["identified", "turns_on_win", "info_gain_per_question", "repeated", "inconsistent_guesses", "unparsed"]
seed = 0
matched = ["dagger", "dpo_mr", "dpo_st"]
token_tolerance = $token_tolerance
comparisons = [
  { arm = "dpo_mr", against = "dagger" }, { arm = "dpo_mr", against = "dpo_st" },
  { arm = "dpo_st", against = "dagger" }, { arm = "dpo_mr", against = "sft" },
  { arm = "dagger", against = "sft" }, { arm = "sft", against = "base" },
]
EOF
    for a in base reference random; do
      printf '[[arms]]\nname = "%s"\nruns = ["%s"]\n' "$a" "$q/eval/$a"
    done
    printf '[[arms]]\nname = "sft"\nruns = [%s]\n' "$(runs "$q/eval/sft")"
    for a in dagger dpo_mr dpo_st; do
      printf '[[arms]]\nname = "%s"\nruns = [%s]\ntrained = [%s]\n' "$a" "$(runs "$q/eval/$a")" \
        "$(trained20 "$a")"
    done
    meta
  } > "$out/study-20q.toml"
  "$bin/eval_multiturn" --study "$out/study-20q.toml" --output "$out/study-20q"
  "$bin/plot" study "$out/study-20q" --output "$out/figures"
  cp "$out/figures/study-20q.png" "docs/figures/method_results_20q$suffix.png"
}

# The evaluated runs of clarify arm $1 in study $2, one per seed: a recorded seed's file
# (docs/results/clarify_seeds/sN/STUDY/ARM.json), then this sitting's evaluations.
runs_clarify() {
  local a=() s
  for s in "${recorded[@]}"; do a+=("\"$seeds_dir/s$s/$2/$1.json\""); done
  for s in "${seeds[@]}"; do a+=("\"$c/eval/$3/$1-s$s\""); done
  (IFS=,; echo "${a[*]}")
}
# The training runs of clarify arm $1 (its directory under each seed; $2 its name in the
# study) in study $3: a recorded seed's file carries its training summary.
trained_clarify() {
  local a=() s
  for s in "${recorded[@]}"; do a+=("\"$seeds_dir/s$s/$3/$2.json\""); done
  for s in "${seeds[@]}"; do a+=("\"$c/s$s/$1\""); done
  (IFS=,; echo "${a[*]}")
}

# One clarify study: evaluation mode $1 (greedy, sampled), primary outcome $2, held-out set $3
# (near: held-out wordings of the training kinds; far: kinds no training template has;
# heldout: both).
clarify_spec() {
  local mode="$1" primary="$2" set="$3" e="$c/eval/$1" filter=""
  local name="study-clarify-$3-$1-$2"
  [[ $set == near ]] && filter='filter = { split = "test" }'
  [[ $set == far ]] && filter='filter = { split = "far" }'
  cat <<EOF
title = "Clarify-or-answer, $set held-out templates ($mode): $primary"
primary = "$primary"
cluster = "template"
$filter
secondary = ["task_reward", "detail_used", "asked_vague", "asked_stated", "ask_macro_f1", "repeated_question", "clarifying_questions", "detail_used_vague", "detail_used_stated", "turns", "tokens_read_k"]
seed = 0
comparisons = [
  { arm = "dpo_mr", against = "dpo_st" }, { arm = "grpo_mr", against = "grpo_st" },
  { arm = "dpo_mr", against = "warm" }, { arm = "dpo_st", against = "warm" },
  { arm = "grpo_mr", against = "warm" }, { arm = "grpo_st", against = "warm" },
  { arm = "warm", against = "base" },
]
EOF
  printf '[[arms]]\nname = "base"\nruns = ["%s"]\n' "$e/base"
  local a dir
  for a in warm dpo_mr dpo_st grpo_mr grpo_st; do
    dir="$a"; [[ $a == dpo_* ]] && dir="$a-r2"
    printf '[[arms]]\nname = "%s"\nruns = [%s]\ntrained = [%s]\n' "$a" \
      "$(runs_clarify "$a" "$name" "$mode")" "$(trained_clarify "$dir" "$a" "$name")"
  done
  meta
}

stats_clarify() {
  local mode set
  for mode in greedy sampled; do
    for set in heldout near far; do
      clarify_spec "$mode" task_reward "$set" > "$out/study-clarify-$set-$mode-task_reward.toml"
      "$bin/eval_multiturn" --study "$out/study-clarify-$set-$mode-task_reward.toml" \
        --output "$out/study-clarify-$set-$mode-task_reward"
    done
    clarify_spec "$mode" detail_used heldout > "$out/study-clarify-heldout-$mode-detail_used.toml"
    "$bin/eval_multiturn" --study "$out/study-clarify-heldout-$mode-detail_used.toml" \
      --output "$out/study-clarify-heldout-$mode-detail_used"
  done
  "$bin/plot" study "$out/study-clarify-heldout-greedy-task_reward" \
    "$out/study-clarify-heldout-sampled-task_reward" --output "$out/figures"
  "$bin/plot" rl "$c"/s*/grpo_* --smooth 0.7 --output "$out/figures/clarify-grpo"
  cp "$out/figures/study-clarify-heldout-greedy-task_reward.png" \
    "docs/figures/method_results_clarify$suffix.png"
  cp "$out/figures/study-clarify-heldout-sampled-task_reward.png" \
    "docs/figures/method_results_clarify_sampled$suffix.png"
  cp "$out/figures/study-clarify-heldout-sampled-task_reward-asking.png" \
    "docs/figures/method_results_clarify_asking$suffix.png"
  cp "$out/figures/clarify-grpo/rl_ask_rate.png" \
    "docs/figures/method_results_clarify_ask_rate$suffix.png"
  record_clarify_seeds
}

# Records this sitting's seeds for later pooling (RECORDED_SEEDS): each study writes every
# arm's seeds as seeds/ARM-K.json (K its position among the study's runs: recorded seeds
# first).
record_clarify_seeds() {
  local study name a i p s
  for study in "$out"/study-clarify-*/; do
    name=$(basename "$study")
    for a in warm dpo_mr dpo_st grpo_mr grpo_st; do
      for i in "${!seeds[@]}"; do
        s=${seeds[$i]}; p=$(( ${#recorded[@]} + i + 1 ))
        mkdir -p "$seeds_dir/s$s/$name"
        cp "$study/seeds/$a-$p.json" "$seeds_dir/s$s/$name/$a.json"
      done
    done
  done
}

if [[ $only != clarify ]]; then study_20q; stats_20q; fi
if [[ $only != 20q ]]; then study_clarify; stats_clarify; fi

# The results file: the studies run now; a study not run keeps its section.
python3 scripts/method_results_collect.py "$out" "$results" "$only" "${recorded[*]}"
echo "finished in $(( $(date +%s) - started )) s; results: $results; tables: $out/study-*/study.md"
