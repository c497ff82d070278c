use std::fmt;

/// One complete message received from a prefill worker.
#[derive(Clone, PartialEq, Eq)]
pub struct KvMessage {
    /// The sender's tag (what it is: which request, layer, or record is up to the caller).
    pub tag: u64,
    /// The bytes, exactly as sent.
    pub payload: Vec<u8>,
}

impl fmt::Debug for KvMessage {
    // Payloads are megabytes of KV; show their size, not their bytes.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KvMessage")
            .field("tag", &self.tag)
            .field("payload_len", &self.payload.len())
            .finish()
    }
}
