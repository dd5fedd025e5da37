//! Multi-turn evaluation environments. `twenty_questions` is the deterministic core of LMRL-Gym's
//! 20 Questions (DESIGN §6): objects, win rule, table oracle, exact information gain, game loop,
//! metrics and reference questioners. No model is involved here.

pub mod twenty_questions;
