//! Which files of a repo make the model: one quant of a GGUF repo (every part of a split
//! one), or the config, tokenizer and weights of a safetensors checkpoint.

use std::path::{Path, PathBuf};

use super::ModelRef;
use crate::DType;

/// The quant chosen when none is asked for: llama.cpp's and ollama's default.
pub const DEFAULT_QUANT: &str = "Q4_K_M";

/// The files a model needs, by path inside the repo.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Choice {
    /// The parts of one GGUF model in order (one, or `-00001-of-0000N` … `-0000N-of-0000N`).
    Gguf { parts: Vec<String> },
    /// A Hugging Face checkpoint: `files` at the repo root; with `index`, also the shards its
    /// `weight_map` names (known once the index is downloaded).
    Safetensors {
        files: Vec<String>,
        index: Option<String>,
    },
}

impl Choice {
    pub fn files(&self) -> &[String] {
        match self {
            Choice::Gguf { parts } => parts,
            Choice::Safetensors { files, .. } => files,
        }
    }

    /// What `-m` opens: the first GGUF part, or the checkpoint directory.
    pub fn local_path(&self, snapshot: &Path) -> PathBuf {
        match self {
            Choice::Gguf { parts } => snapshot.join(&parts[0]),
            Choice::Safetensors { .. } => snapshot.to_path_buf(),
        }
    }
}

fn file_name(path: &str) -> &str {
    path.rsplit('/').next().unwrap_or(path)
}

/// `name` without `.gguf` and without a split suffix `-00001-of-00003` (llama.cpp's
/// `%s-%05d-of-%05d.gguf`), with the (part, count) when it has one.
fn split_stem(name: &str) -> Option<(&str, Option<(usize, usize)>)> {
    let stem = name
        .len()
        .checked_sub(5)
        .filter(|&n| name.is_char_boundary(n) && name[n..].eq_ignore_ascii_case(".gguf"))
        .map(|n| &name[..n])?;
    let split = stem.rsplit_once("-of-").and_then(|(left, count)| {
        let (prefix, no) = left.rsplit_once('-')?;
        let digits = |s: &str| s.len() == 5 && s.bytes().all(|b| b.is_ascii_digit());
        if !digits(no) || !digits(count) || prefix.is_empty() {
            return None;
        }
        Some((prefix, (no.parse().ok()?, count.parse().ok()?)))
    });
    Some(match split {
        Some((prefix, nc)) => (prefix, Some(nc)),
        None => (stem, None),
    })
}

/// Whether a name token is a llama.cpp quant type (`Q4_K_M`, `IQ4_XS`, `Q8_0`, `BF16`,
/// `MXFP4`, `TQ1_0`, unsloth's `Q4_K_XL`).
fn is_quant_token(t: &str) -> bool {
    let u = t.to_ascii_uppercase();
    let digit_after = |p: &str| {
        u.strip_prefix(p)
            .is_some_and(|r| r.starts_with(|c: char| c.is_ascii_digit()))
    };
    ["F16", "F32", "BF16", "MXFP4"].contains(&u.as_str())
        || ((digit_after("Q") || digit_after("IQ") || digit_after("TQ")) && u.contains('_'))
}

fn tokens(stem: &str) -> Vec<&str> {
    stem.split(['-', '.']).collect()
}

/// The quant type a GGUF file name carries (`Qwen3.5-4B-Q4_K_M.gguf` → `Q4_K_M`,
/// `model-UD-Q4_K_XL-00001-of-00002.gguf` → `UD-Q4_K_XL`), upper-case; `None` for other files.
pub fn gguf_quant(path: &str) -> Option<String> {
    let (stem, _) = split_stem(file_name(path))?;
    let toks = tokens(stem);
    let i = toks.iter().rposition(|t| is_quant_token(t))?;
    let q = toks[i].to_ascii_uppercase();
    Some(match i.checked_sub(1).map(|j| toks[j]) {
        Some(ud) if ud.eq_ignore_ascii_case("ud") => format!("UD-{q}"),
        _ => q,
    })
}

/// Whether a GGUF file name carries the quant type `quant` (case-insensitive): as one or more
/// whole `-`/`.`-separated tokens (`:Q4_K_M` matches `x-Q4_K_M.gguf`, `:UD-Q4_K_XL` matches
/// `x-UD-Q4_K_XL.gguf`; `:Q4_K` does not match `x-Q4_K_M.gguf`), or after a final `_`.
pub fn matches_quant(path: &str, quant: &str) -> bool {
    let Some((stem, _)) = split_stem(file_name(path)) else {
        return false;
    };
    let stem = stem.to_ascii_lowercase();
    let q = quant.to_ascii_lowercase();
    let toks = tokens(&stem);
    let n = tokens(&q).len();
    toks.windows(n).any(|w| w.join("-") == q.replace('.', "-")) || stem.ends_with(&format!("_{q}"))
}

/// Whether lathe runs a GGUF of this quant type: its main block type (`Q4_K_M` → `Q4_K`) is
/// one lathe has kernels for.
pub fn lathe_runs(quant: &str) -> bool {
    let q = quant.strip_prefix("UD-").unwrap_or(quant);
    let base = ["_XL", "_S", "_M", "_L"]
        .iter()
        .find_map(|s| q.strip_suffix(s).filter(|b| b.contains('_')))
        .unwrap_or(q);
    DType::from_name(q)
        .or(DType::from_name(base))
        .is_some_and(|t| {
            !matches!(
                t,
                DType::I8 | DType::I16 | DType::I32 | DType::I64 | DType::F64 | DType::U8
            )
        })
}

/// One GGUF model of a repo: its parts in order, total size and quant type.
#[derive(Debug)]
struct Group {
    parts: Vec<String>,
    size: u64,
    quant: Option<String>,
}

/// The complete GGUF models of a listing (a split one only with all its parts), skipping
/// multimodal projectors (`mmproj-*.gguf`), which are not language models.
fn gguf_groups(files: &[(&str, u64)]) -> Vec<Group> {
    let mut by_prefix: std::collections::BTreeMap<String, Vec<(usize, usize, &str, u64)>> =
        Default::default();
    for &(path, size) in files {
        let name = file_name(path);
        if name.to_ascii_lowercase().starts_with("mmproj") {
            continue;
        }
        let Some((stem, split)) = split_stem(name) else {
            continue;
        };
        let dir = &path[..path.len() - name.len()];
        let (no, count) = split.unwrap_or((1, 1));
        let key = format!("{dir}{stem}#{count}#{}", split.is_some());
        by_prefix
            .entry(key)
            .or_default()
            .push((no, count, path, size));
    }
    let mut groups = Vec::new();
    for (_, mut parts) in by_prefix {
        parts.sort();
        let count = parts[0].1;
        let complete = parts.len() == count && parts.iter().enumerate().all(|(i, p)| p.0 == i + 1);
        if complete {
            groups.push(Group {
                quant: gguf_quant(parts[0].2),
                size: parts.iter().map(|p| p.3).sum(),
                parts: parts.iter().map(|p| p.2.to_string()).collect(),
            });
        }
    }
    groups
}

fn quant_list(groups: &[Group]) -> String {
    let mut qs: Vec<&str> = groups.iter().filter_map(|g| g.quant.as_deref()).collect();
    qs.sort();
    qs.dedup();
    if qs.is_empty() {
        "none named in its GGUF file names".into()
    } else {
        qs.join(", ")
    }
}

/// Files a safetensors checkpoint needs beside its weights, when the repo has them (what
/// `HfModel::open` and the tokenizer loader read).
const CHECKPOINT_FILES: [&str; 5] = [
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
];
const INDEX: &str = "model.safetensors.index.json";

/// Chooses the files of `model` from a repo listing of (path, size). The error says what the
/// repo has instead.
pub fn choose(files: &[(&str, u64)], model: &ModelRef) -> Result<Choice, String> {
    let groups = gguf_groups(files);
    if let Some(want) = &model.file {
        let g = groups
            .iter()
            .find(|g| g.parts.iter().any(|p| p == want))
            .ok_or_else(|| {
                let names: Vec<&str> = groups.iter().map(|g| g.parts[0].as_str()).collect();
                format!(
                    "{want}: no such GGUF model in the repo (it has: {})",
                    if names.is_empty() {
                        "no GGUF files".into()
                    } else {
                        names.join(", ")
                    }
                )
            })?;
        return Ok(Choice::Gguf {
            parts: g.parts.clone(),
        });
    }
    if !groups.is_empty() {
        let pick = |quant: &str| {
            groups
                .iter()
                .filter(|g| matches_quant(&g.parts[0], quant))
                // An exact quant token first (`Q4_K_M` over `UD-Q4_K_M`), then the shortest name.
                .min_by_key(|g| {
                    let exact = g
                        .quant
                        .as_deref()
                        .is_some_and(|q| q.eq_ignore_ascii_case(quant));
                    (!exact, g.parts[0].len(), g.parts[0].clone())
                })
        };
        let g = match &model.quant {
            Some(q) => pick(q).ok_or_else(|| {
                format!(
                    "no GGUF of quant type {q} in the repo; it has: {}",
                    quant_list(&groups)
                )
            })?,
            None => pick(DEFAULT_QUANT)
                .or_else(|| {
                    groups
                        .iter()
                        .filter(|g| g.quant.as_deref().is_some_and(lathe_runs))
                        .min_by_key(|g| g.size)
                })
                .or(if groups.len() == 1 {
                    groups.first()
                } else {
                    None
                })
                .ok_or_else(|| {
                    format!(
                        "no GGUF of a quant type lathe runs; the repo has: {}",
                        quant_list(&groups)
                    )
                })?,
        };
        return Ok(Choice::Gguf {
            parts: g.parts.clone(),
        });
    }
    let root: Vec<&str> = files
        .iter()
        .map(|f| f.0)
        .filter(|p| !p.contains('/'))
        .collect();
    let has = |name: &str| root.contains(&name);
    let weights: Vec<&str> = root
        .iter()
        .copied()
        .filter(|p| p.ends_with(".safetensors"))
        .collect();
    if !has("config.json") || weights.is_empty() {
        let mut some: Vec<&str> = files.iter().map(|f| f.0).take(8).collect();
        if files.len() > 8 {
            some.push("...");
        }
        return Err(format!(
            "no GGUF model and no safetensors checkpoint (config.json + *.safetensors) in the repo; it has: {}",
            if some.is_empty() { "no files".into() } else { some.join(", ") }
        ));
    }
    if let Some(q) = &model.quant {
        return Err(format!(
            "a safetensors checkpoint, which has no quant types: drop `:{q}` to fetch it"
        ));
    }
    let mut out: Vec<String> = CHECKPOINT_FILES
        .iter()
        .filter(|f| has(f))
        .map(|f| f.to_string())
        .collect();
    // The same order of preference as `HfModel::open`: the index, else `model.safetensors`,
    // else every `*.safetensors` (DeepSeek's inference-style release).
    let index = has(INDEX).then(|| INDEX.to_string());
    if let Some(i) = &index {
        out.push(i.clone());
    } else if has("model.safetensors") {
        out.push("model.safetensors".into());
    } else {
        out.extend(weights.iter().map(|w| w.to_string()));
    }
    Ok(Choice::Safetensors { files: out, index })
}

/// The shard files a `model.safetensors.index.json` names, in order of first mention.
pub fn index_shards(index: &Path) -> Result<Vec<String>, String> {
    let text = std::fs::read_to_string(index).map_err(|e| format!("{}: {e}", index.display()))?;
    let json: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| format!("{}: JSON: {e}", index.display()))?;
    let map = json["weight_map"]
        .as_object()
        .ok_or_else(|| format!("{}: no `weight_map` object", index.display()))?;
    let mut shards: Vec<String> = Vec::new();
    for v in map.values() {
        let s = v
            .as_str()
            .filter(|s| !s.is_empty() && !s.contains(['/', '\\']))
            .ok_or_else(|| {
                format!(
                    "{}: weight_map value {v} is not a file name",
                    index.display()
                )
            })?;
        if !shards.iter().any(|x| x == s) {
            shards.push(s.to_string());
        }
    }
    Ok(shards)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn m(quant: Option<&str>, file: Option<&str>) -> ModelRef {
        ModelRef {
            repo: "o/r".into(),
            quant: quant.map(Into::into),
            file: file.map(Into::into),
        }
    }

    #[test]
    fn quant_types_come_from_file_names() {
        assert_eq!(
            gguf_quant("Qwen3.5-4B-Q4_K_M.gguf").as_deref(),
            Some("Q4_K_M")
        );
        assert_eq!(
            gguf_quant("Model-7B-q4_k_m.gguf").as_deref(),
            Some("Q4_K_M")
        );
        assert_eq!(gguf_quant("model-f32.gguf").as_deref(), Some("F32"));
        assert_eq!(
            gguf_quant("x/Qwen3.5-4B-BF16.gguf").as_deref(),
            Some("BF16")
        );
        assert_eq!(
            gguf_quant("Q4/M-UD-Q4_K_XL-00001-of-00002.gguf").as_deref(),
            Some("UD-Q4_K_XL")
        );
        assert_eq!(gguf_quant("config.json"), None);
        assert_eq!(gguf_quant("tiny-split-00001-of-00003.gguf"), None);
        assert!(matches_quant("Model-7B-q4_k_m.gguf", "Q4_K_M"));
        assert!(matches_quant("M-UD-Q4_K_XL.gguf", "ud-q4_k_xl"));
        assert!(matches_quant("M-UD-Q4_K_XL.gguf", "Q4_K_XL"));
        assert!(!matches_quant("M-Q4_K_M.gguf", "Q4_K"));
        assert!(!matches_quant("M-Q4_K_M.gguf", "Q8_0"));
        assert!(lathe_runs("Q4_K_M") && lathe_runs("IQ4_XS") && lathe_runs("UD-Q4_K_XL"));
        assert!(lathe_runs("BF16") && lathe_runs("Q8_0") && lathe_runs("MXFP4"));
        assert!(!lathe_runs("IQ2_XXS") && !lathe_runs("IQ3_M") && !lathe_runs("TQ1_0"));
    }

    #[test]
    fn gguf_choice_prefers_the_asked_quant_then_q4_k_m_then_the_smallest_runnable() {
        let files = [
            ("README.md", 10),
            ("mmproj-F16.gguf", 5),
            ("M-IQ2_XXS.gguf", 50),
            ("M-Q8_0.gguf", 800),
            ("M-Q6_K.gguf", 600),
            ("BF16/M-BF16-00002-of-00002.gguf", 900),
            ("BF16/M-BF16-00001-of-00002.gguf", 900),
            ("M-Q2_K-00001-of-00002.gguf", 100),
        ];
        let c = |q: Option<&str>| choose(&files, &m(q, None));
        let gguf = |p: &[&str]| {
            Ok(Choice::Gguf {
                parts: p.iter().map(|s| s.to_string()).collect(),
            })
        };
        assert_eq!(c(Some("q8_0")), gguf(&["M-Q8_0.gguf"]));
        assert_eq!(
            c(Some("BF16")),
            gguf(&[
                "BF16/M-BF16-00001-of-00002.gguf",
                "BF16/M-BF16-00002-of-00002.gguf"
            ])
        );
        // No Q4_K_M: the smallest that lathe runs (IQ2_XXS is smaller but not runnable; the
        // Q2_K split lacks its second part).
        assert_eq!(c(None), gguf(&["M-Q6_K.gguf"]));
        let e = c(Some("Q4_K_M")).unwrap_err();
        assert!(e.contains("BF16, IQ2_XXS, Q6_K, Q8_0"), "{e}");
        assert_eq!(
            choose(&files, &m(None, Some("BF16/M-BF16-00002-of-00002.gguf"))),
            gguf(&[
                "BF16/M-BF16-00001-of-00002.gguf",
                "BF16/M-BF16-00002-of-00002.gguf"
            ])
        );
        let with_default = [
            ("a-Q8_0.gguf", 8),
            ("a-Q4_K_M.gguf", 4),
            ("a-UD-Q4_K_M.gguf", 4),
        ];
        assert_eq!(
            choose(&with_default, &m(None, None)),
            gguf(&["a-Q4_K_M.gguf"])
        );
    }

    #[test]
    fn safetensors_choice_follows_the_checkpoint_loader() {
        let files = [
            ("config.json", 1),
            ("tokenizer.json", 1),
            ("README.md", 1),
            (INDEX, 1),
            ("model-00001-of-00002.safetensors", 9),
            ("model-00002-of-00002.safetensors", 9),
            ("original/consolidated.safetensors", 9),
        ];
        assert_eq!(
            choose(&files, &m(None, None)),
            Ok(Choice::Safetensors {
                files: vec!["config.json".into(), "tokenizer.json".into(), INDEX.into()],
                index: Some(INDEX.into()),
            })
        );
        // DeepSeek's inference-style release: no index, every root *.safetensors.
        let ds = [
            ("config.json", 1),
            ("model0-mp1.safetensors", 9),
            ("model1-mp1.safetensors", 9),
        ];
        assert_eq!(
            choose(&ds, &m(None, None)).unwrap().files(),
            [
                "config.json",
                "model0-mp1.safetensors",
                "model1-mp1.safetensors"
            ]
        );
        assert!(choose(&ds, &m(Some("Q4_K_M"), None)).is_err());
        assert!(choose(&[("README.md", 1)], &m(None, None)).is_err());
    }
}
