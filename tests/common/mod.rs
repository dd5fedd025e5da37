//! Helpers shared by the integration test suites.
#![allow(dead_code)]

pub mod fault_server;
pub mod collab_script;
