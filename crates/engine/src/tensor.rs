//! Typed tensors. A [`HostTensor`] is data in host memory with its dtype and shape (what goes
//! into and comes out of a device); a [`Tensor`] lives on a backend's device and knows the
//! same two things, with the storage owned by the backend. Models never see raw `Vec<f32>`:
//! what a device holds is decided by the dtype, so the same model code runs f32 or bf16
//! weights and K/V, on the CPU or a GPU.

use crate::backend::Backend;
use crate::{Error, Result};
use half::{bf16, f16};

/// Element types a tensor can hold (f32 by default).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum DType {
    /// 32-bit float.
    #[default]
    F32,
    /// bfloat16.
    BF16,
    /// IEEE half.
    F16,
    /// FP8 E4M3 ("fn": no infinities), for weights with block scales.
    F8E4M3,
    /// Unsigned 32-bit integers (token ids, slots, block tables).
    U32,
    /// Signed 32-bit integers.
    I32,
}

impl DType {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::F32 | DType::U32 | DType::I32 => 4,
            DType::BF16 | DType::F16 => 2,
            DType::F8E4M3 => 1,
        }
    }

    /// The name used on the command line and in handoff manifests.
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::BF16 => "bf16",
            DType::F16 => "f16",
            DType::F8E4M3 => "f8e4m3",
            DType::U32 => "u32",
            DType::I32 => "i32",
        }
    }

    /// Parses [`DType::name`].
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "f32" | "float32" => DType::F32,
            "bf16" | "bfloat16" => DType::BF16,
            "f16" | "float16" => DType::F16,
            "f8e4m3" => DType::F8E4M3,
            "u32" => DType::U32,
            "i32" => DType::I32,
            _ => return None,
        })
    }

    /// Whether model activations, weights or K/V can be kept in this type.
    pub fn is_float(self) -> bool {
        matches!(self, DType::F32 | DType::BF16 | DType::F16 | DType::F8E4M3)
    }
}

impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The elements of a host tensor.
#[derive(Clone, Debug, PartialEq)]
pub enum HostData {
    /// f32 values.
    F32(Vec<f32>),
    /// bf16 values.
    BF16(Vec<bf16>),
    /// f16 values.
    F16(Vec<f16>),
    /// E4M3 codes.
    F8E4M3(Vec<u8>),
    /// u32 values.
    U32(Vec<u32>),
    /// i32 values.
    I32(Vec<i32>),
}

impl HostData {
    /// The element type.
    pub fn dtype(&self) -> DType {
        match self {
            HostData::F32(_) => DType::F32,
            HostData::BF16(_) => DType::BF16,
            HostData::F16(_) => DType::F16,
            HostData::F8E4M3(_) => DType::F8E4M3,
            HostData::U32(_) => DType::U32,
            HostData::I32(_) => DType::I32,
        }
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            HostData::F32(v) => v.len(),
            HostData::BF16(v) => v.len(),
            HostData::F16(v) => v.len(),
            HostData::F8E4M3(v) => v.len(),
            HostData::U32(v) => v.len(),
            HostData::I32(v) => v.len(),
        }
    }

    /// Whether there are no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Data in host memory with its dtype and shape.
#[derive(Clone, Debug, PartialEq)]
pub struct HostTensor {
    shape: Vec<usize>,
    data: HostData,
}

impl HostTensor {
    /// A tensor of `shape` over `data`; the element count must match.
    pub fn new(shape: &[usize], data: HostData) -> Result<Self> {
        let want: usize = shape.iter().product();
        if data.len() != want {
            return Err(Error::InvalidRequest(format!(
                "tensor of shape {shape:?} needs {want} values, got {}",
                data.len()
            )));
        }
        Ok(Self {
            shape: shape.to_vec(),
            data,
        })
    }

    /// An f32 tensor (a vector when `shape` is `[len]`).
    pub fn from_f32(shape: &[usize], data: Vec<f32>) -> Result<Self> {
        Self::new(shape, HostData::F32(data))
    }

    /// A u32 vector.
    pub fn from_u32(data: Vec<u32>) -> Self {
        Self {
            shape: vec![data.len()],
            data: HostData::U32(data),
        }
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        self.data.dtype()
    }

    /// The shape.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.data.len()
    }

    /// Whether there are no elements.
    pub fn is_empty(&self) -> bool {
        self.data.is_empty()
    }

    /// The elements.
    pub fn data(&self) -> &HostData {
        &self.data
    }

    /// The elements, owned.
    pub fn into_data(self) -> HostData {
        self.data
    }

    /// The values as f32 (floats widened; integers converted).
    pub fn to_f32_vec(&self) -> Vec<f32> {
        match &self.data {
            HostData::F32(v) => v.clone(),
            HostData::BF16(v) => v.iter().map(|x| x.to_f32()).collect(),
            HostData::F16(v) => v.iter().map(|x| x.to_f32()).collect(),
            HostData::F8E4M3(v) => v
                .iter()
                .map(|&c| tandem_model::fp8::e4m3_to_f32(c))
                .collect(),
            HostData::U32(v) => v.iter().map(|&x| x as f32).collect(),
            HostData::I32(v) => v.iter().map(|&x| x as f32).collect(),
        }
    }

    /// The same values in another float dtype (rounded to nearest even when narrowing).
    pub fn to_dtype(&self, dtype: DType) -> Result<HostTensor> {
        if dtype == self.dtype() {
            return Ok(self.clone());
        }
        if !self.dtype().is_float() || !dtype.is_float() {
            return Err(Error::InvalidRequest(format!(
                "no conversion from {} to {dtype}",
                self.dtype()
            )));
        }
        let f = self.to_f32_vec();
        let data = match dtype {
            DType::F32 => HostData::F32(f),
            DType::BF16 => HostData::BF16(f.iter().map(|&x| bf16::from_f32(x)).collect()),
            DType::F16 => HostData::F16(f.iter().map(|&x| f16::from_f32(x)).collect()),
            DType::F8E4M3 => HostData::F8E4M3(
                f.iter()
                    .map(|&x| tandem_model::fp8::f32_to_e4m3(x))
                    .collect(),
            ),
            DType::U32 | DType::I32 => unreachable!("checked above: float targets only"),
        };
        Ok(HostTensor {
            shape: self.shape.clone(),
            data,
        })
    }

    /// Little-endian bytes of the elements (the wire format of KV handoffs).
    pub fn to_le_bytes(&self) -> Vec<u8> {
        match &self.data {
            HostData::F32(v) => bytemuck::cast_slice(v).to_vec(),
            HostData::BF16(v) => bytemuck::cast_slice(v).to_vec(),
            HostData::F16(v) => bytemuck::cast_slice(v).to_vec(),
            HostData::F8E4M3(v) => v.clone(),
            HostData::U32(v) => bytemuck::cast_slice(v).to_vec(),
            HostData::I32(v) => bytemuck::cast_slice(v).to_vec(),
        }
    }

    /// The inverse of [`HostTensor::to_le_bytes`].
    pub fn from_le_bytes(dtype: DType, shape: &[usize], bytes: &[u8]) -> Result<Self> {
        let want: usize = shape.iter().product::<usize>() * dtype.size();
        if bytes.len() != want {
            return Err(Error::InvalidRequest(format!(
                "{dtype} tensor of shape {shape:?} is {want} bytes, got {}",
                bytes.len()
            )));
        }
        // One copy into storage of the element type (hosts are little-endian, as in
        // `to_le_bytes`); an element-by-element collect was most of a long prompt's import.
        fn copied<T: bytemuck::Pod>(bytes: &[u8]) -> Vec<T> {
            let mut v = vec![T::zeroed(); bytes.len() / std::mem::size_of::<T>()];
            bytemuck::cast_slice_mut::<T, u8>(&mut v).copy_from_slice(bytes);
            v
        }
        let data = match dtype {
            DType::F32 => HostData::F32(copied(bytes)),
            DType::U32 => HostData::U32(copied(bytes)),
            DType::I32 => HostData::I32(copied(bytes)),
            DType::BF16 => HostData::BF16(copied::<bf16>(bytes)),
            DType::F16 => HostData::F16(copied::<f16>(bytes)),
            DType::F8E4M3 => HostData::F8E4M3(bytes.to_vec()),
        };
        Self::new(shape, data)
    }
}

/// A tensor on backend `B`'s device: storage owned by the backend, with its dtype and shape.
/// Operations act on the leading rows they are told about, so one tensor allocated for the
/// largest step serves every smaller one (no allocation inside a forward pass).
pub struct Tensor<B: Backend> {
    pub(crate) storage: B::Storage,
    pub(crate) dtype: DType,
    pub(crate) shape: Vec<usize>,
}

impl<B: Backend> Tensor<B> {
    /// Wraps backend storage (for backend implementations).
    pub fn from_storage(storage: B::Storage, dtype: DType, shape: &[usize]) -> Self {
        Self {
            storage,
            dtype,
            shape: shape.to_vec(),
        }
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The shape.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.shape.iter().product()
    }

    /// Whether there are no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes the elements take.
    pub fn size_bytes(&self) -> usize {
        self.len() * self.dtype.size()
    }

    /// The backend storage (for backend implementations).
    pub fn storage(&self) -> &B::Storage {
        &self.storage
    }

    /// The backend storage, mutably (for backend implementations).
    pub fn storage_mut(&mut self) -> &mut B::Storage {
        &mut self.storage
    }
}

impl<B: Backend> std::fmt::Debug for Tensor<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tensor")
            .field("dtype", &self.dtype)
            .field("shape", &self.shape)
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_round_trip_in_every_dtype() {
        let t = HostTensor::from_f32(&[2, 3], vec![1.0, -2.5, 3.25, 0.0, 1e-3, 65504.0])
            .expect("6 values");
        for dtype in [DType::F32, DType::BF16, DType::F16, DType::F8E4M3] {
            let c = t.to_dtype(dtype).expect("float to float");
            assert_eq!(c.dtype(), dtype);
            let back =
                HostTensor::from_le_bytes(dtype, &[2, 3], &c.to_le_bytes()).expect("same size");
            assert_eq!(back, c, "{dtype}");
        }
        assert!(HostTensor::from_le_bytes(DType::BF16, &[2, 3], &[0; 11]).is_err());
        assert!(HostTensor::from_f32(&[4], vec![1.0]).is_err());
        // The wire order is little-endian whatever the element type (what other workers read).
        let one = HostTensor::from_f32(&[1], vec![1.0]).expect("1");
        assert_eq!(one.to_le_bytes(), [0, 0, 0x80, 0x3f]);
        let one_bf16 = one.to_dtype(DType::BF16).expect("float");
        assert_eq!(one_bf16.to_le_bytes(), [0x80, 0x3f]);
        let back = HostTensor::from_le_bytes(DType::BF16, &[1], &[0x80, 0x3f]).expect("2 bytes");
        assert_eq!(back.to_f32_vec(), [1.0]);
    }

    #[test]
    fn bf16_rounds_to_nearest() {
        let t = HostTensor::from_f32(&[3], vec![1.0, 1.0 + 1.0 / 256.0, 3.0e38]).expect("3");
        let b = t.to_dtype(DType::BF16).expect("float").to_f32_vec();
        assert_eq!(b[0], 1.0);
        assert!((b[1] - (1.0 + 1.0 / 256.0)).abs() <= 1.0 / 128.0);
        assert!(b[2].is_finite());
    }
}
