//! The decode leg after its KV target was sent (wait for the handoff, then stream the
//! tokens), and the aggregated role's whole request on this process's engine.

use super::*;

impl Shared {
    /// The decode leg after the KV target was sent: wait for KV, then stream tokens.
    pub(super) async fn decode_rest(
        self: Arc<Self>,
        prompt: Vec<u32>,
        choices: Vec<SamplingParams>,
        reservations: Vec<crate::engine::Reservation>,
        mut pending: crate::reservations::Pending,
        tx: &mpsc::Sender<std::result::Result<pb::DecodeEvent, Status>>,
    ) -> Result<()> {
        let lease = self.opts.kv_lease;
        // The lease restarts whenever the prefill side says it is still computing.
        let extended = pending.extended.clone();
        let mut expiry = tokio::time::Instant::now() + lease;
        let message = loop {
            tokio::select! {
                m = &mut pending.kv => {
                    break m.map_err(|_| Error::Deadline("reservation dropped".into()))?;
                }
                _ = tokio::time::sleep_until(expiry) => {
                    return Err(Error::KvNotArrived(format!(
                        "no KV and no word from the prefill within the {lease:?} lease"
                    )));
                }
                _ = extended.notified() => expiry = tokio::time::Instant::now() + lease,
                _ = tx.closed() => return self.note_cancelled(),
            }
        };
        drop(pending);
        let engine = self.engine.clone();
        let model_id = self.opts.model_id;
        let events = tokio::task::spawn_blocking(move || -> Result<_> {
            // The handoff reads its body where it arrived (the message, or the landing slot,
            // released once the import is done with it).
            let shared = message.into_shared().ok_or_else(|| {
                Error::InvalidRequest("a KV landing record claims more bytes than its slot".into())
            })?;
            let bytes = (*shared).as_ref();
            let (header, body) = handoff::decode_bytes(bytes)?;
            let start = body.as_ptr() as usize - bytes.as_ptr() as usize;
            let body = tandem_engine::Body::shared(shared.clone(), start..start + body.len());
            if header.model_id != model_id {
                return Err(Error::InvalidRequest(format!(
                    "KV computed by a different checkpoint (model id {:016x}, this decode worker's is {model_id:016x})",
                    header.model_id
                )));
            }
            if header.num_tokens as usize != prompt.len() {
                return Err(Error::InvalidRequest(format!(
                    "KV covers {} tokens, the prompt has {}",
                    header.num_tokens,
                    prompt.len()
                )));
            }
            if header.others.len() + 1 != choices.len() {
                return Err(Error::InvalidRequest(format!(
                    "KV for {} choices, the request has {}",
                    header.others.len() + 1,
                    choices.len()
                )));
            }
            let firsts = std::iter::once(header.first_token)
                .chain(header.others)
                .collect();
            let handoff = tandem_engine::Handoff {
                segments: header.segments,
                body,
            };
            engine.decode(prompt, choices, reservations, handoff, firsts)
        })
        .await
        .map_err(|e| Error::InvalidRequest(format!("decoding task failed: {e}")))??;
        self.forward_tokens(events, tx, |t| pb::DecodeEvent {
            event: Some(pb::decode_event::Event::Token(t)),
        })
        .await
    }

    /// Sends each of a request's tokens (every choice's, each marked with its index) to
    /// its caller until every choice's last one, wrapped for the stream it travels on; a
    /// caller gone away counts as a cancellation, a choice that fails ends them all.
    pub(super) async fn forward_tokens<M>(
        &self,
        events: Vec<crate::engine::TokenEvents>,
        tx: &mpsc::Sender<std::result::Result<M, Status>>,
        wrap: impl Fn(pb::TokenEvent) -> M,
    ) -> Result<()> {
        use futures::StreamExt;
        let streams = events.into_iter().enumerate().map(|(choice, events)| {
            futures::stream::unfold(Some(events), move |events| async move {
                let mut events = events?;
                let event = events.recv().await;
                let more = matches!(&event, Ok(t) if t.finish.is_none());
                Some(((choice, event), more.then_some(events)))
            })
            .boxed()
        });
        let mut merged = futures::stream::select_all(streams);
        loop {
            let next = tokio::select! {
                e = merged.next() => e,
                _ = tx.closed() => return self.note_cancelled(),
            };
            let Some((choice, event)) = next else {
                return Ok(());
            };
            let crate::engine::Token {
                token_id,
                finish,
                logprobs,
                prompt_logprobs,
            } = event?;
            let msg = wrap(pb::TokenEvent {
                token_id,
                finish_reason: finish_to_wire(finish),
                logprobs: logprobs.map(pb::Logprobs::from),
                choice: choice as u32,
                prompt_logprobs: prompt_logprobs
                    .into_iter()
                    .map(pb::Logprobs::from)
                    .collect(),
            });
            if tx.send(Ok(msg)).await.is_err() {
                return self.note_cancelled();
            }
        }
    }
    /// Streams a whole request's tokens from this process's engine (aggregated role).
    pub(super) async fn generate_all(
        &self,
        prompt: Vec<u32>,
        choices: Vec<SamplingParams>,
        tx: &mpsc::Sender<std::result::Result<pb::TokenEvent, Status>>,
    ) -> Result<()> {
        let events = self.engine.generate(prompt, choices)?;
        self.forward_tokens(events, tx, |t| t).await
    }
}
