//! A GGUF (v2/v3) reader.
//!
//! Layout, all little-endian: magic `GGUF`, `u32` version, `u64` tensor count, `u64` metadata
//! count; the metadata key/values (`string` key, `u32` value type, value); the tensor infos
//! (`string` name, `u32` rank, `u64` dims innermost-first, `u32` GGML type, `u64` offset into the
//! data section); padding to `general.alignment` (default 32); the data section.
//!
//! Only the header is parsed on [`Gguf::open`]; tensor bytes are read one tensor at a time with
//! [`Gguf::read_tensor_data`], so memory stays at one tensor regardless of the file size.

use crate::{Error, Result};
use std::fmt;
use std::fs::File;
use std::io::{BufReader, Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

const MAGIC: [u8; 4] = *b"GGUF";
const DEFAULT_ALIGNMENT: u64 = 32;

/// A GGML tensor encoding.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum GgmlType {
    /// 32-bit float.
    F32,
    /// 16-bit IEEE float.
    F16,
    /// Blocks of 32: f16 scale, 16 bytes of 4-bit values (offset 8).
    Q4_0,
    /// Blocks of 32: f16 scale, f16 min, 16 bytes of 4-bit values.
    Q4_1,
    /// Blocks of 32: f16 scale, 32 `i8`.
    Q8_0,
    /// bfloat16.
    BF16,
    /// Any other type, by its GGML id.
    Other(u32),
}

impl GgmlType {
    /// Maps a GGML type id.
    pub fn from_id(id: u32) -> Self {
        match id {
            0 => Self::F32,
            1 => Self::F16,
            2 => Self::Q4_0,
            3 => Self::Q4_1,
            8 => Self::Q8_0,
            30 => Self::BF16,
            other => Self::Other(other),
        }
    }

    /// `(elements per block, bytes per block)`, where known.
    pub fn block_layout(self) -> Option<(usize, usize)> {
        match self {
            Self::F32 => Some((1, 4)),
            Self::F16 | Self::BF16 => Some((1, 2)),
            Self::Q4_0 => Some((32, 2 + 16)),
            Self::Q4_1 => Some((32, 2 + 2 + 16)),
            Self::Q8_0 => Some((32, 2 + 32)),
            Self::Other(_) => None,
        }
    }

    /// Encoded size of `elements` values, if the type is known and `elements` fills whole blocks.
    pub fn byte_len(self, elements: usize) -> Option<usize> {
        let (block, bytes) = self.block_layout()?;
        if !elements.is_multiple_of(block) {
            return None;
        }
        (elements / block).checked_mul(bytes)
    }
}

impl fmt::Display for GgmlType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::F32 => f.write_str("F32"),
            Self::F16 => f.write_str("F16"),
            Self::Q4_0 => f.write_str("Q4_0"),
            Self::Q4_1 => f.write_str("Q4_1"),
            Self::Q8_0 => f.write_str("Q8_0"),
            Self::BF16 => f.write_str("BF16"),
            Self::Other(id) => write!(f, "GGML type {id}"),
        }
    }
}

/// A metadata value.
#[derive(Clone, Debug, PartialEq)]
pub enum MetadataValue {
    /// `uint8`.
    U8(u8),
    /// `int8`.
    I8(i8),
    /// `uint16`.
    U16(u16),
    /// `int16`.
    I16(i16),
    /// `uint32`.
    U32(u32),
    /// `int32`.
    I32(i32),
    /// `float32`.
    F32(f32),
    /// `bool`.
    Bool(bool),
    /// `string` (UTF-8).
    String(String),
    /// `array` of one element type.
    Array(Vec<MetadataValue>),
    /// `uint64`.
    U64(u64),
    /// `int64`.
    I64(i64),
    /// `float64`.
    F64(f64),
}

impl MetadataValue {
    /// Any integer type that is non-negative, as `u64`.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Self::U8(v) => Some(v.into()),
            Self::U16(v) => Some(v.into()),
            Self::U32(v) => Some(v.into()),
            Self::U64(v) => Some(v),
            Self::I8(v) => u64::try_from(v).ok(),
            Self::I16(v) => u64::try_from(v).ok(),
            Self::I32(v) => u64::try_from(v).ok(),
            Self::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    /// Any integer type, as `i64` (when it fits).
    pub fn as_i64(&self) -> Option<i64> {
        match *self {
            Self::I8(v) => Some(v.into()),
            Self::I16(v) => Some(v.into()),
            Self::I32(v) => Some(v.into()),
            Self::I64(v) => Some(v),
            _ => self.as_u64().and_then(|v| i64::try_from(v).ok()),
        }
    }

    /// A float of either width, as `f64`.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Self::F32(v) => Some(v.into()),
            Self::F64(v) => Some(v),
            _ => None,
        }
    }

    /// A string.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Self::String(s) => Some(s),
            _ => None,
        }
    }

    /// An array.
    pub fn as_array(&self) -> Option<&[MetadataValue]> {
        match self {
            Self::Array(items) => Some(items),
            _ => None,
        }
    }
}

/// Where one tensor lives and how it is encoded.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorInfo {
    /// The tensor name, e.g. `blk.0.attn_q.weight`.
    pub name: String,
    /// Dimensions as GGUF lists them: innermost (contiguous) first.
    pub dims: Vec<u64>,
    /// The encoding.
    pub ggml_type: GgmlType,
    /// Offset from the start of the data section.
    pub offset: u64,
}

impl TensorInfo {
    /// Number of elements.
    pub fn elements(&self) -> usize {
        // Checked against the file size when the header is parsed, so this cannot overflow.
        self.dims.iter().map(|&d| d as usize).product()
    }

    /// Row-major shape (outermost first), as safetensors and PyTorch write it.
    pub fn shape(&self) -> Vec<usize> {
        self.dims.iter().rev().map(|&d| d as usize).collect()
    }

    /// Encoded size in bytes, where the type is known.
    pub fn byte_len(&self) -> Option<usize> {
        self.ggml_type.byte_len(self.elements())
    }
}

/// An open GGUF file: its parsed header, and a handle to read tensor data.
#[derive(Debug)]
pub struct Gguf {
    path: PathBuf,
    file: Mutex<File>,
    version: u32,
    metadata: Vec<(String, MetadataValue)>,
    tensors: Vec<TensorInfo>,
    alignment: u64,
    data_offset: u64,
}

impl Gguf {
    /// Opens `path` and parses its header; no tensor data is read.
    pub fn open(path: &Path) -> Result<Self> {
        let io_err = |source| Error::Io {
            path: path.to_path_buf(),
            source,
        };
        let file = File::open(path).map_err(io_err)?;
        let file_len = file.metadata().map_err(io_err)?.len();
        let mut reader = HeaderReader {
            inner: BufReader::new(&file),
            pos: 0,
            file_len,
            path,
        };
        let header = reader.header()?;
        drop(reader);
        let gguf = Self {
            path: path.to_path_buf(),
            file: Mutex::new(file),
            version: header.version,
            metadata: header.metadata,
            tensors: header.tensors,
            alignment: header.alignment,
            data_offset: header.data_offset,
        };
        gguf.check_tensor_extents(file_len)?;
        Ok(gguf)
    }

    /// The file this was opened from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Format version (2 or 3).
    pub fn version(&self) -> u32 {
        self.version
    }

    /// All metadata key/values, in file order.
    pub fn metadata(&self) -> &[(String, MetadataValue)] {
        &self.metadata
    }

    /// One metadata value.
    pub fn get(&self, key: &str) -> Option<&MetadataValue> {
        self.metadata.iter().find(|(k, _)| k == key).map(|(_, v)| v)
    }

    /// All tensor infos, in file order.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    /// One tensor info by name.
    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.iter().find(|t| t.name == name)
    }

    /// Alignment of tensor data (`general.alignment`, default 32).
    pub fn alignment(&self) -> u64 {
        self.alignment
    }

    /// Absolute file offset of the data section.
    pub fn data_offset(&self) -> u64 {
        self.data_offset
    }

    /// Reads the encoded bytes of one tensor.
    pub fn read_tensor_data(&self, tensor: &TensorInfo) -> Result<Vec<u8>> {
        let len = tensor.byte_len().ok_or_else(|| {
            Error::Unsupported(format!(
                "tensor {} has type {}",
                tensor.name, tensor.ggml_type
            ))
        })?;
        let mut buf = vec![0u8; len];
        let io_err = |source| Error::Io {
            path: self.path.clone(),
            source,
        };
        // A poisoned lock only means another reader panicked mid-read; every read seeks
        // first, so the handle is still usable.
        let mut file = self.file.lock().unwrap_or_else(|e| e.into_inner());
        file.seek(SeekFrom::Start(self.data_offset + tensor.offset))
            .map_err(io_err)?;
        file.read_exact(&mut buf).map_err(io_err)?;
        Ok(buf)
    }

    fn malformed(&self, reason: String) -> Error {
        Error::MalformedGguf {
            path: self.path.clone(),
            reason,
        }
    }

    fn check_tensor_extents(&self, file_len: u64) -> Result<()> {
        for t in &self.tensors {
            if !t.offset.is_multiple_of(self.alignment) {
                return Err(self.malformed(format!(
                    "tensor {} offset {} is not a multiple of the alignment {}",
                    t.name, t.offset, self.alignment
                )));
            }
            // Types we cannot size are reported when (if) someone reads them.
            if let Some(len) = t.byte_len() {
                let end = self.data_offset + t.offset + len as u64;
                if end > file_len {
                    return Err(self.malformed(format!(
                        "tensor {} ends at byte {end}, past the end of the file ({file_len})",
                        t.name
                    )));
                }
            }
        }
        Ok(())
    }
}

struct Header {
    version: u32,
    metadata: Vec<(String, MetadataValue)>,
    tensors: Vec<TensorInfo>,
    alignment: u64,
    data_offset: u64,
}

/// Sequential little-endian reader over the header that knows how many bytes remain, so a
/// corrupt length field cannot make it allocate more than the file holds.
struct HeaderReader<'a, R> {
    inner: R,
    pos: u64,
    file_len: u64,
    path: &'a Path,
}

impl<R: Read> HeaderReader<'_, R> {
    fn malformed(&self, reason: impl Into<String>) -> Error {
        Error::MalformedGguf {
            path: self.path.to_path_buf(),
            reason: reason.into(),
        }
    }

    fn bytes<const N: usize>(&mut self) -> Result<[u8; N]> {
        let mut buf = [0u8; N];
        self.fill(&mut buf)?;
        Ok(buf)
    }

    fn fill(&mut self, buf: &mut [u8]) -> Result<()> {
        self.inner.read_exact(buf).map_err(|source| Error::Io {
            path: self.path.to_path_buf(),
            source,
        })?;
        self.pos += buf.len() as u64;
        Ok(())
    }

    fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(self.bytes()?))
    }

    fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(self.bytes()?))
    }

    /// A count of items at least `min_item_bytes` each; rejected if they cannot fit.
    fn count(&mut self, what: &str, min_item_bytes: u64) -> Result<usize> {
        let n = self.u64()?;
        let remaining = self.file_len.saturating_sub(self.pos);
        if n.saturating_mul(min_item_bytes) > remaining {
            return Err(self.malformed(format!(
                "{what} count {n} at byte {} cannot fit in the remaining {remaining} bytes",
                self.pos - 8
            )));
        }
        usize::try_from(n).map_err(|_| self.malformed(format!("{what} count {n} too large")))
    }

    fn string(&mut self) -> Result<String> {
        let len = self.count("string length", 1)?;
        let mut buf = vec![0u8; len];
        self.fill(&mut buf)?;
        String::from_utf8(buf).map_err(|e| {
            self.malformed(format!(
                "string ending at byte {} is not UTF-8: {e}",
                self.pos
            ))
        })
    }

    fn value(&mut self, value_type: u32, depth: u32) -> Result<MetadataValue> {
        use MetadataValue as V;
        Ok(match value_type {
            0 => V::U8(u8::from_le_bytes(self.bytes()?)),
            1 => V::I8(i8::from_le_bytes(self.bytes()?)),
            2 => V::U16(u16::from_le_bytes(self.bytes()?)),
            3 => V::I16(i16::from_le_bytes(self.bytes()?)),
            4 => V::U32(self.u32()?),
            5 => V::I32(i32::from_le_bytes(self.bytes()?)),
            6 => V::F32(f32::from_le_bytes(self.bytes()?)),
            7 => match self.bytes::<1>()?[0] {
                0 => V::Bool(false),
                1 => V::Bool(true),
                b => return Err(self.malformed(format!("bool byte {b} at {}", self.pos - 1))),
            },
            8 => V::String(self.string()?),
            9 => {
                if depth > 8 {
                    return Err(self.malformed("arrays nested more than 8 deep"));
                }
                let elem_type = self.u32()?;
                // Every element takes at least one byte (strings: an 8-byte length).
                let n = self.count("array length", if elem_type == 8 { 8 } else { 1 })?;
                let mut items = Vec::with_capacity(n);
                for _ in 0..n {
                    items.push(self.value(elem_type, depth + 1)?);
                }
                V::Array(items)
            }
            10 => V::U64(self.u64()?),
            11 => V::I64(i64::from_le_bytes(self.bytes()?)),
            12 => V::F64(f64::from_le_bytes(self.bytes()?)),
            other => {
                return Err(self.malformed(format!(
                    "unknown metadata value type {other} at byte {}",
                    self.pos - 4
                )))
            }
        })
    }

    fn header(&mut self) -> Result<Header> {
        let magic: [u8; 4] = self.bytes()?;
        if magic != MAGIC {
            return Err(self.malformed(format!("bad magic {magic:02x?} (expected \"GGUF\")")));
        }
        let version = self.u32()?;
        if !(2..=3).contains(&version) {
            return Err(Error::Unsupported(format!(
                "{}: GGUF version {version} (expected 2 or 3)",
                self.path.display()
            )));
        }
        // A tensor info is at least name length + rank + type + offset = 24 bytes.
        let n_tensors = self.count("tensor", 24)?;
        // A key/value is at least key length + value type + 1 byte = 13 bytes.
        let n_kv = self.count("metadata", 13)?;

        let mut metadata: Vec<(String, MetadataValue)> = Vec::with_capacity(n_kv);
        for _ in 0..n_kv {
            let key = self.string()?;
            let value_type = self.u32()?;
            let value = self.value(value_type, 0)?;
            if metadata.iter().any(|(k, _)| *k == key) {
                return Err(self.malformed(format!("duplicate metadata key {key:?}")));
            }
            metadata.push((key, value));
        }

        let alignment = match metadata.iter().find(|(k, _)| k == "general.alignment") {
            None => DEFAULT_ALIGNMENT,
            Some((_, v)) => match v.as_u64() {
                Some(a) if a > 0 && a.is_power_of_two() => a,
                _ => return Err(self.malformed(format!("general.alignment {v:?}"))),
            },
        };

        let mut tensors = Vec::with_capacity(n_tensors);
        for _ in 0..n_tensors {
            let name = self.string()?;
            let rank = self.u32()?;
            if rank > 8 {
                return Err(self.malformed(format!("tensor {name} has rank {rank}")));
            }
            let mut dims = Vec::with_capacity(rank as usize);
            for _ in 0..rank {
                dims.push(self.u64()?);
            }
            let elements = dims.iter().try_fold(1u64, |acc, &d| acc.checked_mul(d));
            if elements.is_none_or(|n| n > self.file_len.saturating_mul(8)) {
                return Err(self.malformed(format!("tensor {name} dims {dims:?} are implausible")));
            }
            let ggml_type = GgmlType::from_id(self.u32()?);
            let offset = self.u64()?;
            tensors.push(TensorInfo {
                name,
                dims,
                ggml_type,
                offset,
            });
        }
        let data_offset = self.pos.next_multiple_of(alignment);
        Ok(Header {
            version,
            metadata,
            tensors,
            alignment,
            data_offset,
        })
    }
}

/// Writes GGUF files; tests build small fixtures with it.
#[cfg(test)]
pub(crate) mod writer {
    use super::MetadataValue;

    fn string(out: &mut Vec<u8>, s: &str) {
        out.extend_from_slice(&(s.len() as u64).to_le_bytes());
        out.extend_from_slice(s.as_bytes());
    }

    fn type_id(v: &MetadataValue) -> u32 {
        use MetadataValue as V;
        match v {
            V::U8(_) => 0,
            V::I8(_) => 1,
            V::U16(_) => 2,
            V::I16(_) => 3,
            V::U32(_) => 4,
            V::I32(_) => 5,
            V::F32(_) => 6,
            V::Bool(_) => 7,
            V::String(_) => 8,
            V::Array(_) => 9,
            V::U64(_) => 10,
            V::I64(_) => 11,
            V::F64(_) => 12,
        }
    }

    fn value(out: &mut Vec<u8>, v: &MetadataValue) {
        use MetadataValue as V;
        match v {
            V::U8(x) => out.extend_from_slice(&x.to_le_bytes()),
            V::I8(x) => out.extend_from_slice(&x.to_le_bytes()),
            V::U16(x) => out.extend_from_slice(&x.to_le_bytes()),
            V::I16(x) => out.extend_from_slice(&x.to_le_bytes()),
            V::U32(x) => out.extend_from_slice(&x.to_le_bytes()),
            V::I32(x) => out.extend_from_slice(&x.to_le_bytes()),
            V::F32(x) => out.extend_from_slice(&x.to_le_bytes()),
            V::Bool(x) => out.push(u8::from(*x)),
            V::String(s) => string(out, s),
            V::Array(items) => {
                let elem = items.first().map_or(0, type_id);
                out.extend_from_slice(&elem.to_le_bytes());
                out.extend_from_slice(&(items.len() as u64).to_le_bytes());
                for item in items {
                    value(out, item);
                }
            }
            V::U64(x) => out.extend_from_slice(&x.to_le_bytes()),
            V::I64(x) => out.extend_from_slice(&x.to_le_bytes()),
            V::F64(x) => out.extend_from_slice(&x.to_le_bytes()),
        }
    }

    /// A tensor to write: name, GGUF dims (innermost first), GGML type id, encoded bytes.
    pub(crate) struct Tensor<'a> {
        pub name: &'a str,
        pub dims: Vec<u64>,
        pub type_id: u32,
        pub data: Vec<u8>,
    }

    /// Serialises a GGUF v3 file with the given alignment.
    pub(crate) fn gguf(
        metadata: &[(&str, MetadataValue)],
        tensors: &[Tensor<'_>],
        alignment: u64,
    ) -> Vec<u8> {
        let mut out = b"GGUF".to_vec();
        out.extend_from_slice(&3u32.to_le_bytes());
        out.extend_from_slice(&(tensors.len() as u64).to_le_bytes());
        out.extend_from_slice(&(metadata.len() as u64).to_le_bytes());
        for (k, v) in metadata {
            string(&mut out, k);
            out.extend_from_slice(&type_id(v).to_le_bytes());
            value(&mut out, v);
        }
        let mut offset = 0u64;
        let mut offsets = Vec::new();
        for t in tensors {
            string(&mut out, t.name);
            out.extend_from_slice(&(t.dims.len() as u32).to_le_bytes());
            for d in &t.dims {
                out.extend_from_slice(&d.to_le_bytes());
            }
            out.extend_from_slice(&t.type_id.to_le_bytes());
            out.extend_from_slice(&offset.to_le_bytes());
            offsets.push(offset);
            offset = (offset + t.data.len() as u64).next_multiple_of(alignment);
        }
        out.resize((out.len() as u64).next_multiple_of(alignment) as usize, 0);
        let data_start = out.len() as u64;
        for (t, off) in tensors.iter().zip(offsets) {
            out.resize((data_start + off) as usize, 0);
            out.extend_from_slice(&t.data);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::writer::{gguf, Tensor};
    use super::*;
    use std::io::Write;

    fn write_temp(bytes: &[u8]) -> tempfile::NamedTempFile {
        let mut f = tempfile::NamedTempFile::new().expect("temp file");
        f.write_all(bytes).expect("write temp file");
        f
    }

    #[test]
    fn reads_every_metadata_type_and_tensor_infos() {
        use MetadataValue as V;
        let metadata = vec![
            ("general.alignment", V::U32(64)),
            ("u8", V::U8(200)),
            ("i8", V::I8(-3)),
            ("u16", V::U16(60_000)),
            ("i16", V::I16(-30_000)),
            ("u32", V::U32(4_000_000_000)),
            ("i32", V::I32(-2_000_000_000)),
            ("f32", V::F32(1e-5)),
            ("bool", V::Bool(true)),
            ("string", V::String("日本".into())),
            ("u64", V::U64(1 << 40)),
            ("i64", V::I64(-(1 << 40))),
            ("f64", V::F64(0.1)),
            (
                "strings",
                V::Array(vec![V::String("a b".into()), V::String("".into())]),
            ),
            (
                "nested",
                V::Array(vec![V::Array(vec![V::I32(1), V::I32(-1)])]),
            ),
        ];
        let tensors = [
            Tensor {
                name: "a",
                dims: vec![3],
                type_id: 0,
                data: [1.0f32, 2.0, 3.0]
                    .iter()
                    .flat_map(|v| v.to_le_bytes())
                    .collect(),
            },
            Tensor {
                name: "b",
                dims: vec![2, 2],
                type_id: 1,
                data: [1.0f32, -2.0, 0.5, 4.0]
                    .iter()
                    .flat_map(|&v| half::f16::from_f32(v).to_le_bytes())
                    .collect(),
            },
        ];
        let file = write_temp(&gguf(&metadata, &tensors, 64));
        let g = Gguf::open(file.path()).expect("parse");
        assert_eq!(g.version(), 3);
        assert_eq!(g.alignment(), 64);
        assert!(g.data_offset().is_multiple_of(64));
        assert_eq!(g.metadata().len(), metadata.len());
        for ((k, v), (gk, gv)) in metadata.iter().zip(g.metadata()) {
            assert_eq!(k, gk);
            assert_eq!(v, gv);
        }
        assert_eq!(g.get("i8").and_then(MetadataValue::as_i64), Some(-3));
        assert_eq!(g.get("i8").and_then(MetadataValue::as_u64), None);
        assert_eq!(g.get("u16").and_then(MetadataValue::as_u64), Some(60_000));
        assert_eq!(
            g.get("string").and_then(MetadataValue::as_str),
            Some("日本")
        );

        let a = g.tensor("a").expect("tensor a");
        assert_eq!(
            (a.ggml_type, a.offset, a.shape()),
            (GgmlType::F32, 0, vec![3])
        );
        let b = g.tensor("b").expect("tensor b");
        assert_eq!(
            (b.ggml_type, b.offset, b.dims.clone()),
            (GgmlType::F16, 64, vec![2, 2])
        );
        assert_eq!(g.read_tensor_data(a).expect("read a"), tensors[0].data);
        assert_eq!(g.read_tensor_data(b).expect("read b"), tensors[1].data);
    }

    #[test]
    fn default_alignment_is_32() {
        let tensors = [Tensor {
            name: "x",
            dims: vec![1],
            type_id: 0,
            data: 7.0f32.to_le_bytes().to_vec(),
        }];
        let file = write_temp(&gguf(&[], &tensors, 32));
        let g = Gguf::open(file.path()).expect("parse");
        assert_eq!(g.alignment(), 32);
        assert!(g.data_offset().is_multiple_of(32));
        let x = g.read_tensor_data(&g.tensors()[0]).expect("read");
        assert_eq!(x, 7.0f32.to_le_bytes());
    }

    #[test]
    fn rejects_bad_magic_truncation_and_huge_counts() {
        let mut bytes = gguf(&[("k", MetadataValue::U8(1))], &[], 32);
        bytes[0] = b'X';
        let file = write_temp(&bytes);
        assert!(matches!(
            Gguf::open(file.path()),
            Err(Error::MalformedGguf { .. })
        ));

        let bytes = gguf(&[("key", MetadataValue::String("value".into()))], &[], 32);
        let file = write_temp(&bytes[..30]);
        assert!(Gguf::open(file.path()).is_err());

        let mut bytes = b"GGUF".to_vec();
        bytes.extend_from_slice(&3u32.to_le_bytes());
        bytes.extend_from_slice(&0u64.to_le_bytes());
        bytes.extend_from_slice(&u64::MAX.to_le_bytes());
        let file = write_temp(&bytes);
        assert!(matches!(
            Gguf::open(file.path()),
            Err(Error::MalformedGguf { .. })
        ));
    }

    #[test]
    fn rejects_tensor_past_end_of_file() {
        let tensors = [Tensor {
            name: "x",
            dims: vec![4],
            type_id: 0,
            data: vec![0; 16],
        }];
        let bytes = gguf(&[], &tensors, 32);
        let file = write_temp(&bytes[..bytes.len() - 4]);
        assert!(matches!(
            Gguf::open(file.path()),
            Err(Error::MalformedGguf { .. })
        ));
    }

    #[test]
    fn byte_lengths_of_block_types() {
        assert_eq!(GgmlType::Q4_1.byte_len(64), Some(40));
        assert_eq!(GgmlType::Q8_0.byte_len(32), Some(34));
        assert_eq!(GgmlType::Q8_0.byte_len(33), None);
        assert_eq!(GgmlType::F16.byte_len(3), Some(6));
        assert_eq!(GgmlType::Other(12).byte_len(256), None);
    }
}
