//! Layers point one way: a file under `src/` imports (by a `crate::`, `lathe::`, `super::` or
//! `self::` path) only files of its own layer or of lower ones, and no files import each other
//! in a circle.
//!
//! The layers, lowest first, are declared once in [`LAYERS`]. Reading the sources is plain
//! text work (comments and string literals stripped, `use` trees expanded, a relative path
//! made absolute from the module it is written in, inline `mod x { .. }` blocks included, each
//! path resolved to the deepest file it names, through `pub use` re-exports of
//! `mod.rs`/`lib.rs`), so the
//! test needs no compiler plugin. `cargo test --test layers -- --nocapture` prints the import
//! graph's numbers: upward imports, circles, the largest files and functions.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Top-level modules of `src/` (file or folder name), lowest layer first; modules on one line
/// share a layer. Why this order:
/// - `error`, `dtype`, `tensor` and `npy` name things every layer uses;
/// - `quant` (CPU block types) below the file formats that store them;
/// - `gguf`/`safetensors` read files, `hub` downloads them; `model_file` opens either,
///   `inspect` describes one;
/// - `cpu` kernels, then `gpu` (device, buffers, pipelines, kernel wrappers; the GPU tests
///   check against the CPU references);
/// - `moe`: the expert planner and the offload that runs it on both devices, beside
///   `forward` (the contract between a forward and its callers: `LoadOptions`, which carries
///   the choices of the layers below and is read by the planner, `Want`, `Logits`);
/// - `models` (one folder per architecture), with the text pieces that load beside a model
///   (`tokenizer`, `sample`) and `synth` (writes model files with a family's names);
/// - `engine`, the library's front door; `generate`/`bench` drive an engine (`spec`: the
///   speculative decoding loop they share) and `selftest` the kernels; front ends last.
const LAYERS: &[&[&str]] = &[
    &["error", "dtype", "tensor", "npy"],
    &["quant"],
    &["gguf", "safetensors", "hub"],
    &["model_file", "inspect"],
    &["cpu"],
    &["gpu"],
    &["moe", "forward"],
    &["models", "tokenizer", "sample", "synth"],
    &["engine"],
    &["generate", "spec", "bench", "selftest"],
    &["server"],
    &["cli", "main", "bin", "lib"],
];

/// Folders whose files may import each other in a circle (the quant block types share
/// tables and helpers both ways).
const CIRCLES_ALLOWED_UNDER: &[&str] = &["src/quant/"];

fn src_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

/// `s` with comments, string and char literals blanked (lengths kept, newlines kept).
fn strip(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    let blank = |out: &mut Vec<u8>, c: u8| out.push(if c == b'\n' { b'\n' } else { b' ' });
    while i < b.len() {
        if b[i..].starts_with(b"//") {
            while i < b.len() && b[i] != b'\n' {
                out.push(b' ');
                i += 1;
            }
        } else if b[i..].starts_with(b"/*") {
            let mut depth = 0;
            while i < b.len() {
                if b[i..].starts_with(b"/*") {
                    depth += 1;
                    out.extend_from_slice(b"  ");
                    i += 2;
                } else if b[i..].starts_with(b"*/") {
                    depth -= 1;
                    out.extend_from_slice(b"  ");
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    blank(&mut out, b[i]);
                    i += 1;
                }
            }
        } else if b[i] == b'r'
            && (i == 0 || !(b[i - 1].is_ascii_alphanumeric() || b[i - 1] == b'_'))
            && matches!(b.get(i + 1), Some(b'"') | Some(b'#'))
        {
            // Raw string r"..", r#".."#.
            let mut j = i + 1;
            while j < b.len() && b[j] == b'#' {
                j += 1;
            }
            if b.get(j) != Some(&b'"') {
                out.push(b[i]);
                i += 1;
                continue;
            }
            let hashes = j - i - 1;
            let mut end = j + 1;
            loop {
                if end >= b.len() {
                    break;
                }
                if b[end] == b'"'
                    && b[end + 1..]
                        .iter()
                        .take(hashes)
                        .filter(|&&c| c == b'#')
                        .count()
                        == hashes
                {
                    end += 1 + hashes;
                    break;
                }
                end += 1;
            }
            for &c in &b[i..end.min(b.len())] {
                blank(&mut out, c);
            }
            i = end;
        } else if b[i] == b'"' {
            let mut j = i + 1;
            while j < b.len() && b[j] != b'"' {
                if b[j] == b'\\' {
                    j += 1;
                }
                j += 1;
            }
            let end = (j + 1).min(b.len());
            for &c in &b[i..end] {
                blank(&mut out, c);
            }
            i = end;
        } else if b[i] == b'\'' {
            // A char literal ('a', '\n', '\u{..}', '\''); a lifetime is left alone.
            let rest = &b[i + 1..];
            let len = if rest.first() == Some(&b'\\') {
                rest.iter().skip(1).position(|&c| c == b'\'').map(|p| p + 2)
            } else if rest.len() >= 2 && rest[1] == b'\'' {
                Some(1)
            } else {
                std::str::from_utf8(&rest[..rest.len().min(5)])
                    .ok()
                    .or_else(|| std::str::from_utf8(&rest[..rest.len().min(4)]).ok())
                    .and_then(|t| t.chars().next())
                    .filter(|c| c.len_utf8() > 1 && rest.get(c.len_utf8()) == Some(&b'\''))
                    .map(|c| c.len_utf8())
            };
            match len {
                Some(n) => {
                    out.extend(std::iter::repeat_n(b' ', n + 2));
                    i += n + 2;
                }
                None => {
                    out.push(b[i]);
                    i += 1;
                }
            }
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn is_ident(c: u8) -> bool {
    c.is_ascii_alphanumeric() || c == b'_'
}

/// The paths of the `use` tree (or plain path) starting at `i`, each a list of segments
/// (`self` dropped, a glob ends the path).
fn expand(b: &[u8], i: &mut usize, prefix: &[String], out: &mut Vec<Vec<String>>) {
    let mut segs = prefix.to_vec();
    let skip_ws = |i: &mut usize| {
        while *i < b.len() && b[*i].is_ascii_whitespace() {
            *i += 1;
        }
    };
    loop {
        skip_ws(i);
        if *i < b.len() && b[*i] == b'{' {
            *i += 1;
            loop {
                while *i < b.len() && (b[*i].is_ascii_whitespace() || b[*i] == b',') {
                    *i += 1;
                }
                if *i >= b.len() || b[*i] == b'}' {
                    *i += 1;
                    return;
                }
                let before = *i;
                expand(b, i, &segs, out);
                if *i == before {
                    *i += 1;
                }
            }
        }
        let start = *i;
        while *i < b.len() && (is_ident(b[*i]) || b[*i] == b'*') {
            *i += 1;
        }
        if *i == start {
            out.push(segs);
            return;
        }
        let w = String::from_utf8_lossy(&b[start..*i]).into_owned();
        if w != "self" && w != "*" {
            segs.push(w);
        }
        skip_ws(i);
        if b[*i..].starts_with(b"::") {
            *i += 2;
            continue;
        }
        if b[*i..].starts_with(b"as ") {
            *i += 3;
            skip_ws(i);
            while *i < b.len() && is_ident(b[*i]) {
                *i += 1;
            }
        }
        out.push(segs);
        return;
    }
}

/// Every path after `crate::` / `lathe::` in a stripped source.
fn crate_paths(text: &str) -> Vec<Vec<String>> {
    paths(text, &[])
}

/// Every path in a stripped source, relative to the crate root: after `crate::` / `lathe::`,
/// and after `super::` / `self::` made absolute from `module`, the module of the file, and the
/// inline `mod x { .. }` blocks around the path.
fn paths(text: &str, module: &[String]) -> Vec<Vec<String>> {
    let b = text.as_bytes();
    let inline = inline_mods(text);
    let mut out = Vec::new();
    for root in ["crate::", "lathe::", "super::", "self::"] {
        let relative = root == "super::" || root == "self::";
        let mut from = 0;
        while let Some(p) = text[from..].find(root) {
            let at = from + p;
            from = at + root.len();
            if at > 0 && (is_ident(b[at - 1]) || b[at - 1] == b':') {
                continue;
            }
            let mut i = from;
            let mut found = Vec::new();
            expand(b, &mut i, &[], &mut found);
            if !relative {
                out.extend(found);
                continue;
            }
            // The module the path is written in, then one step up per `super`.
            let mut base = module.to_vec();
            base.extend(
                inline
                    .iter()
                    .filter(|(_, span)| span.contains(&at))
                    .map(|(name, _)| name.clone()),
            );
            let ups = usize::from(root == "super::");
            for p in found {
                let more = p.iter().take_while(|s| *s == "super").count();
                let mut full = base[..base.len().saturating_sub(ups + more)].to_vec();
                full.extend(p[more..].iter().cloned());
                out.push(full);
            }
        }
    }
    out
}

/// The inline modules of a stripped source (`mod tests { .. }`): name and byte span, outer
/// ones first.
fn inline_mods(text: &str) -> Vec<(String, std::ops::Range<usize>)> {
    let b = text.as_bytes();
    let mut out = Vec::new();
    let mut from = 0;
    while let Some(p) = text[from..].find("mod ") {
        let at = from + p;
        from = at + 4;
        if at > 0 && is_ident(b[at - 1]) {
            continue;
        }
        let name: String = text[from..]
            .chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect();
        let rest = text[from + name.len()..].trim_start();
        if name.is_empty() || !rest.starts_with('{') {
            continue;
        }
        let open = text.len() - rest.len();
        out.push((name, open..block_end(b, open)));
    }
    out
}

/// The index of the `}` that closes the `{` at `open` (the end of the text if none does).
fn block_end(b: &[u8], open: usize) -> usize {
    let mut depth = 0;
    let mut end = open;
    while end < b.len() {
        match b[end] {
            b'{' => depth += 1,
            b'}' => {
                depth -= 1;
                if depth == 0 {
                    break;
                }
            }
            _ => {}
        }
        end += 1;
    }
    end
}

/// The module path of a file under `src/`: `src/gpu/mod.rs` → `gpu`, `src/gpu/x.rs` → `gpu::x`.
fn module_of(src: &Path, f: &Path) -> Vec<String> {
    let rel = f.strip_prefix(src).unwrap().with_extension("");
    let mut m: Vec<String> = rel
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect();
    if matches!(
        m.last().map(String::as_str),
        Some("mod") | Some("lib") | Some("main")
    ) {
        m.pop();
    }
    m
}

/// Names that module file `f` re-exports (`pub use a::b::{C, D as E}`), to their paths
/// relative to the crate root.
fn reexports(f: &Path, module: &[String]) -> BTreeMap<String, Vec<String>> {
    let text = strip(&std::fs::read_to_string(f).unwrap());
    let b = text.as_bytes();
    let mut map = BTreeMap::new();
    let mut from = 0;
    while let Some(p) = text[from..].find("pub use ") {
        let at = from + p;
        from = at + 8;
        let mut i = from;
        let mut paths = Vec::new();
        expand(b, &mut i, &[], &mut paths);
        for p in paths {
            let Some(last) = p.last().cloned() else {
                continue;
            };
            let full = if p[0] == "crate" || p[0] == "lathe" {
                p[1..].to_vec()
            } else if p[0] == "super" {
                let mut m = module[..module.len().saturating_sub(1)].to_vec();
                m.extend(p[1..].iter().cloned());
                m
            } else {
                let mut m = module.to_vec();
                m.extend(p.iter().cloned());
                m
            };
            map.insert(last, full);
        }
    }
    map
}

/// The file a crate-root path names: the deepest module file on it, followed through the
/// `pub use` of a module file when the next segment is a re-exported name.
fn resolve(src: &Path, segs: &[String], depth: usize) -> Option<PathBuf> {
    let mut dir = src.to_path_buf();
    let mut file = src.join("lib.rs");
    let mut module: Vec<String> = Vec::new();
    for (k, s) in segs.iter().enumerate() {
        let as_file = dir.join(format!("{s}.rs"));
        let as_dir = dir.join(s).join("mod.rs");
        if as_file.is_file() {
            file = as_file;
        } else if as_dir.is_file() {
            file = as_dir;
        } else {
            let is_mod_file = file.ends_with("mod.rs") || file.ends_with("lib.rs");
            if is_mod_file && depth < 8 {
                if let Some(target) = reexports(&file, &module).get(s) {
                    let mut full = target.clone();
                    full.extend(segs[k + 1..].iter().cloned());
                    return resolve(src, &full, depth + 1);
                }
            }
            break;
        }
        dir = dir.join(s);
        module.push(s.clone());
    }
    Some(file)
}

fn rs_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            rs_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// `src/a/b.rs` → `src/a/b.rs` as text, relative to the package.
fn rel(p: &Path) -> String {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    p.strip_prefix(root)
        .unwrap()
        .to_string_lossy()
        .replace('\\', "/")
}

fn layer_of(file: &str) -> usize {
    let top = file
        .strip_prefix("src/")
        .unwrap()
        .split('/')
        .next()
        .unwrap()
        .trim_end_matches(".rs");
    LAYERS
        .iter()
        .position(|l| l.contains(&top))
        .unwrap_or_else(|| panic!("{file}: module `{top}` is in no layer of LAYERS"))
}

/// The import graph: (importing file, imported file) → number of paths.
fn graph() -> BTreeMap<(String, String), usize> {
    let src = src_dir();
    let mut files = Vec::new();
    rs_files(&src, &mut files);
    let mut edges = BTreeMap::new();
    for f in &files {
        let text = strip(&std::fs::read_to_string(f).unwrap());
        let from = rel(f);
        for p in paths(&text, &module_of(&src, f)) {
            let Some(to) = resolve(&src, &p, 0) else {
                continue;
            };
            let to = rel(&to);
            if to != from {
                *edges.entry((from.clone(), to)).or_insert(0) += 1;
            }
        }
    }
    edges
}

/// Strongly connected components of more than one file (Tarjan).
fn circles(edges: &BTreeMap<(String, String), usize>) -> Vec<Vec<String>> {
    let mut adj: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    for (a, b) in edges.keys() {
        adj.entry(a).or_default().push(b);
        adj.entry(b).or_default();
    }
    struct T<'a> {
        adj: &'a BTreeMap<&'a str, Vec<&'a str>>,
        index: BTreeMap<&'a str, usize>,
        low: BTreeMap<&'a str, usize>,
        stack: Vec<&'a str>,
        on: BTreeSet<&'a str>,
        out: Vec<Vec<String>>,
    }
    fn visit<'a>(t: &mut T<'a>, v: &'a str) {
        let n = t.index.len();
        t.index.insert(v, n);
        t.low.insert(v, n);
        t.stack.push(v);
        t.on.insert(v);
        for &w in &t.adj[v] {
            if !t.index.contains_key(w) {
                visit(t, w);
                let lw = t.low[w];
                let lv = t.low.get_mut(v).unwrap();
                *lv = (*lv).min(lw);
            } else if t.on.contains(w) {
                let iw = t.index[w];
                let lv = t.low.get_mut(v).unwrap();
                *lv = (*lv).min(iw);
            }
        }
        if t.low[v] == t.index[v] {
            let mut c = Vec::new();
            loop {
                let w = t.stack.pop().unwrap();
                t.on.remove(w);
                c.push(w.to_string());
                if w == v {
                    break;
                }
            }
            if c.len() > 1 {
                c.sort();
                t.out.push(c);
            }
        }
    }
    let mut t = T {
        adj: &adj,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on: BTreeSet::new(),
        out: Vec::new(),
    };
    for &v in adj.keys() {
        if !t.index.contains_key(v) {
            visit(&mut t, v);
        }
    }
    t.out
}

fn upward(edges: &BTreeMap<(String, String), usize>) -> Vec<(String, String)> {
    edges
        .keys()
        .filter(|(a, b)| layer_of(b) > layer_of(a))
        .cloned()
        .collect()
}

/// (lines, name) of every `fn` body, by brace matching on the stripped text.
fn functions(file: &str, text: &str) -> Vec<(usize, String)> {
    let b = text.as_bytes();
    let mut out = Vec::new();
    let mut from = 0;
    while let Some(p) = text[from..].find("fn ") {
        let at = from + p;
        from = at + 3;
        if at > 0 && is_ident(b[at - 1]) {
            continue;
        }
        let name: String = text[from..]
            .chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect();
        if name.is_empty() {
            continue;
        }
        // The body: the first `{` before any `;` at depth 0 of parentheses.
        let mut i = from;
        let mut paren = 0i32;
        let open = loop {
            match b.get(i) {
                None => break None,
                Some(b'(') | Some(b'[') => paren += 1,
                Some(b')') | Some(b']') => paren -= 1,
                Some(b';') if paren == 0 => break None,
                Some(b'{') if paren == 0 => break Some(i),
                _ => {}
            }
            i += 1;
        };
        let Some(open) = open else { continue };
        let j = block_end(b, open);
        let lines = text[at..j.min(text.len())].lines().count();
        out.push((lines, format!("{file}::{name}")));
    }
    out
}

#[test]
fn layers_point_one_way() {
    let edges = graph();
    let up = upward(&edges);
    let circ = circles(&edges);

    // The report (`-- --nocapture`).
    println!(
        "import graph: {} files import each other over {} edges",
        edges
            .keys()
            .flat_map(|(a, b)| [a, b])
            .collect::<BTreeSet<_>>()
            .len(),
        edges.len()
    );
    println!("upward imports: {}", up.len());
    for (a, b) in &up {
        println!("  {a} -> {b}");
    }
    println!("circles: {}", circ.len());
    for c in &circ {
        println!("  {}", c.join(" <-> "));
    }
    let mut files = Vec::new();
    rs_files(&src_dir(), &mut files);
    let mut sizes = Vec::new();
    let mut fns = Vec::new();
    for f in &files {
        let raw = std::fs::read_to_string(f).unwrap();
        sizes.push((raw.lines().count(), rel(f)));
        fns.extend(functions(&rel(f), &strip(&raw)));
    }
    sizes.sort_by(|a, b| b.cmp(a));
    fns.sort_by(|a, b| b.cmp(a));
    println!("largest files (lines):");
    for (n, f) in sizes.iter().take(8) {
        println!("  {n:5} {f}");
    }
    println!("largest functions (lines):");
    for (n, f) in fns.iter().take(8) {
        println!("  {n:5} {f}");
    }

    assert!(
        up.is_empty(),
        "files that import a higher layer (see LAYERS in tests/layers.rs): {up:#?}"
    );
    let bad: Vec<_> = circ
        .iter()
        .filter(|c| {
            !c.iter()
                .all(|f| CIRCLES_ALLOWED_UNDER.iter().any(|d| f.starts_with(d)))
        })
        .collect();
    assert!(
        bad.is_empty(),
        "files that import each other in a circle: {bad:#?}"
    );
}

/// The reader itself: a `use` tree expands to its paths, comments and strings are no imports,
/// a re-export resolves to the defining file, and an upward import is caught.
#[test]
fn reader_finds_what_it_should() {
    let t =
        strip("use crate::a::{b::{C, d as D}, self, e::*}; // crate::x::y\nlet s = \"crate::q\";");
    let mut p = crate_paths(&t);
    p.sort();
    let want: Vec<Vec<String>> = [
        vec!["a"],
        vec!["a", "b", "C"],
        vec!["a", "b", "d"],
        vec!["a", "e"],
    ]
    .iter()
    .map(|v| v.iter().map(|s| s.to_string()).collect())
    .collect();
    assert_eq!(p, want);
    // Relative paths, from the file's module and the inline modules around them.
    let t = strip(
        "use super::a::B;\nmod tests {\n use super::*;\n fn f() { self::g(); super::super::c::D; }\n}",
    );
    let module = ["gpu".to_string(), "x".to_string()];
    let mut p = paths(&t, &module);
    p.sort();
    let want: Vec<Vec<String>> = [
        vec!["gpu", "a", "B"],
        vec!["gpu", "c", "D"],
        vec!["gpu", "x"],
        vec!["gpu", "x", "tests", "g"],
    ]
    .iter()
    .map(|v| v.iter().map(|s| s.to_string()).collect())
    .collect();
    assert_eq!(p, want);
    let src = src_dir();
    assert_eq!(module_of(&src, &src.join("gpu/mod.rs")), ["gpu"]);
    assert_eq!(
        module_of(&src, &src.join("gpu/matvec.rs")),
        ["gpu", "matvec"]
    );
    let lib_error = resolve(&src, &["Error".to_string()], 0).unwrap();
    assert_eq!(rel(&lib_error), "src/error.rs");
    assert!(layer_of("src/gpu/matmul.rs") < layer_of("src/models/qwen35/mod.rs"));
    let mut e = BTreeMap::new();
    e.insert(("src/gpu/x.rs".to_string(), "src/engine.rs".to_string()), 1);
    e.insert(("src/engine.rs".to_string(), "src/gpu/x.rs".to_string()), 1);
    assert_eq!(upward(&e).len(), 1);
    assert_eq!(circles(&e).len(), 1);
}
