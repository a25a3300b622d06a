//! safetensors files: a checked header parser and memory-mapped tensor views.
//!
//! The format is an 8-byte little-endian header length N, N bytes of JSON
//! (`{"name": {"dtype": "BF16", "shape": [..], "data_offsets": [begin, end]},
//! "__metadata__": {..}}`), then the data section the offsets point into.
//! Everything in the header is untrusted: [`parse_header`] checks every field
//! and every byte range before any tensor is handed out, and is the target of
//! the `fuzz/` harness.

use serde_json::Value;
use std::borrow::Cow;
use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};

#[cfg(target_endian = "big")]
compile_error!("safetensors data is little-endian; bespoke reads it in place and supports little-endian targets only");

/// The largest header accepted (the reference implementation's limit too).
pub const MAX_HEADER_BYTES: u64 = 100 << 20;

/// Element types a safetensors file may declare.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Dtype {
    F64,
    F32,
    F16,
    BF16,
    /// OCP FP8 E4M3 "fn" (no infinities).
    F8E4M3,
    F8E5M2,
    /// Unsigned power-of-two scale, 2^(b-127); 0xFF is NaN.
    F8E8M0,
    I64,
    I32,
    I16,
    /// Also the container of packed FP4 E2M1 pairs.
    I8,
    U64,
    U32,
    U16,
    U8,
    Bool,
}

const DTYPES: &[(&str, Dtype, usize)] = &[
    ("F64", Dtype::F64, 8),
    ("F32", Dtype::F32, 4),
    ("F16", Dtype::F16, 2),
    ("BF16", Dtype::BF16, 2),
    ("F8_E4M3", Dtype::F8E4M3, 1),
    ("F8_E5M2", Dtype::F8E5M2, 1),
    ("F8_E8M0", Dtype::F8E8M0, 1),
    ("I64", Dtype::I64, 8),
    ("I32", Dtype::I32, 4),
    ("I16", Dtype::I16, 2),
    ("I8", Dtype::I8, 1),
    ("U64", Dtype::U64, 8),
    ("U32", Dtype::U32, 4),
    ("U16", Dtype::U16, 2),
    ("U8", Dtype::U8, 1),
    ("BOOL", Dtype::Bool, 1),
];

impl Dtype {
    pub fn parse(s: &str) -> Option<Dtype> {
        DTYPES.iter().find(|(n, _, _)| *n == s).map(|(_, d, _)| *d)
    }
    /// The name as the header spells it.
    pub fn name(self) -> &'static str {
        DTYPES
            .iter()
            .find(|(_, d, _)| *d == self)
            .map(|(n, _, _)| *n)
            .unwrap_or("?")
    }
    /// Bytes per element.
    pub fn size(self) -> usize {
        DTYPES
            .iter()
            .find(|(_, d, _)| *d == self)
            .map(|(_, _, s)| *s)
            .unwrap_or(1)
    }
}

impl std::fmt::Display for Dtype {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// One tensor's entry in the header; offsets are relative to the data section.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorInfo {
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    pub begin: usize,
    pub end: usize,
}

impl TensorInfo {
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
    pub fn bytes(&self) -> usize {
        self.end - self.begin
    }
}

/// A parsed, validated header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Header {
    pub tensors: BTreeMap<String, TensorInfo>,
    pub metadata: BTreeMap<String, String>,
    /// Offset of the data section in the file (8 + header length).
    pub data_start: usize,
    pub data_len: usize,
}

/// What is wrong with a header. The file name is added by the caller.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HeaderError {
    #[error("file is {0} bytes, too short to hold the 8-byte header length")]
    TooShort(usize),
    #[error("header length {len} runs past the end of the file ({file} bytes)")]
    HeaderPastEnd { len: u64, file: usize },
    #[error("header length {0} bytes is larger than the {MAX_HEADER_BYTES}-byte limit")]
    HeaderTooLarge(u64),
    #[error("header is not valid UTF-8 (byte {0})")]
    NotUtf8(usize),
    #[error("header is not valid JSON: {0}")]
    BadJson(String),
    #[error("header must be a JSON object of tensors, found {0}")]
    NotObject(&'static str),
    #[error("__metadata__ must be an object of strings: {0}")]
    BadMetadata(String),
    #[error("tensor {name:?}: {message}")]
    Tensor { name: String, message: String },
    #[error(
        "tensors {a:?} (bytes {a_begin}..{a_end}) and {b:?} (bytes {b_begin}..{b_end}) overlap"
    )]
    Overlap {
        a: String,
        a_begin: usize,
        a_end: usize,
        b: String,
        b_begin: usize,
        b_end: usize,
    },
}

fn json_kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// A non-negative integer that fits in usize, or a message saying what it is.
fn index_value(v: &Value) -> Result<usize, String> {
    match v {
        Value::Number(n) => {
            if let Some(u) = n.as_u64() {
                usize::try_from(u)
                    .map_err(|_| format!("{u} does not fit in this machine's address space"))
            } else if n.as_i64().is_some() {
                Err(format!("{n} is negative"))
            } else {
                Err(format!("{n} is not an integer (or is too large)"))
            }
        }
        other => Err(format!(
            "expected a non-negative integer, found {}",
            json_kind(other)
        )),
    }
}

fn parse_entry(name: &str, v: &Value, data_len: usize) -> Result<TensorInfo, HeaderError> {
    let bad = |message: String| HeaderError::Tensor {
        name: name.to_string(),
        message,
    };
    let obj = v.as_object().ok_or_else(|| {
        bad(format!(
            "expected an object with dtype, shape and data_offsets, found {}",
            json_kind(v)
        ))
    })?;
    let dtype = match obj.get("dtype") {
        Some(Value::String(s)) => Dtype::parse(s).ok_or_else(|| {
            let known: Vec<&str> = DTYPES.iter().map(|(n, _, _)| *n).collect();
            bad(format!("unknown dtype {s:?} (known: {})", known.join(", ")))
        })?,
        Some(other) => {
            return Err(bad(format!(
                "dtype must be a string, found {}",
                json_kind(other)
            )))
        }
        None => return Err(bad("has no dtype".into())),
    };
    let shape = match obj.get("shape") {
        Some(Value::Array(dims)) => dims
            .iter()
            .enumerate()
            .map(|(i, d)| index_value(d).map_err(|m| bad(format!("shape[{i}]: {m}"))))
            .collect::<Result<Vec<usize>, _>>()?,
        Some(other) => {
            return Err(bad(format!(
                "shape must be an array, found {}",
                json_kind(other)
            )))
        }
        None => return Err(bad("has no shape".into())),
    };
    let (begin, end) = match obj.get("data_offsets") {
        Some(Value::Array(o)) if o.len() == 2 => (
            index_value(&o[0]).map_err(|m| bad(format!("data_offsets[0]: {m}")))?,
            index_value(&o[1]).map_err(|m| bad(format!("data_offsets[1]: {m}")))?,
        ),
        Some(Value::Array(o)) => {
            return Err(bad(format!(
                "data_offsets must be [begin, end], found {} numbers",
                o.len()
            )))
        }
        Some(other) => {
            return Err(bad(format!(
                "data_offsets must be an array, found {}",
                json_kind(other)
            )))
        }
        None => return Err(bad("has no data_offsets".into())),
    };
    if begin > end {
        return Err(bad(format!(
            "data_offsets [{begin}, {end}] end before they begin"
        )));
    }
    if end > data_len {
        return Err(bad(format!(
            "data_offsets [{begin}, {end}] run past the end of the data section ({data_len} bytes)"
        )));
    }
    let numel = shape
        .iter()
        .try_fold(1usize, |acc, &d| acc.checked_mul(d))
        .ok_or_else(|| {
            bad(format!(
                "shape {shape:?} has more elements than fit in memory"
            ))
        })?;
    let want = numel.checked_mul(dtype.size()).ok_or_else(|| {
        bad(format!(
            "shape {shape:?} of {dtype} is larger than fits in memory"
        ))
    })?;
    if want != end - begin {
        return Err(bad(format!(
            "shape {shape:?} of {dtype} ({} bytes each) needs {want} bytes, but data_offsets [{begin}, {end}] span {}",
            dtype.size(),
            end - begin
        )));
    }
    Ok(TensorInfo {
        dtype,
        shape,
        begin,
        end,
    })
}

/// Parse and validate the header of a whole safetensors file held in `file`.
/// Never panics; every problem is a [`HeaderError`].
pub fn parse_header(file: &[u8]) -> Result<Header, HeaderError> {
    if file.len() < 8 {
        return Err(HeaderError::TooShort(file.len()));
    }
    let mut len_bytes = [0u8; 8];
    len_bytes.copy_from_slice(&file[..8]);
    let n = u64::from_le_bytes(len_bytes);
    if n > MAX_HEADER_BYTES {
        return Err(HeaderError::HeaderTooLarge(n));
    }
    // n ≤ 100 MiB, so it fits in usize on every supported target.
    let n_usize = n as usize;
    if n_usize > file.len() - 8 {
        return Err(HeaderError::HeaderPastEnd {
            len: n,
            file: file.len(),
        });
    }
    let raw = &file[8..8 + n_usize];
    let text = std::str::from_utf8(raw).map_err(|e| HeaderError::NotUtf8(e.valid_up_to()))?;
    let root: Value =
        serde_json::from_str(text).map_err(|e| HeaderError::BadJson(e.to_string()))?;
    let map = match root {
        Value::Object(m) => m,
        other => return Err(HeaderError::NotObject(json_kind(&other))),
    };
    let data_start = 8 + n_usize;
    let data_len = file.len() - data_start;
    let mut tensors = BTreeMap::new();
    let mut metadata = BTreeMap::new();
    for (name, v) in &map {
        if name == "__metadata__" {
            let m = v
                .as_object()
                .ok_or_else(|| HeaderError::BadMetadata(format!("found {}", json_kind(v))))?;
            for (k, val) in m {
                let s = val.as_str().ok_or_else(|| {
                    HeaderError::BadMetadata(format!("{k:?} is {}", json_kind(val)))
                })?;
                metadata.insert(k.clone(), s.to_string());
            }
            continue;
        }
        if name.is_empty() {
            return Err(HeaderError::Tensor {
                name: String::new(),
                message: "empty tensor name".into(),
            });
        }
        tensors.insert(name.clone(), parse_entry(name, v, data_len)?);
    }
    // No two tensors may share bytes (a writer bug, or a crafted file that
    // would alias one weight onto another).
    let mut spans: Vec<(&String, &TensorInfo)> =
        tensors.iter().filter(|(_, t)| t.begin < t.end).collect();
    spans.sort_by_key(|(_, t)| (t.begin, t.end));
    for w in spans.windows(2) {
        let ((a, ta), (b, tb)) = (w[0], w[1]);
        if tb.begin < ta.end {
            return Err(HeaderError::Overlap {
                a: a.clone(),
                a_begin: ta.begin,
                a_end: ta.end,
                b: b.clone(),
                b_begin: tb.begin,
                b_end: tb.end,
            });
        }
    }
    Ok(Header {
        tensors,
        metadata,
        data_start,
        data_len,
    })
}

/// Opening or reading a safetensors file failed.
#[derive(Debug, thiserror::Error)]
pub enum FileError {
    #[error("cannot read {}: {source}", path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{}: {source}", path.display())]
    Header { path: PathBuf, source: HeaderError },
}

/// A memory-mapped safetensors file with its validated header.
pub struct SafetensorsFile {
    pub path: PathBuf,
    pub header: Header,
    map: memmap2::Mmap,
}

impl std::fmt::Debug for SafetensorsFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SafetensorsFile")
            .field("path", &self.path)
            .field("tensors", &self.header.tensors.len())
            .finish()
    }
}

impl SafetensorsFile {
    pub fn open(path: &Path) -> Result<SafetensorsFile, FileError> {
        let io = |source| FileError::Io {
            path: path.to_path_buf(),
            source,
        };
        let file = File::open(path).map_err(io)?;
        let len = file.metadata().map_err(io)?.len();
        if len < 8 {
            return Err(FileError::Header {
                path: path.to_path_buf(),
                source: HeaderError::TooShort(len as usize),
            });
        }
        // SAFETY: the mapping is read-only and private to this process. The
        // one hazard memmap2 cannot rule out is another process truncating or
        // rewriting the file while it is mapped; model files are not written
        // while a model is loaded (the same contract every mmap-based loader —
        // llama.cpp, safetensors — relies on), and all bounds are checked
        // against the length seen here.
        let map = unsafe { memmap2::MmapOptions::new().map(&file) }.map_err(io)?;
        let header = parse_header(&map).map_err(|source| FileError::Header {
            path: path.to_path_buf(),
            source,
        })?;
        Ok(SafetensorsFile {
            path: path.to_path_buf(),
            header,
            map,
        })
    }

    pub fn tensor(&self, name: &str) -> Option<TensorView<'_>> {
        let (key, info) = self.header.tensors.get_key_value(name)?;
        let start = self.header.data_start + info.begin;
        let end = self.header.data_start + info.end;
        Some(TensorView {
            name: key,
            info,
            bytes: &self.map[start..end],
        })
    }

    /// The mapped bytes (the whole file).
    pub fn mapped(&self) -> &[u8] {
        &self.map
    }
}

/// Reading a tensor as a typed slice failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("tensor {name}: {message}")]
pub struct ViewError {
    pub name: String,
    pub message: String,
}

/// A tensor's bytes, in place in the mapping.
#[derive(Debug, Clone, Copy)]
pub struct TensorView<'a> {
    pub name: &'a str,
    pub info: &'a TensorInfo,
    pub bytes: &'a [u8],
}

impl<'a> TensorView<'a> {
    pub fn dtype(&self) -> Dtype {
        self.info.dtype
    }
    pub fn shape(&self) -> &'a [usize] {
        &self.info.shape
    }

    fn expect(&self, want: &[Dtype]) -> Result<(), ViewError> {
        if want.contains(&self.info.dtype) {
            Ok(())
        } else {
            let names: Vec<&str> = want.iter().map(|d| d.name()).collect();
            Err(ViewError {
                name: self.name.to_string(),
                message: format!("is {}, expected {}", self.info.dtype, names.join(" or ")),
            })
        }
    }

    /// The elements as `T`: borrowed from the mapping when the bytes are
    /// aligned for `T` (the usual case), copied otherwise (safetensors does
    /// not promise alignment; the copy is counted by [`TensorView::is_aligned`]).
    fn cast<T: bytemuck::AnyBitPattern>(&self) -> Cow<'a, [T]> {
        match bytemuck::try_cast_slice::<u8, T>(self.bytes) {
            Ok(s) => Cow::Borrowed(s),
            Err(_) => Cow::Owned(
                self.bytes
                    .chunks_exact(std::mem::size_of::<T>())
                    .map(bytemuck::pod_read_unaligned)
                    .collect(),
            ),
        }
    }

    /// Whether the bytes are aligned to the element size (so typed views
    /// borrow the mapping instead of copying).
    pub fn is_aligned(&self) -> bool {
        (self.bytes.as_ptr() as usize) % self.info.dtype.size() == 0
    }

    pub fn f32s(&self) -> Result<Cow<'a, [f32]>, ViewError> {
        self.expect(&[Dtype::F32])?;
        Ok(self.cast())
    }
    /// BF16 or F16 bit patterns.
    pub fn u16s(&self) -> Result<Cow<'a, [u16]>, ViewError> {
        self.expect(&[Dtype::BF16, Dtype::F16])?;
        Ok(self.cast())
    }
    /// One-byte codes (FP8, E8M0 scales, packed FP4, I8/U8).
    pub fn u8s(&self) -> Result<&'a [u8], ViewError> {
        self.expect(&[
            Dtype::F8E4M3,
            Dtype::F8E5M2,
            Dtype::F8E8M0,
            Dtype::I8,
            Dtype::U8,
            Dtype::Bool,
        ])?;
        Ok(self.bytes)
    }
    /// Integer tensors (I32 or I64), widened to i64.
    pub fn i64s(&self) -> Result<Cow<'a, [i64]>, ViewError> {
        self.expect(&[Dtype::I64, Dtype::I32])?;
        Ok(match self.info.dtype {
            Dtype::I64 => self.cast(),
            _ => Cow::Owned(self.cast::<i32>().iter().map(|&v| v as i64).collect()),
        })
    }
    /// Any float tensor (F32, BF16, F16) as f32 values (a copy).
    pub fn to_f32_vec(&self) -> Result<Vec<f32>, ViewError> {
        self.expect(&[Dtype::F32, Dtype::BF16, Dtype::F16])?;
        Ok(match self.info.dtype {
            Dtype::F32 => self.cast::<f32>().into_owned(),
            Dtype::BF16 => self
                .cast::<u16>()
                .iter()
                .map(|&b| half::bf16::from_bits(b).to_f32())
                .collect(),
            _ => self
                .cast::<u16>()
                .iter()
                .map(|&b| half::f16::from_bits(b).to_f32())
                .collect(),
        })
    }
}

/// Serialise tensors into safetensors bytes (used by the tests' corpus of
/// broken files and by tools; tensors are laid out in the given order).
pub fn write_bytes(
    tensors: &[(&str, Dtype, &[usize], &[u8])],
    metadata: &[(&str, &str)],
) -> Vec<u8> {
    let mut header = serde_json::Map::new();
    if !metadata.is_empty() {
        let m: serde_json::Map<String, Value> = metadata
            .iter()
            .map(|(k, v)| (k.to_string(), Value::String(v.to_string())))
            .collect();
        header.insert("__metadata__".into(), Value::Object(m));
    }
    let mut offset = 0usize;
    for (name, dtype, shape, data) in tensors {
        header.insert(
            name.to_string(),
            serde_json::json!({
                "dtype": dtype.name(),
                "shape": shape,
                "data_offsets": [offset, offset + data.len()],
            }),
        );
        offset += data.len();
    }
    let mut text = Value::Object(header).to_string().into_bytes();
    // Pad the header with spaces so the data section starts 8-aligned, as
    // the reference writer does.
    while (8 + text.len()) % 8 != 0 {
        text.push(b' ');
    }
    let mut out = Vec::with_capacity(8 + text.len() + offset);
    out.extend_from_slice(&(text.len() as u64).to_le_bytes());
    out.extend_from_slice(&text);
    for (_, _, _, data) in tensors {
        out.extend_from_slice(data);
    }
    out
}
