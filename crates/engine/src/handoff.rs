//! What a prefill hands to a decode: a typed manifest (per segment: what it holds, the layer,
//! the shard it came from, dtype and shape) over one contiguous body of little-endian bytes.
//! Every model family exports its request state in this form and checks what it imports
//! against the manifest it would have produced itself, so a handoff of another shape, dtype
//! or family is refused with the reason instead of being read as garbage.

use crate::tensor::{DType, HostTensor};
use crate::{Error, Result};
use std::sync::Arc;

/// What a segment of the body holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SegmentKind {
    /// Paged-attention K and V of one layer, `[2][tokens][kv_dim]`.
    KvLayer,
    /// The layout of the sending side, `[tp, dp, ep]` (u32): state is resharded from it.
    Layout,
    /// A KDA layer's recurrent state on one attention-TP rank, `[heads][dk][dv]`.
    KdaRecurrent,
    /// A KDA layer's short-conv windows (q, k, v) on one attention-TP rank, `[3][width]`.
    KdaConv,
    /// An MLA layer's compressed KV latents, `[tokens][kv_lora_rank]` (sent once: they are
    /// replicated over attention TP).
    MlaLatent,
    /// An MLA layer's rotary key part, `[tokens][rope_dim]`.
    MlaRope,
    /// An MLA layer's DSA indexer keys (flattened).
    IndexerKeys,
    /// An MLA layer's DSA indexer pool gate (flattened).
    IndexerGate,
}

impl SegmentKind {
    const ALL: [SegmentKind; 8] = [
        SegmentKind::KvLayer,
        SegmentKind::Layout,
        SegmentKind::KdaRecurrent,
        SegmentKind::KdaConv,
        SegmentKind::MlaLatent,
        SegmentKind::MlaRope,
        SegmentKind::IndexerKeys,
        SegmentKind::IndexerGate,
    ];

    /// The wire code.
    pub fn code(self) -> u8 {
        match self {
            SegmentKind::KvLayer => 1,
            // 2 was the opaque KDA state of the first manifest version.
            SegmentKind::Layout => 3,
            SegmentKind::KdaRecurrent => 4,
            SegmentKind::KdaConv => 5,
            SegmentKind::MlaLatent => 6,
            SegmentKind::MlaRope => 7,
            SegmentKind::IndexerKeys => 8,
            SegmentKind::IndexerGate => 9,
        }
    }

    /// The kind of a wire code.
    pub fn from_code(c: u8) -> Option<Self> {
        Self::ALL.into_iter().find(|k| k.code() == c)
    }
}

/// The wire code of a dtype.
pub fn dtype_code(d: DType) -> u8 {
    match d {
        DType::F32 => 1,
        DType::BF16 => 2,
        DType::F16 => 3,
        DType::F8E4M3 => 4,
        DType::U32 => 5,
        DType::I32 => 6,
    }
}

/// The dtype of a wire code.
pub fn dtype_from_code(c: u8) -> Option<DType> {
    [
        DType::F32,
        DType::BF16,
        DType::F16,
        DType::F8E4M3,
        DType::U32,
        DType::I32,
    ]
    .into_iter()
    .find(|&d| dtype_code(d) == c)
}

/// One byte range of the body.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Segment {
    /// What it holds.
    pub kind: SegmentKind,
    /// Model layer, or 0.
    pub layer: u32,
    /// The sending rank it came from (attention-TP rank within its group; 0 on one rank).
    pub shard: u32,
    /// Element type.
    pub dtype: DType,
    /// Shape (elements = product).
    pub shape: Vec<u32>,
}

impl Segment {
    /// Elements in the segment.
    pub fn elements(&self) -> u64 {
        self.shape.iter().map(|&d| u64::from(d)).product()
    }

    /// Bytes this segment takes in the body.
    pub fn len_bytes(&self) -> u64 {
        self.elements() * self.dtype.size() as u64
    }

    /// A short description for error messages.
    pub fn describe(&self) -> String {
        format!(
            "{:?} layer {} shard {} {} {:?}",
            self.kind, self.layer, self.shard, self.dtype, self.shape
        )
    }
}

/// A request's exported state: the manifest and the body it describes.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Handoff {
    /// Segments, in body order.
    pub segments: Vec<Segment>,
    /// Their bytes, concatenated (little-endian elements).
    pub body: Body,
}

/// A handoff's bytes: owned, or a range of memory the handoff shares with whoever received it
/// (the transport's message, a shared-memory landing slot), so an import reads them where they
/// arrived instead of from a copy.
#[derive(Clone)]
pub enum Body {
    /// Bytes of its own.
    Owned(Vec<u8>),
    /// `range` of bytes kept alive by `bytes`.
    Shared {
        /// What holds the bytes.
        bytes: Arc<dyn AsRef<[u8]> + Send + Sync>,
        /// The body's part of them.
        range: std::ops::Range<usize>,
    },
}

impl Body {
    /// `range` of `bytes` (which must lie inside them).
    pub fn shared(
        bytes: Arc<dyn AsRef<[u8]> + Send + Sync>,
        range: std::ops::Range<usize>,
    ) -> Self {
        assert!(
            range.end <= (*bytes).as_ref().len(),
            "body range past its bytes"
        );
        Body::Shared { bytes, range }
    }

    /// The bytes to change in place (a shared body is copied first).
    pub fn to_mut(&mut self) -> &mut Vec<u8> {
        if let Body::Shared { .. } = self {
            *self = Body::Owned(self.to_vec());
        }
        match self {
            Body::Owned(v) => v,
            Body::Shared { .. } => unreachable!("made owned above"),
        }
    }
}

impl Default for Body {
    fn default() -> Self {
        Body::Owned(Vec::new())
    }
}

impl From<Vec<u8>> for Body {
    fn from(v: Vec<u8>) -> Self {
        Body::Owned(v)
    }
}

impl std::ops::Deref for Body {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            Body::Owned(v) => v,
            Body::Shared { bytes, range } => &(**bytes).as_ref()[range.clone()],
        }
    }
}

impl PartialEq for Body {
    fn eq(&self, other: &Self) -> bool {
        **self == **other
    }
}

impl std::fmt::Debug for Body {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Body({} bytes)", self.len())
    }
}

impl Handoff {
    /// Appends a tensor as a segment.
    pub fn push(&mut self, kind: SegmentKind, layer: usize, shard: usize, t: &HostTensor) {
        self.segments.push(Segment {
            kind,
            layer: layer as u32,
            shard: shard as u32,
            dtype: t.dtype(),
            shape: t.shape().iter().map(|&d| d as u32).collect(),
        });
        self.body.to_mut().extend_from_slice(&t.to_le_bytes());
    }

    /// Appends f32 values as a segment of the given shape.
    pub fn push_f32(
        &mut self,
        kind: SegmentKind,
        layer: usize,
        shard: usize,
        shape: &[usize],
        values: &[f32],
    ) {
        debug_assert_eq!(shape.iter().product::<usize>(), values.len());
        self.segments.push(Segment {
            kind,
            layer: layer as u32,
            shard: shard as u32,
            dtype: DType::F32,
            shape: shape.iter().map(|&d| d as u32).collect(),
        });
        self.body
            .to_mut()
            .extend_from_slice(bytemuck::cast_slice(values));
    }

    /// Checks that the manifest describes exactly the body.
    pub fn check_sizes(&self) -> Result<()> {
        let described: u64 = self.segments.iter().map(Segment::len_bytes).sum();
        if described != self.body.len() as u64 {
            return Err(Error::InvalidRequest(format!(
                "handoff manifest describes {described} bytes, the body has {}",
                self.body.len()
            )));
        }
        Ok(())
    }
}

/// Reads the f32 segments of a handoff in order, each checked against what the receiver
/// expects (kind, layer, shard, element count).
pub(crate) struct SegmentReader<'a> {
    handoff: &'a Handoff,
    next: usize,
    at: usize,
}

impl<'a> SegmentReader<'a> {
    /// A reader over `h` (whose sizes it checks first).
    pub(crate) fn new(h: &'a Handoff) -> Result<Self> {
        h.check_sizes()?;
        Ok(Self {
            handoff: h,
            next: 0,
            at: 0,
        })
    }

    fn take(&mut self) -> Option<(&'a Segment, &'a [u8])> {
        let s = self.handoff.segments.get(self.next)?;
        let n = s.len_bytes() as usize;
        let bytes = &self.handoff.body[self.at..self.at + n];
        self.next += 1;
        self.at += n;
        Some((s, bytes))
    }

    /// The next segment, which must be `kind` at `layer`/`shard` (f32 or u32 by `dtype`),
    /// with `elements` values when given.
    pub(crate) fn next(
        &mut self,
        kind: SegmentKind,
        layer: usize,
        shard: usize,
        dtype: DType,
        elements: Option<usize>,
    ) -> Result<(&'a Segment, &'a [u8])> {
        let want = || format!("{kind:?} layer {layer} shard {shard}");
        let (s, bytes) = self
            .take()
            .ok_or_else(|| Error::InvalidRequest(format!("handoff ends before the {}", want())))?;
        if s.kind != kind || s.layer as usize != layer || s.shard as usize != shard {
            return Err(Error::InvalidRequest(format!(
                "handoff segment is {}, expected the {}",
                s.describe(),
                want()
            )));
        }
        if s.dtype != dtype {
            return Err(Error::InvalidRequest(format!(
                "handoff segment {} is {}, expected {dtype}",
                want(),
                s.dtype
            )));
        }
        if let Some(n) = elements {
            if s.elements() != n as u64 {
                return Err(Error::InvalidRequest(format!(
                    "handoff segment {} has {} values, this model's has {n}",
                    want(),
                    s.elements()
                )));
            }
        }
        Ok((s, bytes))
    }

    /// [`SegmentReader::next`] of an f32 segment, as values.
    pub(crate) fn f32s(
        &mut self,
        kind: SegmentKind,
        layer: usize,
        shard: usize,
        elements: Option<usize>,
    ) -> Result<Vec<f32>> {
        let (_, bytes) = self.next(kind, layer, shard, DType::F32, elements)?;
        Ok(bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect())
    }

    /// Fails when segments are left over.
    pub(crate) fn finish(mut self) -> Result<()> {
        match self.take() {
            None => Ok(()),
            Some((s, _)) => Err(Error::InvalidRequest(format!(
                "handoff has an unexpected segment {}",
                s.describe()
            ))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_shared_body_reads_its_range_and_copies_only_when_changed() {
        let bytes: Arc<dyn AsRef<[u8]> + Send + Sync> = Arc::new(vec![9u8, 1, 2, 3, 9]);
        let mut body = Body::shared(bytes.clone(), 1..4);
        assert_eq!(&*body, &[1, 2, 3]);
        assert_eq!(body, Body::from(vec![1, 2, 3]));
        body.to_mut().push(4);
        assert_eq!(&*body, &[1, 2, 3, 4]);
        assert_eq!(
            (*bytes).as_ref(),
            &[9, 1, 2, 3, 9],
            "the shared bytes are untouched"
        );
    }

    #[test]
    fn codes_round_trip() {
        for k in SegmentKind::ALL {
            assert_eq!(SegmentKind::from_code(k.code()), Some(k));
        }
        assert_eq!(SegmentKind::from_code(2), None, "the retired opaque state");
        for d in [DType::F32, DType::BF16, DType::U32] {
            assert_eq!(dtype_from_code(dtype_code(d)), Some(d));
        }
    }

    #[test]
    fn reader_checks_kind_layer_and_size() {
        let mut h = Handoff::default();
        h.push_f32(SegmentKind::KdaConv, 2, 1, &[3, 2], &[1.0; 6]);
        let mut r = SegmentReader::new(&h).expect("sizes");
        assert!(r
            .f32s(SegmentKind::KdaConv, 2, 0, Some(6))
            .expect_err("wrong shard")
            .to_string()
            .contains("shard 1"));
        let mut r = SegmentReader::new(&h).expect("sizes");
        assert!(r.f32s(SegmentKind::KdaConv, 2, 1, Some(4)).is_err());
        let mut r = SegmentReader::new(&h).expect("sizes");
        assert_eq!(
            r.f32s(SegmentKind::KdaConv, 2, 1, Some(6)).expect("read"),
            vec![1.0; 6]
        );
        r.finish().expect("nothing left");
        let mut h = h.clone();
        h.body.to_mut().pop();
        assert!(SegmentReader::new(&h).is_err(), "a short body");
    }
}
