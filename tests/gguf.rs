//! GGUF reader and writer against files written by gguf-py (llama.cpp's own Python writer,
//! `tests/fixtures/gguf/make_gguf.py`), the shared fixture models (when `../shared` is
//! present), round trips through `GgufWriter`, and one malformed file per validation rule.

use lathe::gguf::{keys, split_path, GgufFile, GgufWriter, Split, Value};
use lathe::{DType, Error};
use std::path::{Path, PathBuf};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/gguf")
}

/// ../shared/fixtures/models; the test fails when this checkout lacks it.
fn shared_models() -> PathBuf {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("../shared/fixtures/models");
    assert!(
        p.is_dir(),
        "{} is absent: this test needs ../shared/fixtures (CI has it)",
        p.display()
    );
    p
}

/// A fresh scratch directory per test (tests run in parallel).
fn scratch(test: &str) -> PathBuf {
    let d = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join("gguf")
        .join(test);
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// The checksum make_gguf.py writes: sum_i byte[i] * (i % 251 + 1), wrapping.
fn checksum(data: &[u8]) -> u64 {
    data.iter().enumerate().fold(0u64, |acc, (i, &b)| {
        acc.wrapping_add(b as u64 * (i as u64 % 251 + 1))
    })
}

fn pattern(n: usize, mul: usize, add: usize) -> Vec<u8> {
    (0..n).map(|i| ((i * mul + add) % 256) as u8).collect()
}

fn le_bytes<T: Copy, const N: usize>(v: &[T], f: impl Fn(T) -> [u8; N]) -> Vec<u8> {
    v.iter().flat_map(|&x| f(x)).collect()
}

fn arr(v: Vec<Value>) -> Value {
    Value::Array(v)
}

/// What make_gguf.py writes into all_types.gguf, in file order.
fn all_types_metadata() -> Vec<(&'static str, Value)> {
    use Value::*;
    let s = |x: &str| Str(x.to_string());
    vec![
        ("general.architecture", s("lathe-test")),
        ("general.alignment", U32(64)),
        ("test.u8", U8(200)),
        ("test.i8", I8(-100)),
        ("test.u16", U16(60000)),
        ("test.i16", I16(-30000)),
        ("test.u32", U32(4_000_000_000)),
        ("test.i32", I32(-2_000_000_000)),
        ("test.u64", U64((1 << 63) + 5)),
        ("test.i64", I64(-(1 << 62) - 3)),
        ("test.f32", F32(1.5)),
        ("test.f64", F64(-2.25e-300)),
        ("test.bool_true", Bool(true)),
        ("test.bool_false", Bool(false)),
        ("test.str", s("h\u{e9}llo, w\u{f6}rld \u{2713}")),
        ("test.str_empty", s("")),
        ("test.arr_u8", arr(vec![U8(0), U8(1), U8(255)])),
        ("test.arr_i8", arr(vec![I8(-128), I8(0), I8(127)])),
        ("test.arr_u16", arr(vec![U16(0), U16(65535)])),
        ("test.arr_i16", arr(vec![I16(-32768), I16(32767)])),
        ("test.arr_u32", arr(vec![U32(1), U32(u32::MAX)])),
        ("test.arr_i32", arr(vec![I32(-7), I32(0), I32(7)])),
        ("test.arr_u64", arr(vec![U64(u64::MAX), U64(3)])),
        ("test.arr_i64", arr(vec![I64(i64::MIN), I64(i64::MAX)])),
        ("test.arr_f32", arr(vec![F32(0.5), F32(-1.25), F32(3.0e38)])),
        ("test.arr_f64", arr(vec![F64(1.0e-310), F64(-0.125)])),
        (
            "test.arr_bool",
            arr(vec![Bool(true), Bool(false), Bool(true)]),
        ),
        ("test.arr_str", arr(vec![s("a"), s(""), s("\u{fc}n\u{ef}")])),
        (
            "test.arr_arr_i32",
            arr(vec![
                arr(vec![I32(1), I32(2)]),
                arr(vec![I32(3)]),
                arr(vec![I32(4), I32(5), I32(6)]),
            ]),
        ),
        (
            "test.arr_arr_str",
            arr(vec![arr(vec![s("x"), s("y")]), arr(vec![s("z")])]),
        ),
        (
            "test.arr_arr_arr_f32",
            arr(vec![
                arr(vec![arr(vec![F32(1.0), F32(2.0)])]),
                arr(vec![arr(vec![F32(3.0)]), arr(vec![F32(4.0), F32(5.0)])]),
            ]),
        ),
        (
            "test.arr_mixed_inner",
            arr(vec![
                arr(vec![I32(1), I32(2)]),
                arr(vec![s("a"), s("b")]),
                arr(vec![Bool(true)]),
            ]),
        ),
    ]
}

/// (name, dtype, shape outermost first, bytes) of all_types.gguf's tensors, recomputed from
/// the formulas in make_gguf.py.
fn all_types_tensors() -> Vec<(&'static str, DType, Vec<u64>, Vec<u8>)> {
    let f32s = |v: Vec<f32>| le_bytes(&v, f32::to_le_bytes);
    let mut q8 = Vec::new();
    let mut q: Vec<f32> = (0..64).map(|i| ((i * 5) % 255) as f32 - 127.0).collect();
    q[0] = 127.0;
    q[32] = -127.0;
    for block in q.chunks(32) {
        q8.extend_from_slice(&half::f16::from_f32(1.0).to_le_bytes());
        q8.extend(block.iter().map(|&x| x as i8 as u8));
    }
    vec![
        (
            "f32_mat",
            DType::F32,
            vec![3, 5],
            f32s((0..15).map(|i| i as f32 * 0.25 - 2.0).collect()),
        ),
        (
            "f16_vec",
            DType::F16,
            vec![7],
            le_bytes(
                &(0..7)
                    .map(|i| half::f16::from_f32((i as f32 - 3.0) * 0.5))
                    .collect::<Vec<_>>(),
                half::f16::to_le_bytes,
            ),
        ),
        (
            "bf16_mat",
            DType::BF16,
            vec![2, 4],
            le_bytes(
                &(0..8)
                    .map(|i| half::bf16::from_f32(i as f32 * 1.5 - 4.0))
                    .collect::<Vec<_>>(),
                half::bf16::to_le_bytes,
            ),
        ),
        ("q8_0_mat", DType::Q8_0, vec![2, 32], q8),
        (
            "i32_vec",
            DType::I32,
            vec![6],
            le_bytes(&[-3i32, 0, 7, i32::MAX, i32::MIN, 42], i32::to_le_bytes),
        ),
        (
            "i8_3d",
            DType::I8,
            vec![2, 3, 4],
            (0..24).map(|i| (i - 12) as i8 as u8).collect(),
        ),
        (
            "i16_vec",
            DType::I16,
            vec![4],
            le_bytes(&[i16::MIN, -1, 0, i16::MAX], i16::to_le_bytes),
        ),
        (
            "i64_vec",
            DType::I64,
            vec![3],
            le_bytes(&[i64::MIN, 1, i64::MAX], i64::to_le_bytes),
        ),
        (
            "f64_vec",
            DType::F64,
            vec![3],
            le_bytes(&[std::f64::consts::PI, -0.0, 1e300], f64::to_le_bytes),
        ),
        (
            "f32_4d",
            DType::F32,
            vec![2, 1, 3, 2],
            f32s((0..12).map(|i| i as f32 - 6.0).collect()),
        ),
        ("q4_k_raw", DType::Q4_K, vec![1, 256], pattern(144, 37, 11)),
        ("mxfp4_raw", DType::MXFP4, vec![2, 32], pattern(34, 13, 5)),
    ]
}

fn assert_all_types(g: &GgufFile) {
    let want = all_types_metadata();
    let got = g.metadata();
    assert_eq!(got.len(), want.len());
    for ((gk, gv), (wk, wv)) in got.iter().zip(&want) {
        assert_eq!(gk, wk);
        assert_eq!(gv, wv, "value of {wk}");
    }
    assert_eq!(g.alignment(), 64);
    let want = all_types_tensors();
    assert_eq!(g.n_tensors(), want.len());
    for (t, (name, dtype, shape, bytes)) in g.tensors().zip(&want) {
        assert_eq!(t.name, *name);
        assert_eq!(t.dtype, *dtype, "{name}");
        assert_eq!(t.shape, &shape[..], "{name}");
        assert_eq!(t.data, &bytes[..], "{name}");
        // make_gguf.py aligns data to 64 bytes.
        let (_, off) = g.tensor_location(name).unwrap();
        assert_eq!(off % 64, 0, "{name}");
    }
    assert_eq!(
        g.data_bytes(),
        want.iter().map(|t| t.3.len() as u64).sum::<u64>()
    );
}

#[test]
fn reads_every_value_type_and_tensor_written_by_gguf_py() {
    let path = fixtures().join("all_types.gguf");
    let g = GgufFile::open(&path).unwrap();
    assert_eq!(g.version(), 3);
    assert_eq!(g.path(), path);
    assert_eq!(g.architecture().unwrap(), "lathe-test");
    assert_all_types(&g);

    // Typed getters and their errors.
    assert_eq!(g.get_u64("test.u64").unwrap(), (1 << 63) + 5);
    assert_eq!(g.get_i64("test.i64").unwrap(), -(1 << 62) - 3);
    assert_eq!(g.get_f32("test.f32").unwrap(), 1.5);
    assert_eq!(g.get_f64("test.f64").unwrap(), -2.25e-300);
    assert!(g.get_bool("test.bool_true").unwrap());
    assert_eq!(g.get_str("test.str_empty").unwrap(), "");
    assert_eq!(g.get_array("test.arr_u8").unwrap().len(), 3);
    assert_eq!(
        g.get_u64_array("test.arr_u32").unwrap(),
        [1, u32::MAX as u64]
    );
    assert_eq!(g.get_i64_array("test.arr_i8").unwrap(), [-128, 0, 127]);
    assert_eq!(
        g.get_f32_array("test.arr_f32").unwrap(),
        [0.5, -1.25, 3.0e38]
    );
    assert_eq!(
        g.get_bool_array("test.arr_bool").unwrap(),
        [true, false, true]
    );
    assert_eq!(
        g.get_str_array("test.arr_str").unwrap(),
        ["a", "", "\u{fc}n\u{ef}"]
    );
    assert_eq!(g.get_u64_per_layer("test.u8", 3).unwrap(), [200, 200, 200]);
    assert_eq!(g.get_u64_per_layer("test.arr_u8", 3).unwrap(), [0, 1, 255]);
    assert_eq!(g.opt_u64("absent.key").unwrap(), None);
    assert_eq!(
        g.opt_str("test.str").unwrap(),
        Some("h\u{e9}llo, w\u{f6}rld \u{2713}")
    );
    for e in [
        g.get_u64("test.i8").unwrap_err(), // negative
        g.get_str("test.u8").unwrap_err(),
        g.opt_bool("test.str").unwrap_err(),
        g.get_u64_array("test.arr_i8").unwrap_err(),
        g.get_u64_per_layer("test.arr_u8", 4).unwrap_err(),
    ] {
        assert!(matches!(e, Error::Config { .. }), "{e}");
        let m = e.to_string();
        assert!(
            m.contains(&path.display().to_string()) && m.contains("`test."),
            "{m}"
        );
    }
    let e = g.get_u64("absent.key").unwrap_err().to_string();
    assert!(e.contains("absent.key") && e.contains("missing"), "{e}");

    // Tensor lookup.
    let t = g.require("q8_0_mat").unwrap();
    assert_eq!((t.n_rows(), t.row_len(), t.row_bytes()), (2, 32, 34));
    assert!(g.tensor("nope").is_none());
    match g.require("nope").unwrap_err() {
        Error::MissingTensor { path: p, name } => assert_eq!((p, name.as_str()), (path, "nope")),
        e => panic!("wrong error {e}"),
    }
}

#[test]
fn reads_version_2() {
    // v2 and v3 share the layout (v3 only added big-endian files): patch the version.
    let mut bytes = std::fs::read(fixtures().join("all_types.gguf")).unwrap();
    bytes[4..8].copy_from_slice(&2u32.to_le_bytes());
    let path = scratch("v2").join("v2.gguf");
    std::fs::write(&path, bytes).unwrap();
    let g = GgufFile::open(&path).unwrap();
    assert_eq!(g.version(), 2);
    assert_all_types(&g);
}

/// The expected values of the gguf-py split fixture: blk.i.w is f32 [i+1, 4] = 100 i + k.
fn check_tiny_split(g: &GgufFile, dir: &Path) {
    assert_eq!(g.path(), dir.join("tiny-split-00001-of-00003.gguf"));
    assert_eq!(g.shard_paths().count(), 3);
    check_tiny_split_tensors(g);
    for (i, t) in g.tensors().enumerate() {
        let shard = [1, 1, 2, 2, 3][i];
        assert_eq!(
            t.path,
            dir.join(format!("tiny-split-{shard:05}-of-00003.gguf"))
        );
    }
}

fn check_tiny_split_tensors(g: &GgufFile) {
    assert_eq!(g.n_tensors(), 5);
    assert_eq!(g.get_u64("lathe-test.block_count").unwrap(), 5);
    for (i, t) in g.tensors().enumerate() {
        assert_eq!(t.name, format!("blk.{i}.w"));
        assert_eq!(t.shape, [i as u64 + 1, 4]);
        let want: Vec<u8> = (0..4 * (i + 1))
            .flat_map(|k| (k as f32 + 100.0 * i as f32).to_le_bytes())
            .collect();
        assert_eq!(t.data, &want[..]);
    }
}

#[test]
fn opens_gguf_py_split_files_from_any_shard() {
    let dir = fixtures().join("split");
    for no in 1..=3 {
        let g = GgufFile::open(split_path(dir.join("tiny-split"), no, 3)).unwrap();
        check_tiny_split(&g, &dir);
    }
}

#[test]
fn writer_reproduces_gguf_py_files_byte_for_byte() {
    let src = GgufFile::open(fixtures().join("all_types.gguf")).unwrap();
    let mut w = GgufWriter::new();
    for (k, v) in src.metadata() {
        w.set(k, v.clone()).unwrap();
    }
    assert_eq!(w.alignment(), 64);
    for t in src.tensors() {
        w.add_tensor_info(t.name, t.dtype, t.shape).unwrap();
    }
    let out = scratch("reproduce").join("all_types.gguf");
    w.write(&out, |i, o| o.write_all(src.tensors().nth(i).unwrap().data))
        .unwrap();
    assert_eq!(
        std::fs::read(&out).unwrap(),
        std::fs::read(src.path()).unwrap()
    );

    // Split: the same three shards gguf-py wrote.
    let dir = fixtures().join("split");
    let src = GgufFile::open(dir.join("tiny-split-00001-of-00003.gguf")).unwrap();
    let mut w = GgufWriter::new();
    for (k, v) in src.metadata() {
        w.set(k, v.clone()).unwrap(); // split.* keys are replaced by write_split
    }
    for t in src.tensors() {
        w.add_tensor_info(t.name, t.dtype, t.shape).unwrap();
    }
    let tmp = scratch("reproduce_split");
    let paths = w
        .write_split(tmp.join("tiny-split"), Split::MaxTensors(2), |i, o| {
            o.write_all(src.tensors().nth(i).unwrap().data)
        })
        .unwrap();
    assert_eq!(paths.len(), 3);
    for (no, p) in paths.iter().enumerate() {
        let name = format!("tiny-split-{:05}-of-00003.gguf", no + 1);
        assert_eq!(p, &tmp.join(&name));
        assert_eq!(
            std::fs::read(p).unwrap(),
            std::fs::read(dir.join(&name)).unwrap(),
            "{name}"
        );
    }
    // Merged back into one file, the split keys are dropped.
    let merged = tmp.join("merged.gguf");
    w.write(&merged, |i, o| {
        o.write_all(src.tensors().nth(i).unwrap().data)
    })
    .unwrap();
    let g = GgufFile::open(&merged).unwrap();
    assert_eq!(g.get(keys::SPLIT_COUNT), None);
    check_tiny_split_tensors(&g);
}

/// A writer with metadata of every type and tensors of several types; data of tensor i is
/// `pattern(bytes, 7 + i, i)`.
fn sample_writer(n_tensors: usize) -> GgufWriter {
    let mut w = GgufWriter::new();
    w.set(keys::GENERAL_ARCHITECTURE, "qwen35").unwrap();
    w.set("qwen35.block_count", 4u32).unwrap();
    w.set("x.f32", -0.75f32).unwrap();
    w.set("x.f64", 1e-200f64).unwrap();
    w.set("x.u64", u64::MAX).unwrap();
    w.set("x.i64", i64::MIN).unwrap();
    w.set("x.i8", -1i8).unwrap();
    w.set("x.u16", 7u16).unwrap();
    w.set("x.bool", true).unwrap();
    w.set("x.strs", &["a", "bb", ""][..]).unwrap();
    w.set(
        "x.nested",
        arr(vec![
            arr(vec![Value::U8(1)]),
            arr(vec![]),
            arr(vec![Value::F64(2.5)]),
        ]),
    )
    .unwrap();
    w.set("x.empty", arr(vec![])).unwrap();
    let types = [
        (DType::F32, vec![3, 5]),
        (DType::F16, vec![7]),
        (DType::BF16, vec![2, 2, 3]),
        (DType::Q8_0, vec![2, 64]),
        (DType::Q4_K, vec![3, 256]),
        (DType::I32, vec![9]),
        (DType::MXFP4, vec![1, 2, 3, 32]),
        (DType::Q6_K, vec![256]),
    ];
    for i in 0..n_tensors {
        let (dtype, shape) = &types[i % types.len()];
        w.add_tensor_info(format!("blk.{i}.weight"), *dtype, shape)
            .unwrap();
    }
    w
}

fn sample_data(w: &GgufWriter, i: usize) -> Vec<u8> {
    pattern(w.tensor_bytes(i) as usize, 7 + i, i)
}

fn check_sample(g: &GgufFile, w: &GgufWriter) {
    let meta: Vec<_> = w
        .metadata()
        .iter()
        .filter(|(k, _)| !k.starts_with("split."))
        .collect();
    let got: Vec<_> = g
        .metadata()
        .iter()
        .filter(|(k, _)| !k.starts_with("split."))
        .collect();
    assert_eq!(got, meta);
    assert_eq!(g.n_tensors(), w.n_tensors());
    for (i, t) in g.tensors().enumerate() {
        assert_eq!(t.name, w.tensor_name(i));
        assert_eq!(t.data, &sample_data(w, i)[..], "{}", t.name);
    }
    assert_eq!(g.data_bytes(), w.data_bytes());
}

#[test]
fn writer_round_trip() {
    let dir = scratch("writer_round_trip");
    for alignment in [None, Some(128u32), Some(1)] {
        let mut w = sample_writer(8);
        if let Some(a) = alignment {
            w.set_alignment(a).unwrap();
        }
        let path = dir.join(format!("m{alignment:?}.gguf"));
        w.write(&path, |i, o| o.write_all(&sample_data(&w, i)))
            .unwrap();
        let g = GgufFile::open(&path).unwrap();
        assert_eq!(g.version(), 3);
        assert_eq!(g.alignment(), alignment.unwrap_or(32) as u64);
        check_sample(&g, &w);
        let t = g.require("blk.2.weight").unwrap();
        assert_eq!((t.dtype, t.shape), (DType::BF16, &[2u64, 2, 3][..]));
        let t = g.require("blk.6.weight").unwrap();
        assert_eq!((t.dtype, t.shape), (DType::MXFP4, &[1u64, 2, 3, 32][..]));
        // Streaming in small pieces works the same.
        let path2 = dir.join(format!("pieces{alignment:?}.gguf"));
        w.write(&path2, |i, o| {
            for c in sample_data(&w, i).chunks(5) {
                o.write_all(c)?;
            }
            Ok(())
        })
        .unwrap();
        assert_eq!(
            std::fs::read(&path).unwrap(),
            std::fs::read(&path2).unwrap()
        );
    }
    // Empty arrays keep no element type; nested empties survive as empty arrays.
    let g = GgufFile::open(dir.join("mNone.gguf")).unwrap();
    assert_eq!(g.get_array("x.empty").unwrap(), &[]);
}

#[test]
fn writer_rejects_bad_input_and_wrong_data_sizes() {
    let dir = scratch("writer_errors");
    let mut w = GgufWriter::new();
    assert!(w.add_tensor_info("q", DType::Q8_0, &[3, 33]).is_err());
    assert!(w.add_tensor_info("z", DType::F32, &[0, 4]).is_err());
    assert!(w
        .add_tensor_info("d5", DType::F32, &[1, 1, 1, 1, 1])
        .is_err());
    assert!(w.add_tensor_info("f8", DType::F8_E4M3, &[4]).is_err());
    assert!(w.add_tensor_info("n".repeat(64), DType::F32, &[4]).is_err());
    assert!(w
        .set("mixed", arr(vec![Value::U8(1), Value::I8(1)]))
        .is_err());
    assert!(w.set_alignment(48).is_err());
    w.add_tensor_info("a", DType::F32, &[4]).unwrap();
    assert!(w.add_tensor_info("a", DType::F32, &[4]).is_err());
    w.add_tensor_info("b", DType::F32, &[2]).unwrap();
    let path = dir.join("short.gguf");

    let e = w
        .write(&path, |i, o| {
            o.write_all(&vec![0u8; if i == 1 { 7 } else { 16 }])
        })
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("short.gguf") && e.contains("`b`") && e.contains("7 of the 8"),
        "{e}"
    );
    assert!(!path.exists(), "a failed write leaves no partial file");
    let e = w
        .write(&path, |_, o| o.write_all(&[0u8; 17]))
        .unwrap_err()
        .to_string();
    assert!(e.contains("`a`") && e.contains("past the end"), "{e}");
    let e = w
        .write(&path, |i, o| {
            if i == 1 {
                return Err(std::io::Error::other("generator failed"));
            }
            o.write_all(&[0u8; 16])
        })
        .unwrap_err()
        .to_string();
    assert!(e.contains("`b`") && e.contains("generator failed"), "{e}");
    assert!(!path.exists());
    assert!(w
        .write_split(dir.join("s"), Split::MaxTensors(0), |_, _| Ok(()))
        .is_err());
}

#[test]
fn split_round_trip() {
    let dir = scratch("split_round_trip");
    let w = sample_writer(7);
    // Sizes are 60, 14, 24, 136, 432, 36, 102: a 300-byte cap keeps 4, then 1, then 2.
    let paths = w
        .write_split(dir.join("model"), Split::MaxBytes(300), |i, o| {
            o.write_all(&sample_data(&w, i))
        })
        .unwrap();
    assert_eq!(paths.len(), 3);
    for p in &paths {
        let g = GgufFile::open(p).unwrap();
        check_sample(&g, &w);
        assert_eq!(g.path(), paths[0]);
        assert_eq!(g.get_u64(keys::SPLIT_COUNT).unwrap(), 3);
        assert_eq!(g.get_u64(keys::SPLIT_TENSORS_COUNT).unwrap(), 7);
        let shard_of: Vec<_> = g.tensors().map(|t| t.path.to_path_buf()).collect();
        assert_eq!(
            shard_of,
            [0, 0, 0, 0, 1, 2, 2].map(|s| paths[s].clone()).to_vec()
        );
    }
    // Each shard alone is a valid GGUF with its own split.no.
    let raw = std::fs::read(&paths[1]).unwrap();
    let lone = dir.join("lone.gguf");
    std::fs::write(&lone, &raw).unwrap();
    let e = GgufFile::open(&lone).unwrap_err().to_string();
    assert!(e.contains("lone.gguf") && e.contains("file name"), "{e}");

    // A missing shard is named.
    std::fs::remove_file(&paths[2]).unwrap();
    let e = GgufFile::open(&paths[1]).unwrap_err().to_string();
    assert!(e.contains("model-00003-of-00003.gguf"), "{e}");

    // A shard swapped with another's split.no is caught.
    std::fs::copy(&paths[1], &paths[2]).unwrap();
    let e = GgufFile::open(&paths[0]).unwrap_err().to_string();
    assert!(
        e.contains("model-00003-of-00003.gguf") && e.contains("split.no"),
        "{e}"
    );

    // A single-shard split (split.count = 1) reads as a plain file.
    let p = w
        .write_split(dir.join("one"), Split::MaxTensors(100), |i, o| {
            o.write_all(&sample_data(&w, i))
        })
        .unwrap();
    assert_eq!(p, [dir.join("one-00001-of-00001.gguf")]);
    check_sample(&GgufFile::open(&p[0]).unwrap(), &w);
}

// ---------------------------------------------------------------------------------------------
// The shared fixture models, against what gguf-py reports (models_expected.json, written by
// `make_gguf.py --models`).

fn value_tag(v: &Value) -> String {
    match v {
        Value::Array(a) => format!("array[{}]", a.first().map_or("?", |x| x.type_name())),
        v => v.type_name().to_string(),
    }
}

fn value_matches(v: &Value, j: &serde_json::Value) -> bool {
    match v {
        Value::Array(a) => j.as_array().is_some_and(|ja| {
            ja.len() == a.len() && a.iter().zip(ja).all(|(x, y)| value_matches(x, y))
        }),
        Value::Str(s) => j.as_str() == Some(s),
        Value::Bool(b) => j.as_bool() == Some(*b),
        Value::F32(x) => j.as_f64() == Some(*x as f64),
        Value::F64(x) => j.as_f64() == Some(*x),
        v if v.as_u64().is_some() => j.as_u64() == v.as_u64(),
        v => j.as_i64() == v.as_i64(),
    }
}

#[test]
fn shared_fixture_models_match_gguf_py() {
    let root = shared_models();
    let text = std::fs::read_to_string(fixtures().join("models_expected.json")).unwrap();
    let expected: Vec<serde_json::Value> = serde_json::from_str(&text).unwrap();
    let mut on_disk: Vec<String> = std::fs::read_dir(&root)
        .unwrap()
        .flat_map(|d| std::fs::read_dir(d.unwrap().path()).unwrap())
        .map(|e| e.unwrap().path())
        .filter(|p| {
            let n = p.file_name().unwrap().to_str().unwrap();
            n.starts_with("model-") && n.ends_with(".gguf")
        })
        .map(|p| p.strip_prefix(&root).unwrap().to_str().unwrap().to_string())
        .collect();
    on_disk.sort();
    let listed: Vec<&str> = expected
        .iter()
        .map(|e| e["file"].as_str().unwrap())
        .collect();
    assert_eq!(
        on_disk, listed,
        "regenerate models_expected.json (make_gguf.py --models)"
    );

    for e in &expected {
        let file = e["file"].as_str().unwrap();
        let g = GgufFile::open(root.join(file)).unwrap();
        assert_eq!(g.version() as u64, e["version"].as_u64().unwrap(), "{file}");
        assert_eq!(g.alignment(), e["alignment"].as_u64().unwrap(), "{file}");
        let meta = e["metadata"].as_array().unwrap();
        assert_eq!(g.metadata().len(), meta.len(), "{file}");
        for ((k, v), m) in g.metadata().iter().zip(meta) {
            assert_eq!(k, m[0].as_str().unwrap(), "{file}");
            assert_eq!(value_tag(v), m[1].as_str().unwrap(), "{file}: {k}");
            assert!(value_matches(v, &m[2]), "{file}: {k}: {v} vs {}", m[2]);
        }
        let tensors = e["tensors"].as_array().unwrap();
        assert_eq!(g.n_tensors(), tensors.len(), "{file}");
        for (t, w) in g.tensors().zip(tensors) {
            assert_eq!(t.name, w[0].as_str().unwrap(), "{file}");
            assert_eq!(t.dtype.name(), w[1].as_str().unwrap(), "{file}: {}", t.name);
            let shape: Vec<u64> = w[2]
                .as_array()
                .unwrap()
                .iter()
                .map(|d| d.as_u64().unwrap())
                .collect();
            assert_eq!(t.shape, &shape[..], "{file}: {}", t.name);
            assert_eq!(
                t.data.len() as u64,
                w[3].as_u64().unwrap(),
                "{file}: {}",
                t.name
            );
            assert_eq!(
                checksum(t.data),
                w[4].as_u64().unwrap(),
                "{file}: {}",
                t.name
            );
        }
    }

    // Spot checks through the typed getters and the key table.
    let g = GgufFile::open(root.join("qwen35moe-dims/model-q4_k_m.gguf")).unwrap();
    let arch = g.architecture().unwrap();
    assert_eq!(arch, keys::ARCH_QWEN35MOE);
    let k = |s| keys::key(arch, s);
    assert_eq!(g.get_u64(&k(keys::EXPERT_COUNT)).unwrap(), 16);
    assert_eq!(g.get_u64(&k(keys::EXPERT_USED_COUNT)).unwrap(), 4);
    assert_eq!(g.get_u64(&k(keys::ATTENTION_KEY_LENGTH)).unwrap(), 256);
    assert_eq!(g.get_f32(&k(keys::ROPE_FREQ_BASE)).unwrap(), 1e7);
    assert_eq!(
        g.get_bool_array(&k(keys::ATTENTION_RECURRENT_LAYERS))
            .unwrap(),
        [true, false]
    );
    assert_eq!(g.get_str(keys::TOKENIZER_MODEL).unwrap(), "none");
    let g = GgufFile::open(root.join("dsv4-dims/model-q8_0.gguf")).unwrap();
    let k = |s| keys::key(keys::ARCH_DEEPSEEK4, s);
    assert_eq!(
        g.get_i64_array(&k(keys::ATTENTION_COMPRESS_RATIOS))
            .unwrap(),
        [0, 4, 128, 4]
    );
    assert_eq!(g.get_str(&k(keys::ROPE_SCALING_TYPE)).unwrap(), "yarn");
    assert_eq!(
        g.get_u64(&k(keys::ROPE_SCALING_ORIG_CTX_LEN)).unwrap(),
        65536
    );
    assert_eq!(
        g.get_u64(&k(keys::HYPER_CONNECTION_SINKHORN_ITERATIONS))
            .unwrap(),
        20
    );
    assert_eq!(g.get_u64(&k(keys::ATTENTION_INDEXER_TOP_K)).unwrap(), 16);
    let t = g.require("blk.0.ffn_gate_exps.weight").unwrap();
    assert_eq!((t.dtype, t.shape), (DType::MXFP4, &[16u64, 128, 256][..]));
}

#[test]
fn shared_vocab_gguf_without_tensors() {
    // llama.cpp's vocab-only file: no tensors, and the (empty) data section would start
    // past the end of the file.
    let p = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../shared/fixtures/tokenizer/qwen35-llamacpp-vocab/ggml-vocab-qwen35.gguf");
    assert!(
        p.exists(),
        "{} is absent: this test needs ../shared/fixtures (CI has it)",
        p.display()
    );
    let g = GgufFile::open(&p).unwrap();
    assert_eq!((g.n_tensors(), g.data_bytes()), (0, 0));
    let tokens = g.get_str_array(keys::TOKENIZER_TOKENS).unwrap();
    assert_eq!(tokens.len(), 151936);
    assert_eq!(&tokens[..3], ["!", "\"", "#"]);
    assert_eq!(tokens[151935], "[PAD151935]");
    let merges = g.get_str_array(keys::TOKENIZER_MERGES).unwrap();
    assert_eq!((merges.len(), merges[0]), (151387, "\u{120} \u{120}"));
    let types = g.get_i64_array(keys::TOKENIZER_TOKEN_TYPE).unwrap();
    assert_eq!(types.iter().filter(|&&t| t == 3).count(), 3);
    assert_eq!(g.get_u64(keys::TOKENIZER_EOS_ID).unwrap(), 151643);
    assert_eq!(g.get_str(keys::TOKENIZER_PRE).unwrap(), "qwen35");
    assert_eq!(g.get_str(keys::TOKENIZER_CHAT_TEMPLATE).unwrap().len(), 327);
    assert_eq!(g.opt_u64(keys::TOKENIZER_EOT_ID).unwrap(), None);
}

// ---------------------------------------------------------------------------------------------
// Malformed files: a GGUF assembled by hand (independent of GgufWriter) with one fault each.

const F32: u32 = 0;
const Q8_0: u32 = 8;
const T_U32: u32 = 4;
const T_BOOL: u32 = 7;
const T_STR: u32 = 8;
const T_ARR: u32 = 9;

fn gstr(s: &[u8]) -> Vec<u8> {
    let mut v = (s.len() as u64).to_le_bytes().to_vec();
    v.extend_from_slice(s);
    v
}

fn kv(key: &[u8], ty: u32, payload: &[u8]) -> Vec<u8> {
    let mut v = gstr(key);
    v.extend_from_slice(&ty.to_le_bytes());
    v.extend_from_slice(payload);
    v
}

fn info(name: &[u8], ne: &[u64], ty: u32, offset: u64) -> Vec<u8> {
    let mut v = gstr(name);
    v.extend_from_slice(&(ne.len() as u32).to_le_bytes());
    for d in ne {
        v.extend_from_slice(&d.to_le_bytes());
    }
    v.extend_from_slice(&ty.to_le_bytes());
    v.extend_from_slice(&offset.to_le_bytes());
    v
}

/// A GGUF file's parts; `bytes()` lays them out with 32-byte alignment.
#[derive(Clone)]
struct Raw {
    version: u32,
    n_kv: Option<u64>,
    n_tensors: Option<u64>,
    kvs: Vec<Vec<u8>>,
    infos: Vec<Vec<u8>>,
    data: Vec<u8>,
}

impl Raw {
    /// Two keys; tensors t0 (f32 [2, 4], 32 bytes at 0) and t1 (f32 [8], 32 bytes at 32).
    fn good() -> Raw {
        Raw {
            version: 3,
            n_kv: None,
            n_tensors: None,
            kvs: vec![
                kv(b"general.architecture", T_STR, &gstr(b"test")),
                kv(b"test.count", T_U32, &7u32.to_le_bytes()),
            ],
            infos: vec![info(b"t0", &[4, 2], F32, 0), info(b"t1", &[8], F32, 32)],
            data: pattern(64, 3, 1),
        }
    }

    fn bytes(&self) -> Vec<u8> {
        let mut b = b"GGUF".to_vec();
        b.extend_from_slice(&self.version.to_le_bytes());
        b.extend_from_slice(
            &self
                .n_tensors
                .unwrap_or(self.infos.len() as u64)
                .to_le_bytes(),
        );
        b.extend_from_slice(&self.n_kv.unwrap_or(self.kvs.len() as u64).to_le_bytes());
        b.extend(self.kvs.concat());
        b.extend(self.infos.concat());
        b.resize(b.len().div_ceil(32) * 32, 0);
        b.extend_from_slice(&self.data);
        b
    }
}

/// Writes `bytes` to `<test>.gguf`, opens it, and checks for an error (not a panic) whose
/// message names the file and each of `needles`.
fn open_err(test: &str, bytes: &[u8], needles: &[&str]) -> Error {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("gguf/bad");
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(format!("{test}.gguf"));
    std::fs::write(&path, bytes).unwrap();
    let e = match GgufFile::open(&path) {
        Ok(_) => panic!("{test}: opened a malformed file"),
        Err(e) => e,
    };
    let m = e.to_string();
    eprintln!("{test}: {m}");
    assert!(m.contains(&path.display().to_string()), "{test}: {m}");
    for n in needles {
        assert!(m.contains(n), "{test}: `{n}` not in: {m}");
    }
    e
}

#[test]
fn hand_made_good_file_opens() {
    let path = scratch("good").join("good.gguf");
    std::fs::write(&path, Raw::good().bytes()).unwrap();
    let g = GgufFile::open(&path).unwrap();
    assert_eq!(g.get_u64("test.count").unwrap(), 7);
    assert_eq!(g.require("t0").unwrap().shape, [2, 4]);
    assert_eq!(g.require("t1").unwrap().data, &pattern(64, 3, 1)[32..]);
}

#[test]
fn bad_magic() {
    let mut b = Raw::good().bytes();
    b[3] = b'X';
    open_err("bad_magic", &b, &["not a GGUF file"]);
    open_err("empty", &[], &["truncated"]);
}

#[test]
fn unsupported_versions() {
    let mut r = Raw::good();
    r.version = 1;
    open_err("v1", &r.bytes(), &["version 1"]);
    r.version = 3u32.swap_bytes();
    open_err("big_endian", &r.bytes(), &["big-endian"]);
    r.version = 4;
    open_err("v4", &r.bytes(), &["version 4"]);
}

#[test]
fn truncated_header() {
    let b = Raw::good().bytes();
    open_err("trunc_header", &b[..20], &["truncated", "metadata count"]);
}

#[test]
fn truncated_metadata() {
    let r = Raw::good();
    let b = r.bytes();
    // Cut inside the second key's value.
    let cut = 24 + r.kvs[0].len() + r.kvs[1].len() - 2;
    open_err("trunc_meta", &b[..cut], &["truncated", "test.count"]);
}

#[test]
fn truncated_tensor_info() {
    let r = Raw::good();
    let b = r.bytes();
    let cut = 24 + r.kvs.concat().len() + r.infos[0].len() + 20;
    open_err("trunc_info", &b[..cut], &["truncated", "t1"]);
}

#[test]
fn absurd_string_length() {
    let mut r = Raw::good();
    let mut v = (1u64 << 40).to_le_bytes().to_vec();
    v.extend_from_slice(b"abc");
    r.kvs[0] = kv(b"general.architecture", T_STR, &v);
    open_err(
        "long_string",
        &r.bytes(),
        &["general.architecture", "string length"],
    );
    let mut r = Raw::good();
    let mut k = u64::MAX.to_le_bytes().to_vec();
    k.extend_from_slice(b"key");
    r.kvs.push(k);
    open_err(
        "long_key",
        &r.bytes(),
        &["metadata entry #2", "string length"],
    );
}

#[test]
fn absurd_array_count() {
    let mut r = Raw::good();
    let mut v = T_U32.to_le_bytes().to_vec();
    v.extend_from_slice(&(1u64 << 60).to_le_bytes());
    v.extend_from_slice(&[0; 8]);
    r.kvs.push(kv(b"test.big_array", T_ARR, &v));
    open_err("big_array", &r.bytes(), &["test.big_array", "cannot fit"]);
}

#[test]
fn absurd_counts() {
    let mut r = Raw::good();
    r.n_tensors = Some(u64::MAX / 3);
    open_err("tensor_count", &r.bytes(), &["tensors, impossible"]);
    let mut r = Raw::good();
    r.n_kv = Some(1 << 40);
    open_err("kv_count", &r.bytes(), &["metadata entries, impossible"]);
}

#[test]
fn bad_utf8() {
    let mut r = Raw::good();
    r.kvs[1] = kv(b"test.\xffcount", T_U32, &7u32.to_le_bytes());
    open_err(
        "utf8_key",
        &r.bytes(),
        &["metadata key #1", "test.\u{fffd}count", "UTF-8"],
    );
    let mut r = Raw::good();
    r.kvs[0] = kv(b"general.architecture", T_STR, &gstr(b"te\xc3st"));
    open_err(
        "utf8_value",
        &r.bytes(),
        &["`general.architecture`", "UTF-8"],
    );
    let mut r = Raw::good();
    r.infos[1] = info(b"t\xe21", &[8], F32, 32);
    open_err("utf8_tensor", &r.bytes(), &["tensor #1", "UTF-8"]);
}

#[test]
fn duplicate_key() {
    let mut r = Raw::good();
    r.kvs.push(kv(b"test.count", T_U32, &8u32.to_le_bytes()));
    open_err("dup_key", &r.bytes(), &["`test.count`", "duplicate key"]);
}

#[test]
fn duplicate_tensor() {
    let mut r = Raw::good();
    r.infos[1] = info(b"t0", &[8], F32, 32);
    open_err("dup_tensor", &r.bytes(), &["`t0`", "duplicate tensor"]);
}

#[test]
fn unaligned_offset() {
    let mut r = Raw::good();
    r.infos[1] = info(b"t1", &[4], F32, 36);
    open_err(
        "unaligned",
        &r.bytes(),
        &["`t1`", "not a multiple of the alignment 32"],
    );
}

#[test]
fn data_outside_file() {
    let mut r = Raw::good();
    r.infos[1] = info(b"t1", &[16], F32, 32);
    open_err("outside", &r.bytes(), &["`t1`", "outside the file"]);
    let mut r = Raw::good();
    r.infos[1] = info(b"t1", &[8], F32, u64::MAX - 31);
    open_err(
        "outside_overflow",
        &r.bytes(),
        &["`t1`", "outside the file"],
    );
}

#[test]
fn overlapping_tensors() {
    let mut r = Raw::good();
    r.infos[0] = info(b"t0", &[4, 4], F32, 0); // 64 bytes: runs into t1 at 32
    r.data = pattern(96, 3, 1);
    open_err("overlap", &r.bytes(), &["`t1`", "overlaps tensor `t0`"]);
}

#[test]
fn elements_not_whole_blocks() {
    let mut r = Raw::good();
    r.infos.push(info(b"q", &[48, 1], Q8_0, 64));
    r.data.extend(vec![0; 64]);
    open_err(
        "block",
        &r.bytes(),
        &["`q`", "not a multiple of the Q8_0 block size 32"],
    );
}

#[test]
fn too_many_dims() {
    let mut r = Raw::good();
    r.infos[1] = info(b"t1", &[2, 1, 1, 2, 2], F32, 32);
    open_err("dims5", &r.bytes(), &["`t1`", "5 dimensions"]);
}

#[test]
fn zero_or_overflowing_dims() {
    let mut r = Raw::good();
    r.infos[1] = info(b"t1", &[8, 0], F32, 32);
    open_err("dim_zero", &r.bytes(), &["`t1`", "zero"]);
    let mut r = Raw::good();
    r.infos[1] = info(b"t1", &[1 << 32, 1 << 32], F32, 32);
    open_err("dim_overflow", &r.bytes(), &["`t1`", "overflows"]);
    let mut r = Raw::good();
    r.infos[1] = info(b"t1", &[1 << 62], F32, 32);
    open_err("bytes_overflow", &r.bytes(), &["`t1`"]);
}

#[test]
fn unknown_ggml_type() {
    let mut r = Raw::good();
    r.infos[1] = info(b"t1", &[8], 16, 32); // IQ2_XXS: not supported by lathe
    open_err("type16", &r.bytes(), &["`t1`", "ggml type id 16"]);
    let mut r = Raw::good();
    r.infos[1] = info(b"t1", &[8], 999, 32);
    open_err("type999", &r.bytes(), &["`t1`", "ggml type id 999"]);
}

#[test]
fn bad_values() {
    let mut r = Raw::good();
    r.kvs.push(kv(b"test.ty", 13, &[0; 8]));
    open_err("value_type", &r.bytes(), &["`test.ty`", "type id 13"]);
    let mut r = Raw::good();
    r.kvs.push(kv(b"test.flag", T_BOOL, &[2]));
    open_err("bool2", &r.bytes(), &["`test.flag`", "bool"]);
    let mut r = Raw::good();
    r.kvs
        .push(kv(b"general.alignment", T_U32, &48u32.to_le_bytes()));
    open_err(
        "alignment",
        &r.bytes(),
        &["`general.alignment`", "power of two"],
    );
    // Arrays nested 100 deep (each level: element type array, count 1).
    let mut r = Raw::good();
    let mut v = Vec::new();
    for _ in 0..100 {
        v.extend_from_slice(&T_ARR.to_le_bytes());
        v.extend_from_slice(&1u64.to_le_bytes());
    }
    v.extend_from_slice(&[0; 16]);
    r.kvs.push(kv(b"test.deep", T_ARR, &v));
    open_err("deep", &r.bytes(), &["`test.deep`", "nested"]);
}

#[test]
fn bad_split_keys() {
    let mut r = Raw::good();
    r.kvs.push(kv(b"split.count", 2, &3u16.to_le_bytes()));
    open_err(
        "model-00001-of-00003",
        &r.bytes(),
        &["`split.no`", "missing"],
    );
    r.kvs.push(kv(b"split.no", 2, &5u16.to_le_bytes()));
    open_err(
        "model-00001-of-00003",
        &r.bytes(),
        &["`split.no`", "out of range"],
    );
}

#[test]
fn every_truncation_errors_cleanly() {
    // Every prefix of a valid file fails with an error (no panic, no out-of-bounds read).
    let b = Raw::good().bytes();
    let dir = scratch("truncations");
    for n in 0..b.len() {
        let path = dir.join(format!("cut{n}.gguf"));
        std::fs::write(&path, &b[..n]).unwrap();
        assert!(GgufFile::open(&path).is_err(), "prefix of {n} bytes opened");
    }
}
