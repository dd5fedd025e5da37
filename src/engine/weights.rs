//! Writing safetensors files the way PyTorch tools expect them.
//!
//! transformers' `from_pretrained` refuses a `model.safetensors` whose header lacks the
//! `{"format": "pt"}` metadata (candle's own `safetensors::save` writes none), so every
//! checkpoint this toolkit writes carries it. Files are written beside their destination and
//! renamed into place, so a crash never leaves a torn weights file under the real name.

use std::collections::HashMap;
use std::path::Path;

use candle_core::{Result, Tensor};

/// Writes `tensors` to `path` as safetensors with `format = pt` metadata, atomically.
pub fn save_safetensors(tensors: &HashMap<String, Tensor>, path: &Path) -> Result<()> {
    let err = |what: &str, e: &dyn std::fmt::Display| {
        candle_core::Error::Msg(format!("{}: {what}: {e}", path.display()))
    };
    let contiguous = tensors
        .iter()
        .map(|(k, v)| Ok((k.as_str(), v.contiguous()?)))
        .collect::<Result<Vec<_>>>()?;
    let metadata = HashMap::from([("format".to_string(), "pt".to_string())]);
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".partial");
    let tmp = std::path::PathBuf::from(tmp);
    safetensors::serialize_to_file(contiguous, Some(metadata), &tmp)
        .map_err(|e| err("write", &e))?;
    // Durable like `run::write_atomic` (the tensors stream to the file, so not through it).
    std::fs::File::open(&tmp)
        .and_then(|f| f.sync_all())
        .map_err(|e| err("sync", &e))?;
    std::fs::rename(&tmp, path).map_err(|e| err("rename into place", &e))?;
    let dir = path.parent().filter(|p| !p.as_os_str().is_empty());
    crate::run::sync_dir(dir.unwrap_or(std::path::Path::new("."))).map_err(|e| err("sync", &e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn files_carry_pt_metadata_and_round_trip() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("model.safetensors");
        let t = Tensor::arange(0f32, 6.0, &candle_core::Device::Cpu)
            .unwrap()
            .reshape((2, 3))
            .unwrap();
        save_safetensors(&HashMap::from([("w".to_string(), t.t().unwrap())]), &path).unwrap();
        let bytes = std::fs::read(&path).unwrap();
        let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
        let format = meta
            .metadata()
            .as_ref()
            .and_then(|m| m.get("format").cloned());
        assert_eq!(format.as_deref(), Some("pt"));
        let back = candle_core::safetensors::load(&path, &candle_core::Device::Cpu).unwrap();
        assert_eq!(
            back["w"].to_vec2::<f32>().unwrap(),
            vec![vec![0.0, 3.0], vec![1.0, 4.0], vec![2.0, 5.0]]
        );
        assert!(!dir.path().join("model.safetensors.partial").exists());
    }
}
