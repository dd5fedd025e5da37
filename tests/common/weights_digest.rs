//! The checksum a gradient fixture records of the weights it was made from: SHA-256 over the
//! tensors in name order, each as its UTF-8 name then its values as little-endian f32
//! (`scripts/make_grad_fixture.py` computes the same from the exported safetensors), so a
//! change in GGUF dequantization or Q/K conversion is caught before gradients are compared.
#![allow(dead_code)]

use std::collections::HashMap;

use candle_core::{DType, Tensor};
use sha2::{Digest, Sha256};

pub fn weights_digest(tensors: &HashMap<String, Tensor>) -> String {
    let mut names: Vec<&String> = tensors.keys().collect();
    names.sort();
    let mut h = Sha256::new();
    for name in names {
        h.update(name.as_bytes());
        let values = tensors[name]
            .to_dtype(DType::F32)
            .and_then(|t| t.flatten_all())
            .and_then(|t| t.to_vec1::<f32>())
            .expect("f32 values of a weight");
        for v in values {
            h.update(v.to_le_bytes());
        }
    }
    hex::encode(h.finalize())
}
