//! The prefill leg: reserve nothing, compute the prompt, push its KV (or state) to the
//! decode worker's target and answer the first token.

use super::*;

impl Shared {
    pub(super) async fn prefill(&self, req: pb::PrefillRequest) -> Result<pb::PrefillResponse> {
        self.check_role(Role::Prefill)?;
        let (prompt, choices) = self.checked_request(req.request)?;
        let target = req
            .kv_target
            .ok_or_else(|| Error::InvalidRequest("missing kv_target".into()))?;
        let mine = self.kv_layout(prompt.len());
        let theirs = target.layout.clone().unwrap_or_default();
        if theirs.model_id != mine.model_id {
            return Err(Error::InvalidRequest(format!(
                "the decode worker serves a different checkpoint (model id {:016x}, this prefill worker's is {:016x})",
                theirs.model_id, mine.model_id
            )));
        }
        if (
            theirs.num_layers,
            theirs.num_kv_heads,
            theirs.head_dim,
            theirs.num_tokens,
            &theirs.dtype,
        ) != (
            mine.num_layers,
            mine.num_kv_heads,
            mine.head_dim,
            mine.num_tokens,
            &mine.dtype,
        ) {
            return Err(Error::InvalidRequest(format!(
                "decode KV layout {theirs:?} does not match this prefill worker's {mine:?}"
            )));
        }
        let prompt_len = prompt.len();
        let computing = self.engine.prefill(prompt, choices);
        let crate::engine::Prefilled {
            first_token,
            finish,
            logprobs,
            handoff,
            others,
            prompt_logprobs,
        } = match (&self.sender, target.lease_ms) {
            (Some(sender), ms) if ms > 0 => {
                // Tell the decode worker, at a third of its lease, that this prefill is still
                // computing, so a long prompt does not outlive the reservation waiting for it.
                let every = Duration::from_millis(ms / 3).max(Duration::from_millis(50));
                let record = handoff::encode_extend(
                    tandem_core::ReservationId(target.reservation_id),
                    tandem_core::Epoch(target.epoch),
                );
                let extend = async {
                    loop {
                        tokio::time::sleep(every).await;
                        let sent = sender
                            .send(
                                &target.transfer_address,
                                target.reservation_id,
                                record.clone(),
                                every,
                            )
                            .await;
                        if let Err(e) = sent {
                            tracing::debug!(error = %e, "lease extension not sent");
                        }
                    }
                };
                tokio::select! {
                    done = computing => done?,
                    _ = extend => unreachable!("the extension loop never ends"),
                }
            }
            _ => computing.await?,
        };
        let mut sent = 0;
        // The KV goes unless every choice already ended.
        if finish.is_none() || others.iter().any(|o| o.finish.is_none()) {
            let reservation = tandem_core::ReservationId(target.reservation_id);
            let epoch = tandem_core::Epoch(target.epoch);
            let model_id = self.opts.model_id;
            let mut dropped = false;
            let mut corrupt = None;
            if let Some(chaos) = &self.opts.transfer_chaos {
                use tandem_chaos::TransferFault;
                let fault = chaos.next();
                if let Some(f) = fault {
                    tracing::warn!(fault = ?f, reservation = %reservation, "chaos: injecting a transfer fault");
                }
                match fault {
                    Some(TransferFault::Abort) => {
                        return Err(Error::InjectedTransferFault("KV push aborted".into()))
                    }
                    Some(TransferFault::Corrupt(i)) => corrupt = Some(i),
                    Some(TransferFault::Delay(d)) => tokio::time::sleep(d).await,
                    Some(TransferFault::Drop) => dropped = true,
                    None => {}
                }
            }
            let sender = self
                .sender
                .as_ref()
                .ok_or_else(|| Error::InvalidRequest("no transport".into()))?;
            let message = Outgoing {
                head: handoff::Head {
                    reservation,
                    epoch,
                    first_token,
                    num_tokens: prompt_len as u32,
                    model_id,
                    others: others.iter().map(|o| o.token).collect(),
                },
                handoff,
                corrupt,
            };
            let how = crate::push::Push {
                sender,
                writer: &self.landing_writer,
                landed: &self.kv_bytes_landed,
                mode: self.opts.kv_landing,
                timeout: self.opts.transfer_timeout,
            };
            let started = std::time::Instant::now();
            let (bytes, path) = how.push(&target, message, dropped).await?;
            sent = bytes;
            if let Some(path) = path {
                self.kv_transfers.observe(path, sent, started.elapsed());
            }
            self.kv_bytes_sent.fetch_add(sent, Ordering::Relaxed);
        }
        Ok(pb::PrefillResponse {
            first_token_id: first_token,
            prompt_tokens: prompt_len as u32,
            kv_bytes_sent: sent,
            finish_reason: finish_to_wire(finish),
            first_logprobs: logprobs.map(pb::Logprobs::from),
            other_choices: others
                .into_iter()
                .enumerate()
                .map(|(j, o)| pb::TokenEvent {
                    token_id: o.token,
                    finish_reason: finish_to_wire(o.finish),
                    logprobs: o.logprobs.map(pb::Logprobs::from),
                    choice: j as u32 + 1,
                    prompt_logprobs: Vec::new(),
                })
                .collect(),
            prompt_logprobs: prompt_logprobs
                .into_iter()
                .map(pb::Logprobs::from)
                .collect(),
        })
    }
}
