//! A Hugging Face checkpoint directory: `config.json` plus one table of tensors over all
//! its safetensors files, with names normalised to the text model's.

use super::file::SafetensorsFile;
use crate::tensor::TensorRef;
use crate::{Error, Result};
use serde::de::{self, Deserializer, MapAccess, Visitor};
use serde::Deserialize;
use serde_json::Value;
use std::collections::{HashMap, HashSet};
use std::fmt;
use std::path::{Component, Path, PathBuf};

/// Multimodal Qwen3.5 releases (`Qwen3_5ForConditionalGeneration`) keep the text model
/// here; it is exposed as `model.` so model code asks for one set of names.
pub const TEXT_MODEL_PREFIX: &str = "model.language_model.";
/// Vision-tower prefixes, left out of the normalised view.
pub const VISION_PREFIXES: [&str; 2] = ["model.visual.", "visual."];

/// The name under which a raw checkpoint name appears in the normalised (text-model) view,
/// or `None` for vision-tower tensors, which that view leaves out.
pub fn normalise_name(raw: &str) -> Option<String> {
    if VISION_PREFIXES.iter().any(|p| raw.starts_with(p)) {
        return None;
    }
    Some(match raw.strip_prefix(TEXT_MODEL_PREFIX) {
        Some(rest) => format!("model.{rest}"),
        None => raw.to_string(),
    })
}

/// Where a tensor lives: file index and entry index in that file.
#[derive(Clone, Copy, Debug)]
struct Slot {
    file: usize,
    entry: usize,
}

/// A Hugging Face checkpoint directory, opened.
#[derive(Debug)]
pub struct HfModel {
    dir: PathBuf,
    config: Value,
    files: Vec<SafetensorsFile>,
    /// Every tensor of every file, raw names (the names live in the files).
    raw: Vec<Slot>,
    raw_index: HashMap<String, usize>,
    /// Normalised view: (name, index into `raw`), in file then header order.
    norm: Vec<(String, usize)>,
    norm_index: HashMap<String, usize>,
}

/// `model.safetensors.index.json`'s `weight_map`, duplicate names refused.
struct WeightMap(Vec<(String, String)>);

impl<'de> Deserialize<'de> for WeightMap {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = WeightMap;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("an object of tensor name -> shard file name")
            }
            fn visit_map<A: MapAccess<'de>>(
                self,
                mut map: A,
            ) -> std::result::Result<WeightMap, A::Error> {
                let mut seen = HashSet::new();
                let mut out = Vec::new();
                while let Some((k, v)) = map.next_entry::<String, String>()? {
                    if !seen.insert(k.clone()) {
                        return Err(de::Error::custom(format!("duplicate entry `{k}`")));
                    }
                    out.push((k, v));
                }
                Ok(WeightMap(out))
            }
        }
        d.deserialize_map(V)
    }
}

#[derive(Deserialize)]
struct IndexFile {
    weight_map: WeightMap,
}

fn read_json(path: &Path) -> Result<Value> {
    let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
    serde_json::from_str(&text).map_err(|e| Error::format(path, format!("JSON: {e}")))
}

/// Shard names must stay inside the checkpoint directory.
fn check_shard_name(index: &Path, tensor: &str, shard: &str) -> Result<()> {
    let p = Path::new(shard);
    if shard.is_empty() || !p.components().all(|c| matches!(c, Component::Normal(_))) {
        return Err(Error::tensor(
            index,
            tensor,
            format!("shard `{shard}` is not a file name inside the checkpoint directory"),
        ));
    }
    Ok(())
}

impl HfModel {
    /// Open a checkpoint directory: `config.json` and either the shards listed by
    /// `model.safetensors.index.json`, or `model.safetensors`, or (DeepSeek's inference-style
    /// release) every `*.safetensors` file in the directory.
    pub fn open(dir: impl AsRef<Path>) -> Result<Self> {
        let dir = dir.as_ref().to_path_buf();
        let config_path = dir.join("config.json");
        let config = read_json(&config_path)?;
        if !config.is_object() {
            return Err(Error::format(&config_path, "config is not a JSON object"));
        }

        let index_path = dir.join("model.safetensors.index.json");
        let mut files = Vec::new();
        let mut weight_map = None;
        if index_path.is_file() {
            let text =
                std::fs::read_to_string(&index_path).map_err(|e| Error::io(&index_path, e))?;
            let idx: IndexFile = serde_json::from_str(&text)
                .map_err(|e| Error::format(&index_path, format!("JSON: {e}")))?;
            // Open each shard once, in order of first mention.
            let mut shard_of: HashMap<String, usize> = HashMap::new();
            for (tensor, shard) in &idx.weight_map.0 {
                check_shard_name(&index_path, tensor, shard)?;
                if !shard_of.contains_key(shard) {
                    shard_of.insert(shard.clone(), files.len());
                    files.push(SafetensorsFile::open(dir.join(shard))?);
                }
            }
            if files.is_empty() {
                return Err(Error::format(&index_path, "weight_map lists no tensors"));
            }
            weight_map = Some((idx.weight_map.0, shard_of));
        } else if dir.join("model.safetensors").is_file() {
            files.push(SafetensorsFile::open(dir.join("model.safetensors"))?);
        } else {
            let rd = std::fs::read_dir(&dir).map_err(|e| Error::io(&dir, e))?;
            let mut paths = Vec::new();
            for ent in rd {
                let p = ent.map_err(|e| Error::io(&dir, e))?.path();
                if p.extension().is_some_and(|x| x == "safetensors") && p.is_file() {
                    paths.push(p);
                }
            }
            paths.sort();
            for p in paths {
                files.push(SafetensorsFile::open(p)?);
            }
            if files.is_empty() {
                return Err(Error::format(
                    &dir,
                    "no *.safetensors files in the checkpoint directory",
                ));
            }
        }

        // One table over all files: a name may appear in one file only.
        let mut raw: Vec<Slot> = Vec::new();
        let mut raw_index: HashMap<String, usize> = HashMap::new();
        for (fi, f) in files.iter().enumerate() {
            for (ei, name) in f.names().enumerate() {
                if let Some(&prev) = raw_index.get(name) {
                    let other = &files[raw[prev].file];
                    return Err(Error::tensor(
                        f.path(),
                        name,
                        format!("also stored in {}", other.path().display()),
                    ));
                }
                raw_index.insert(name.to_string(), raw.len());
                raw.push(Slot {
                    file: fi,
                    entry: ei,
                });
            }
        }

        if let Some((map, shard_of)) = weight_map {
            for (tensor, shard) in &map {
                let fi = shard_of[shard];
                let found = raw_index.get(tensor).map(|&i| raw[i].file);
                if found != Some(fi) {
                    return Err(Error::tensor(
                        &index_path,
                        tensor,
                        format!("weight_map puts it in `{shard}`, which does not hold it"),
                    ));
                }
            }
        }

        let mut norm: Vec<(String, usize)> = Vec::new();
        let mut norm_index: HashMap<String, usize> = HashMap::new();
        for (ri, s) in raw.iter().enumerate() {
            let f = &files[s.file];
            let raw_name = f.name_at(s.entry);
            let Some(n) = normalise_name(raw_name) else {
                continue;
            };
            if let Some(&prev) = norm_index.get(&n) {
                let p = raw[norm[prev].1];
                return Err(Error::tensor(
                    f.path(),
                    raw_name,
                    format!(
                        "normalises to `{n}`, as `{}` does",
                        files[p.file].name_at(p.entry)
                    ),
                ));
            }
            norm_index.insert(n.clone(), norm.len());
            norm.push((n, ri));
        }

        let model = HfModel {
            dir,
            config,
            files,
            raw,
            raw_index,
            norm,
            norm_index,
        };
        model.check_standard_keys()?;
        Ok(model)
    }

    /// transformers' `PretrainedConfig` keys whose meaning lathe follows without reading a
    /// value it needs (the output head falls back to the embedding when `lm_head` is absent;
    /// the context is lathe's own setting), checked for their type: a wrong one is an error
    /// naming the key, as it would be in transformers, not a value quietly ignored.
    fn check_standard_keys(&self) -> Result<()> {
        self.cfg_opt_bool("tie_word_embeddings")?;
        self.cfg_opt_u64("max_position_embeddings")?;
        Ok(())
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn config(&self) -> &Value {
        &self.config
    }

    pub fn config_path(&self) -> PathBuf {
        self.dir.join("config.json")
    }

    /// The safetensors files, in the order they were opened.
    pub fn files(&self) -> &[SafetensorsFile] {
        &self.files
    }

    /// `architectures[0]` of config.json (`"Qwen3_5ForCausalLM"`, ...).
    pub fn architecture(&self) -> Result<String> {
        self.config
            .get("architectures")
            .and_then(|a| a.get(0))
            .and_then(Value::as_str)
            .map(str::to_string)
            .ok_or_else(|| {
                Error::config(
                    self.config_path(),
                    "architectures",
                    "missing or not a list of strings",
                )
            })
    }

    /// True when the checkpoint stores its text model under `model.language_model.`.
    pub fn is_multimodal(&self) -> bool {
        self.raw_index
            .keys()
            .any(|k| k.starts_with(TEXT_MODEL_PREFIX))
    }

    fn slot_ref<'a>(&'a self, ri: usize, name: &'a str) -> Result<TensorRef<'a>> {
        let s = self.raw[ri];
        self.files[s.file].entry_ref(s.entry, name)
    }

    /// Text-model tensors of supported types under normalised names (`model.X` for
    /// `model.language_model.X`; vision tensors left out).
    pub fn tensors(&self) -> impl Iterator<Item = TensorRef<'_>> {
        self.norm
            .iter()
            .filter_map(move |(n, ri)| self.slot_ref(*ri, n).ok())
    }

    /// A tensor by normalised name; `None` when absent or of an unsupported type.
    pub fn tensor(&self, name: &str) -> Option<TensorRef<'_>> {
        let (n, ri) = &self.norm[*self.norm_index.get(name)?];
        self.slot_ref(*ri, n).ok()
    }

    /// A tensor by normalised name, or an error naming the checkpoint and tensor.
    pub fn require(&self, name: &str) -> Result<TensorRef<'_>> {
        match self.norm_index.get(name) {
            Some(&i) => self.slot_ref(self.norm[i].1, &self.norm[i].0),
            None => Err(Error::MissingTensor {
                path: self.dir.clone(),
                name: name.to_string(),
            }),
        }
    }

    /// Every tensor of a supported type under its name as stored (vision tower included).
    pub fn raw_tensors(&self) -> impl Iterator<Item = TensorRef<'_>> {
        self.raw.iter().filter_map(move |s| {
            let f = &self.files[s.file];
            f.entry_ref(s.entry, f.name_at(s.entry)).ok()
        })
    }

    /// A tensor by its name as stored.
    pub fn raw_tensor(&self, name: &str) -> Option<TensorRef<'_>> {
        let s = self.raw[*self.raw_index.get(name)?];
        let f = &self.files[s.file];
        f.entry_ref(s.entry, f.name_at(s.entry)).ok()
    }

    /// Number of tensors in the normalised view (unsupported types included).
    pub fn len(&self) -> usize {
        self.norm.len()
    }

    pub fn is_empty(&self) -> bool {
        self.norm.is_empty()
    }

    // ------------------------------------------------------------------ config accessors

    /// The value at `key` (dots walk nested objects: `"rope_parameters.rope_theta"`),
    /// looked up in `text_config` first when the config has one, then at the top level.
    /// Multimodal Qwen3.5 configs keep the text model's hyper-parameters in `text_config`.
    pub fn cfg_value(&self, key: &str) -> Option<&Value> {
        fn walk<'v>(root: &'v Value, key: &str) -> Option<&'v Value> {
            key.split('.').try_fold(root, |v, k| v.get(k))
        }
        self.config
            .get("text_config")
            .filter(|t| t.is_object())
            .and_then(|t| walk(t, key))
            .or_else(|| walk(&self.config, key))
    }

    fn cfg_err(&self, key: &str, what: impl Into<String>) -> Error {
        Error::config(self.config_path(), key, what)
    }

    /// `Ok(None)` when absent or null; an error when present with another type.
    fn cfg_opt<'a, T>(
        &'a self,
        key: &str,
        want: &str,
        get: impl Fn(&'a Value) -> Option<T>,
    ) -> Result<Option<T>> {
        match self.cfg_value(key) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => get(v)
                .map(Some)
                .ok_or_else(|| self.cfg_err(key, format!("expected {want}, found {v}"))),
        }
    }

    fn cfg_req<'a, T>(
        &'a self,
        key: &str,
        want: &str,
        get: impl Fn(&'a Value) -> Option<T>,
    ) -> Result<T> {
        self.cfg_opt(key, want, get)?
            .ok_or_else(|| self.cfg_err(key, format!("missing (expected {want})")))
    }

    pub fn cfg_opt_u64(&self, key: &str) -> Result<Option<u64>> {
        self.cfg_opt(key, "a non-negative integer", as_u64)
    }
    pub fn cfg_opt_f64(&self, key: &str) -> Result<Option<f64>> {
        self.cfg_opt(key, "a number", Value::as_f64)
    }
    pub fn cfg_opt_str(&self, key: &str) -> Result<Option<&str>> {
        self.cfg_opt(key, "a string", Value::as_str)
    }
    pub fn cfg_opt_bool(&self, key: &str) -> Result<Option<bool>> {
        self.cfg_opt(key, "true or false", Value::as_bool)
    }
    pub fn cfg_u64(&self, key: &str) -> Result<u64> {
        self.cfg_req(key, "a non-negative integer", as_u64)
    }
    pub fn cfg_f64(&self, key: &str) -> Result<f64> {
        self.cfg_req(key, "a number", Value::as_f64)
    }
    pub fn cfg_str(&self, key: &str) -> Result<&str> {
        self.cfg_req(key, "a string", Value::as_str)
    }
    pub fn cfg_bool(&self, key: &str) -> Result<bool> {
        self.cfg_req(key, "true or false", Value::as_bool)
    }
    /// A list of non-negative integers (`compress_ratios`, `mrope_section`).
    pub fn cfg_u64_list(&self, key: &str) -> Result<Vec<u64>> {
        self.cfg_req(key, "a list of non-negative integers", |v| {
            v.as_array()?.iter().map(as_u64).collect()
        })
    }
    /// A list of strings (`layer_types`).
    pub fn cfg_str_list(&self, key: &str) -> Result<Vec<&str>> {
        self.cfg_req(key, "a list of strings", |v| {
            v.as_array()?.iter().map(Value::as_str).collect()
        })
    }
}

/// Integers, also when written as a float with no fraction (`4096.0`).
fn as_u64(v: &Value) -> Option<u64> {
    v.as_u64().or_else(|| {
        let f = v.as_f64()?;
        (f >= 0.0 && f.fract() == 0.0 && f < 2f64.powi(53)).then_some(f as u64)
    })
}
